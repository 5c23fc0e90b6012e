"""The pack: one ledger, node, handler, prefetcher and stores wired together.

pack = build_pack("sqlite:///runs.sqlite", model="/models/qwen")
runtime = pack.runtime()            # Runtime(run_store, ledger_store, {LLM_CALL: handler})
...
pack.close()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TypedDict, Unpack

from abstractruntime import Runtime
from abstractruntime.core.models import EffectType
from abstractruntime.core.policy import EffectPolicy, RetryPolicy
from abstractruntime.core.runtime import EffectHandler

from ...controls import UNSET, Unset
from ...json_values import as_str, object_at
from ...ledger import Ledger, normalize_ledger_url
from ...nodes import LLMNode, ProviderRegistry
from ..prefetch.catalog import FlowCatalog
from ..prefetch.prefetch import SiblingPrefetcher
from .handler import LLMCallHandler, RuntimeProgress
from .routing import RemotePolicy, Routing
from .stores import LedgerRunStore, LedgerStepStore

__all__ = ["MLXPack", "PackOptions", "PackSettings", "ResumeOptions", "build_pack", "normalize_ledger_url"]


class ResumeOptions(TypedDict):
    """What ``resume_run`` needs to rebuild an equivalent pack (stored in the run's vars)."""

    model: str | None
    force_model: bool
    routes: list[str]
    provider_options: dict[str, object]
    sibling_batching: bool
    allow_remote: bool | list[str]


@dataclass(frozen=True, slots=True)
class PackSettings:
    """How a pack serves a flow's LLM nodes: ``build_pack``'s options as one value, built once
    where they are given (keywords, the command line, a stored run) and passed through.

    ``model``: the default model of nodes that name none (``force_model=True``: of every node).
    ``provider_options``: load-time options of local providers (``mlx_batching`` is on by
    default). ``server_base_url``: send every node to a remote server unless it names its own.
    ``sibling_batching``: prefetch independent sibling branches (``prefetch``).
    ``prefix_warm``: when an LLM node finishes, warm the predictable prefix of the LLM nodes it
    enables in the local model's prefix cache (``prompt_cache.RunCacheHints.warm``).
    ``record_progress=False``: no progress rows (everything else unchanged).
    ``runtime_progress``: when phase events also go to AbstractRuntime's progress channel
    (``handler``). ``routes``: ``--route`` specs (``"lmstudio=mlx:/models/qwen"``,
    ``"openai/gpt-4o=http://..."``); with ``model``/``force_model`` they make the handler's
    ``routing.Routing``. ``allow_remote``: the servers a flow may send nodes to besides the route
    URLs and ``server_base_url`` (True: any; a list: those hosts or ``host:port``; False: none),
    see ``routing.RemotePolicy``. ``effect_policy``: the runtime's retry policy; default
    ``RetryPolicy(llm_max_attempts=3)`` with a short backoff, as AbstractRuntime's own factories
    do (capacity errors such as ``QueueFull`` are retried; requests that are wrong are not);
    ``None``: the kernel default (one attempt).
    """

    model: str | None = None
    force_model: bool = False
    provider_options: Mapping[str, object] | None = None
    server_base_url: str | None = None
    sibling_batching: bool = True
    prefix_warm: bool = True
    record_progress: bool = True
    runtime_progress: RuntimeProgress = "auto"
    effect_policy: EffectPolicy | None | Unset = UNSET
    routes: Sequence[str] = ()
    allow_remote: bool | Sequence[str] = False

    @classmethod
    def from_resume_options(cls, options: Mapping[str, object], *, model: str | None = None) -> PackSettings:
        """The settings a run was started with (``MLXPack.resume_options``, as stored in its
        vars); ``model`` replaces the stored default model."""
        routes = options.get("routes")
        allow_remote = options.get("allow_remote", False)
        return cls(
            model=model or as_str(options.get("model")),
            force_model=bool(options.get("force_model", False)),
            provider_options=object_at(options, "provider_options") or None,
            sibling_batching=bool(options.get("sibling_batching", True)),
            routes=[str(route) for route in routes] if isinstance(routes, list) else [],
            allow_remote=[str(host) for host in allow_remote]
            if isinstance(allow_remote, list)
            else allow_remote is True,
        )


SETTING_NAMES: frozenset[str] = frozenset(f.name for f in fields(PackSettings))


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
    settings: PackSettings
    owns_ledger: bool
    effect_policy: EffectPolicy | None = None
    """``settings.effect_policy`` with its default applied."""

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
            "provider_options": dict(self.settings.provider_options or {}),
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
    """``PackSettings``' fields as keywords (``build_pack(url, model=...)``), for callers that
    forward them."""

    model: str | None
    force_model: bool
    provider_options: Mapping[str, object] | None
    server_base_url: str | None
    sibling_batching: bool
    prefix_warm: bool
    record_progress: bool
    runtime_progress: RuntimeProgress
    effect_policy: EffectPolicy | None | Unset
    routes: Sequence[str]
    allow_remote: bool | Sequence[str]


def pack_settings(settings: PackSettings | None, options: PackOptions) -> PackSettings:
    """``settings``, or ``options`` as settings; both given is a caller's mistake."""
    if settings is not None and options:
        raise TypeError(f"give settings=PackSettings(...) or its fields as keywords, not both (got {sorted(options)})")
    return settings if settings is not None else PackSettings(**options)


def build_pack(
    ledger_url: str | None = None,
    *,
    ledger: Ledger | None = None,
    registry: ProviderRegistry | None = None,
    settings: PackSettings | None = None,
    **options: Unpack[PackOptions],
) -> MLXPack:
    """Open (or reuse) the ledger and wire node, handler, prefetcher and stores.

    ``ledger_url``: a SQLAlchemy URL or a file path (SQLite); ``ledger``: an open ``Ledger``
    (not closed by the pack); neither: no ledger (the handler alone, for hosts that bring
    their own stores; phase events then go to AbstractRuntime's progress channel).
    ``registry``: where resident models live (default: the process-wide one).
    ``settings`` (or its fields as keywords: ``build_pack(url, model=..., routes=[...])``): how
    nodes are served, see ``PackSettings``.
    """
    settings = pack_settings(settings, options)
    effect_policy = settings.effect_policy
    if effect_policy is UNSET:
        effect_policy = RetryPolicy(llm_max_attempts=3, tool_max_attempts=1, backoff_base=0.25, backoff_max=4.0)
    owns = False
    if ledger is None and ledger_url is not None:
        ledger = Ledger(normalize_ledger_url(ledger_url))
        owns = True
    node = LLMNode(
        ledger=ledger,
        registry=registry,
        default_model=settings.model,
        provider_options=settings.provider_options,
        record_progress=settings.record_progress,
    )
    flows = FlowCatalog()
    prefetcher = SiblingPrefetcher(node)
    handler = LLMCallHandler(
        node,
        flows=flows,
        prefetcher=prefetcher if settings.sibling_batching else None,
        model=settings.model,
        force_model=settings.force_model,
        server_base_url=settings.server_base_url,
        runtime_progress=settings.runtime_progress,
        prefix_warm=settings.prefix_warm,
        routing=Routing.build(
            default_model=settings.model,
            serve_all=settings.force_model,
            routes=settings.routes,
            remote=RemotePolicy.build(settings.allow_remote),
        ),
    )
    return MLXPack(
        ledger=ledger,
        node=node,
        handler=handler,
        flows=flows,
        prefetcher=prefetcher,
        run_store=LedgerRunStore(ledger) if ledger is not None else None,
        ledger_store=LedgerStepStore(ledger) if ledger is not None else None,
        settings=settings,
        owns_ledger=owns,
        effect_policy=effect_policy,
    )
