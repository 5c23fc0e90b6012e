"""The LLM_CALL payload as a node request (the node-payload edge).

``request_from_payload`` turns the payload AbstractRuntime's visual compiler emits into a
``nodes.NodeRequest``: the ``<runtime_metadata>`` grounding envelope the runtime core puts on
every prompt is removed (``abstractruntime.turn_grounding.strip_turn_grounding``; a per-second
timestamp in the prompt would defeat prefix reuse, batching of identical prompts and sibling
prefetch, and the tiny/local models have no use for it) and the run-level controls are folded
from ``run.vars["_runtime"]`` (the runtime core does not merge them into the payload). The
node validates it once, into a ``GenerationRequest``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Final

from abstractruntime.turn_grounding import strip_turn_grounding

from ...controls import SAMPLING_FIELDS, UNSET
from ...errors import InvalidRequest
from ...json_values import JSONObject, array_at, object_at
from ...nodes import NodeRequest
from ...request import Message, output_cap
from ...structured import check_schema_limits
from ..prefetch.prompt_cache import CallIdentity, node_prompt_cache_key
from .routing import RouteDecision

__all__ = ["explicit_base_url", "input_as_sent", "request_from_payload"]

# Sampling params of the payload (a seed is taken only when it is a valid one: the editor's
# -1 means "random"); ``stop`` is a limit of the request.
_SAMPLING_PARAMS: Final = (*(f for f in SAMPLING_FIELDS if f != "seed"), "stop")


def request_from_payload(
    payload: Mapping[str, object],
    run_vars: Mapping[str, object] | None,
    *,
    node_config: Mapping[str, object] | None = None,
    default_model: str | None = None,
    force_model: bool = False,
    default_base_url: str | None = None,
    route: RouteDecision | None = None,
    call: CallIdentity | None = None,
) -> NodeRequest:
    """The ``NodeRequest`` of an LLM_CALL payload (as the visual compiler emits it).

    Node level: ``params.speculation`` / ``params.thinking`` (absent or null inherit).
    Run level: ``run_vars["_runtime"]["speculation"|"thinking"]``. ``prompt_cache_key``: given
    or derived for ``call`` as the host derives it (``prompt_cache.node_prompt_cache_key``). Remote selection, first
    found: ``params.base_url``, the node's ``effectConfig.base_url``/``server_base_url`` (from
    the flow JSON, which the compiler does not forward), ``_runtime.base_url``/
    ``server_base_url``, ``default_base_url``. Model: ``default_model`` when ``force_model``,
    else the payload's model, else ``default_model``. ``route`` (a ``routing.RouteDecision``)
    replaces all of that: it names the provider, model and server that serve the node.
    ``call``'s session id (else its run id) is the request's ``affinity_key``.
    """
    params = object_at(payload, "params")
    runtime_ns = object_at(run_vars or {}, "_runtime")
    config = node_config or {}
    given_messages = payload.get("messages")
    messages = [_strip_message(m) for m in given_messages] if isinstance(given_messages, list) else None
    sampling: dict[str, object] = {
        name: copy.deepcopy(params[name]) for name in _SAMPLING_PARAMS if params.get(name) is not None
    }
    seed = params.get("seed")
    if seed is not None and not isinstance(seed, bool) and isinstance(seed, int) and seed >= 0:
        sampling["seed"] = seed
    model = given if isinstance(given := payload.get("model"), str) and given else None
    if force_model or model is None:
        model = default_model or model
    provider = str(payload.get("provider") or "mlx")
    base_url = explicit_base_url(payload, run_vars, node_config=config, default_base_url=default_base_url)
    if route is not None:
        provider, model, base_url = route.provider, route.model, route.base_url
    return NodeRequest(
        prompt=_strip_grounding(payload.get("prompt") or ""),
        messages=messages,
        system_prompt=_str_or_none(payload.get("system_prompt")),
        tools=list(array_at(payload, "tools")) or None,
        media=list(array_at(payload, "media")) or None,
        provider=provider,
        model=model,
        base_url=base_url,
        speculation=_level(params, "speculation"),
        thinking=_level(params, "thinking"),
        run_speculation=_level(runtime_ns, "speculation"),
        run_thinking=_level(runtime_ns, "thinking"),
        sampling=sampling,
        max_output_tokens=_output_cap(params, payload, run_vars or {}),
        prompt_cache_key=node_prompt_cache_key(params, config, run_vars or {}, call, provider=provider, model=model),
        response_schema=_response_schema(payload.get("response_schema")),
        response_schema_name=_str_or_none(payload.get("response_schema_name")),
        affinity_key=None if call is None else (call.session_id or call.run_id or None),
    )


def input_as_sent(payload: Mapping[str, object], request: NodeRequest) -> JSONObject:
    """What the node sent that differs from the payload the host recorded in the step: the
    prompt and the messages (``index -> content``) whose ``<runtime_metadata>`` stamps were
    removed. Small (the stamped turns only), so a viewer rebuilds the conversation exactly
    from the recorded payload without the ledger keeping a second copy of the transcript."""
    out: JSONObject = {}
    if str(payload.get("prompt") or "") != request.prompt:
        out["prompt"] = request.prompt
    given = payload.get("messages")
    if isinstance(given, list) and request.messages:
        changed: JSONObject = {}
        for index, (original, sent) in enumerate(zip(given, request.messages)):
            content = sent.get("content")
            if isinstance(original, Mapping) and original.get("content") != content and isinstance(content, str):
                changed[str(index)] = content
        if changed:
            out["messages"] = changed
    return out


def _output_cap(params: Mapping[str, object], payload: Mapping[str, object], run_vars: Mapping[str, object]) -> object:
    """The call's output cap as the host finds it: ``params.max_output_tokens``/``max_tokens``,
    then the payload's ``max_output_tokens``/``max_out_tokens``, then the run's
    ``_limits.max_output_tokens`` (where an agent node's configured cap travels). The two
    params follow ``request.output_cap`` (different values: ``InvalidControls``). A value
    that is not a positive number falls through to the next level; a params value that is
    neither absent nor a number is kept, so the request refuses it by name."""
    given = output_cap(max_output_tokens=params.get("max_output_tokens"), max_tokens=params.get("max_tokens"))
    for value in (
        given,
        payload.get("max_output_tokens"),
        payload.get("max_out_tokens"),
        object_at(run_vars, "_limits").get("max_output_tokens"),
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    if given is not None and not (isinstance(given, int) and not isinstance(given, bool)):
        return given
    return None


def _response_schema(value: object) -> Mapping[str, object] | None:
    """The node's structured-output schema (None: free text); a schema that is not an object is
    refused, naming the field, rather than silently ignored."""
    if value is None or value == {}:
        return None
    if not isinstance(value, Mapping):
        raise InvalidRequest("response_schema must be a JSON Schema object", details={"field": "response_schema"})
    check_schema_limits(value)  # before the copy, which recurses
    return copy.deepcopy(dict(value))


def explicit_base_url(
    payload: Mapping[str, object],
    run_vars: Mapping[str, object] | None,
    *,
    node_config: Mapping[str, object] | None = None,
    default_base_url: str | None = None,
) -> str | None:
    """The server a node is sent to, first found: ``params.base_url``, the node's
    ``effectConfig.base_url``/``server_base_url``, ``_runtime.base_url``/``server_base_url``,
    ``default_base_url``; ``None``: local."""
    params = object_at(payload, "params")
    runtime_ns = object_at(run_vars or {}, "_runtime")
    config = node_config or {}
    return _first_str(
        params.get("base_url"),
        config.get("base_url"),
        config.get("server_base_url"),
        runtime_ns.get("base_url"),
        runtime_ns.get("server_base_url"),
        default_base_url,
    )


def _level(source: Mapping[str, object], name: str) -> object:
    value = source.get(name)
    return UNSET if value is None else copy.deepcopy(value)


def _strip_message(message: object) -> Message:
    if not isinstance(message, Mapping):
        # The error GenerationRequest.build raises for such a message, raised where the payload is read.
        raise InvalidRequest("each message must be an object with a 'role'")
    if message.get("role") == "user" and isinstance(message.get("content"), str):
        return {**message, "content": _strip_grounding(message["content"])}
    return copy.deepcopy(message)


# A stamp the host puts inside a turn it extends (an agent's appended guidance), not only at its head.
_INNER_GROUNDING: Final = re.compile(r"\s*<runtime_metadata>\s*\{[^\n]*?\}\s*</runtime_metadata>")


def _strip_grounding(text: object) -> str:
    """``text`` without the host's per-second ``<runtime_metadata>`` stamps, at its head or inside it."""
    return _INNER_GROUNDING.sub("", strip_turn_grounding(text))


def _first_str(*values: object) -> str | None:
    for value in values:
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
