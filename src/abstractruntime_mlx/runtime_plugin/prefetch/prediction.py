"""Sibling prediction: the LLM_CALL payload of a later ``llm_call`` branch, before the runtime
reaches it.

A payload is predictable when every input of the node is known before any branch runs:
``effectConfig`` values, ``pinDefaults``, the start node's pins (the run's input vars), and
pure data nodes over those (literals, ``concat``, ``format``), computed the way the
VisualFlow executor computes them. An input wired from any other node (an earlier branch's
answer, a variable, a tool) makes the branch unpredictable, with the reason. So does a
control the prediction does not model (tools, structured output, context); ``include_context:
false`` and ``use_context: false``, which the editor writes by default, change nothing and are
accepted.

``steps_to_llm_nodes(flow, node_id)`` says how many execution edges away each LLM node
(``llm_call``, ``agent``) is from a node: what the prefix cache's eviction hints are made of.

``plan_payload(flow, node_id)`` returns a payload template whose values may be expressions
over the run's vars; ``resolve_payload(template, run_vars)`` computes it for one run.
``plan_prefix`` is the part of it a prefix warm can send before the node's prompt is known.
``plan_agent_inputs(flow, node_id)`` is the same for an ``agent`` node: the inputs that shape
its first request before its task (``agent_prefix`` builds that request). A prediction is only
ever a guess: the handler uses a prefetched result only when the real request's fingerprint
matches.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from abstractruntime.visualflow_compiler.visual.builtins import get_builtin_handler

from ...json_values import array_at, object_at, to_float, to_int

__all__ = [
    "LLM_NODE_TYPES",
    "Unpredictable",
    "plan_agent_inputs",
    "plan_payload",
    "plan_prefix",
    "resolve_agent_inputs",
    "resolve_payload",
    "steps_to_llm_nodes",
]

# effectConfig keys a predicted request honours; anything else makes the node unpredictable.
PREDICTABLE_CONFIG: Final = frozenset(
    {
        "provider",
        "model",
        "temperature",
        "seed",
        "thinking",
        "speculation",
        "max_output_tokens",
        "maxOutputTokens",
        "base_url",
        "server_base_url",
    }
)
# Data pins of an llm_call node a prediction computes (wired in or from pinDefaults).
PREDICTABLE_PINS: Final = frozenset({"prompt", "system", "provider", "model", "temperature", "seed"})
# Flags the editor writes as ``false`` by default: false is no dependency.
NO_OP_WHEN_FALSE: Final = frozenset({"include_context", "use_context"})
# Pure data nodes computed here: literals and string building.
LITERAL_TYPES: Final = frozenset(
    {"literal_string", "literal_number", "literal_boolean", "literal_json", "literal_array"}
)
COMPUTED_TYPES: Final = LITERAL_TYPES | {"concat", "format"}
START_TYPES: Final = frozenset({"on_flow_start"})
LLM_NODE_TYPES: Final = frozenset({"llm_call", "agent"})
DEFAULT_TEMPERATURE: Final = 0.7  # the VisualFlow compiler's default for an llm_call node

# Inputs of an agent node that reach its first request before the task: its system prompt (the
# ``system`` pin is appended to AbstractAgent's ReAct prompt), its tools, the model that serves
# it and its thinking. A prediction computes them (wired in, or from pinDefaults / agentConfig).
AGENT_PREFIX_PINS: Final = frozenset({"system", "tools", "provider", "model", "thinking", "speculation"})
# Inputs that reach the request after its prefix (the task) or not its tokens at all (sampling,
# budgets): they may be wired from any node.
AGENT_LATER_PINS: Final = frozenset(
    {
        "task",
        "prompt",
        "temperature",
        "seed",
        "max_iterations",
        "max_input_tokens",
        "max_output_tokens",
        "max_out_tokens",
    }
)
AGENT_CONFIG: Final = AGENT_PREFIX_PINS | AGENT_LATER_PINS | {"_react_workflow_id", "outputSchema"}
# Agent inputs that add messages to its first request (memory recall, parent context) when true.
AGENT_NO_OP_WHEN_FALSE: Final = NO_OP_WHEN_FALSE | {"use_span_memory", "use_kg_memory", "use_semantic_search"}


class Unpredictable(Exception):
    """The node's request cannot be known before the runtime reaches it (message: why)."""


