"""Connection limits of ``serve``: what the server bounds before any route (or the API key) runs.

uvicorn reads a request header without a deadline and keeps every connection it accepts, so
connections that send nothing, or a byte now and then (slowloris), pile up until the process
runs out of file descriptors and ``/health`` stops answering. The API key does not help: it is
checked once the header is in. ``guarded_protocol(limits)`` is uvicorn's own HTTP protocol
(httptools when installed, else h11, as uvicorn's ``auto`` picks) with these rules added:

- **header deadline** (``header_timeout_s``): a connection delivers a complete request header
  within this time of opening, and again after each response; bytes trickling in do not extend
  it. Past it, the connection is closed.
- **idle keep-alive** (``idle_timeout_s``): a connection that sends nothing after a response is
  closed after this long (uvicorn's ``timeout_keep_alive``).
- **a cap** (``max_connections``): a connection arriving at the cap closes the oldest one that
  is waiting for a header (idle, or trickling) to make room, so ``/health`` answers through a
  flood of idle connections. When every open connection has a request in flight, the newcomer
  gets 503 ``too_many_connections`` and is closed.

``raise_open_file_limit()`` raises the soft ``RLIMIT_NOFILE`` to the hard limit where the OS
allows it; ``connection_cap()`` keeps the cap below the descriptor limit, with room for the
model files, the ledger and the prompt cache's SSD tier.

The overrides hook four methods of uvicorn's protocols and read ``cycle.response_complete``
(tests/test_server_connections.py pins them to the supported uvicorn range).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Final

from uvicorn.protocols.http.h11_impl import H11Protocol

from ..default_limits import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS
from ..errors import InvalidRequest, TooManyConnections
from .wire import error_payload

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is optional (uvicorn[standard]); uvicorn then speaks h11 too
    HttpToolsProtocol = None  # type: ignore[assignment, misc]

__all__ = [
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "ConnectionGuard",
    "ConnectionLimits",
    "connection_cap",
    "guarded_protocol",
    "raise_open_file_limit",
]

MAX_TIMEOUT_S: Final = 3600.0
# Descriptors kept free of connections: safetensors files while loading, the ledger, SSD-tier
# snapshots, pipes, the listening socket (a quarter of the limit when that is smaller).
DESCRIPTOR_HEADROOM: Final = 256
# macOS refuses a soft limit above OPEN_MAX when the hard limit is "unlimited".
_MACOS_OPEN_MAX: Final = 10240


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What ``guarded_protocol`` enforces (see the module docstring); ``serve``'s
    ``--max-connections``, ``--header-timeout`` and ``--idle-timeout``."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    idle_timeout_s: int = DEFAULT_IDLE_TIMEOUT_S

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_connections, bool)
            or not isinstance(self.max_connections, int)
            or self.max_connections < 1
        ):
            raise InvalidRequest(
                f"max_connections (--max-connections) must be an integer >= 1, not {self.max_connections!r}",
                details={"field": "max_connections"},
            )
        for name, flag in (("header_timeout_s", "--header-timeout"), ("idle_timeout_s", "--idle-timeout")):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or not 0 < value <= MAX_TIMEOUT_S
            ):
                raise InvalidRequest(
                    f"{name} ({flag}) must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds, not {value!r}",
                    details={"field": name},
                )
        if isinstance(self.idle_timeout_s, float):
            raise InvalidRequest(
                "idle_timeout_s (--idle-timeout) takes whole seconds", details={"field": "idle_timeout_s"}
            )


def raise_open_file_limit() -> int | None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit where allowed; the soft limit after
    that (``None``: unlimited, or no such limit on this OS)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    targets = ([] if hard == resource.RLIM_INFINITY else [hard]) + [_MACOS_OPEN_MAX]
    for target in targets:
        if soft == resource.RLIM_INFINITY or target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            break
        except (ValueError, OSError):  # not allowed here: try the next, else keep what we have
            continue
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def connection_cap(requested: int | None, descriptor_limit: int | None) -> int:
    """The connection cap for a process with ``descriptor_limit`` open files: ``requested``
    (default ``DEFAULT_MAX_CONNECTIONS``, lowered to fit), kept ``DESCRIPTOR_HEADROOM`` below the
    limit. An explicit ``requested`` that does not fit is ``InvalidRequest``."""
    allowed = (
        None if descriptor_limit is None else max(1, descriptor_limit - min(DESCRIPTOR_HEADROOM, descriptor_limit // 4))
    )
    if requested is None:
        return DEFAULT_MAX_CONNECTIONS if allowed is None else min(DEFAULT_MAX_CONNECTIONS, allowed)
    if allowed is not None and requested > allowed:
        raise InvalidRequest(
            f"--max-connections {requested}: this process may open {descriptor_limit} files, which leaves room "
            f"for {allowed} connections (raise the hard limit, ulimit -Hn, or ask for fewer)",
            details={"field": "max_connections", "max": allowed},
        )
    return requested


class _Watch:
    """One connection as the guard sees it: waiting for a request header, or serving a request."""

    __slots__ = ("_guard", "_transport", "_loop", "_in_flight", "_timer")

    def __init__(
        self,
        guard: ConnectionGuard,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        in_flight: Callable[[], bool],
    ) -> None:
        self._guard = guard
        self._transport = transport
        self._loop = loop
        self._in_flight = in_flight
        self._timer: asyncio.TimerHandle | None = None

    def waiting(self) -> bool:
        return not self._in_flight()

    def arm(self) -> None:
        """Start the header deadline, unless a (pipelined) request is already in flight."""
        self.disarm()
        if not self._in_flight() and not self._transport.is_closing():
            self._timer = self._loop.call_later(self._guard.limits.header_timeout_s, self._expire)

    def check(self) -> None:
        """After new bytes: a complete header has started a request, so its deadline is met."""
        if self._timer is not None and self._in_flight():
            self.disarm()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        self.disarm()
        self._transport.close()

    def _expire(self) -> None:
        self._timer = None
        if not self._in_flight():
            self._guard.release(self)
            self._transport.close()


class ConnectionGuard:
    """Every open connection of one server, oldest first (the cap and the evictions)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._open: dict[_Watch, None] = {}  # insertion order: the oldest first

    @property
    def num_open(self) -> int:
        return len(self._open)

    def admit(self, watch: _Watch) -> bool:
        """Count a new connection in, closing the oldest one waiting for a header when at the
        cap; ``False`` when every open connection has a request in flight."""
        if len(self._open) >= self.limits.max_connections:
            oldest_waiting = next((w for w in self._open if w.waiting()), None)
            if oldest_waiting is None:
                return False
            self.release(oldest_waiting)
            oldest_waiting.close()
        self._open[watch] = None
        watch.arm()
        return True

    def release(self, watch: _Watch) -> None:
        self._open.pop(watch, None)
        watch.disarm()


