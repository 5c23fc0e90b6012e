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

MLX is imported on the first LLM call, never at import. See ``docs/runtime-plugin.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Unpack

from abstractruntime import Runtime
from abstractruntime.core.models import EffectType
from abstractruntime.core.policy import EffectPolicy
from abstractruntime.core.runtime import EffectHandler

from ..controls import UNSET, Unset
from ..ledger import Ledger
from ..nodes import ProviderRegistry

from .adapter import (
    LLMCallHandler,
    LedgerRunStore,
    LedgerStepStore,
    MLXPack,
    PackOptions,
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
    **pack_options: Unpack[PackOptions],
) -> dict[EffectType, EffectHandler]:
    """Install the MLX LLM_CALL handler: returns ``effect_handlers`` (or a new dict) with
    ``EffectType.LLM_CALL`` set, for ``Runtime(effect_handlers=...)``.

    ``pack`` reuses a built pack; otherwise ``pack_options`` go to ``build_pack`` (e.g.
    ``ledger_url=``, ``model=``). Without a ledger the handler forwards phase events to
    AbstractRuntime's progress channel, so the host's own ledger store records them.
    """
    handlers = effect_handlers if effect_handlers is not None else {}
    pack = pack or build_pack(**pack_options)
    handlers[EffectType.LLM_CALL] = pack.handler
    return handlers


def build_runtime(
    ledger_url: str,
    *,
    model: str | None = None,
    ledger: Ledger | None = None,
    force_model: bool = False,
    provider_options: Mapping[str, object] | None = None,
    server_base_url: str | None = None,
    sibling_batching: bool = True,
    record_progress: bool = True,
    runtime_progress: RuntimeProgress = "auto",
    registry: ProviderRegistry | None = None,
    effect_policy: EffectPolicy | None | Unset = UNSET,
    routes: Sequence[str] = (),
    allow_remote: bool | Sequence[str] = False,
    **more_provider_options: object,
) -> Runtime:
    """A ``Runtime`` whose runs, steps and phase events live in the ledger at ``ledger_url``
    (SQLAlchemy URL or SQLite path) and whose LLM_CALL effects run on MLX.

    ``model`` is the default model of nodes that name none. The other named options are
    ``build_pack``'s; ``provider_options`` entries may also be given directly as further
    keywords (``mlx_max_batch_size=8``). ``pack_of(runtime).close()`` releases the ledger and
    the writer.
    """
    pack = build_pack(
        ledger_url,
        ledger=ledger,
        model=model,
        force_model=force_model,
        provider_options={**(provider_options or {}), **more_provider_options},
        server_base_url=server_base_url,
        sibling_batching=sibling_batching,
        record_progress=record_progress,
        runtime_progress=runtime_progress,
        registry=registry,
        effect_policy=effect_policy,
        routes=routes,
        allow_remote=allow_remote,
    )
    runtime = pack.runtime()
    setattr(runtime, _PACK_ATTRIBUTE, pack)
    return runtime


def pack_of(runtime: Runtime) -> MLXPack:
    """The pack behind a runtime made by ``build_runtime``."""
    pack = getattr(runtime, _PACK_ATTRIBUTE, None)
    if not isinstance(pack, MLXPack):
        raise ValueError("this Runtime was not made by abstractruntime_mlx.runtime_plugin.build_runtime")
    return pack
