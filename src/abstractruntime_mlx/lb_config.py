"""An HAProxy configuration for a pool of model servers (``abstractruntime-mlx lb-config``).

The pack writes no balancer: HAProxy (Debian's ``haproxy``, Homebrew's ``haproxy``) spreads the
LLM calls of many coordinators over several ``abstractruntime-mlx serve`` processes (or any
OpenAI-compatible server with a ``GET /health``, such as ``mlx_lm.server``). What this module
decides is only what to write:

- ``balance hdr(X-Session-Affinity)`` with ``hash-type consistent``: the remote client sends a
  run's session id (else its run id) in that header on every call, sibling prefetches included,
  so one run's calls land on one server, where batching and prefix reuse work. A call without
  the header is balanced round-robin.
- ``hash-balance-factor`` (bounded load): a key whose server already carries more than
  ``factor``% of the pool's average load goes to the next server on the ring instead.
- ``maxconn`` per server = its engine slots plus its queue places, so HAProxy queues what the
  server would refuse (``queue_full``, 503) instead of passing it on; ``timeout queue`` bounds
  that wait.
- ``option httpchk GET /health``; ``retries`` with ``option redispatch`` and ``retry-on
  conn-failure empty-response junk-response 503``: a call to a dead server is sent again, to
  another server. A connection error marks a server down at once (``observe layer4
  error-limit 1 on-error mark-down``): a redispatch re-runs the hash, which would otherwise
  pick the dead server again until two health checks failed; the checks bring it back. A request
  larger than ``tune.bufsize`` cannot be replayed by HAProxy and is retried by the remote client
  itself (connection failures and ``queue_full`` only).
- SSE passes through unbuffered (HTTP mode streams responses as they come); ``timeout server``
  is long, since a generation can stream for minutes.
- a stats socket (``show stat``, ``show servers state``) for operators and tests.

    settings = LBSettings(servers=(PoolServer("10.0.0.2", 8080, slots=4, queue=32),))
    text = haproxy_config(settings)
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from .errors import InvalidRequest
from .json_values import JSONValue, object_at
from .request import AFFINITY_HEADER

__all__ = [
    "AFFINITY_HEADER",
    "DEFAULT_BALANCE_FACTOR",
    "DEFAULT_BIND",
    "LBSettings",
    "PoolServer",
    "haproxy_config",
    "format_address",
    "parse_address",
    "probe_capacity",
]

DEFAULT_BIND: Final = "127.0.0.1:8090"
DEFAULT_BALANCE_FACTOR: Final = 150
DEFAULT_RETRIES: Final = 3
DEFAULT_CHECK_INTERVAL_S: Final = 2.0
DEFAULT_QUEUE_TIMEOUT_S: Final = 120.0  # the engine's own default queue timeout
DEFAULT_SERVER_TIMEOUT_S: Final = 600.0  # the remote client's read timeout
BUFFER_BYTES: Final = 262_144  # tune.bufsize: requests up to this size can be replayed
_MAX_SERVERS: Final = 256
_MAX_TIMEOUT_S: Final = 2_147_483.0  # HAProxy's timers hold 2**31 - 1 ms
_SOURCES: Final = frozenset({"server", "flags"})
_PORT: Final = re.compile(r"[0-9]{1,5}")
_HOST: Final = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,252}[A-Za-z0-9_])?")
_IPV6: Final = re.compile(r"[0-9A-Fa-f:.]{2,45}(?:%[A-Za-z0-9_.-]{1,32})?")


@dataclass(frozen=True, slots=True)
class PoolServer:
    """One server of the pool and its capacity: ``slots`` engine batch slots plus ``queue``
    waiting places; ``source`` says where they were read (``server``: its stats route,
    ``flags``: ``--slots``/``--queue``)."""

    host: str
    port: int
    slots: int
    queue: int
    source: str = "flags"

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    @property
    def maxconn(self) -> int:
        return self.slots + self.queue


@dataclass(frozen=True, slots=True)
class LBSettings:
    """What ``haproxy_config`` writes. ``bind``: where HAProxy listens (``HOST:PORT``);
    ``stats_socket``: the admin socket's path (None: none); ``balance_factor``: HAProxy's
    ``hash-balance-factor`` (0 turns bounded load off, else >= 100)."""

    servers: tuple[PoolServer, ...]
    bind: str = DEFAULT_BIND
    stats_socket: str | None = None
    balance_factor: int = DEFAULT_BALANCE_FACTOR
    retries: int = DEFAULT_RETRIES
    check_interval_s: float = DEFAULT_CHECK_INTERVAL_S
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    server_timeout_s: float = DEFAULT_SERVER_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.servers:
            raise InvalidRequest("an HAProxy pool needs at least one --server HOST:PORT", details={"field": "server"})
        if len(self.servers) > _MAX_SERVERS:
            raise InvalidRequest(
                f"{len(self.servers)} servers; the limit is {_MAX_SERVERS}", details={"field": "server"}
            )
        seen: set[tuple[str, int]] = set()
        for server in self.servers:
            _check_host(server.host, f"server {server.host!r}", field="server")
            _check_int(server.port, "server port", field="server", lo=1, hi=65535)
            if (server.host, server.port) in seen:
                raise InvalidRequest(f"server {server.address} is given twice", details={"field": "server"})
            seen.add((server.host, server.port))
            for name, value, lo in (("slots", server.slots, 1), ("queue", server.queue, 0)):
                _check_int(value, f"server {server.address}: {name}", field="slots", lo=lo)
            if server.source not in _SOURCES:
                raise InvalidRequest(
                    f"server {server.address}: source must be one of {sorted(_SOURCES)}", details={"field": "source"}
                )
        parse_address(self.bind, field="bind", wildcard=True)
        _check_int(self.balance_factor, "balance factor", field="balance_factor", lo=0)
        if self.balance_factor != 0 and self.balance_factor < 100:
            raise InvalidRequest(
                f"balance factor {self.balance_factor}: HAProxy takes 0 (off) or a percentage >= 100",
                details={"field": "balance_factor"},
            )
        _check_int(self.retries, "retries", field="retries", lo=0)
        for name in ("check_interval_s", "queue_timeout_s", "server_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= _MAX_TIMEOUT_S:
                raise InvalidRequest(
                    f"{name} must be > 0 and at most {_MAX_TIMEOUT_S:g} s, HAProxy's longest timer (got {value!r})",
                    details={"field": name},
                )
        if self.stats_socket is not None:
            _check_path(self.stats_socket, "the stats socket path", field="stats_socket")


def parse_address(text: str, *, field: str = "server", wildcard: bool = False) -> tuple[str, int]:
    """``"10.0.0.2:8080"``, ``"mac-2.local:8080"``, ``"[::1]:8080"`` → ``(host, port)``; anything
    else is ``InvalidRequest`` naming ``field``: no whitespace anywhere, the port in ASCII digits,
    the host a DNS name or IPv4 address in ASCII, or an IPv6 address in brackets (``wildcard``:
    ``*``, every address, too; for ``bind``)."""
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        ipv6 = True
    else:
        host, sep, port_text = text.rpartition(":")
        ipv6 = False
    if not sep or not host or not _PORT.fullmatch(port_text):
        raise InvalidRequest(
            f"{field} {text!r}: expected HOST:PORT (IPv6 as [ADDR]:PORT, the port in ASCII digits)",
            details={"field": field},
        )
    port = int(port_text)
    if not 0 < port < 65536:
        raise InvalidRequest(f"{field} {text!r}: the port must be 1 to 65535", details={"field": field})
    if ipv6 and not _IPV6.fullmatch(host):
        raise InvalidRequest(f"{field} {text!r}: the host is not an IPv6 address", details={"field": field})
    if not (wildcard and host == "*"):
        _check_host(host, f"{field} {text!r}", field=field)
    return host, port


def format_address(host: str, port: int) -> str:
    """``HOST:PORT`` as HAProxy reads it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_host(host: object, what: str, *, field: str) -> None:
    """A host HAProxy reads as one word: a DNS name or IPv4 address in ASCII (an IDN as its
    punycode), or an IPv6 address (written in brackets)."""
    if not isinstance(host, str) or not (_HOST.fullmatch(host) or _IPV6.fullmatch(host)):
        raise InvalidRequest(
            f"{what}: the host must be ASCII letters, digits, '.', '-', '_' (or an IPv6 address); "
            "whitespace, '#', quotes and other characters would be misread by HAProxy",
            details={"field": field},
        )


