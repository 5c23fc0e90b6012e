"""How long a node's prompt-cache pin should live, read from the flow's graph.

An LLM node whose run comes back to it (a chat loop, an agent asked again) through a wait
(``wait_until``, ``ask_user``, ``wait_event``) needs its key's KV across that wait: its next
call re-sends the same conversation. ``return_wait_s(flow, node_id)`` is how long the way back
waits: the sum of its literal timers' durations when every wait on it is a timer with a
literal duration, ``math.inf`` when one is a person (``ask_user``), an event (``wait_event``)
or a timer whose duration is wired (unknown before the run gets there), None when the run
never comes back to the node, or comes back without waiting. ``RunCacheHints`` turns it into
the pin's TTL (docs/prompt-cache.md, "In flows").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

from ...json_values import array_at, object_at, to_float

__all__ = ["WAIT_NODE_TYPES", "return_wait_s"]

WAIT_NODE_TYPES: Final = frozenset({"wait_until", "ask_user", "wait_event"})
_SECONDS: Final = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0}


def return_wait_s(flow: Mapping[str, object], node_id: str) -> float | None:
    """How long a run waits between leaving ``node_id`` and reaching it again (module doc)."""
    nodes = {str(n.get("id")): n for n in array_at(flow, "nodes") if isinstance(n, Mapping)}
    forward: dict[str, set[str]] = {}
    backward: dict[str, set[str]] = {}
    wired: set[tuple[str, str]] = set()
    for edge in array_at(flow, "edges"):
        if not isinstance(edge, Mapping):
            continue
        source, target = str(edge.get("source")), str(edge.get("target"))
        if edge.get("targetHandle") == "exec-in":
            forward.setdefault(source, set()).add(target)
            backward.setdefault(target, set()).add(source)
        else:
            wired.add((target, str(edge.get("targetHandle"))))
    on_loop = _reach(forward, node_id) & _reach(backward, node_id)
    if node_id not in on_loop:
        return None
    waits = [n for n in on_loop if nodes.get(n, {}).get("type") in WAIT_NODE_TYPES]
    if not waits:
        return None
    total = 0.0
    for wait in waits:
        seconds = _timer_s(nodes[wait], duration_wired=(wait, "duration") in wired)
        if seconds is None:
            return math.inf
        total += seconds
    return total


def _reach(successors: Mapping[str, set[str]], start: str) -> set[str]:
    """Every node a walk from ``start`` reaches (``start`` itself only over a cycle)."""
    seen: set[str] = set()
    frontier = list(successors.get(start, ()))
    while frontier:
        node = frontier.pop()
        if node not in seen:
            seen.add(node)
            frontier.extend(successors.get(node, ()))
    return seen


def _timer_s(node: Mapping[str, object], *, duration_wired: bool) -> float | None:
    """A ``wait_until``'s literal duration in seconds; None for any other wait or an unknown one."""
    if node.get("type") != "wait_until" or duration_wired:
        return None
    data = object_at(node, "data")
    unit = object_at(data, "effectConfig").get("durationType", "seconds")
    try:
        duration = to_float(object_at(data, "pinDefaults").get("duration"))
    except (TypeError, ValueError):
        return None
    if not math.isfinite(duration) or duration < 0 or unit not in _SECONDS:
        return None
    return duration * _SECONDS[str(unit)]
