"""A run drawn as its flow's graph: the VisualFlow's nodes (with the editor's positions) and
edges, each node with its state in this run, how often it ran, its time, its inputs and
outputs, its LLM calls and the child runs it started.

    graph = run_graph(flow, state, steps, calls_by_node, child_durations)
    graph.as_dict()     # what the web inspector draws

Built from what the ledger keeps, nothing else: the flow document ``run`` stores with the run
(the root run's ``_runtime.mlx_pack.flow``; a subflow run's graph is the root's stored copy of
that subflow), the host's node traces in the run's vars (each effect node's payload and
result), the node outputs it keeps for the other nodes (``_temp.node_outputs``), and the
step records (attempts, times, failures).

A node's state is one of ``idle`` (not reached yet), ``running``, ``waiting``, ``completed``,
``failed``. A node that waits on a child run that is itself running is ``running``: the flow
is busy in its subflow or agent, not waiting for anyone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .json_values import JSONObject, JSONValue, array_at, as_float, object_at, objects_in
from .ledger import StepRow

__all__ = [
    "GraphEdge",
    "GraphNode",
    "RunGraph",
    "display_labels",
    "run_graph",
    "short_id",
]

MAX_TEXT = 2000
"""Characters kept of one string in a node's inputs or outputs (the rest is cut, saying how much)."""

MAX_ITEMS = 50
"""Items kept of one list or object in a node's inputs or outputs."""

TERMINAL = frozenset({"completed", "failed", "cancelled"})
_EFFECT_KEYS_HIDDEN = frozenset({"type", "resume_to_node", "result_key"})


@dataclass(frozen=True, slots=True)
class GraphEdge:
    source: str
    source_handle: str | None
    target: str
    target_handle: str | None
    execution: bool
    """An execution edge (control flow) rather than a data edge."""


@dataclass(frozen=True, slots=True)
class GraphNode:
    node_id: str
    label: str
    """The node's label, with its short id when another node of the flow has the same label."""
    node_type: str
    x: float
    y: float
    state: str
    visits: int
    """How many times the node ran (a node in a loop runs once per iteration)."""
    attempts: int
    """The highest attempt of any of its steps (retries)."""
    time_s: float | None
    """Time spent in the node over all its visits, where the ledger timed it."""
    error: str | None
    inputs: JSONObject | None
    outputs: JSONObject | None
    call_keys: list[str] = field(default_factory=list)
    child_run_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RunGraph:
    flow_id: str
    nodes: list[GraphNode]
    edges: list[GraphEdge]
    laid_out: bool
    """True when positions come from the flow file; False when computed here (the file had none)."""

    def as_dict(self) -> JSONObject:
        return {
            "flow_id": self.flow_id,
            "laid_out": self.laid_out,
            "nodes": [_node_dict(n) for n in self.nodes],
            "edges": [
                {
                    "source": e.source,
                    "source_handle": e.source_handle,
                    "target": e.target,
                    "target_handle": e.target_handle,
                    "execution": e.execution,
                }
                for e in self.edges
            ],
        }


def _node_dict(node: GraphNode) -> JSONObject:
    return {
        "node_id": node.node_id,
        "label": node.label,
        "type": node.node_type,
        "x": node.x,
        "y": node.y,
        "state": node.state,
        "visits": node.visits,
        "attempts": node.attempts,
        "time_s": node.time_s,
        "error": node.error,
        "inputs": node.inputs,
        "outputs": node.outputs,
        "call_keys": list(node.call_keys),
        "child_run_ids": list(node.child_run_ids),
    }


# --------------------------------------------------------------------------------------
# Labels
# --------------------------------------------------------------------------------------


def short_id(node_id: str) -> str:
    """A node id short enough for a label: the id itself up to 8 characters, else its first 8."""
    return node_id if len(node_id) <= 8 else node_id[:8]


