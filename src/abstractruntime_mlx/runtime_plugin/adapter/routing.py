"""Which model serves an LLM node: the routing rule of ``run --model`` / ``--route``.

Flows written in the AbstractFlow editor name the provider and model they were built
against (``lmstudio`` / ``qwen/qwen3-next-80b``, ``openai`` / ``gpt-4o``...). The rule, first
match wins:

1. A node that names a server itself (``base_url`` in its params or ``effectConfig``) or a run
   that sets ``_runtime.base_url`` is *explicitly remote*: it goes there unchanged.
2. A ``--route PROVIDER/MODEL=TARGET`` whose provider and model equal the node's, then a
   ``--route PROVIDER=TARGET`` for its provider. ``TARGET`` is ``mlx:MODEL`` (served on the
   local resident model ``MODEL``) or an ``http(s)://`` URL (sent to that server with the
   model the node asked for).
3. ``--model M`` (``serve_all``): every other node, whatever provider it names, runs locally on
   ``M``.
4. Otherwise a node naming ``mlx`` (or no provider) runs locally on its own model, or the
   default model when it names none; any other provider is refused with a hint.

``decide(...)`` returns a ``RouteDecision``: what the node asked for, what serves it, and which
rule decided. The handler stores it in every result's metadata under ``route``, so the ledger
records both.

A server receives the node's prompts, so remote targets are opt-in: ``RemotePolicy`` says which
servers the user allowed (``run --allow-remote``, a config file's ``allow_remote``, the URLs of
``--route`` rules and of the user's own ``--var _runtime.base_url``), and ``RemotePolicy.check``
refuses any other one before anything is sent (``RemoteNotAllowed``). Link-local and cloud
metadata addresses are refused whatever was allowed (``RemoteAddressForbidden``).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

from ...errors import InvalidRequest, RemoteAddressForbidden, RemoteNotAllowed
from ...json_values import JSONObject

__all__ = ["LOCAL_PROVIDER", "RemotePolicy", "Route", "RouteDecision", "Routing", "parse_route", "url_origin"]

LOCAL_PROVIDER: Final = "mlx"
_URL_PREFIXES: Final = ("http://", "https://")

METADATA_HOSTS: Final = frozenset(
    {
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "metadata.azure.com",
        "instance-data",
        "instance-data.ec2.internal",
        "metadata.tencentyun.com",
        "100.100.100.200",  # Alibaba Cloud's metadata service
        "fd00:ec2::254",  # AWS's IPv6 metadata service
    }
)
"""Cloud metadata services by name or by an address outside the link-local ranges."""

_LINK_LOCAL: Final = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


def url_origin(url: str) -> tuple[str, int | None]:
    """``(host, port)`` of an http(s) URL: the host lower-cased, the port given or the scheme's."""
    parts = urlsplit(url.strip())
    host = (parts.hostname or "").lower().rstrip(".")
    try:
        port = parts.port
    except ValueError:
        port = None
    return host, port if port is not None else _DEFAULT_PORTS.get(parts.scheme.lower())


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address ``host`` spells, in any form the resolver accepts for one (``169.254.169.254``,
    ``2852039166``, ``0xa9.0xfe.0xa9.0xfe``, ``::ffff:169.254.169.254``); ``None`` for a name."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def forbidden_reason(url: str) -> str | None:
    """Why ``url`` may never receive prompts (a link-local or cloud metadata address), or None."""
    host, _ = url_origin(url)
    if not host:
        return "it names no host"
    if host in METADATA_HOSTS:
        return f"{host} is a cloud metadata service"
    address = _address(host)
    if address is not None and (str(address) in METADATA_HOSTS or any(address in net for net in _LINK_LOCAL)):
        return f"{host} is a link-local address (where cloud metadata services answer)"
    return None