# --- expressions over the run's vars -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartPin:
    """A start-node pin: the run var of that name, else the start node's default, else None."""

    pin: str
    default: object = None

    def evaluate(self, run_vars: Mapping[str, object]) -> object:
        return run_vars[self.pin] if self.pin in run_vars else copy.deepcopy(self.default)


@dataclass(frozen=True, slots=True)
class Concat:
    """The executor's ``concat``: present pins in pin order, None as "", joined by the separator."""

    parts: tuple[object, ...]
    separator: str

    def evaluate(self, run_vars: Mapping[str, object]) -> str:
        values = (_evaluate(p, run_vars) for p in self.parts)
        return self.separator.join("" if v is None else str(v) for v in values)


@dataclass(frozen=True, slots=True)
class Builtin:
    """A builtin pure node (literals, ``format``), called as the executor's wrapper calls it."""

    node_type: str
    inputs: tuple[tuple[str, object], ...]
    literal: object
    pin_order: tuple[str, ...]

    def evaluate(self, run_vars: Mapping[str, object]) -> object:
        handler = get_builtin_handler(self.node_type)
        if handler is None:
            raise Unpredictable(f"no builtin for {self.node_type!r}")
        inputs = {name: _evaluate(value, run_vars) for name, value in self.inputs}
        if self.literal is not None:
            inputs["_literalValue"] = copy.deepcopy(self.literal)
        if self.pin_order:
            inputs["_pin_order"] = list(self.pin_order)
        try:
            return handler(inputs)
        except Exception as exc:  # noqa: BLE001 - the node would fail or differ at run time too
            raise Unpredictable(f"{self.node_type} node failed on the known inputs: {type(exc).__name__}") from exc


_EXPRESSIONS = (StartPin, Concat, Builtin)


def _evaluate(value: object, run_vars: Mapping[str, object]) -> object:
    if isinstance(value, _EXPRESSIONS):
        return value.evaluate(run_vars)
    if isinstance(value, dict):
        return {k: _evaluate(v, run_vars) for k, v in value.items()}
    return copy.deepcopy(value)


# --- planning ---------------------------------------------------------------------------


class _Graph:
    def __init__(self, flow: Mapping[str, object]) -> None:
        self.nodes: dict[str, Mapping[str, object]] = {
            str(n.get("id")): n for n in array_at(flow, "nodes") if isinstance(n, Mapping)
        }
        self.inputs: dict[str, dict[str, tuple[str, str]]] = {}  # target -> pin -> (source, handle)
        for edge in array_at(flow, "edges"):
            if not isinstance(edge, Mapping) or edge.get("targetHandle") in (None, "exec-in"):
                continue
            pins = self.inputs.setdefault(str(edge.get("target")), {})
            pins[str(edge.get("targetHandle"))] = (str(edge.get("source")), str(edge.get("sourceHandle") or ""))

    def data(self, node_id: str) -> Mapping[str, object]:
        return object_at(self.nodes.get(node_id, {}), "data")

    def pin_defaults(self, node_id: str) -> dict[str, object]:
        defaults = self.data(node_id).get("pinDefaults")
        return dict(defaults) if isinstance(defaults, Mapping) else {}

    def node_inputs(self, node_id: str, seen: frozenset[str]) -> dict[str, object]:
        """The node's data inputs: its pin defaults, overridden by what is wired in."""
        values = self.pin_defaults(node_id)
        for pin, (source, handle) in self.inputs.get(node_id, {}).items():
            values[pin] = self.output(source, handle, seen | {node_id})
        return values

    def output(self, node_id: str, handle: str, seen: frozenset[str]) -> StartPin | Concat | Builtin:
        node_type = self.nodes.get(node_id, {}).get("type")
        if node_type in START_TYPES:
            return StartPin(handle, self.pin_defaults(node_id).get(handle))
        if node_type not in COMPUTED_TYPES:
            raise Unpredictable(f"input from {node_type or 'a missing'} node {node_id!r}")
        if node_id in seen:
            raise Unpredictable(f"a data cycle through node {node_id!r}")
        data = self.data(node_id)
        inputs = self.node_inputs(node_id, seen)
        pin_order = tuple(
            str(p["id"])
            for p in array_at(data, "inputs")
            if isinstance(p, Mapping) and p.get("type") != "execution" and p.get("id")
        )
        if node_type == "concat":
            config = object_at(data, "concatConfig")
            raw_separator = config.get("separator")
            separator = raw_separator if isinstance(raw_separator, str) else " "
            separator = separator.replace("\\n", "\n").replace("\\t", "\t").replace("\\r", "\r")
            if not pin_order:
                letters = sorted(k for k in inputs if len(k) == 1 and "a" <= k <= "z")
                pin_order = tuple(letters + sorted(k for k in inputs if k not in letters))
            return Concat(tuple(inputs[p] for p in pin_order if p in inputs), separator)
        return Builtin(str(node_type), tuple(sorted(inputs.items())), data.get("literalValue"), pin_order)


