"""What plugs our LLM node into AbstractRuntime: the pack and its parts.

- ``pack``: ``build_pack`` wires one ledger, node, handler, prefetcher and stores (``MLXPack``);
- ``handler``: the LLM_CALL effect handler;
- ``payload``: the LLM_CALL payload as a ``nodes.NodeRequest``;
- ``routing``: which model or server serves a node (``--route``, remote opt-in);
- ``stores``: the host's ``RunStore`` / ``LedgerStore`` over our ``Ledger``.

Imports ``prefetch``; never ``hosting`` (which drives runs over a pack).
"""

from __future__ import annotations

from .handler import LLMCallHandler, RuntimeProgress
from .pack import MLXPack, PackOptions, PackSettings, build_pack, normalize_ledger_url
from .payload import request_from_payload
from .routing import RemotePolicy, Route, RouteDecision, Routing, parse_route, routes_from_config
from .stores import LedgerRunStore, LedgerStepStore

__all__ = [
    "LLMCallHandler",
    "LedgerRunStore",
    "LedgerStepStore",
    "MLXPack",
    "PackOptions",
    "PackSettings",
    "RemotePolicy",
    "Route",
    "RouteDecision",
    "Routing",
    "RuntimeProgress",
    "build_pack",
    "normalize_ledger_url",
    "parse_route",
    "request_from_payload",
    "routes_from_config",
]
