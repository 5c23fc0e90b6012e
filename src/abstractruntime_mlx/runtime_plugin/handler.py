"""The LLM_CALL effect handler, sibling-branch batching, and the pack that wires them.

    pack = build_pack("sqlite:///runs.sqlite", model="/models/qwen")
    runtime = pack.runtime()            # Runtime(run_store, ledger_store, {LLM_CALL: handler})
    ...
    pack.close()

``LLMCallHandler(run, effect, default_next_node)`` turns the LLM_CALL payload into a
``nodes.NodeRequest``: the ``<runtime_metadata>`` grounding envelope the runtime core puts on
every prompt is removed (``abstractruntime.turn_grounding.strip_turn_grounding``; a per-second
timestamp in the prompt would defeat prefix reuse, batching of identical prompts and sibling
prefetch, and the tiny/local models have no use for it); the run-level controls are folded
from ``run.vars["_runtime"]`` (the runtime core does not merge them into the payload); the node
runs through ``nodes.LLMNode`` and the result goes back as ``EffectOutcome.completed(dict)``.

Sibling-branch batching: AbstractRuntime's ``parallel``/``sequence`` node runs its branches
one after another on the tick thread. When the handler runs the first ``llm_call`` branch of
such a node, it also submits the later ``llm_call`` branches whose requests are fully known
from the flow (``effectConfig`` + ``pinDefaults``, nothing wired in) on background threads, so
all of them meet in one engine batch. When the runtime reaches a sibling, its real request is
prepared and compared with the prefetched one by fingerprint (every ``generate`` argument,
the resolved controls and the client); only an identical request takes the precomputed result
(and its buffered progress rows, written then under the sibling's own step with their
original timestamps). Anything else is cancelled and called again. See docs/runtime-plugin.md.
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Final, Literal

from abstractruntime import Runtime
from abstractruntime.core.effect_cancellation import current_effect_cancel_event
from abstractruntime.core.models import Effect, EffectType, RunState
from abstractruntime.core.policy import RetryPolicy
from abstractruntime.core.progress_channel import current_effect_progress_callback
from abstractruntime.core.runtime import EffectOutcome
from abstractruntime.turn_grounding import strip_turn_grounding

from ..controls import UNSET
from ..errors import (
    AuthenticationError,
    ConflictError,
    InvalidRequest,
    MLXRuntimeError,
    ModelNotFound,
    PolicyError,
    SpeculationUnavailable,
)
from ..ledger import Ledger, NodeKey, sqlite_url
from ..nodes import LLMNode, NodeRequest, NodeResult, PreparedCall, ProgressRoute, ProviderRegistry
from .flows import FlowCatalog
from .prediction import Unpredictable
from .stores import LedgerRunStore, LedgerStepStore

__all__ = [
    "LLMCallHandler",
    "MLXPack",
    "PrefetchStats",
    "SiblingPrefetcher",
    "build_pack",
    "normalize_ledger_url",
    "request_from_payload",
]

log = logging.getLogger(__name__)

RuntimeProgress = Literal["auto", "always", "never"]

_SAMPLING_PARAMS: Final = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stop",
)
_NOT_RETRYABLE: Final = (
    InvalidRequest,
    PolicyError,
    ModelNotFound,
    SpeculationUnavailable,
    AuthenticationError,
    ConflictError,
)
DEFAULT_PREFETCH_WORKERS: Final = 32
DEFAULT_PREFETCH_TTL_S: Final = 600.0
DEFAULT_MAX_PREFETCHES: Final = 256


def normalize_ledger_url(url_or_path: str) -> str:
    """A SQLAlchemy URL: URLs pass through, plain paths become ``sqlite:///<absolute path>``."""
    text = str(url_or_path)
    return text if "://" in text else sqlite_url(text)


# --------------------------------------------------------------------------------------
# Payload -> NodeRequest
# --------------------------------------------------------------------------------------