def steps_to_llm_nodes(flow: Mapping[str, object], node_id: str) -> dict[str, int]:
    """Each LLM node reachable from ``node_id`` over execution edges, with the fewest edges to
    it (``node_id`` itself only when a cycle leads back to it). Branches of a parallel or
    sequence node count one edge each, as their node runs them all."""
    nodes = {str(n.get("id")): n for n in array_at(flow, "nodes") if isinstance(n, Mapping)}
    successors: dict[str, list[str]] = {}
    for edge in array_at(flow, "edges"):
        if isinstance(edge, Mapping) and edge.get("targetHandle") == "exec-in":
            successors.setdefault(str(edge.get("source")), []).append(str(edge.get("target")))
    steps: dict[str, int] = {}
    frontier, seen, distance = [node_id], {node_id}, 0
    while frontier:
        distance += 1
        following: list[str] = []
        for source in frontier:
            for target in successors.get(source, ()):
                if nodes.get(target, {}).get("type") in LLM_NODE_TYPES and target not in steps:
                    steps[target] = distance
                if target not in seen:
                    seen.add(target)
                    following.append(target)
        frontier = following
    return steps


def plan_payload(flow: Mapping[str, object], node_id: str) -> dict[str, object]:
    """The payload template of ``llm_call`` node ``node_id``; raises ``Unpredictable``."""
    graph = _Graph(flow)
    data = graph.data(node_id)
    config = object_at(data, "effectConfig")
    extra = sorted(k for k in set(config) - PREDICTABLE_CONFIG if not (k in NO_OP_WHEN_FALSE and config[k] is False))
    if extra:
        raise Unpredictable(f"effectConfig keys {extra} are not predicted")
    defaults = graph.pin_defaults(node_id)
    wired = graph.inputs.get(node_id, {})
    extra = sorted(
        k
        for k in (set(defaults) | set(wired)) - PREDICTABLE_PINS
        if not (k in NO_OP_WHEN_FALSE and k not in wired and defaults[k] is False)
    )
    if extra:
        raise Unpredictable(f"inputs {extra} are not predicted")
    inputs = graph.node_inputs(node_id, frozenset())
    params: dict[str, object] = {
        "temperature": inputs.get("temperature", config.get("temperature", DEFAULT_TEMPERATURE))
    }
    if "seed" in inputs or "seed" in config:
        params["seed"] = inputs.get("seed", config.get("seed"))
    max_out = config.get("max_output_tokens", config.get("maxOutputTokens"))
    if max_out is not None:
        params["max_output_tokens"] = max_out
    thinking = config.get("thinking")
    if isinstance(thinking, bool) or (isinstance(thinking, str) and thinking.strip()):
        params["thinking"] = thinking.strip() if isinstance(thinking, str) else thinking
    if config.get("speculation") is not None:
        params["speculation"] = copy.deepcopy(config["speculation"])
    payload: dict[str, object] = {
        "prompt": inputs.get("prompt"),
        "system_prompt": inputs.get("system", ""),
        "tools": [],
        "params": params,
    }
    for name in ("provider", "model"):
        value = inputs.get(name, config.get(name))
        if value is not None:
            payload[name] = value
    # fail now on constants that cannot be a request (a wrong type would fail at run time too)
    if not any(isinstance(v, _EXPRESSIONS) for v in (*payload.values(), *params.values())):
        resolve_payload(payload, {})
    return payload


