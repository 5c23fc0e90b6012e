"""Graphs that make a run go on forever, found before it starts.

- ``exec_cycles(flow)``: execution wires that lead back to where they started without a bound.
  A wire out of a loop node's body pin (``loop``/``for``/``while``, pin ``loop``: the host runs
  the body once per item, or while its condition holds) and a wire with a loop limit
  (``data.loopLimit``, or through a ``loop_limit`` node: the host lowers the one into the other)
  bound a cycle; every other cycle repeats forever. A cycle from a loop's ``done`` back to the
  loop restarts the whole loop forever, so it is one too. The node types and pin are the host
  compiler's own (``visualflow_compiler.visual.loop_back_check``, ``loop_limit_lowering``).
- ``subflow_cycles(calls)``: flows that call themselves, directly or through other subflows.
  Each call starts a child run, one level deeper: without end when every call of the circle
  runs on every run of its flow (``always_run``); behind a condition (an ``if``, a loop body),
  the flow's own condition ends it, as the editor's recursive agent examples do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from abstractruntime.visualflow_compiler.visual.loop_back_check import BODY_PIN, LOOP_NODE_TYPES
from abstractruntime.visualflow_compiler.visual.loop_limit_lowering import LOOP_LIMIT_NODE_TYPE

from ...json_values import array_at, object_at

__all__ = ["always_run", "exec_cycles", "subflow_cycles"]

_EXEC_IN: Final = "exec-in"
_START_TYPES: Final = frozenset({"on_flow_start"})


def exec_cycles(flow: Mapping[str, object]) -> list[list[str]]:
    """One cycle of unbounded execution wires per group of nodes that repeat together, as the
    node ids along it (the first node is not repeated at the end)."""
    types: dict[str, str] = {}
    for node in array_at(flow, "nodes"):
        if isinstance(node, Mapping) and isinstance(node.get("id"), str):
            types[str(node["id"])] = str(node.get("type") or "")
    graph: dict[str, list[str]] = {node_id: [] for node_id in types}
    for edge in array_at(flow, "edges"):
        if not isinstance(edge, Mapping) or edge.get("targetHandle") != _EXEC_IN:
            continue
        source, target = edge.get("source"), edge.get("target")
        if not isinstance(source, str) or not isinstance(target, str) or source not in types or target not in types:
            continue
        if types[source] in LOOP_NODE_TYPES and edge.get("sourceHandle") == BODY_PIN:
            continue
        if (
            LOOP_LIMIT_NODE_TYPE in (types[source], types[target])
            or object_at(edge, "data").get("loopLimit") is not None
        ):
            continue
        graph[source].append(target)
    return _cycles(graph)


def always_run(flow: Mapping[str, object]) -> set[str]:
    """The nodes every run of ``flow`` reaches: from its start, along execution wires out of
    ``exec-out`` or a ``then:N`` pin (a sequence or parallel node runs every branch); a pin
    that chooses (``true``/``false``, a case, a loop's body or ``done``) stops the walk."""
    starts = {str(n["id"]) for n in array_at(flow, "nodes") if isinstance(n, Mapping) and n.get("type") in _START_TYPES}
    entry = flow.get("entryNode")
    if isinstance(entry, str):
        starts.add(entry)
    graph: dict[str, list[str]] = {}
    for edge in array_at(flow, "edges"):
        if not isinstance(edge, Mapping) or edge.get("targetHandle") != _EXEC_IN:
            continue
        handle = str(edge.get("sourceHandle") or "")
        if handle == "exec-out" or handle.startswith("then:"):
            graph.setdefault(str(edge.get("source")), []).append(str(edge.get("target")))
    seen: set[str] = set()
    for start in starts:
        seen |= _reach(graph, start)
    return seen


def subflow_cycles(calls: Iterable[tuple[str, str, str]]) -> list[list[tuple[str, str]]]:
    """Each group of flows that call each other in a circle, as ``(flow_id, node_id)`` hops: the
    ``subflow`` node of each flow that calls the next (the last one calls the first). A circle
    starts at the flow that comes first in ``calls`` (the root's calls come first)."""
    graph: dict[str, list[str]] = {}
    via: dict[tuple[str, str], str] = {}
    for flow_id, node_id, called in calls:
        graph.setdefault(flow_id, []).append(called)
        graph.setdefault(called, [])
        via.setdefault((flow_id, called), node_id)
    rank = {flow_id: i for i, flow_id in enumerate(graph)}
    out = []
    for cycle in _cycles(graph):
        first = min(range(len(cycle)), key=lambda i: rank[cycle[i]])
        cycle = cycle[first:] + cycle[:first]
        hops = list(zip(cycle, cycle[1:] + cycle[:1], strict=True))
        out.append([(flow_id, via[(flow_id, called)]) for flow_id, called in hops])
    return out


def _cycles(graph: Mapping[str, list[str]]) -> list[list[str]]:
    """A shortest cycle through the first node (in sorted order) of each strongly connected
    group of ``graph`` that has one."""
    reverse: dict[str, list[str]] = {node: [] for node in graph}
    for node, targets in graph.items():
        for target in targets:
            reverse.setdefault(target, []).append(node)
    found: list[list[str]] = []
    covered: set[str] = set()
    for start in sorted(graph):
        if start in covered:
            continue
        cycle = _shortest_cycle(graph, start)
        if cycle is None:
            continue
        covered |= _reach(graph, start) & _reach(reverse, start)
        found.append(cycle)
    return found


def _shortest_cycle(graph: Mapping[str, list[str]], start: str) -> list[str] | None:
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for target in graph.get(node, ()):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return path[::-1]
                if target not in parent:
                    parent[target] = node
                    following.append(target)
        frontier = following
    return None


def _reach(graph: Mapping[str, list[str]], start: str) -> set[str]:
    seen = {start}
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen
