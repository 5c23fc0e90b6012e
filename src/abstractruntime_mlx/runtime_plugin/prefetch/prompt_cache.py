"""The prompt-cache key of one LLM node, found or derived exactly as the host finds it.

AbstractRuntime's own LLM_CALL handler gives every call of a run that has a session a
session-scoped key (``_maybe_inject_prompt_cache_key``: a digest of session id, provider,
model, workflow id without its bundle version, and node id), on by default. This pack
replaces that handler, so it asks the host's function for the key, with the same inputs,
and a flow reuses here exactly when it would on the host. Precedence, first found:

1. ``params.prompt_cache_binding`` (a string, or an object with ``key``) and an explicit
   ``params.prompt_cache_key`` (present with ``None`` or ``""``: reuse off for this call);
2. the node's ``effectConfig.prompt_cache_key`` in the flow JSON (the compiler drops it);
3. ``_runtime.prompt_cache_key`` (a run-level key, shared by every node of the run);
4. the host's derivation: ``_runtime.prompt_cache`` (``false``; or ``{"enabled", "namespace",
   "key"}``), else ``ABSTRACTRUNTIME_PROMPT_CACHE`` (``0`` turns it off process-wide); a
   run without a session gets no derived key.

The provider and model in the digest are the ones that serve the node (the route), which is
what the host's client reports as its default identity.

``RunCacheHints`` turns a run's place in its flow into the prefix cache's eviction hints and
pins (steps-to-execution from ``prediction.steps_to_llm_nodes``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

# A private host function, read for parity; pinned with abstractruntime>=0.13,<0.14
# (tests/test_prompt_cache_keys.py fails loudly when it moves).
from abstractruntime.integrations.abstractcore.effect_handlers import _maybe_inject_prompt_cache_key

from ...errors import InvalidRequest, MLXRuntimeError
from ...json_values import JSONValue, object_at
from ...request import GenerationRequest

__all__ = ["CallIdentity", "RunCacheHints", "node_prompt_cache_key", "run_hints"]

log = logging.getLogger(__name__)

_EXPLICIT_PARAMS = ("prompt_cache_key", "prompt_cache_binding", "expected_prompt_cache_binding")


@dataclass(frozen=True, slots=True)
class CallIdentity:
    """What the host's derivation reads of the run and the call: who asks, for which node."""

    run_id: str
    workflow_id: str
    node_id: str
    session_id: str | None


def node_prompt_cache_key(
    params: Mapping[str, object],
    node_config: Mapping[str, object],
    run_vars: Mapping[str, object],
    call: CallIdentity | None,
    *,
    provider: str,
    model: str | None,
) -> str | None:
    """The key this call reuses under (None: no reuse), see the module's precedence.
    ``call`` None: no run to derive a key from (only given keys count)."""
    explicit = {name: params[name] for name in _EXPLICIT_PARAMS if name in params}
    if not explicit:
        configured = _nonempty(node_config.get("prompt_cache_key")) or _nonempty(
            object_at(run_vars, "_runtime").get("prompt_cache_key")
        )
        if configured is not None or call is None:
            return configured
    if call is None:
        call = CallIdentity(run_id="", workflow_id="", node_id="", session_id=None)
    trace = {"run_id": call.run_id, "workflow_id": call.workflow_id, "node_id": call.node_id}
    if call.session_id:
        trace["session_id"] = call.session_id
    host_params: dict[str, object] = {**explicit, "_provider": provider, "trace_metadata": trace}
    if model:
        host_params["_model"] = model
    try:
        _maybe_inject_prompt_cache_key(run=_HostRun(call, run_vars), params=host_params)
    except ValueError as exc:  # mismatched key and binding
        raise InvalidRequest(str(exc), details={"field": "prompt_cache_key"}) from exc
    return _nonempty(host_params.get("prompt_cache_key"))


class _HostRun:
    """The fields of the host's ``RunState`` that its derivation reads."""

    def __init__(self, call: CallIdentity, run_vars: Mapping[str, object]) -> None:
        self.run_id = call.run_id
        self.workflow_id = call.workflow_id
        self.current_node = call.node_id
        self.session_id = call.session_id
        self.vars = dict(run_vars)


def _nonempty(value: object) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None


# --- what the graph tells the prefix cache ---------------------------------------------------

DEFAULT_AGENT_PIN_TTL_S: Final = 120.0
# A node whose run comes back to it through a person or an event (``pin_ttl.return_wait_s`` is
# infinite) keeps its pin this long; a timer's literal wait is added to the agent's TTL, up to
# the longest pin.
WAIT_PIN_TTL_S: Final = 900.0
MAX_PIN_TTL_S: Final = 3600.0