def request_from_payload(
    payload: Mapping[str, Any],
    run_vars: Mapping[str, Any] | None,
    *,
    node_config: Mapping[str, Any] | None = None,
    default_model: str | None = None,
    force_model: bool = False,
    default_base_url: str | None = None,
) -> NodeRequest:
    """The ``NodeRequest`` of an LLM_CALL payload (as the visual compiler emits it).

    Node level: ``params.speculation`` / ``params.thinking`` (absent or null inherit).
    Run level: ``run_vars["_runtime"]["speculation"|"thinking"]``. ``prompt_cache_key``, first
    found: ``params.prompt_cache_key``, the node's ``effectConfig.prompt_cache_key``, a string
    ``params.prompt_cache_binding`` (or its ``key``), ``_runtime.prompt_cache_key``. Remote selection, first
    found: ``params.base_url``, the node's ``effectConfig.base_url``/``server_base_url`` (from
    the flow JSON, which the compiler does not forward), ``_runtime.base_url``/
    ``server_base_url``, ``default_base_url``. Model: ``default_model`` when ``force_model``,
    else the payload's model, else ``default_model``.
    """
    if payload.get("response_schema") is not None:
        raise InvalidRequest("structured output (response_schema) is not supported by the mlx pack's LLM node")
    params = payload.get("params") if isinstance(payload.get("params"), Mapping) else {}
    runtime_ns = (run_vars or {}).get("_runtime")
    runtime_ns = runtime_ns if isinstance(runtime_ns, Mapping) else {}
    config = node_config or {}
    messages = payload.get("messages")
    if isinstance(messages, list):
        messages = [_strip_message(m) for m in messages]
    else:
        messages = None
    sampling: dict[str, Any] = {name: copy.deepcopy(params[name]) for name in _SAMPLING_PARAMS if params.get(name) is not None}
    seed = params.get("seed")
    if seed is not None and not isinstance(seed, bool) and isinstance(seed, int) and seed >= 0:
        sampling["seed"] = seed
    max_out = params.get("max_output_tokens", params.get("max_tokens"))
    if max_out is not None:
        sampling["max_output_tokens"] = max_out
    model = payload.get("model") if isinstance(payload.get("model"), str) and payload.get("model") else None
    if force_model or model is None:
        model = default_model or model
    base_url = _first_str(
        params.get("base_url"),
        config.get("base_url"),
        config.get("server_base_url"),
        runtime_ns.get("base_url"),
        runtime_ns.get("server_base_url"),
        default_base_url,
    )
    return NodeRequest(
        prompt=strip_turn_grounding(payload.get("prompt") or ""),
        messages=messages,
        system_prompt=_str_or_none(payload.get("system_prompt")),
        tools=list(payload.get("tools") or []) or None,
        media=list(payload.get("media") or []) or None,
        provider=str(payload.get("provider") or "mlx"),
        model=model,
        base_url=base_url,
        speculation=_level(params, "speculation"),
        thinking=_level(params, "thinking"),
        run_speculation=_level(runtime_ns, "speculation"),
        run_thinking=_level(runtime_ns, "thinking"),
        sampling=sampling,
        prompt_cache_key=_prompt_cache_key(params, config, runtime_ns),
    )


def _prompt_cache_key(params: Mapping[str, Any], config: Mapping[str, Any], runtime_ns: Mapping[str, Any]) -> str | None:
    """The node's prompt-cache key (node level first, then run level); None: no reuse."""
    binding = params.get("prompt_cache_binding")
    if isinstance(binding, Mapping):
        binding = binding.get("key")
    return _first_str(params.get("prompt_cache_key"), config.get("prompt_cache_key"), binding, runtime_ns.get("prompt_cache_key"))


def _level(source: Mapping[str, Any], name: str) -> Any:
    value = source.get(name)
    return UNSET if value is None else copy.deepcopy(value)


def _strip_message(message: Any) -> Any:
    if isinstance(message, Mapping) and message.get("role") == "user" and isinstance(message.get("content"), str):
        return {**message, "content": strip_turn_grounding(message["content"])}
    return copy.deepcopy(message)


