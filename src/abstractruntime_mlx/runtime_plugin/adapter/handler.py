"""The LLM_CALL effect handler.

``LLMCallHandler(run, effect, default_next_node)`` turns the LLM_CALL payload into a node
request (``payload``), runs it through ``nodes.LLMNode`` (taking a prefetched sibling's
result when its fingerprint matches, see ``prefetch``) and returns
``EffectOutcome.completed(dict)``. The pack that wires it to stores lives in ``pack``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Final, Literal, Protocol

from abstractruntime.core.effect_cancellation import current_effect_cancel_event
from abstractruntime.core.progress_channel import current_effect_progress_callback
from abstractruntime.core.runtime import EffectOutcome

from ...errors import (
    AuthenticationError,
    ConflictError,
    InvalidRequest,
    MLXRuntimeError,
    ModelNotFound,
    PolicyError,
    SpeculationUnavailable,
)
from ...json_values import JSONObject, JSONValue, object_at
from ...ledger import Ledger, NodeKey
from ...nodes import LLMNode, ModelLoad, NodeRequest, NodeResult, PreparedCall
from ...nodes.llm_node import ClientKind
from ...request import ProgressSink
from ..prefetch.catalog import FlowCatalog, FlowIndex
from ..prefetch.prediction import Unpredictable
from ..prefetch.prefetch import SiblingPrefetcher
from ..prefetch.prompt_cache import CacheHintTarget, CallIdentity, RunCacheHints, node_prompt_cache_key, run_hints
from .payload import explicit_base_url, input_as_sent, request_from_payload
from .routing import RouteDecision, Routing
from .stores import LedgerStepStore

__all__ = ["LLMCallHandler", "RuntimeProgress"]

log = logging.getLogger(__name__)

_MAX_WARMED_AGENT_RUNS: Final = 1024  # ReAct runs remembered as having warmed (``_first_agent_turn``)

RuntimeProgress = Literal["auto", "always", "never"]


class RunView(Protocol):
    """What the handler reads of AbstractRuntime's ``RunState`` (upstream has no type information)."""

    run_id: str
    workflow_id: str
    current_node: str
    session_id: str | None
    vars: Mapping[str, object]


@dataclasses.dataclass(frozen=True, slots=True)
class FlowRun:
    """The run of a registered flow that a call belongs to (an agent's ReAct run belongs to the
    run that started it)."""

    run_id: str
    workflow_id: str
    vars: Mapping[str, object]


class EffectView(Protocol):
    """What the handler reads of AbstractRuntime's ``Effect``: the LLM_CALL payload (a JSON object)."""

    payload: object