def plan_prefix(flow: Mapping[str, object], node_id: str) -> dict[str, object]:
    """The payload template of the predictable prefix of ``llm_call`` node ``node_id``: its whole
    payload where ``plan_payload`` predicts it, else the node with its prompt left empty (its
    system prompt and controls), marked ``"prefix_only": True``, when the prompt is the one
    input wired from a node that runs first (an earlier node's answer); raises ``Unpredictable``."""
    try:
        return plan_payload(flow, node_id)
    except Unpredictable as whole:
        wired = _Graph(flow).inputs.get(node_id, {})
        if "prompt" not in wired:
            raise
        edges = [
            e
            for e in array_at(flow, "edges")
            if not (isinstance(e, Mapping) and str(e.get("target")) == node_id and e.get("targetHandle") == "prompt")
        ]
        try:
            payload = plan_payload({**flow, "edges": edges}, node_id)
        except Unpredictable:
            raise whole from None
    system = payload.get("system_prompt")
    if not system and not isinstance(system, _EXPRESSIONS):
        raise Unpredictable("the prompt is not known and the node has no system prompt")
    payload["prompt"] = ""
    payload["prefix_only"] = True
    return payload


def plan_agent_inputs(flow: Mapping[str, object], node_id: str) -> dict[str, object]:
    """The template of agent node ``node_id``'s inputs that shape its first request before its
    task (``AGENT_PREFIX_PINS``): ``{"inputs": pin -> value, "config": agentConfig}``, the two
    places the visual compiler reads them from, pins first; raises ``Unpredictable``."""
    graph = _Graph(flow)
    data = graph.data(node_id)
    config = dict(object_at(data, "agentConfig"))
    extra = sorted(k for k in set(config) - AGENT_CONFIG if not (k in AGENT_NO_OP_WHEN_FALSE and config[k] is False))
    if extra:
        raise Unpredictable(f"agentConfig keys {extra} are not predicted")
    defaults = graph.pin_defaults(node_id)
    wired = graph.inputs.get(node_id, {})
    extra = sorted(
        k
        for k in (set(defaults) | set(wired)) - AGENT_PREFIX_PINS - AGENT_LATER_PINS
        if not (k in AGENT_NO_OP_WHEN_FALSE and k not in wired and defaults[k] is False)
    )
    if extra:
        raise Unpredictable(f"inputs {extra} are not predicted")
    for pin in set(wired) & AGENT_LATER_PINS:
        del wired[pin]  # this graph's copy: the task comes after the prefix, whoever computes it
    inputs = {pin: value for pin, value in graph.node_inputs(node_id, frozenset()).items() if pin in AGENT_PREFIX_PINS}
    return {"inputs": inputs, "config": config}


def resolve_agent_inputs(
    template: Mapping[str, object], run_vars: Mapping[str, object]
) -> tuple[dict[str, object], dict[str, object]]:
    """The agent inputs and agentConfig ``template`` (``plan_agent_inputs``) gives for a run."""
    inputs = _evaluate(object_at(template, "inputs"), run_vars)
    assert isinstance(inputs, dict)
    return inputs, copy.deepcopy(dict(object_at(template, "config")))


def resolve_payload(template: Mapping[str, object], run_vars: Mapping[str, object]) -> dict[str, object]:
    """The payload ``template`` gives for a run with ``run_vars``; raises ``Unpredictable``."""
    payload = {key: _evaluate(value, run_vars) for key, value in template.items()}
    payload["prompt"] = "" if payload.get("prompt") is None else str(payload["prompt"])
    system = payload.get("system_prompt")
    payload["system_prompt"] = "" if system is None else system
    for name in ("provider", "model"):
        if not (isinstance(payload.get(name), str) and payload[name]):
            payload.pop(name, None)
    raw = object_at(payload, "params")
    params = dict(raw)
    try:
        params["temperature"] = to_float(DEFAULT_TEMPERATURE if raw.get("temperature") is None else raw["temperature"])
        seed = raw.get("seed")
        params.pop("seed", None)
        if seed is not None and not isinstance(seed, bool) and to_int(seed) >= 0:
            params["seed"] = to_int(seed)
        max_out = raw.get("max_output_tokens")
        params.pop("max_output_tokens", None)
        if max_out is not None and not isinstance(max_out, bool) and to_int(max_out) > 0:
            params["max_output_tokens"] = to_int(max_out)
    except (TypeError, ValueError) as exc:
        raise Unpredictable("sampling values are not numbers") from exc
    payload["params"] = params
    return payload