def _check_path(path: object, what: str, *, field: str) -> None:
    """A path HAProxy reads as one word: no whitespace (it splits words), ``#`` (a comment),
    quotes or backslashes (escapes), nothing unprintable (newlines), no digits but ASCII ones."""
    bad = (
        not isinstance(path, str)
        or not path
        or any(c.isspace() or c in "#'\"\\" or not c.isprintable() or (c.isnumeric() and not c.isascii()) for c in path)
    )
    if bad:
        raise InvalidRequest(
            f"{what} {path!r}: one word with no whitespace, '#', quotes, "
            "backslashes, control characters or non-ASCII digits",
            details={"field": field},
        )


def _check_int(value: object, what: str, *, field: str, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"{lo} to {hi}"
        raise InvalidRequest(f"{what} must be an integer {bound} (got {value!r})", details={"field": field})


def probe_capacity(
    host: str, port: int, *, api_key: str | None = None, timeout_s: float = 2.0
) -> tuple[int, int] | None:
    """``(slots, queue)`` as the server at ``host:port`` reports them (``GET
    /acore/prompt_cache/stats``: ``execution.max_batch_size`` and ``max_queue_size``), or None
    when it cannot say (not running, not this package's server, no such route)."""
    request = urllib.request.Request(f"http://{format_address(host, port)}/acore/prompt_cache/stats")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - an http URL built here
            body: JSONValue = json.loads(response.read(1_000_000))
    except (OSError, ValueError, urllib.error.URLError):
        return None
    if not isinstance(body, dict):
        return None
    execution = object_at(object_at(body, "stats"), "execution")
    slots, queue = execution.get("max_batch_size"), execution.get("max_queue_size")
    if (
        isinstance(slots, int)
        and isinstance(queue, int)
        and not isinstance(slots, bool)
        and not isinstance(queue, bool)
    ):
        return slots, queue
    return None


def _ms(seconds: float) -> str:
    """An HAProxy duration: whole seconds as ``120s``, else milliseconds."""
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def haproxy_config(settings: LBSettings, *, comment: Sequence[str] = ()) -> str:
    """The HAProxy configuration text for ``settings`` (see the module docstring for why each line);
    ``comment``: lines written as ``#`` comments at the top (printable text, one line each)."""
    for line in comment:
        if not line.isprintable():
            raise InvalidRequest(
                f"comment line {line[:40]!r}: printable text on one line only", details={"field": "comment"}
            )
    total = sum(s.maxconn for s in settings.servers)
    lines = [
        "# HAProxy configuration for a pool of abstractruntime-mlx model servers.",
        *(f"# {line}" for line in comment),
        "# Check it: haproxy -c -f THIS_FILE    Run it: haproxy -f THIS_FILE",
        "global",
        # Clients waiting in HAProxy's queue hold a connection too: room for them and for the health checks.
        f"    maxconn {max(256, 4 * total)}",
        f"    tune.bufsize {BUFFER_BYTES}",
    ]
    if settings.stats_socket is not None:
        lines += [f"    stats socket {settings.stats_socket} mode 600 level admin", "    stats timeout 30s"]
    lines += [
        "",
        "defaults",
        "    mode http",
        "    option redispatch 1",
        f"    retries {settings.retries}",
        "    retry-on conn-failure empty-response junk-response 503",
        "    timeout connect 2s",
        "    timeout client 1h",
        f"    timeout server {_ms(settings.server_timeout_s)}",
        "    timeout tunnel 1h",
        f"    timeout queue {_ms(settings.queue_timeout_s)}",
        "    timeout http-request 30s",
        "    timeout http-keep-alive 30s",
        f"    timeout check {_ms(min(settings.check_interval_s, 5.0))}",
        "",
        "frontend abstractruntime_mlx",
        f"    bind {format_address(*parse_address(settings.bind, field='bind', wildcard=True))}",
        "    default_backend model_servers",
        "",
        "backend model_servers",
        f"    balance hdr({AFFINITY_HEADER})",
        "    hash-type consistent",
    ]
    if settings.balance_factor:
        lines.append(f"    hash-balance-factor {settings.balance_factor}")
    lines += [
        "    option httpchk GET /health",
        "    http-check expect status 200",
        # A connection the server refuses or drops marks it down at once (not only after two
        # failed checks): a retry re-runs the hash, which must not pick the dead server again.
        f"    default-server check inter {_ms(settings.check_interval_s)} fall 2 rise 2"
        " observe layer4 error-limit 1 on-error mark-down",
    ]
    for index, server in enumerate(settings.servers, start=1):
        lines.append(
            f"    server s{index} {server.address} maxconn {server.maxconn}"
            f"  # {server.slots} slots + {server.queue} queue places ({server.source})"
        )
    return "\n".join(lines) + "\n"