def display_labels(flow: Mapping[str, object]) -> dict[str, str]:
    """``node_id -> label`` for every node of ``flow``: its label (or title, or id), followed by
    its short id in parentheses when another node of the flow has the same label, so the three
    ``LLM Call`` nodes of a flow read ``LLM Call (node-4)``, ``LLM Call (node-7)``, ..."""
    raw: dict[str, str] = {}
    for node in objects_in(array_at(flow, "nodes")):
        node_id = node.get("id")
        if not node_id:
            continue
        data = object_at(node, "data")
        label = data.get("label") or data.get("title")
        raw[str(node_id)] = str(label) if label else str(node_id)
    counts: dict[str, int] = {}
    for label in raw.values():
        counts[label] = counts.get(label, 0) + 1
    return {
        node_id: f"{label} ({short_id(node_id)})" if counts[label] > 1 and label != node_id else label
        for node_id, label in raw.items()
    }


# --------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------


def run_graph(
    flow: Mapping[str, object],
    state: Mapping[str, object],
    steps: Sequence[StepRow],
    *,
    calls_by_node: Mapping[str, Sequence[str]],
    child_runs: Mapping[str, tuple[str, float]],
) -> RunGraph:
    """The graph of ``flow`` as this run went: ``state`` is the run's saved state, ``steps`` its
    step records, ``calls_by_node`` the keys of each node's LLM calls (``inspection.CallView.key``),
    ``child_runs`` ``child run id -> (status, duration_s)`` for the run's child runs."""
    labels = display_labels(flow)
    run_vars = object_at(state, "vars")
    traces = object_at(object_at(run_vars, "_runtime"), "node_traces")
    temp = object_at(run_vars, "_temp")
    node_outputs = object_at(temp, "node_outputs")
    effects = object_at(temp, "effects")
    status = str(state.get("status") or "")
    current = state.get("current_node")
    steps_of: dict[str, list[StepRow]] = {}
    for step in steps:
        steps_of.setdefault(step.node_id, []).append(step)

    edges = [
        GraphEdge(
            source=str(e.get("source")),
            source_handle=_opt_str(e.get("sourceHandle")),
            target=str(e.get("target")),
            target_handle=_opt_str(e.get("targetHandle")),
            execution=_is_execution_edge(e, flow),
        )
        for e in objects_in(array_at(flow, "edges"))
        if e.get("source") and e.get("target")
    ]
    flow_nodes = [n for n in objects_in(array_at(flow, "nodes")) if n.get("id")]
    positions = _positions(flow_nodes, edges)
    nodes: list[GraphNode] = []
    for node in flow_nodes:
        node_id = str(node["id"])
        data = object_at(node, "data")
        trace_steps = objects_in(array_at(object_at(traces, node_id), "steps"))
        own_steps = steps_of.get(node_id, [])
        children = _child_run_ids(trace_steps, own_steps)
        visits = _visits(trace_steps, own_steps, node_id in node_outputs)
        node_state, error = _state(node_id, status, current, own_steps, visits, children, child_runs)
        x, y = positions[node_id]
        nodes.append(
            GraphNode(
                node_id=node_id,
                label=labels.get(node_id, node_id),
                node_type=str(node.get("type") or data.get("nodeType") or "?"),
                x=x,
                y=y,
                state=node_state,
                visits=visits,
                attempts=max((s.attempt for s in own_steps), default=0),
                time_s=_time_s(trace_steps, own_steps, children, child_runs),
                error=error,
                inputs=_inputs(node_id, data, trace_steps, edges, node_outputs, effects),
                outputs=_outputs(node_id, trace_steps, node_outputs, effects),
                call_keys=list(calls_by_node.get(node_id, [])),
                child_run_ids=children,
            )
        )
    return RunGraph(
        flow_id=str(flow.get("id") or ""),
        nodes=nodes,
        edges=edges,
        laid_out=_has_layout(flow_nodes),
    )


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def _is_execution_edge(edge: Mapping[str, object], flow: Mapping[str, object]) -> bool:
    """An edge between execution pins: the editor animates those, and names them ``exec-*`` or
    types the pin ``execution``."""
    handle = str(edge.get("sourceHandle") or "")
    if handle.startswith("exec") or edge.get("animated") is True:
        return True
    for node in objects_in(array_at(flow, "nodes")):
        if node.get("id") == edge.get("source"):
            for pin in objects_in(array_at(object_at(node, "data"), "outputs")):
                if pin.get("id") == handle:
                    return pin.get("type") == "execution"
    return False