def _first_str(*values: Any) -> str | None:
    for value in values:
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


# --------------------------------------------------------------------------------------
# Sibling prefetch
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Prefetch:
    run_id: str
    node_id: str
    trigger_node: str
    prepared: PreparedCall
    route: ProgressRoute
    cancel_event: threading.Event
    launched_at: float
    future: Future[NodeResult] | None = None

    def wait(self, cancel_event: threading.Event | None) -> NodeResult:
        assert self.future is not None
        while True:
            try:
                return self.future.result(timeout=0.25)
            except FutureTimeout:
                if cancel_event is not None and cancel_event.is_set():
                    self.cancel_event.set()  # the result comes back as cancelled soon after


@dataclass(slots=True)
class PrefetchStats:
    launched: int = 0
    used: int = 0
    mismatched: int = 0
    failed: int = 0
    unstarted: int = 0
    throttled: int = 0
    discarded: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "launched": self.launched,
            "used": self.used,
            "mismatched": self.mismatched,
            "failed": self.failed,
            "unstarted": self.unstarted,
            "throttled": self.throttled,
            "discarded": self.discarded,
        }


class SiblingPrefetcher:
    """Runs predicted sibling calls ahead of the runtime and hands them over by fingerprint.

    Owns one thread pool (``max_workers`` calls in flight); ``close()`` cancels what is left
    and joins it. Entries of a run that never claims them are dropped by ``discard_run``
    (``run_flow`` calls it when a run comes to rest) or after ``ttl_s``.
    """

    def __init__(
        self,
        node: LLMNode,
        *,
        max_workers: int = DEFAULT_PREFETCH_WORKERS,
        max_pending: int = DEFAULT_MAX_PREFETCHES,
        ttl_s: float = DEFAULT_PREFETCH_TTL_S,
    ) -> None:
        self._node = node
        self._max_workers = max_workers
        self._max_pending = max_pending
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], _Prefetch] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._active_runs = 0
        self._active_calls = 0
        self.stats = PrefetchStats()

    @contextmanager
    def run_in_progress(self) -> Iterator[None]:
        """Mark a run as ticking (``run_flow`` does), so prefetches leave it room in the engine."""
        with self._lock:
            self._active_runs += 1
        try:
            yield
        finally:
            with self._lock:
                self._active_runs -= 1

    @contextmanager
    def call_in_progress(self) -> Iterator[None]:
        """Mark a handler call in progress (the handler does)."""
        with self._lock:
            self._active_calls += 1
        try:
            yield
        finally:
            with self._lock:
                self._active_calls -= 1

    def note(self, outcome: str) -> None:
        """Count a claim outcome: ``used``, ``mismatched``, ``failed`` or ``unstarted``."""
        with self._lock:
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)

    def has(self, run_id: str, node_id: str) -> bool:
        with self._lock:
            return (run_id, node_id) in self._pending

    def launch(self, run_id: str, trigger_node: str, calls: list[tuple[str, PreparedCall]], *, buffer: bool) -> list[str]:
        """Start ``calls`` (``(node_id, prepared)``) for ``run_id``; returns the node ids started.

        Prefetches only take what the engine can spare: its free batch slots and queue places,
        minus the prefetches already in flight, minus one place per run or call in progress
        (each may submit one request of its own at any moment), halved (the rest stays for
        other users of the engine). So a burst of prefetches does not make a real call fail
        with ``QueueFull``. Engines that do not report their load (remote) get at most
        ``max_workers`` prefetches in flight.
        """
        started: list[str] = []
        budgets: dict[str, int] = {}
        with self._lock:
            if self._closed:
                return started
            self._expire_locked()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="abstractruntime-mlx-sibling")
            in_flight = sum(1 for e in self._pending.values() if e.future is not None and not e.future.done())
            for node_id, prepared in calls:
                key = (run_id, node_id)
                if key in self._pending or len(self._pending) >= self._max_pending or in_flight >= self._max_workers:
                    continue
                if prepared.client_id not in budgets:
                    headroom = self._node.headroom(prepared)
                    # In-flight prefetches may not have reached the engine yet: count them as
                    # taken. Each run/call in progress may submit a request of its own.
                    reserve = max(self._active_runs, self._active_calls)
                    budgets[prepared.client_id] = (
                        self._max_workers if headroom is None else max(0, headroom - in_flight - reserve) // 2
                    )
                if budgets[prepared.client_id] <= 0:
                    self.stats.throttled += 1
                    continue
                budgets[prepared.client_id] -= 1
                in_flight += 1
                entry = _Prefetch(
                    run_id=run_id,
                    node_id=node_id,
                    trigger_node=trigger_node,
                    prepared=prepared,
                    route=ProgressRoute(buffer=buffer),
                    cancel_event=threading.Event(),
                    launched_at=time.perf_counter(),
                )
                entry.future = self._pool.submit(self._node.execute, prepared, route=entry.route, cancel_event=entry.cancel_event)
                self._pending[key] = entry
                self.stats.launched += 1
                started.append(node_id)
        return started

    def take(self, run_id: str, node_id: str) -> _Prefetch | None:
        with self._lock:
            return self._pending.pop((run_id, node_id), None)

    def discard_run(self, run_id: str) -> int:
        """Cancel and forget every unclaimed prefetch of ``run_id``."""
        with self._lock:
            keys = [k for k in self._pending if k[0] == run_id]
            entries = [self._pending.pop(k) for k in keys]
            self.stats.discarded += len(entries)
        for entry in entries:
            entry.cancel_event.set()
        return len(entries)

    def _expire_locked(self) -> None:
        now = time.perf_counter()
        for key in [k for k, e in self._pending.items() if now - e.launched_at > self._ttl_s]:
            entry = self._pending.pop(key)
            entry.cancel_event.set()
            self.stats.discarded += 1

    def close(self) -> None:
        """Cancel every unclaimed prefetch and join the pool (cancelled calls end quickly)."""
        with self._lock:
            self._closed = True
            entries = list(self._pending.values())
            self._pending.clear()
            pool, self._pool = self._pool, None
        for entry in entries:
            entry.cancel_event.set()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------------------