def refusal_bytes(limits: ConnectionLimits) -> bytes:
    """The raw 503 a connection past the cap gets (written before its request is read)."""
    status, body = error_payload(
        TooManyConnections(
            f"the server holds {limits.max_connections} connections, each with a request in flight; retry later",
            limit="max_connections",
            maximum=limits.max_connections,
        )
    )
    payload = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + payload


def _open(
    guard: ConnectionGuard, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, in_flight: Callable[[], bool]
) -> _Watch:
    watch = _Watch(guard, transport, loop, in_flight)
    if not guard.admit(watch):
        transport.write(refusal_bytes(guard.limits))
        transport.close()
    return watch


class _GuardedH11(H11Protocol):
    guard: ClassVar[ConnectionGuard]
    watch: _Watch

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.watch = _open(self.guard, transport, self.loop, self._in_flight)

    def _in_flight(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.watch.check()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.watch.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.release(self.watch)
        super().connection_lost(exc)


if HttpToolsProtocol is not None:

    class _GuardedHttpTools(HttpToolsProtocol):
        guard: ClassVar[ConnectionGuard]
        watch: _Watch

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.watch = _open(self.guard, transport, self.loop, self._in_flight)

        def _in_flight(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self.watch.check()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.watch.arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self.guard.release(self.watch)
            super().connection_lost(exc)


def guarded_protocol(limits: ConnectionLimits, *, http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``http``: ``auto``, ``httptools`` or ``h11``) bound to a
    new ``ConnectionGuard(limits)``; pass it as ``uvicorn.Config(http=...)``, with
    ``timeout_keep_alive=limits.idle_timeout_s``. One class per server: the guard counts that
    server's connections."""
    if http not in ("auto", "httptools", "h11"):
        raise InvalidRequest(f"http {http!r}: expected auto, httptools or h11", details={"field": "http"})
    if http == "httptools" and HttpToolsProtocol is None:
        raise InvalidRequest("http 'httptools': httptools is not installed", details={"field": "http"})
    base: type[asyncio.Protocol] = _GuardedH11 if http == "h11" or HttpToolsProtocol is None else _GuardedHttpTools
    return type(base.__name__, (base,), {"guard": ConnectionGuard(limits)})