def _has_layout(nodes: Sequence[Mapping[str, object]]) -> bool:
    """Whether the editor placed the nodes: at least two distinct positions."""
    seen = {(as_float(object_at(n, "position").get("x")), as_float(object_at(n, "position").get("y"))) for n in nodes}
    return len(seen) > 1 and (None, None) not in seen


def _positions(nodes: Sequence[Mapping[str, object]], edges: Sequence[GraphEdge]) -> dict[str, tuple[float, float]]:
    """Each node's top-left corner: the editor's positions when the file has them, else
    columns by distance from the flow's first nodes along its edges (loops' back edges ignored),
    one row per node of a column."""
    if _has_layout(nodes):
        return {
            str(n["id"]): (
                as_float(object_at(n, "position").get("x")) or 0.0,
                as_float(object_at(n, "position").get("y")) or 0.0,
            )
            for n in nodes
        }
    ids = [str(n["id"]) for n in nodes]
    targets = {e.target for e in edges}
    depth: dict[str, int] = {}
    frontier = [i for i in ids if i not in targets] or ids[:1]
    for node_id in frontier:
        depth[node_id] = 0
    while frontier:
        following: list[str] = []
        for node_id in frontier:
            for e in edges:
                if e.source == node_id and e.target in ids and e.target not in depth:
                    depth[e.target] = depth[node_id] + 1
                    following.append(e.target)
        frontier = following
    rows: dict[int, int] = {}
    out: dict[str, tuple[float, float]] = {}
    for node_id in ids:
        column = depth.get(node_id, 0)
        row = rows.get(column, 0)
        rows[column] = row + 1
        out[node_id] = (column * 220.0, row * 110.0)
    return out


def _visits(trace_steps: Sequence[Mapping[str, object]], own_steps: Sequence[StepRow], has_output: bool) -> int:
    """How often the node ran: its distinct effect steps (a subflow's start and its resume are
    one visit), else its trace entries, else 1 when the host kept an output for it."""
    started = {s.step_id for s in own_steps if s.effect_type not in (None, "resume")}
    if started:
        return len(started)
    if trace_steps:
        return len(trace_steps)
    return 1 if has_output else 0


def _child_run_ids(trace_steps: Sequence[Mapping[str, object]], own_steps: Sequence[StepRow]) -> list[str]:
    out: list[str] = []
    records = [object_at(t, "wait") for t in trace_steps] + [
        object_at(object_at(s.record, "result"), "wait") for s in own_steps
    ]
    records += [object_at(s.record, "wait") for s in own_steps]
    for wait in records:
        child = object_at(wait, "details").get("sub_run_id")
        if isinstance(child, str) and child not in out:
            out.append(child)
    return out


def _state(
    node_id: str,
    run_status: str,
    current: object,
    own_steps: Sequence[StepRow],
    visits: int,
    children: Sequence[str],
    child_runs: Mapping[str, tuple[str, float]],
) -> tuple[str, str | None]:
    latest: dict[str, StepRow] = {}
    for step in own_steps:
        latest[step.step_id] = step
    failed = [s for s in latest.values() if s.status == "failed"]
    if failed:
        return "failed", failed[-1].error
    if any(s.status not in TERMINAL and s.status != "waiting" for s in latest.values()) and run_status == "running":
        return "running", None
    if node_id == current and run_status in ("running", "waiting"):
        if any(child_runs.get(c, ("", 0.0))[0] == "running" for c in children):
            return "running", None  # busy in its subflow or agent
        if any(s.status == "waiting" for s in latest.values()) or run_status == "waiting":
            return "waiting", None
        return "running", None
    if visits:
        return "completed", None
    return "idle", None


