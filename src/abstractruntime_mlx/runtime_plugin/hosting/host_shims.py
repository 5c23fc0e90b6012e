"""Work-arounds for host bugs, each applied only to the host versions it was tested on.

**An Agent node's ``task`` pin.** AbstractFlow's Agent node names its task input ``task``
(labelled "prompt"; most AbstractFlow examples) or ``prompt`` (older flows). AbstractRuntime
0.13's visual executor builds the agent's inputs from ``prompt`` alone
(``visualflow_compiler/visual/executor.py``, ``_create_agent_input_handler``:
``raw_task = input_data.get("prompt")``), so a value wired or defaulted into ``task`` is
dropped there: the agent's child run starts with ``context.task = ''`` and its LLM calls
receive no task. (The compiler's Agent handler reads ``task`` first, then ``prompt``, so
``task`` is the pin meant to win.)

``compile_ready(flow)`` hands the compiler a copy of the flow in which an Agent node's ``task``
pin is named ``prompt`` (its edges, its default, its declared input), so the host's own
handler picks the value up; a node that also feeds ``prompt`` keeps the ``task`` value, as the
compiler intends. The run keeps the flow as written (inspector, ``runs replay``, resume).

``HOST_RANGE`` pins the shim: outside it, flows are compiled as they are.
``tests/test_agent_inputs.py::test_the_host_still_drops_an_agent_task_pin`` fails once the host
reads ``task`` itself; then the shim goes.
"""

from __future__ import annotations

import copy
import importlib.metadata
from collections.abc import Mapping
from typing import Final

from ...json_values import array_at, object_at

__all__ = ["AGENT_TASK_PIN", "HOST_RANGE", "compile_ready", "host_needs_shim"]

AGENT_TASK_PIN: Final = "task"
_HOST_TASK_PIN: Final = "prompt"  # the one pin the host's agent input handler reads
HOST_RANGE: Final = ((0, 13), (0, 14))
"""``abstractruntime`` versions ``>= 0.13, < 0.14`` (the range pyproject.toml allows)."""


def _version_tuple(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def host_needs_shim(version: str | None = None) -> bool:
    """Whether ``abstractruntime`` (installed, or ``version``) is in ``HOST_RANGE``."""
    if version is None:
        try:
            version = importlib.metadata.version("abstractruntime")
        except importlib.metadata.PackageNotFoundError:
            return False
    low, high = HOST_RANGE
    return low <= _version_tuple(version) < high


def _feeds(flow: Mapping[str, object], node_id: object, pin: str) -> bool:
    if pin in object_at(object_at(_node(flow, node_id), "data"), "pinDefaults"):
        return True
    return any(
        isinstance(e, Mapping) and e.get("target") == node_id and e.get("targetHandle") == pin
        for e in array_at(flow, "edges")
    )


def _node(flow: Mapping[str, object], node_id: object) -> Mapping[str, object]:
    for node in array_at(flow, "nodes"):
        if isinstance(node, Mapping) and node.get("id") == node_id:
            return node
    return {}


def compile_ready(flow: Mapping[str, object], *, apply: bool | None = None) -> dict[str, object]:
    """``flow`` as the host's compiler must see it (a copy; ``flow`` itself is left as it is).
    ``apply``: force the shim on or off (default: ``host_needs_shim()``)."""
    out = dict(flow)
    if not (host_needs_shim() if apply is None else apply):
        return out
    agents = [
        node.get("id")
        for node in array_at(flow, "nodes")
        if isinstance(node, Mapping) and node.get("type") == "agent" and _feeds(flow, node.get("id"), AGENT_TASK_PIN)
    ]
    if not agents:
        return out
    out = copy.deepcopy(out)
    renamed = set(agents)
    edges = []
    for edge in array_at(out, "edges"):
        if isinstance(edge, dict) and edge.get("target") in renamed:
            if edge.get("targetHandle") == _HOST_TASK_PIN:
                continue  # the task pin wins over a second prompt input
            if edge.get("targetHandle") == AGENT_TASK_PIN:
                edge["targetHandle"] = _HOST_TASK_PIN
        edges.append(edge)
    out["edges"] = edges
    for node in array_at(out, "nodes"):
        if not isinstance(node, dict) or node.get("id") not in renamed:
            continue
        data = node.get("data")
        if not isinstance(data, dict):
            continue
        defaults = data.get("pinDefaults")
        if isinstance(defaults, dict):
            defaults.pop(_HOST_TASK_PIN, None)
            if AGENT_TASK_PIN in defaults:
                defaults[_HOST_TASK_PIN] = defaults.pop(AGENT_TASK_PIN)
        inputs = data.get("inputs")
        if isinstance(inputs, list):
            kept = [p for p in inputs if not (isinstance(p, dict) and p.get("id") == _HOST_TASK_PIN)]
            for pin in kept:
                if isinstance(pin, dict) and pin.get("id") == AGENT_TASK_PIN:
                    pin["id"] = _HOST_TASK_PIN
            data["inputs"] = kept
    return out