_NOT_RETRYABLE: Final = (
    InvalidRequest,
    PolicyError,
    ModelNotFound,
    SpeculationUnavailable,
    AuthenticationError,
    ConflictError,
)


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
        routing: Routing | None = None,
        cache_hints: RunCacheHints | None = None,
        prefix_warm: bool = True,
    ) -> None:
        if runtime_progress not in ("auto", "always", "never"):
            raise ValueError(f"runtime_progress must be 'auto', 'always' or 'never' (got {runtime_progress!r})")
        self.node = node
        self.flows = flows or FlowCatalog()
        self.prefetcher = prefetcher
        self.cache_hints = cache_hints or RunCacheHints()
        self.prefix_warm = prefix_warm
        # The agents' ReAct runs whose first call warmed what their agent enables: each later
        # turn would read the parent run back and build the same prefix again, for a warm the
        # engine refuses as already resident.
        self._agent_runs_warmed: OrderedDict[str, None] = OrderedDict()
        self._warm_lock = threading.Lock()
        self.model = model
        self.force_model = force_model
        self.server_base_url = server_base_url
        self.runtime_progress = runtime_progress
        routing = routing or Routing(default_model=model, serve_all=force_model)
        # The caller named this server itself: it is allowed like a --route URL.
        self.routing = dataclasses.replace(routing, remote=routing.remote.with_urls([server_base_url]))

    def __call__(self, run: RunView, effect: EffectView, default_next_node: str | None = None) -> EffectOutcome:
        try:
            if self.prefetcher is None:
                return self._handle(run, effect)
            with self.prefetcher.call_in_progress():
                return self._handle(run, effect)
        except MLXRuntimeError as exc:
            retryable = not isinstance(exc, _NOT_RETRYABLE)
            return EffectOutcome.failed(f"[{exc.code}] {exc.message}", retryable=retryable)

    # -- internals ----------------------------------------------------------------------

    def _request(
        self,
        call: CallIdentity,
        run_vars: Mapping[str, object],
        payload: Mapping[str, object],
        node_config: Mapping[str, object] | None,
    ) -> tuple[NodeRequest, RouteDecision]:
        """The request ``call`` sends from a run with ``run_vars``, served where ``self.routing``
        says (see ``routing``), with the prompt-cache key the host would give it (see
        ``prompt_cache``). A server the user did not allow is refused here, before anything is
        sent (``routing.RemotePolicy``)."""
        route = self.routing.decide(
            payload.get("provider"),
            payload.get("model"),
            explicit_base_url=explicit_base_url(
                payload, run_vars, node_config=node_config, default_base_url=self.server_base_url
            ),
        )
        if route.base_url is not None:
            self.routing.remote.check(route.base_url, where=f"node {call.node_id!r}")
        return request_from_payload(payload, run_vars, node_config=node_config, route=route, call=call), route

    def _handle(self, run: RunView, effect: EffectView) -> EffectOutcome:
        payload = effect.payload if isinstance(effect.payload, Mapping) else {}
        node_id = str(run.current_node)
        params = object_at(payload, "params")
        trace = object_at(params, "trace_metadata")
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
        index = self.flows.get(run.workflow_id)
        request, route = self._request(
            _call_identity(run, node_id), run.vars, payload, index.node_config(node_id) if index is not None else None
        )
        loads: list[ModelLoad] = []
        prepared = self.node.prepare(request, on_load=self._load_recorder(key, loads))

        extra: JSONObject = {"route": route.to_metadata(), "input": input_as_sent(payload, request)}
        if loads:
            extra["model_load"] = loads[-1].event()
        cache_target = self._hint_cache(run, index, node_id, request, prepared)
        result: NodeResult | None = None
        if self.prefetcher is not None:
            result, claimed = self._claim(run.run_id, node_id, prepared, key, callback, cancel_event)
            extra.update(claimed)
            launched = self._launch_siblings(run, node_id, buffer=forward or self.node.record_progress)
            if launched:
                extra = {**extra, "sibling_batch": {**object_at(extra, "sibling_batch"), "launched": launched}}
        if result is None:
            result = self.node.execute(prepared, route=self.node.route_for(key, callback), cancel_event=cancel_event)
        if cache_target is not None and request.prompt_cache_key is not None and index is not None:
            self.cache_hints.after_call(
                run.run_id,
                node_id,
                request.prompt_cache_key,
                agent=index.node_types.get(node_id) == "agent",
                return_wait_s=index.return_wait_s(node_id),
            )
        if self.prefix_warm and result.generation.finish_reason != "cancelled":
            warmed = self._warm_next(run, node_id)
            if warmed:
                extra["prefix_warm"] = warmed
        result.extra_metadata.update(extra)
        body = result.to_runtime_result()
        if result.generation.finish_reason == "cancelled":
            return EffectOutcome.cancelled({"reason": "cancelled", "node_id": node_id, "partial": body})
        return EffectOutcome.completed(body)

    def _hint_cache(
        self, run: RunView, index: FlowIndex | None, node_id: str, request: NodeRequest, prepared: PreparedCall
    ) -> CacheHintTarget | None:
        """Send the run's eviction hints to the local model serving this call (``RunCacheHints``);
        the provider they went to, or None (a remote call, no key, no known flow)."""
        key = request.prompt_cache_key
        if index is None or key is None or prepared.client_kind != ClientKind.LOCAL or prepared.model is None:
            return None
        target: CacheHintTarget = self.node.registry.local(prepared.model, self.node.provider_options).provider
        call = _call_identity(run, node_id)

        def key_of(other: str) -> str | None:
            return node_prompt_cache_key(
                {},
                index.node_config(other),
                run.vars,
                dataclasses.replace(call, node_id=other),
                provider="mlx",
                model=prepared.model,
            )

        hints = run_hints(index.steps_from(node_id), index.llm_nodes, key_of, (node_id, key))
        self.cache_hints.before_call(target, run.run_id, node_id, hints)
        return target

    def _flow_position(self, run: RunView, node_id: str) -> tuple[FlowIndex, str, FlowRun] | None:
        """Where a call stands in a registered flow: the flow, its node, and the flow's run. A
        call of an agent's ReAct run stands at the agent node, in the run that started it (read
        back from the ledger); None for a run of no registered flow."""
        index = self.flows.get(run.workflow_id)
        if index is not None:
            return index, node_id, FlowRun(run.run_id, str(run.workflow_id), run.vars)
        agent = self.flows.agent_of(str(run.workflow_id))
        parent_id = getattr(run, "parent_run_id", None)
        if agent is None or not isinstance(parent_id, str) or self.node.ledger is None:
            return None
        parent = self.node.ledger.load_run(parent_id)
        if parent is None:
            return None
        return agent[0], agent[1], FlowRun(parent_id, str(parent.get("workflow_id")), object_at(parent, "vars"))

    def _first_agent_turn(self, run_id: str) -> bool:
        """Whether this is the first call of ReAct run ``run_id`` to warm (remembered, bounded)."""
        with self._warm_lock:
            if run_id in self._agent_runs_warmed:
                return False
            self._agent_runs_warmed[run_id] = None
            while len(self._agent_runs_warmed) > _MAX_WARMED_AGENT_RUNS:
                self._agent_runs_warmed.popitem(last=False)
            return True

    def _warm_next(self, run: RunView, node_id: str) -> list[JSONValue]:
        """Warm the predictable prefix of each LLM node this call's node enables (an
        ``llm_call``'s system prompt or whole payload, an agent's first request up to its task;
        ``FlowIndex.prefix_call``), in the local model that will serve it when that model is
        resident (``RunCacheHints.warm``); what each warm did, by node."""
        if self.flows.get(run.workflow_id) is None and not self._first_agent_turn(run.run_id):
            return []
        position = self._flow_position(run, node_id)
        if position is None:
            return []
        index, at, flow_run = position
        warmed: list[JSONValue] = []
        for later in index.next_llm_nodes(at):
            try:
                prefix = index.prefix_call(later, flow_run.vars)
            except Unpredictable as exc:
                log.debug("no prefix warm for %s: %s", later, exc)
                continue
            session_id = getattr(run, "session_id", None)
            call = CallIdentity(
                run_id=flow_run.run_id,
                workflow_id=prefix.workflow_id or flow_run.workflow_id,
                node_id=prefix.node_id,
                session_id=session_id if isinstance(session_id, str) and session_id else None,
            )
            # an agent's call comes from its ReAct run, which has no node config in the flow
            config = index.node_config(later) if prefix.workflow_id is None else None
            try:
                request, _ = self._request(call, prefix.run_vars, prefix.payload, config)
                model = request.model or self.node.default_model
                if request.prompt_cache_key is None or request.base_url or not model:
                    continue
                if self.node.registry.resident(model, self.node.provider_options) is None:
                    continue  # a warm never loads a model: the node's own call does
                prepared = self.node.prepare(request)
            except MLXRuntimeError as exc:
                # Its own turn raises the same error on the tick thread, where it belongs.
                log.debug("no prefix warm for %s: %s", later, exc.message)
                continue
            if prepared.client_kind != ClientKind.LOCAL or prepared.model is None:
                continue
            target: CacheHintTarget = self.node.registry.local(prepared.model, self.node.provider_options).provider
            report = self.cache_hints.warm(target, prepared.request)
            if report is not None:
                warmed.append({"node_id": later, "prefix_only": prefix.prefix_only, **report})
        return warmed

    def _load_recorder(self, key: NodeKey, seen: list[ModelLoad]) -> Callable[[ModelLoad], None]:
        """Tells the ledger (a ``load`` phase row of this call) when the call's model starts and
        ends loading, so the load is a span of its own before the call's prefill."""
        writer = self.node.writer if self.node.record_progress else None

        def record(load: ModelLoad) -> None:
            seen.append(load)
            if writer is not None:
                writer.put(load.event(), key)

        return record

    def _claim(
        self,
        run_id: str,
        node_id: str,
        prepared: PreparedCall,
        key: NodeKey,
        callback: ProgressSink | None,
        cancel_event: threading.Event | None,
    ) -> tuple[NodeResult | None, JSONObject]:
        assert self.prefetcher is not None
        entry = self.prefetcher.take(run_id, node_id)
        if entry is None:
            return None, {}
        info: JSONObject = {"role": "sibling", "trigger_node": entry.trigger_node}
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

    def _launch_siblings(self, run: RunView, node_id: str, *, buffer: bool) -> list[str]:
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
                call = _call_identity(run, sibling.node_id)
                request, _ = self._request(call, run.vars, payload, sibling.config)
                calls.append((sibling.node_id, self.node.prepare(request)))
            except MLXRuntimeError as exc:
                # Its own turn will raise the same error on the tick thread, where it belongs.
                log.info("not prefetching %s: %s", sibling.node_id, exc.message)
        if not calls:
            return []
        return self.prefetcher.launch(run.run_id, node_id, calls, buffer=buffer)

    def _forward_runtime_progress(self, run: RunView) -> bool:
        if self.runtime_progress != "auto":
            return self.runtime_progress == "always"
        store = getattr(run, "_runtime_ledger_store", None)
        return not (self.node.ledger is not None and _is_store_of(store, self.node.ledger))


def _call_identity(run: RunView, node_id: str) -> CallIdentity:
    session_id = getattr(run, "session_id", None)
    return CallIdentity(
        run_id=run.run_id,
        workflow_id=str(run.workflow_id),
        node_id=node_id,
        session_id=session_id if isinstance(session_id, str) and session_id else None,
    )


def _is_store_of(store: object, ledger: Ledger) -> bool:
    for _ in range(4):  # see through wrappers (ObservableLedgerStore._inner, ...)
        if isinstance(store, LedgerStepStore):
            return store.ledger is ledger
        store = getattr(store, "_inner", None) or getattr(store, "inner", None)
        if store is None:
            return False
    return False