def _time_s(
    trace_steps: Sequence[Mapping[str, object]],
    own_steps: Sequence[StepRow],
    children: Sequence[str],
    child_runs: Mapping[str, tuple[str, float]],
) -> float | None:
    """A subflow or agent node's time is its child runs' time; another effect node's is its
    steps' time (start to end of each); else what the host's trace measured."""
    if children:
        known = [child_runs[c][1] for c in children if c in child_runs]
        return round(sum(known), 6) if known else None
    spans: dict[str, tuple[float, float]] = {}
    for step in own_steps:
        if step.started_at is None:
            continue
        start = step.started_at.timestamp()
        end = step.ended_at.timestamp() if step.ended_at is not None else start
        lo, hi = spans.get(step.step_id, (start, end))
        spans[step.step_id] = (min(lo, start), max(hi, end))
    if spans:
        return round(sum(hi - lo for lo, hi in spans.values()), 6)
    measured = [as_float(t.get("duration_ms")) for t in trace_steps]
    values = [m for m in measured if m is not None]
    return round(sum(values) / 1000.0, 6) if values else None


def _inputs(
    node_id: str,
    data: Mapping[str, object],
    trace_steps: Sequence[Mapping[str, object]],
    edges: Sequence[GraphEdge],
    node_outputs: Mapping[str, object],
    effects: Mapping[str, object],
) -> JSONObject | None:
    """What the node was given on its latest visit: an effect node's payload as the host
    recorded it; for another node, its pins' defaults and what its data edges carried from
    the outputs the host kept."""
    if trace_steps:
        payload = object_at(object_at(trace_steps[-1], "effect"), "payload")
        if payload:
            return {str(k): clip(v) for k, v in payload.items() if k not in _EFFECT_KEYS_HIDDEN}
    out: JSONObject = {str(k): clip(v) for k, v in object_at(data, "pinDefaults").items()}
    for edge in edges:
        if edge.target != node_id or edge.execution or edge.target_handle is None:
            continue
        source_outputs = object_at(node_outputs, edge.source) or object_at(effects, edge.source)
        if edge.source_handle is not None and edge.source_handle in source_outputs:
            out[edge.target_handle] = clip(source_outputs[edge.source_handle])
    return out or None


def _outputs(
    node_id: str,
    trace_steps: Sequence[Mapping[str, object]],
    node_outputs: Mapping[str, object],
    effects: Mapping[str, object],
) -> JSONObject | None:
    """What the node produced on its latest visit: the host's kept output, else its effect's result."""
    kept = object_at(node_outputs, node_id)
    if kept:
        return {str(k): clip(v) for k, v in kept.items()}
    result = object_at(effects, node_id)
    if not result and trace_steps:
        result = object_at(trace_steps[-1], "result")
    return {str(k): clip(v) for k, v in result.items()} if result else None


def clip(value: object, *, depth: int = 0) -> JSONValue:
    """``value`` as JSON small enough to ship to a page: strings cut at ``MAX_TEXT``, lists and
    objects at ``MAX_ITEMS``, nesting at 6 levels; a slimmed payload field (``$slim``) says so."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT else f"{value[:MAX_TEXT]}… ({len(value) - MAX_TEXT:,} more characters)"
    if depth >= 6:
        return "…"
    if isinstance(value, Mapping):
        marker = value.get("$slim")
        if isinstance(marker, Mapping):
            size = marker.get("bytes")
            return f"not kept by the host ({size:,} bytes)" if isinstance(size, int) else "not kept by the host"
        items = list(value.items())
        out: dict[str, JSONValue] = {str(k): clip(v, depth=depth + 1) for k, v in items[:MAX_ITEMS]}
        if len(items) > MAX_ITEMS:
            out["…"] = f"{len(items) - MAX_ITEMS} more keys"
        return out
    if isinstance(value, (list, tuple)):
        kept = [clip(v, depth=depth + 1) for v in value[:MAX_ITEMS]]
        if len(value) > MAX_ITEMS:
            kept.append(f"… {len(value) - MAX_ITEMS} more items")
        return kept
    return str(value)