class CacheHintTarget(Protocol):
    """The provider calls the hints are sent through (``MLXProvider``'s)."""

    def prompt_cache_hints(self, hints: Mapping[str, int | None], *, replace: bool = False) -> Mapping[str, object]: ...

    def prompt_cache_pin(self, key: str, ttl_s: float) -> Mapping[str, object]: ...

    def prompt_cache_release(self, key: str) -> Mapping[str, object]: ...

    def prompt_cache_warm_request(self, request: GenerationRequest) -> Mapping[str, object]: ...


def run_hints(
    steps: Mapping[str, int], llm_nodes: Iterable[str], key_of: Callable[[str], str | None], current: tuple[str, str]
) -> dict[str, int | None]:
    """Steps-to-execution of one run's keys from its current node: the current key 0, a node it
    reaches its edge count, a node it no longer reaches None."""
    hints: dict[str, int | None] = {}
    for node_id in llm_nodes:
        key = key_of(node_id)
        if key is not None and node_id != current[0]:
            hints[key] = steps.get(node_id)
    hints[current[1]] = 0
    return hints


@dataclass(slots=True)
class _RunCache:
    target: CacheHintTarget
    keys: set[str] = field(default_factory=set)
    pinned: tuple[str, str] | None = None  # (node id, key)


class RunCacheHints:
    """Tells each local model's prefix cache what the runs ahead of it need (docs/prompt-cache.md).

    Before an LLM node's call: the run's hints (``run_hints``), and the pin of a node the run
    has left is released. After the call of an agent node, or of a node its run comes back to
    through a wait (``return_wait_s``, from the graph): its key is pinned (``ttl_for``: an
    agent's next turn follows a tool call; a chat loop's follows a person, an event or a timer).
    When the run ends (``finish_run``): its pin is released and its keys are hinted None. A
    cache command that fails is logged, never raised: hints only order eviction.
    """

    def __init__(self, *, pin_ttl_s: float = DEFAULT_AGENT_PIN_TTL_S) -> None:
        self.pin_ttl_s = pin_ttl_s
        self._lock = threading.Lock()
        self._runs: dict[str, _RunCache] = {}

    def before_call(self, target: CacheHintTarget, run_id: str, node_id: str, hints: Mapping[str, int | None]) -> None:
        with self._lock:
            state = self._runs.setdefault(run_id, _RunCache(target))
            state.keys.update(hints)
            left = state.pinned if state.pinned is not None and state.pinned[0] != node_id else None
            if left is not None:
                state.pinned = None
        if left is not None:
            _quietly(target.prompt_cache_release, left[1])
        _quietly(target.prompt_cache_hints, dict(hints))

    def ttl_for(self, return_wait_s: float | None) -> float:
        """The pin's TTL for a node whose run comes back after ``return_wait_s`` (None: an
        agent's turns, ``pin_ttl_s``; infinite: ``WAIT_PIN_TTL_S``; a timer: added, capped)."""
        if return_wait_s is None:
            return self.pin_ttl_s
        if math.isinf(return_wait_s):
            return max(self.pin_ttl_s, WAIT_PIN_TTL_S)
        return min(self.pin_ttl_s + return_wait_s, max(self.pin_ttl_s, MAX_PIN_TTL_S))

    def after_call(
        self, run_id: str, node_id: str, key: str, *, agent: bool, return_wait_s: float | None = None
    ) -> float | None:
        """Pin ``key`` when the node is an agent or its run comes back to it through a wait;
        the TTL sent, or None when nothing was pinned."""
        with self._lock:
            state = self._runs.get(run_id)
            if state is None or not (agent or return_wait_s is not None):
                return None
            state.pinned = (node_id, key)
        ttl = self.ttl_for(return_wait_s)
        _quietly(state.target.prompt_cache_pin, key, ttl)
        return ttl

    def warm(self, target: CacheHintTarget, request: GenerationRequest) -> dict[str, JSONValue] | None:
        """Warm ``request``'s prompt prefix in ``target``'s prefix cache (a later node's, before
        it runs): what the cache did (``queued``, or the ``reason`` not), or None when the
        command failed (logged: a warm only saves time)."""
        try:
            report = target.prompt_cache_warm_request(request)
        except MLXRuntimeError as exc:
            log.warning("prefix warm not applied: [%s] %s", exc.code, exc.message)
            return None
        return {
            name: value
            for name, value in report.items()
            if name in ("queued", "reason", "prompt_tokens", "resident_tokens", "ssd_tokens")
            and isinstance(value, (bool, int, str))
        }

    def finish_run(self, run_id: str) -> None:
        with self._lock:
            state = self._runs.pop(run_id, None)
        if state is None:
            return
        if state.pinned is not None:
            _quietly(state.target.prompt_cache_release, state.pinned[1])
        _quietly(state.target.prompt_cache_hints, {key: None for key in state.keys})


def _quietly(command: Callable[..., object], *args: object) -> None:
    try:
        command(*args)
    except MLXRuntimeError as exc:
        log.warning("prompt-cache hint not applied: [%s] %s", exc.code, exc.message)