# The handler
# --------------------------------------------------------------------------------------


class LLMCallHandler:
    """AbstractRuntime LLM_CALL handler running every call through ``nodes.LLMNode``.

    ``runtime_progress``: where phase events go besides our ledger. ``"auto"`` (default)
    forwards them to AbstractRuntime's progress channel only when the runtime's ledger store
    is not ours on the same ledger (our node already records them, in the ``progress`` table,
    through a batching writer; forwarding would store every event twice, once synchronously on
    the tick thread). ``"always"``/``"never"`` force it.
    """

    def __init__(
        self,
        node: LLMNode,
        *,
        flows: FlowCatalog | None = None,
        prefetcher: SiblingPrefetcher | None = None,
        model: str | None = None,
        force_model: bool = False,
        server_base_url: str | None = None,
        runtime_progress: RuntimeProgress = "auto",
    ) -> None:
        if runtime_progress not in ("auto", "always", "never"):
            raise ValueError(f"runtime_progress must be 'auto', 'always' or 'never' (got {runtime_progress!r})")
        self.node = node
        self.flows = flows or FlowCatalog()
        self.prefetcher = prefetcher
        self.model = model
        self.force_model = force_model
        self.server_base_url = server_base_url
        self.runtime_progress = runtime_progress

    def __call__(self, run: RunState, effect: Effect, default_next_node: str | None = None) -> EffectOutcome:
        try:
            if self.prefetcher is None:
                return self._handle(run, effect)
            with self.prefetcher.call_in_progress():
                return self._handle(run, effect)
        except MLXRuntimeError as exc:
            retryable = not isinstance(exc, _NOT_RETRYABLE)
            return EffectOutcome.failed(f"[{exc.code}] {exc.message}", retryable=retryable)

    # -- internals ----------------------------------------------------------------------

    def _request(self, run: RunState, node_id: str, payload: Mapping[str, Any]) -> NodeRequest:
        index = self.flows.get(run.workflow_id)
        return request_from_payload(
            payload,
            run.vars,
            node_config=index.node_config(node_id) if index is not None else None,
            default_model=self.model,
            force_model=self.force_model,
            default_base_url=self.server_base_url,
        )

    def _handle(self, run: RunState, effect: Effect) -> EffectOutcome:
        payload = effect.payload if isinstance(effect.payload, Mapping) else {}
        node_id = str(run.current_node)
        params = payload.get("params") if isinstance(payload.get("params"), Mapping) else {}
        trace = params.get("trace_metadata") if isinstance(params.get("trace_metadata"), Mapping) else {}
        attempt = trace.get("attempt")
        key = NodeKey(
            run.run_id,
            node_id,
            workflow_id=run.workflow_id,
            step_id=str(trace["step_id"]) if trace.get("step_id") else None,
            attempt=attempt if isinstance(attempt, int) else None,
        )
        forward = self._forward_runtime_progress(run)
        callback = current_effect_progress_callback() if forward else None
        cancel_event = current_effect_cancel_event()
        prepared = self.node.prepare(self._request(run, node_id, payload))

        extra: dict[str, Any] = {}
        result: NodeResult | None = None
        if self.prefetcher is not None:
            result, extra = self._claim(run.run_id, node_id, prepared, key, callback, cancel_event)
            launched = self._launch_siblings(run, node_id, buffer=forward or self.node.record_progress)
            if launched:
                extra = {**extra, "sibling_batch": {**extra.get("sibling_batch", {}), "launched": launched}}
        if result is None:
            result = self.node.execute(prepared, route=self.node.route_for(key, callback), cancel_event=cancel_event)
        result.extra_metadata.update(extra)
        body = result.to_runtime_result()
        if result.generation.finish_reason == "cancelled":
            return EffectOutcome.cancelled({"reason": "cancelled", "node_id": node_id, "partial": body})
        return EffectOutcome.completed(body)

    def _claim(
        self,
        run_id: str,
        node_id: str,
        prepared: PreparedCall,
        key: NodeKey,
        callback: Callable[[dict[str, Any]], Any] | None,
        cancel_event: threading.Event | None,
    ) -> tuple[NodeResult | None, dict[str, Any]]:
        assert self.prefetcher is not None
        entry = self.prefetcher.take(run_id, node_id)
        if entry is None:
            return None, {}
        info: dict[str, Any] = {"role": "sibling", "trigger_node": entry.trigger_node}
        if entry.prepared.fingerprint != prepared.fingerprint:
            entry.cancel_event.set()
            self.prefetcher.note("mismatched")
            log.info("sibling prefetch of %s/%s not used: the request changed", run_id, node_id)
            return None, {"sibling_batch": {**info, "used": False, "reason": "request_changed"}}
        if entry.future is not None and entry.future.cancel():
            # Still queued behind other prefetches: calling it here is no slower.
            self.prefetcher.note("unstarted")
            return None, {"sibling_batch": {**info, "used": False, "reason": "not_started"}}
        claimed_at = time.perf_counter()
        ready = entry.future is not None and entry.future.done()
        try:
            result = entry.wait(cancel_event)
        except Exception as exc:  # noqa: BLE001 - recorded by name; the node's own call decides
            code = exc.code if isinstance(exc, MLXRuntimeError) else type(exc).__name__
            self.prefetcher.note("failed")
            log.warning("sibling prefetch of %s/%s failed (%s); calling again", run_id, node_id, code)
            return None, {"sibling_batch": {**info, "used": False, "reason": "prefetch_failed", "error": code}}
        writer = self.node.writer if self.node.record_progress else None
        entry.route.attach(
            ledger=self.node.ledger if writer is not None else None,
            writer=writer,
            key=key if writer is not None else None,
            callback=callback,
        )
        entry.route.flush()
        self.prefetcher.note("used")
        info.update(used=True, ready_when_reached=ready, waited_s=round(time.perf_counter() - claimed_at, 6))
        return result, {"sibling_batch": info}

    def _launch_siblings(self, run: RunState, node_id: str, *, buffer: bool) -> list[str]:
        assert self.prefetcher is not None
        index = self.flows.get(run.workflow_id)
        if index is None:
            return []
        calls: list[tuple[str, PreparedCall]] = []
        for sibling in index.later_siblings(node_id):
            if self.prefetcher.has(run.run_id, sibling.node_id):
                continue
            try:
                payload = sibling.payload_for(run.vars)
            except Unpredictable as exc:
                log.info("not prefetching %s: %s", sibling.node_id, exc)
                continue
            try:
                request = request_from_payload(
                    payload,
                    run.vars,
                    node_config=sibling.config,
                    default_model=self.model,
                    force_model=self.force_model,
                    default_base_url=self.server_base_url,
                )
                calls.append((sibling.node_id, self.node.prepare(request)))
            except MLXRuntimeError as exc:
                # Its own turn will raise the same error on the tick thread, where it belongs.
                log.info("not prefetching %s: %s", sibling.node_id, exc.message)
        if not calls:
            return []
        return self.prefetcher.launch(run.run_id, node_id, calls, buffer=buffer)

    def _forward_runtime_progress(self, run: RunState) -> bool:
        if self.runtime_progress != "auto":
            return self.runtime_progress == "always"
        store = getattr(run, "_runtime_ledger_store", None)
        return not (self.node.ledger is not None and _is_store_of(store, self.node.ledger))


