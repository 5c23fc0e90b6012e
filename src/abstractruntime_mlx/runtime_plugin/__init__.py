"""AbstractRuntime integration: the only package that imports ``abstractruntime``.

    from abstractruntime_mlx.runtime_plugin import build_runtime, run_flow

    runtime = build_runtime("sqlite:///runs.sqlite", model="/models/qwen")   # a Runtime
    results = run_flow("examples/fanout.json", runs=3, ledger_url="sqlite:///runs.sqlite")

- ``register(effect_handlers=None, **pack_options)``: the entry point
  (``[project.entry-points."abstractruntime.packs"] mlx``); puts our LLM_CALL handler into a
  ``Runtime(effect_handlers=...)`` dict and returns it.
- ``build_pack`` / ``build_runtime``: ledger-backed ``RunStore`` + ``LedgerStore``, the
  handler, sibling-branch batching.
- ``run_flow`` / ``resume_run``: run VisualFlow JSON N times concurrently (one compiled spec
  per thread), resume an interrupted run from the ledger alone.
- ``PackSettings``: the pack's options as one frozen value (or its fields as keywords).

Sub-packages, each importing only those before it: ``prefetch`` (flow index, sibling
prediction and prefetch, prompt-cache keys), ``adapter`` (pack, LLM_CALL handler, payload,
routing, stores), ``hosting`` (host, run / resume, waits, takeover, flow hash, code sandbox),
``check`` (the whole-flow check).

MLX is imported on the first LLM call, never at import. See ``docs/runtime-plugin.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Unpack, cast

from abstractruntime import Runtime
from abstractruntime.core.models import EffectType
from abstractruntime.core.runtime import EffectHandler

from ..ledger import Ledger
from ..nodes import ProviderRegistry
from .adapter import (
    LedgerRunStore,
    LedgerStepStore,
    LLMCallHandler,
    MLXPack,
    PackOptions,
    PackSettings,
    RemotePolicy,
    Route,
    RouteDecision,
    Routing,
    RuntimeProgress,
    build_pack,
    normalize_ledger_url,
    parse_route,
    request_from_payload,
)
from .adapter.pack import SETTING_NAMES, pack_settings
from .hosting import (
    DriveLimits,
    FlowBundle,
    FlowHost,
    FlowRunResult,
    NodeFailure,
    NodeOutcome,
    drive,
    network_tool_uses,
    node_failures,
    node_outcomes,
    resume_run,
    run_flow,
    run_tree,
)
from .prefetch import FlowCatalog, FlowIndex, SiblingPrefetcher, load_flow

__all__ = [
    "RuntimeProgress",
    "DriveLimits",
    "FlowBundle",
    "FlowCatalog",
    "FlowHost",
    "FlowIndex",
    "FlowRunResult",
    "LLMCallHandler",
    "LedgerRunStore",
    "LedgerStepStore",
    "MLXPack",
    "PackSettings",
    "NodeFailure",
    "NodeOutcome",
    "RemotePolicy",
    "Route",
    "RouteDecision",
    "Routing",
    "SiblingPrefetcher",
    "build_pack",
    "build_runtime",
    "load_flow",
    "drive",
    "network_tool_uses",
    "node_failures",
    "node_outcomes",
    "parse_route",
    "normalize_ledger_url",
    "pack_of",
    "register",
    "request_from_payload",
    "resume_run",
    "run_flow",
    "run_tree",
]

_PACK_ATTRIBUTE = "_abstractruntime_mlx_pack"


def register(
    effect_handlers: dict[EffectType, EffectHandler] | None = None,
    *,
    pack: MLXPack | None = None,
    ledger_url: str | None = None,
    ledger: Ledger | None = None,
    registry: ProviderRegistry | None = None,
    settings: PackSettings | None = None,
    **options: Unpack[PackOptions],
) -> dict[EffectType, EffectHandler]:
    """Install the MLX LLM_CALL handler: returns ``effect_handlers`` (or a new dict) with
    ``EffectType.LLM_CALL`` set, for ``Runtime(effect_handlers=...)``.

    ``pack`` reuses a built pack; otherwise the other arguments go to ``build_pack`` (e.g.
    ``ledger_url=``, ``model=``). Without a ledger the handler forwards phase events to
    AbstractRuntime's progress channel, so the host's own ledger store records them.
    """
    handlers = effect_handlers if effect_handlers is not None else {}
    pack = pack or build_pack(ledger_url, ledger=ledger, registry=registry, settings=settings, **options)
    handlers[EffectType.LLM_CALL] = pack.handler
    return handlers


def build_runtime(
    ledger_url: str,
    *,
    ledger: Ledger | None = None,
    registry: ProviderRegistry | None = None,
    settings: PackSettings | None = None,
    **options: object,
) -> Runtime:
    """A ``Runtime`` whose runs, steps and phase events live in the ledger at ``ledger_url``
    (SQLAlchemy URL or SQLite path) and whose LLM_CALL effects run on MLX.

    ``options`` named as ``PackSettings``' fields are the pack's (``model=`` is the default
    model of nodes that name none); any other keyword is a provider option, added to
    ``provider_options`` (``mlx_max_batch_size=8``). ``pack_of(runtime).close()`` releases the
    ledger and the writer.
    """
    named = {name: value for name, value in options.items() if name in SETTING_NAMES}
    extra = {name: value for name, value in options.items() if name not in SETTING_NAMES}
    base = pack_settings(settings, cast(PackOptions, named))
    merged = dataclasses.replace(base, provider_options={**(base.provider_options or {}), **extra})
    pack = build_pack(ledger_url, ledger=ledger, registry=registry, settings=merged)
    runtime = pack.runtime()
    setattr(runtime, _PACK_ATTRIBUTE, pack)
    return runtime


def pack_of(runtime: Runtime) -> MLXPack:
    """The pack behind a runtime made by ``build_runtime``."""
    pack = getattr(runtime, _PACK_ATTRIBUTE, None)
    if not isinstance(pack, MLXPack):
        raise ValueError("this Runtime was not made by abstractruntime_mlx.runtime_plugin.build_runtime")
    return pack
