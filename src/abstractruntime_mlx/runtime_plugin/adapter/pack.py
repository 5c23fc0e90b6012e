"""The pack: one ledger, node, handler, prefetcher and stores wired together.

    pack = build_pack("sqlite:///runs.sqlite", model="/models/qwen")
    runtime = pack.runtime()            # Runtime(run_store, ledger_store, {LLM_CALL: handler})
    ...
    pack.close()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

from abstractruntime import Runtime
from abstractruntime.core.models import EffectType
from abstractruntime.core.policy import EffectPolicy, RetryPolicy
from abstractruntime.core.runtime import EffectHandler

from ...controls import UNSET, Unset
from ...ledger import Ledger, normalize_ledger_url
from ...nodes import LLMNode, ProviderRegistry
from ..prefetch.catalog import FlowCatalog
from .handler import LLMCallHandler, RuntimeProgress
from ..prefetch.prefetch import SiblingPrefetcher
from .routing import RemotePolicy, Routing
from .stores import LedgerRunStore, LedgerStepStore


__all__ = ["MLXPack", "PackOptions", "ResumeOptions", "build_pack", "normalize_ledger_url"]


class ResumeOptions(TypedDict):
    """What ``resume_run`` needs to rebuild an equivalent pack (stored in the run's vars)."""

    model: str | None
    force_model: bool
    routes: list[str]
    provider_options: dict[str, object]
    sibling_batching: bool
    allow_remote: bool | list[str]


@dataclass(slots=True)
class MLXPack:
    """Everything one process needs to run flows on MLX with our ledger."""

    ledger: Ledger | None
    node: LLMNode
    handler: LLMCallHandler
    flows: FlowCatalog
    prefetcher: SiblingPrefetcher
    run_store: LedgerRunStore | None
    ledger_store: LedgerStepStore | None
    provider_options: dict[str, object]
    owns_ledger: bool
    effect_policy: EffectPolicy | None = None

    def effect_handlers(self) -> dict[EffectType, EffectHandler]:
        return {EffectType.LLM_CALL: self.handler}

    def runtime(self, **runtime_options: object) -> Runtime:
        """A new ``Runtime`` over this pack's stores and handler (cheap; one per thread is fine)."""
        if self.run_store is None or self.ledger_store is None:
            raise RuntimeError("this pack has no ledger; build it with a ledger URL to get a Runtime")
        options: dict[str, object] = {"effect_policy": self.effect_policy} if self.effect_policy is not None else {}
        options.update(runtime_options)
        return Runtime(
            run_store=self.run_store,
            ledger_store=self.ledger_store,
            effect_handlers=self.effect_handlers(),
            **options,
        )

    def resume_options(self) -> ResumeOptions:
        """What ``resume_run`` needs to rebuild an equivalent pack (stored in the run's vars)."""
        return {
            "model": self.handler.model,
            "force_model": self.handler.force_model,
            "routes": self.handler.routing.route_specs(),
            "provider_options": dict(self.provider_options),
            "sibling_batching": self.handler.prefetcher is not None,
            "allow_remote": self.handler.routing.remote.to_options(),
        }

    def close(self) -> None:
        """Stop prefetches and the progress writer (draining it); close the ledger if the pack
        opened it. Resident models stay loaded for the next pack (``ProviderRegistry``)."""
        self.prefetcher.close()
        self.node.close()
        if self.owns_ledger and self.ledger is not None:
            self.ledger.close()

    def __enter__(self) -> MLXPack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class PackOptions(TypedDict, total=False):
    """The keyword options of ``build_pack`` (for callers that forward them)."""

    ledger_url: str | None
    ledger: Ledger | None
    model: str | None
    force_model: bool
    provider_options: Mapping[str, object] | None
    server_base_url: str | None
    sibling_batching: bool
    record_progress: bool
    runtime_progress: RuntimeProgress
    registry: ProviderRegistry | None
    effect_policy: EffectPolicy | None | Unset
    routes: Sequence[str]
    allow_remote: bool | Sequence[str]


def build_pack(
    ledger_url: str | None = None,
    *,
    ledger: Ledger | None = None,
    model: str | None = None,
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
) -> MLXPack:
    """Open (or reuse) the ledger and wire node, handler, prefetcher and stores.

    ``ledger_url``: a SQLAlchemy URL or a file path (SQLite); ``ledger``: an open ``Ledger``
    (not closed by the pack); neither: no ledger (the handler alone, for hosts that bring
    their own stores; phase events then go to AbstractRuntime's progress channel).
    ``model``: the default model of nodes that name none (``force_model=True``: of every
    node). ``provider_options``: load-time options of local providers (``mlx_batching`` is on
    by default). ``server_base_url``: send every node to a remote server unless it names its
    own. ``sibling_batching``: prefetch independent sibling branches (see module doc).
    ``record_progress=False``: no progress rows (everything else unchanged).
    ``routes``: ``--route`` specs (``"lmstudio=mlx:/models/qwen"``, ``"openai/gpt-4o=http://..."``);
    with ``model``/``force_model`` they make the handler's ``routing.Routing`` (see that module).
    ``allow_remote``: the servers a flow may send nodes to besides the route URLs and
    ``server_base_url`` (True: any; a list: those hosts or ``host:port``; False: none), see
    ``routing.RemotePolicy``.
    ``effect_policy``: the runtime's retry policy; default ``RetryPolicy(llm_max_attempts=3)``
    with a short backoff, as AbstractRuntime's own factories do (capacity errors such as
    ``QueueFull`` are retried; requests that are wrong are not); ``None``: the kernel default
    (one attempt).
    """
    if effect_policy is UNSET:
        effect_policy = RetryPolicy(llm_max_attempts=3, tool_max_attempts=1, backoff_base=0.25, backoff_max=4.0)
    owns = False
    if ledger is None and ledger_url is not None:
        ledger = Ledger(normalize_ledger_url(ledger_url))
        owns = True
    node = LLMNode(
        ledger=ledger,
        registry=registry,
        default_model=model,
        provider_options=provider_options,
        record_progress=record_progress,
    )
    flows = FlowCatalog()
    prefetcher = SiblingPrefetcher(node)
    handler = LLMCallHandler(
        node,
        flows=flows,
        prefetcher=prefetcher if sibling_batching else None,
        model=model,
        force_model=force_model,
        server_base_url=server_base_url,
        runtime_progress=runtime_progress,
        routing=Routing.build(default_model=model, serve_all=force_model, routes=routes, remote=RemotePolicy.build(allow_remote)),
    )
    return MLXPack(
        ledger=ledger,
        node=node,
        handler=handler,
        flows=flows,
        prefetcher=prefetcher,
        run_store=LedgerRunStore(ledger) if ledger is not None else None,
        ledger_store=LedgerStepStore(ledger) if ledger is not None else None,
        provider_options=dict(provider_options or {}),
        owns_ledger=owns,
        effect_policy=effect_policy,
    )
