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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# A private host function, read for parity; pinned with abstractruntime>=0.13,<0.14
# (tests/test_prompt_cache_keys.py fails loudly when it moves).
from abstractruntime.integrations.abstractcore.effect_handlers import _maybe_inject_prompt_cache_key

from ...errors import InvalidRequest
from ...json_values import object_at

__all__ = ["CallIdentity", "node_prompt_cache_key"]

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
        configured = _nonempty(node_config.get("prompt_cache_key")) or _nonempty(object_at(run_vars, "_runtime").get("prompt_cache_key"))
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