def _is_store_of(store: Any, ledger: Ledger) -> bool:
    for _ in range(4):  # see through wrappers (ObservableLedgerStore._inner, ...)
        if isinstance(store, LedgerStepStore):
            return store.ledger is ledger
        store = getattr(store, "_inner", None) or getattr(store, "inner", None)
        if store is None:
            return False
    return False


# --------------------------------------------------------------------------------------
# The pack
# --------------------------------------------------------------------------------------


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
    provider_options: dict[str, Any]
    owns_ledger: bool
    effect_policy: Any = None

    def effect_handlers(self) -> dict[EffectType, Any]:
        return {EffectType.LLM_CALL: self.handler}

    def runtime(self, **runtime_options: Any) -> Runtime:
        """A new ``Runtime`` over this pack's stores and handler (cheap; one per thread is fine)."""
        if self.run_store is None or self.ledger_store is None:
            raise RuntimeError("this pack has no ledger; build it with a ledger URL to get a Runtime")
        options: dict[str, Any] = {"effect_policy": self.effect_policy} if self.effect_policy is not None else {}
        options.update(runtime_options)
        return Runtime(
            run_store=self.run_store,
            ledger_store=self.ledger_store,
            effect_handlers=self.effect_handlers(),
            **options,
        )

    def resume_options(self) -> dict[str, Any]:
        """What ``resume_run`` needs to rebuild an equivalent pack (stored in the run's vars)."""
        return {
            "model": self.handler.model,
            "force_model": self.handler.force_model,
            "provider_options": dict(self.provider_options),
            "sibling_batching": self.handler.prefetcher is not None,
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


def build_pack(
    ledger_url: str | None = None,
    *,
    ledger: Ledger | None = None,
    model: str | None = None,
    force_model: bool = False,
    provider_options: Mapping[str, Any] | None = None,
    server_base_url: str | None = None,
    sibling_batching: bool = True,
    record_progress: bool = True,
    runtime_progress: RuntimeProgress = "auto",
    registry: ProviderRegistry | None = None,
    effect_policy: Any = UNSET,
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