@dataclass(frozen=True, slots=True)
class RemotePolicy:
    """Which servers nodes may be sent to: every one (``allow_all``), or those whose host (any
    port) or ``host:port`` is in ``hosts``. Link-local and metadata addresses never."""

    allow_all: bool = False
    hosts: frozenset[str] = frozenset()

    @classmethod
    def build(cls, allow: bool | Iterable[str] = False, *, urls: Iterable[str | None] = ()) -> RemotePolicy:
        """``allow``: True (every server), False, or host / ``host:port`` entries; ``urls``: URLs
        the user gave (``--route``, ``--var _runtime.base_url``), allowed by their ``host:port``."""
        if isinstance(allow, bool):
            entries: set[str] = set()
            allow_all = allow
        else:
            entries = {str(h).strip().lower().rstrip(".") for h in allow if str(h).strip()}
            allow_all = False
        for url in urls:
            if url:
                host, port = url_origin(url)
                entries.add(f"{host}:{port}" if port is not None else host)
        return cls(allow_all=allow_all, hosts=frozenset(entries))

    def with_urls(self, urls: Iterable[str | None]) -> RemotePolicy:
        extra = RemotePolicy.build(False, urls=urls)
        return RemotePolicy(allow_all=self.allow_all, hosts=self.hosts | extra.hosts)

    def allows(self, url: str) -> bool:
        host, port = url_origin(url)
        return self.allow_all or host in self.hosts or f"{host}:{port}" in self.hosts

    def check(self, url: str, *, where: str) -> None:
        """Raise ``RemoteAddressForbidden`` / ``RemoteNotAllowed`` unless ``url`` may receive the
        prompts of ``where`` (``node 'ask'``, ``--route ...``)."""
        reason = forbidden_reason(url)
        if reason is not None:
            raise RemoteAddressForbidden(
                f"{where} would send prompts to {url}, which is refused: {reason}", details={"url": url}
            )
        if not self.allows(url):
            raise RemoteNotAllowed(
                f"{where} would send its prompts to {url}, a server you did not allow; pass --allow-remote "
                '(or "allow_remote": true, or a list of hosts, in the --config file) to allow it',
                details={"url": url},
            )

    def to_options(self) -> bool | list[str]:
        """What ``build`` takes back (stored with a run, so a resume keeps the policy)."""
        return True if self.allow_all else sorted(self.hosts)


@dataclass(frozen=True, slots=True)
class Route:
    """``provider[/model]`` → ``mlx:MODEL`` or a server URL. ``spec`` is the text it was parsed from."""

    provider: str
    model: str | None
    local_model: str | None = None
    base_url: str | None = None
    spec: str = ""

    def matches(self, provider: str, model: str | None) -> bool:
        return self.provider == provider and (self.model is None or self.model == model)


def parse_route(text: str) -> Route:
    """``"lmstudio=mlx:/models/qwen"``, ``"openai/gpt-4o=http://127.0.0.1:8080"`` → ``Route``."""
    raw = str(text).strip()
    left, sep, target = raw.partition("=")
    left, target = left.strip(), target.strip()
    if not sep or not left or not target:
        raise InvalidRequest(f"route {raw!r}: expected PROVIDER[/MODEL]=mlx:MODEL or PROVIDER[/MODEL]=URL")
    provider, slash, model = left.partition("/")
    provider = provider.strip().lower()
    if not provider:
        raise InvalidRequest(f"route {raw!r}: the provider before '=' is empty")
    model_name = model.strip() if slash else None
    if slash and not model_name:
        raise InvalidRequest(f"route {raw!r}: the model after '/' is empty")
    if target.lower().startswith(_URL_PREFIXES):
        reason = forbidden_reason(target)
        if reason is not None:
            raise RemoteAddressForbidden(f"route {raw!r}: the target is refused: {reason}", details={"url": target})
        return Route(provider, model_name, base_url=target.rstrip("/"), spec=raw)
    scheme, colon, local = target.partition(":")
    if scheme.strip().lower() != LOCAL_PROVIDER or not colon or not local.strip():
        raise InvalidRequest(f"route {raw!r}: the target must be mlx:MODEL (a local model) or an http(s):// URL")
    return Route(provider, model_name, local_model=local.strip(), spec=raw)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """What one LLM node asked for and what serves it (``base_url`` set: a remote server)."""

    asked_provider: str | None
    asked_model: str | None
    provider: str
    model: str | None
    base_url: str | None
    rule: str

    def to_metadata(self) -> JSONObject:
        served: dict[str, str | None] = {"provider": self.provider, "model": self.model}
        if self.base_url:
            served["base_url"] = self.base_url
        return {
            "asked": {"provider": self.asked_provider, "model": self.asked_model},
            "served": served,
            "rule": self.rule,
        }


