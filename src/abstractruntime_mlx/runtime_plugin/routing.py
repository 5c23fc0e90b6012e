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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from ..errors import InvalidRequest
from ..json_values import JSONObject

__all__ = ["LOCAL_PROVIDER", "Route", "RouteDecision", "Routing", "parse_route"]

LOCAL_PROVIDER: Final = "mlx"
_URL_PREFIXES: Final = ("http://", "https://")


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
    before provider-only ones)."""

    default_model: str | None = None
    serve_all: bool = False
    routes: tuple[Route, ...] = field(default_factory=tuple)

    @classmethod
    def build(cls, *, default_model: str | None, serve_all: bool, routes: Iterable[str | Route] = ()) -> Routing:
        parsed = tuple(r if isinstance(r, Route) else parse_route(r) for r in routes)
        return cls(default_model=default_model, serve_all=serve_all, routes=parsed)

    def route_specs(self) -> list[str]:
        return [r.spec for r in self.routes]

    def decide(self, provider: object, model: object, *, explicit_base_url: str | None = None) -> RouteDecision:
        asked_provider = provider.strip() if isinstance(provider, str) and provider.strip() else None
        asked_model = model.strip() if isinstance(model, str) and model.strip() else None
        key = (asked_provider or LOCAL_PROVIDER).lower()
        if explicit_base_url:
            return RouteDecision(asked_provider, asked_model, key, asked_model or self.default_model, explicit_base_url, "node base_url")
        for exact in (True, False):
            for route in self.routes:
                if (route.model is not None) != exact or not route.matches(key, asked_model):
                    continue
                if route.base_url is not None:
                    return RouteDecision(asked_provider, asked_model, key, asked_model or self.default_model, route.base_url, f"--route {route.spec}")
                return RouteDecision(asked_provider, asked_model, LOCAL_PROVIDER, route.local_model, None, f"--route {route.spec}")
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