@dataclass(frozen=True, slots=True)
class Routing:
    """The routing table of one pack: ``default_model`` (``--model`` or the built-in default),
    ``serve_all`` (``--model`` was given: every node not routed otherwise runs on it) and
    ``routes`` (``--route``, in the order given; exact ``provider/model`` routes are tried
    before provider-only ones) and ``remote`` (the servers nodes may be sent to: the route URLs
    and whatever the user allowed)."""

    default_model: str | None = None
    serve_all: bool = False
    routes: tuple[Route, ...] = field(default_factory=tuple)
    remote: RemotePolicy = field(default_factory=RemotePolicy)

    @classmethod
    def build(
        cls,
        *,
        default_model: str | None,
        serve_all: bool,
        routes: Iterable[str | Route] = (),
        remote: RemotePolicy | None = None,
    ) -> Routing:
        parsed = tuple(r if isinstance(r, Route) else parse_route(r) for r in routes)
        policy = (remote or RemotePolicy()).with_urls(r.base_url for r in parsed)
        return cls(default_model=default_model, serve_all=serve_all, routes=parsed, remote=policy)

    def route_specs(self) -> list[str]:
        return [r.spec for r in self.routes]

    def decide(self, provider: object, model: object, *, explicit_base_url: str | None = None) -> RouteDecision:
        asked_provider = provider.strip() if isinstance(provider, str) and provider.strip() else None
        asked_model = model.strip() if isinstance(model, str) and model.strip() else None
        key = (asked_provider or LOCAL_PROVIDER).lower()
        if explicit_base_url:
            return RouteDecision(
                asked_provider, asked_model, key, asked_model or self.default_model, explicit_base_url, "node base_url"
            )
        for exact in (True, False):
            for route in self.routes:
                if (route.model is not None) != exact or not route.matches(key, asked_model):
                    continue
                if route.base_url is not None:
                    return RouteDecision(
                        asked_provider,
                        asked_model,
                        key,
                        asked_model or self.default_model,
                        route.base_url,
                        f"--route {route.spec}",
                    )
                return RouteDecision(
                    asked_provider, asked_model, LOCAL_PROVIDER, route.local_model, None, f"--route {route.spec}"
                )
        if self.serve_all:
            return RouteDecision(asked_provider, asked_model, LOCAL_PROVIDER, self.default_model, None, "--model")
        if key != LOCAL_PROVIDER:
            raise InvalidRequest(
                f"node provider {asked_provider!r} is not served here: run with --model MODEL to serve every LLM node "
                f"on a local model, or --route {key}=mlx:MODEL (or =URL) to route this provider"
            )
        if asked_model:
            return RouteDecision(asked_provider, asked_model, LOCAL_PROVIDER, asked_model, None, "node model")
        return RouteDecision(asked_provider, asked_model, LOCAL_PROVIDER, self.default_model, None, "default model")


def routes_from_config(value: object, *, source: str) -> list[str]:
    """Route specs from a config file value: a list of ``"PROVIDER[/MODEL]=TARGET"`` strings or
    a mapping ``{"PROVIDER[/MODEL]": "TARGET"}``."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [f"{k}={v}" for k, v in value.items()]
    if isinstance(value, list):
        specs = [v for v in value if isinstance(v, str)]
        if len(specs) == len(value):
            return specs
    raise InvalidRequest(f"{source}: 'routes' must be a list of 'PROVIDER[/MODEL]=TARGET' strings or an object")
