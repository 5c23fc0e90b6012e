"""What a person looks at for one run, built from the ledger alone.

    view = run_view(ledger, run_id)      # -> RunView (None if the run is unknown)
    view.calls[0].segments()             # prefill / generation spans of one LLM call
    view.as_dict()                       # JSON-safe, what the web inspector ships

One ``CallView`` per LLM call (node, step, attempt): a node that runs twice in a loop is two
calls, named ``label #1``, ``label #2`` (``CallView.name``; the label carries the node's short id
when another node of the flow has the same label). ``RunView.graph`` is the flow's own graph
with each node's state (``run_graph``); ``RunView.spans`` the run's child runs (subflows,
agents) with their calls on this run's time axis. Times are seconds since the run was created. The prefill segment runs from the call's
start (its first phase event minus that event's ``elapsed_s``) to its first token; the
generation segment from the first token to ``complete`` (or to the latest event while the
call is still running). Controls, execution, speculation and prompt-cache figures come from
the call's recorded result; while it runs, the controls the node asked for are shown with the
source ``requested``.

Each call carries its whole input as the model got it (``CallView.messages``: the system prompt,
the history with roles, tool calls and tool results, then the prompt, rebuilt from the step's
recorded payload and the node's ``metadata.input``), the tools offered, the served model and
route, and ``new_from``: where the messages new in this turn start (an agent's transcript
grows turn by turn). A model load the call waited for is its own ``load`` segment.
``RunTotals`` sums a run and every run below it (tokens, cache hits, time up to now while
any of them runs).

Reads through ``Ledger``'s query methods only; used by ``runs show``, ``runs web`` and the
live view of ``run``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .conversation import assemble_conversation
from .errors import InvalidRequest, RunNotFound
from .json_values import JSONObject, JSONValue, array_at, as_float, as_int, as_str, object_at
from .ledger import Ledger, ProgressRow, RunDetail, RunSummary, StepRow
from .run_graph import RunGraph, display_labels, run_graph

__all__ = [
    "CallSample",
    "CallView",
    "ControlView",
    "NodeOutcome",
    "RunTotals",
    "RunView",
    "SpanView",
    "call_views",
    "child_run_steps",
    "child_runs",
    "control_text",
    "event_dict",
    "node_dict",
    "node_labels",
    "node_outcomes",
    "payload_text",
    "prefix_break_text",
    "run_dict",
    "run_flow_document",
    "run_tree_dicts",
    "run_view",
    "summary_dict",
    "tree_call_summary",
    "tree_calls",
    "tree_totals",
]

MAX_NESTING = 8
"""How many levels of child runs the run views follow below a run."""

TERMINAL_STEP_STATUSES = frozenset({"completed", "failed", "cancelled"})

AGENT_WORKFLOW_PREFIX = "visual_react_agent"
"""The workflow id an agent node's ReAct loop runs under (the host's visual compiler names it)."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CallSample:
    """One phase event of a call, as a point on its charts."""

    t: float
    phase: str
    prompt_tokens: int | None
    cached_tokens: int | None
    prefill_processed_tokens: int | None
    generated_tokens: int | None
    ttft_s: float | None
    tokens_per_second: float | None
    prefill_tokens_per_second: float | None


@dataclass(frozen=True, slots=True)
class ControlView:
    """One control's effective value and the level that decided it (call, node, run, policy, ...)."""

    name: str
    value: str
    source: str


@dataclass(frozen=True, slots=True)
class CallView:
    key: str
    node_id: str
    label: str
    step_id: str | None
    attempt: int
    status: str
    lane: str | None
    start_s: float | None
    first_token_s: float | None
    end_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    generated_tokens: int | None
    ttft_s: float | None
    tokens_per_second: float | None
    prefill_tokens_per_second: float | None
    finish_reason: str | None
    prompt: str | None
    system_prompt: str | None
    response: str | None
    error: str | None
    controls: list[ControlView]
    usage: dict[str, object]
    execution: dict[str, object]
    speculation: dict[str, object]
    prompt_cache: dict[str, object]
    sibling_batch: dict[str, object]
    client: dict[str, object]
    recorded: bool = False
    """The call's terminal step record (its result or error) is in the ledger."""
    samples: list[CallSample] = field(default_factory=list)
    visit: int = 1
    """Which call of its node this is, in start order (a node in a loop has one per iteration)."""
    name: str = ""
    """What views call it: the label, ``#visit`` when the node has several calls in the run,
    ``attempt N`` on a retry."""
    messages: list[JSONObject] = field(default_factory=list)
    """The conversation as the model got it: the system prompt first, then the history (roles,
    tool calls, tool results), then the prompt as a user turn (``conversation``'s rule)."""
    tools: list[JSONValue] = field(default_factory=list)
    """The tool schemas offered to the model."""
    tool_calls: list[JSONValue] = field(default_factory=list)
    """The tool calls the model answered with."""
    input_note: str | None = None
    """Said when part of the input was not kept by the host (the rest is shown)."""
    new_from: int = 0
    """Index in ``messages`` of the first message that the previous call of the same run did
    not have (0: all new): what this turn added to a growing transcript."""
    model: str | None = None
    """The model that served the call (``route.served.model``, else the result's ``model``)."""
    route: dict[str, object] = field(default_factory=dict)
    """``{"asked": {...}, "served": {...}, "rule": ...}``: what the node named and what served it."""
    request_params: dict[str, object] = field(default_factory=dict)
    """The sampling parameters the call asked for (the step's ``params``: ``temperature``,
    ``max_output_tokens`` ...)."""
    load: dict[str, object] = field(default_factory=dict)
    """The model load the call waited for: ``model``, ``size_bytes``, ``state`` (``loading``,
    ``loaded``, ``failed``), ``start_s``, ``end_s``, ``seconds``; empty when the model was resident."""
    http: dict[str, object] = field(default_factory=dict)
    """A served call's HTTP request (``serve``): ``method``, ``route`` (``/v1/chat/completions``
    ...), ``stream``; empty for a flow's call."""
    prefetched_tokens: int | None = None
    """Of the cached tokens, those a prefix warm put in RAM before the call came
    (``prompt_cache.prefetched_tokens``); None when no warm ran on its model's cache."""
    prefix_warm: list[dict[str, object]] = field(default_factory=list)
    """The warms this call started when it finished: the next nodes' prefixes (``node_id``,
    ``prefix_only``, ``prompt_tokens``, ``queued`` or the ``reason`` not)."""
    prefix_break: str | None = None
    """Where the prompt broke its cache key's previous prompt (``prefix_break_text`` of
    ``prompt_cache.prefix_break``); None when it extended it, or had no key."""

    @property
    def phase(self) -> str:
        """``load``, ``queued``, ``prefill``, ``generate``, or the terminal status."""
        if self.status in TERMINAL_STEP_STATUSES:
            return self.status
        if not self.samples:
            return "load" if self.load.get("state") == "loading" else "queued"
        return self.samples[-1].phase

    @property
    def prefill_processed_tokens(self) -> int | None:
        """Prompt tokens in the KV cache: all of them once a token exists, else the latest position."""
        if self.first_token_s is not None:
            return self.prompt_tokens
        for sample in reversed(self.samples):
            if sample.prefill_processed_tokens is not None:
                return sample.prefill_processed_tokens
        return None

    @property
    def acceptance(self) -> float | None:
        """MTP draft acceptance (accepted / drafted tokens), when speculation ran."""
        drafted = self.speculation.get("drafted_tokens")
        accepted = self.speculation.get("accepted_tokens")
        if isinstance(drafted, (int, float)) and isinstance(accepted, (int, float)) and drafted > 0:
            return float(accepted) / float(drafted)
        return None

    def segments(self) -> list[tuple[str, float, float]]:
        """``[("load", ...), ("queue", a, b), ("prefill", b, c), ("generate", c, d)]`` in run
        seconds, as far as known.

        The load segment exists when the call waited for its model to load. The queue segment
        exists once the result reports ``execution.queue_s``; before that the time waiting for a
        batch slot is part of the prefill segment.
        """
        load: list[tuple[str, float, float]] = []
        load_start, load_end = as_float(self.load.get("start_s")), as_float(self.load.get("end_s"))
        if load_start is not None:
            load = [
                ("load", load_start, max(load_start, load_end if load_end is not None else self.end_s or load_start))
            ]
        if self.start_s is None:
            return load
        return load + self._engine_segments()

    def _engine_segments(self) -> list[tuple[str, float, float]]:
        assert self.start_s is not None
        end = max(self.end_s if self.end_s is not None else self.start_s, self.start_s)
        prefill_end = end if self.first_token_s is None else self.first_token_s
        out: list[tuple[str, float, float]] = []
        prefill_start = self.start_s
        queue_s = self.execution.get("queue_s")
        if isinstance(queue_s, (int, float)) and queue_s > 0:
            prefill_start = min(self.start_s + float(queue_s), prefill_end)
            out.append(("queue", self.start_s, prefill_start))
        out.append(("prefill", prefill_start, prefill_end))
        if self.first_token_s is not None:
            out.append(("generate", self.first_token_s, max(end, self.first_token_s)))
        return out


@dataclass(frozen=True, slots=True)
class SpanView:
    """A child run (subflow, agent) of the run viewed, on the viewed run's time axis: when it
    started and last moved, and its LLM calls (their times shifted the same way)."""

    run: RunSummary
    depth: int
    """1 for a child of the viewed run, 2 for a grandchild, ..."""
    start_s: float
    end_s: float
    calls: list[CallView]
    node_id: str | None = None
    """The node of the parent run that started this run (the agent or subflow node)."""
    node_label: str | None = None

    @property
    def kind(self) -> str:
        """``agent`` for an agent's ReAct loop, else ``subflow``."""
        return "agent" if self.run.workflow_id.startswith(AGENT_WORKFLOW_PREFIX) else "subflow"

    def as_dict(self) -> JSONObject:
        return {
            "run": summary_dict(self.run),
            "kind": self.kind,
            "node_id": self.node_id,
            "node_label": self.node_label,
            "depth": self.depth,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "calls": [_call_dict(c) for c in self.calls],
        }


@dataclass(frozen=True, slots=True)
class RunTotals:
    """A run and every run below it (subflows, agents), summed: what a root run of a subflow or
    agent flow really cost. ``elapsed_s`` runs from the run's start to the latest checkpoint in
    the tree, or up to now while any run of the tree is running (``busy``)."""

    runs: int
    calls: int | None
    """LLM calls, where known (the run page counts them; the run list does not)."""
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    elapsed_s: float
    busy: bool

    def as_dict(self) -> JSONObject:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def tree_totals(
    run: RunSummary, below: Sequence[RunSummary], *, as_of: dt.datetime | None, calls: int | None = None
) -> RunTotals:
    """``RunTotals`` of ``run`` and the runs ``below`` it (all its descendants)."""
    runs = [run, *below]
    busy = any(r.status == "running" for r in runs)
    end = max(r.created_at + dt.timedelta(seconds=r.duration_s) for r in runs)
    if busy and as_of is not None:
        end = max(end, as_of)
    return RunTotals(
        runs=len(runs),
        calls=calls,
        prompt_tokens=sum(r.prompt_tokens for r in runs),
        cached_tokens=sum(r.cached_tokens for r in runs),
        generated_tokens=sum(r.generated_tokens for r in runs),
        elapsed_s=round(max(0.0, (end - run.created_at).total_seconds()), 6),
        busy=busy,
    )


def descendants(run_id: str, children: Mapping[str, Sequence[RunSummary]]) -> list[RunSummary]:
    """Every run below ``run_id`` in ``children`` (``child_runs``), depth first."""
    out: list[RunSummary] = []
    for child in children.get(run_id, []):
        out.append(child)
        out.extend(descendants(child.run_id, children))
    return out


@dataclass(frozen=True, slots=True)
class RunView:
    summary: RunSummary
    error: str | None
    current_node: str | None
    steps: list[StepRow]
    calls: list[CallView]
    last_step_seq: int
    last_progress_seq: int
    graph: RunGraph | None = None
    spans: list[SpanView] = field(default_factory=list)
    children: dict[str, list[RunSummary]] = field(default_factory=dict)
    """``parent run id -> child runs`` below this run (``child_runs``)."""
    as_of: dt.datetime | None = None
    """When the view was read (a running run's elapsed time counts up to it)."""
    output: JSONValue = None
    """The flow's own final output (the run's ``output``), once it has one."""

    @property
    def live(self) -> bool:
        return self.summary.status == "running"

    @property
    def totals(self) -> RunTotals:
        """This run with its child runs (``spans``): tokens, cache hits, calls, time."""
        calls = len(self.calls) + sum(len(s.calls) for s in self.spans)
        return tree_totals(self.summary, [s.run for s in self.spans], as_of=self.as_of, calls=calls)

    @property
    def unfinished(self) -> bool:
        """The run may still change: running, waiting (an answer or a child run continues it) or
        interrupted (``runs resume``); a page of it keeps following the ledger."""
        return self.summary.status not in ("completed", "failed", "cancelled")

    @property
    def elapsed_s(self) -> float:
        """How long the run has taken: up to now while it or a run below it runs, else to the
        latest checkpoint of its tree (``totals``)."""
        return self.totals.elapsed_s

    @property
    def horizon_s(self) -> float:
        """The end of the time axis: the run's duration or the latest call or child run end,
        whichever is later."""
        ends = [c.end_s for c in self.calls if c.end_s is not None] + [s.end_s for s in self.spans]
        return max([self.summary.duration_s, *ends, 1e-3])

    def as_dict(self) -> JSONObject:
        return {
            "run": summary_dict(self.summary),
            "error": self.error,
            "current_node": self.current_node,
            "live": self.live,
            "unfinished": self.unfinished,
            "as_of": None if self.as_of is None else self.as_of.isoformat(),
            "elapsed_s": round(self.elapsed_s, 6),
            "totals": self.totals.as_dict(),
            "output": self.output,
            "horizon_s": self.horizon_s,
            "last_step_seq": self.last_step_seq,
            "last_progress_seq": self.last_progress_seq,
            "steps": [_step_dict(s) for s in self.steps],
            "calls": [_call_dict(c) for c in self.calls],
            "graph": None if self.graph is None else self.graph.as_dict(),
            "spans": [s.as_dict() for s in self.spans],
            "children": run_tree_dicts(self.children.get(self.summary.run_id, []), self.children, as_of=self.as_of),
        }


def summary_dict(summary: RunSummary) -> JSONObject:
    """A run summary as JSON-safe values (datetimes as ISO-8601 UTC)."""
    out: JSONObject = {}
    for f in dataclasses.fields(RunSummary):
        value = getattr(summary, f.name)
        out[f.name] = value.isoformat() if isinstance(value, dt.datetime) else value
    return out


def child_runs(ledger: Ledger, run_ids: Sequence[str], *, max_depth: int = MAX_NESTING) -> dict[str, list[RunSummary]]:
    """``parent run id -> its child runs`` (oldest first) for the runs ``run_ids`` and their
    descendants, down to ``max_depth`` levels: one ledger read per level."""
    out: dict[str, list[RunSummary]] = {}
    level = list(run_ids)
    for _ in range(max_depth):
        if not level:
            break
        found = sorted(ledger.list_runs(limit=1_000_000, parent_run_ids=level), key=lambda c: (c.created_at, c.run_id))
        for child in found:
            out.setdefault(child.parent_run_id or "", []).append(child)
        level = [child.run_id for child in found]
    return out


def run_tree_dicts(
    roots: Sequence[RunSummary], children: Mapping[str, Sequence[RunSummary]], *, as_of: dt.datetime | None = None
) -> list[JSONObject]:
    """``summary_dict`` of each run in ``roots`` with ``totals`` (``tree_totals`` as of
    ``as_of``, default now: a running run's time counts up) and ``children``: its child runs
    (from ``child_runs``), each the same way, oldest first."""
    when = as_of or dt.datetime.now(dt.UTC)
    out: list[JSONObject] = []
    for run in roots:
        item = summary_dict(run)
        item["totals"] = tree_totals(run, descendants(run.run_id, children), as_of=when).as_dict()
        item["children"] = run_tree_dicts(children.get(run.run_id, []), children, as_of=when)
        out.append(item)
    return out


def _step_dict(step: StepRow) -> JSONObject:
    effect = step.effect_type
    if effect == "emit_event":
        payload = object_at(object_at(step.record, "effect"), "payload")
        effect = str(payload.get("name") or effect)
    return {
        "seq": step.seq,
        "node_id": step.node_id,
        "status": step.status,
        "effect": effect,
        "attempt": step.attempt,
        "duration_s": step.duration_s,
        "error": step.error,
    }


def _call_dict(call: CallView) -> JSONObject:
    out = dataclasses.asdict(call)
    out["phase"] = call.phase
    out["prefill_processed_tokens"] = call.prefill_processed_tokens
    out["acceptance"] = call.acceptance
    out["segments"] = [{"phase": p, "start_s": a, "end_s": b} for p, a, b in call.segments()]
    return out


# --------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------


def run_view(ledger: Ledger, run_id: str, *, tree: bool = True) -> RunView | None:
    """Everything the inspector shows about one run, or None if the ledger has no such run.
    With ``tree`` (the default) also its graph's node states, its child runs and their calls
    (``spans``); without, its own calls only (one ledger read fewer per child)."""
    as_of = dt.datetime.now(dt.UTC)
    detail = ledger.get_run(run_id)
    if detail is None:
        return None
    steps = ledger.run_steps(run_id)
    progress = ledger.node_timeline(run_id)
    state = detail.state
    error = state.get("error")
    current = state.get("current_node")
    flow = run_flow_document(ledger, detail)
    labels = display_labels(flow) if flow is not None else node_labels(state)
    calls = call_views(detail, steps, progress, labels=labels)
    children: dict[str, list[RunSummary]] = child_runs(ledger, [run_id]) if tree else {}
    graph = None
    if flow is not None and tree:
        calls_by_node: dict[str, list[str]] = {}
        for call in calls:
            calls_by_node.setdefault(call.node_id, []).append(call.key)
        direct = {c.run_id: (c.status, c.duration_s) for c in children.get(run_id, [])}
        graph = run_graph(flow, state, steps, calls_by_node=calls_by_node, child_runs=direct)
    return RunView(
        summary=_summary_of(detail),
        error=str(error) if error else None,
        current_node=str(current) if current else None,
        steps=steps,
        calls=calls,
        last_step_seq=max((s.seq for s in steps), default=0),
        last_progress_seq=max((p.seq for p in progress), default=0),
        graph=graph,
        spans=_spans(ledger, detail.created_at, run_id, children, steps=steps, labels=labels) if tree else [],
        children=children,
        as_of=as_of,
        output=_json_value(state.get("output")),
    )


def _spans(
    ledger: Ledger,
    origin: dt.datetime,
    run_id: str,
    children: Mapping[str, Sequence[RunSummary]],
    *,
    steps: Sequence[StepRow],
    labels: Mapping[str, str],
    depth: int = 1,
) -> list[SpanView]:
    """The child runs below ``run_id`` (depth first, oldest first), each with its calls, on the
    time axis that starts at ``origin``, and the node of the parent (its ``steps``, ``labels``)
    that started it."""
    out: list[SpanView] = []
    started_by = _child_run_nodes(steps)
    for child in children.get(run_id, []):
        offset = (child.created_at - origin).total_seconds()
        view = run_view(ledger, child.run_id, tree=False)
        calls = [] if view is None else [_shifted(c, offset) for c in view.calls]
        node_id = started_by.get(child.run_id)
        label = labels.get(node_id, node_id) if node_id is not None else None
        out.append(SpanView(child, depth, round(offset, 6), round(offset + child.duration_s, 6), calls, node_id, label))
        child_steps = view.steps if view is not None else []
        child_labels = {c.node_id: c.label for c in view.calls} if view is not None else {}
        out.extend(
            _spans(ledger, origin, child.run_id, children, steps=child_steps, labels=child_labels, depth=depth + 1)
        )
    return out


def _child_run_nodes(steps: Sequence[StepRow]) -> dict[str, str]:
    """``child run id -> node id`` of the run's nodes that started child runs."""
    return {child: step.node_id for child, step in child_run_steps(steps).items()}


def child_run_steps(steps: Sequence[StepRow]) -> dict[str, StepRow]:
    """``child run id -> the first step`` of the run that started it (its step waits on
    ``details.sub_run_id``)."""
    out: dict[str, StepRow] = {}
    for step in steps:
        for wait in (object_at(object_at(step.record, "result"), "wait"), object_at(step.record, "wait")):
            child = object_at(wait, "details").get("sub_run_id")
            if isinstance(child, str):
                out.setdefault(child, step)
    return out


def _shifted(call: CallView, offset: float) -> CallView:
    def move(value: float | None) -> float | None:
        return None if value is None else round(value + offset, 6)

    return dataclasses.replace(
        call, start_s=move(call.start_s), first_token_s=move(call.first_token_s), end_s=move(call.end_s)
    )


def run_flow_document(ledger: Ledger, detail: RunDetail) -> Mapping[str, object] | None:
    """The VisualFlow document a run executes: the flow ``run`` stored with a root run
    (``_runtime.mlx_pack.flow``); for a subflow run, its root's stored copy of that subflow
    (``_runtime.mlx_pack.subflows``); None for a run of another kind (an agent's ReAct loop)."""
    own = _stored_pack(detail.state).get("flow")
    if isinstance(own, Mapping):
        return own
    parent_id = detail.parent_run_id
    for _ in range(MAX_NESTING):
        if parent_id is None:
            return None
        parent = ledger.get_run(parent_id)
        if parent is None:
            return None
        stored = _stored_pack(parent.state)
        subflow = object_at(stored, "subflows").get(detail.workflow_id)
        if stored:
            return subflow if isinstance(subflow, Mapping) else None
        parent_id = parent.parent_run_id
    return None


def _stored_pack(run_state: Mapping[str, object]) -> Mapping[str, object]:
    """What ``run_flow`` stored in a run's vars (``_runtime.mlx_pack``)."""
    return object_at(object_at(object_at(run_state, "vars"), "_runtime"), "mlx_pack")


def tree_calls(ledger: Ledger, run_id: str, *, max_depth: int = MAX_NESTING) -> list[tuple[str, CallView]]:
    """``(run_id, call)`` for every LLM call of the run and of its child runs (subflows, agents),
    down to ``max_depth`` levels: the run's own calls first, then each child's tree in the order
    the children were created."""
    view = run_view(ledger, run_id, tree=False)
    out = [(run_id, call) for call in view.calls] if view is not None else []
    if max_depth <= 0:
        return out
    children = ledger.list_runs(limit=1_000_000, parent_run_ids=[run_id])
    for child in sorted(children, key=lambda c: (c.created_at, c.run_id)):
        out.extend(tree_calls(ledger, child.run_id, max_depth=max_depth - 1))
    return out


def _summary_of(detail: RunDetail) -> RunSummary:
    return RunSummary(**{f.name: getattr(detail, f.name) for f in dataclasses.fields(RunSummary)})


def node_labels(run_state: Mapping[str, object]) -> dict[str, str]:
    """``node_id -> label`` from the flow stored with the run (``run_graph.display_labels``:
    the node id when it has no label, the short id added where a label repeats)."""
    return display_labels(object_at(_stored_pack(run_state), "flow"))


def call_views(
    detail: RunDetail,
    steps: Sequence[StepRow],
    progress: Sequence[ProgressRow],
    *,
    labels: Mapping[str, str] | None = None,
) -> list[CallView]:
    """One ``CallView`` per LLM call of the run, ordered by start time, each named
    (``CallView.name``) from ``labels`` (default: ``node_labels`` of the run)."""
    origin = detail.created_at
    if labels is None:
        labels = node_labels(detail.state)
    started: dict[tuple[str, int], StepRow] = {}
    ended: dict[tuple[str, int], StepRow] = {}
    for step in steps:
        if step.effect_type != "llm_call":
            continue
        key = (step.step_id, step.attempt)
        if step.status in TERMINAL_STEP_STATUSES:
            ended[key] = step
        else:
            started.setdefault(key, step)
    rows_by_call: dict[tuple[str, int], list[ProgressRow]] = {}
    node_of: dict[tuple[str, int], str] = {}
    for row in progress:
        key = (row.step_id or f"node:{row.node_id}", row.attempt or 1)
        rows_by_call.setdefault(key, []).append(row)
        node_of.setdefault(key, row.node_id)
    for key, step in [*started.items(), *ended.items()]:
        node_of.setdefault(key, step.node_id)
    calls = [
        _call_view(key, node_of[key], labels, started.get(key), ended.get(key), rows_by_call.get(key, []), origin)
        for key in node_of
    ]
    ordered = sorted(calls, key=lambda c: (_first_s(c), c.node_id))
    return _with_new_from(named_calls(ordered))


def _first_s(call: CallView) -> float:
    """When the call began: its model load, else its first phase event (unknown: last)."""
    segments = call.segments()
    return segments[0][1] if segments else float("inf")


def _with_new_from(calls: Sequence[CallView]) -> list[CallView]:
    """``calls`` (in start order) with ``new_from`` set: how many leading messages each shares
    with the call before it (an agent's next turn repeats the transcript and adds to it)."""
    out: list[CallView] = []
    previous: list[JSONObject] = []
    for call in calls:
        shared = 0
        for mine, theirs in zip(call.messages, previous):
            if mine != theirs:
                break
            shared += 1
        out.append(dataclasses.replace(call, new_from=shared))
        previous = call.messages
    return out


def named_calls(calls: Sequence[CallView]) -> list[CallView]:
    """``calls`` (in start order) with ``visit`` and ``name`` set: ``label #n`` for the n-th call
    of a node that has several (loop iterations), `` attempt N`` on a retry."""
    totals: dict[str, int] = {}
    for call in calls:
        if call.attempt <= 1:
            totals[call.node_id] = totals.get(call.node_id, 0) + 1
    seen: dict[str, int] = {}
    out: list[CallView] = []
    for call in calls:
        if call.attempt <= 1:
            seen[call.node_id] = seen.get(call.node_id, 0) + 1
        visit = max(1, seen.get(call.node_id, 1))
        name = call.label
        if totals.get(call.node_id, 0) > 1:
            name += f" #{visit}"
        if call.attempt > 1:
            name += f" attempt {call.attempt}"
        out.append(dataclasses.replace(call, visit=visit, name=name))
    return out


def _secs(when: dt.datetime | None, origin: dt.datetime) -> float | None:
    return None if when is None else (when - origin).total_seconds()


def _latest(values: Iterable[T | None]) -> T | None:
    """The first value that is not ``None`` (callers pass the newest first)."""
    return next((value for value in values if value is not None), None)


def _call_view(
    key: tuple[str, int],
    node_id: str,
    labels: Mapping[str, str],
    started: StepRow | None,
    ended: StepRow | None,
    rows: Sequence[ProgressRow],
    origin: dt.datetime,
) -> CallView:
    step_id, attempt = key
    load_rows = [r for r in rows if r.phase == "load"]
    rows = [r for r in rows if r.phase != "load"]
    recorded = ended or started
    record = recorded.record if recorded is not None else {}
    payload = object_at(object_at(record, "effect"), "payload")
    started_payload = object_at(object_at(started.record, "effect"), "payload") if started is not None else {}
    result = object_at(record, "result") if ended is not None else {}
    meta = object_at(result, "metadata")
    execution = dict(object_at(meta, "execution"))
    client = dict(object_at(meta, "client"))

    samples = [
        CallSample(
            t=round(_secs(r.created_at, origin) or 0.0, 6),
            phase=r.phase or "?",
            prompt_tokens=r.prompt_tokens,
            cached_tokens=r.cached_tokens,
            prefill_processed_tokens=r.prefill_processed_tokens,
            generated_tokens=r.generated_tokens,
            ttft_s=r.ttft_s,
            tokens_per_second=r.tokens_per_second,
            prefill_tokens_per_second=r.prefill_tokens_per_second,
        )
        for r in rows
    ]
    start_s = first_token_s = end_s = None
    if rows:
        first = rows[0]
        start_s = (_secs(first.created_at, origin) or 0.0) - float(first.elapsed_s or 0.0)
        ttft = next((r.ttft_s for r in rows if r.ttft_s is not None), None)
        first_token_s = start_s + ttft if ttft is not None else None
        end_s = max(s.t for s in samples)
    elif recorded is not None:  # a call recorded without phase events
        start_s = _secs(recorded.started_at, origin)
        end_s = _secs(recorded.ended_at, origin)
    last = rows[-1] if rows else None
    status = ended.status if ended is not None else ("completed" if last is not None and last.final else "running")
    # The lane: from the recorded result, or (while the call runs) from its phase events.
    lane = execution.get("mode") or next(
        (r.event.get("execution_mode") for r in reversed(rows) if r.event.get("execution_mode")), None
    )
    if client.get("kind") == "remote":
        lane = f"remote/{lane}" if lane else "remote"
    usage = dict(object_at(result, "usage"))
    newest_first = rows[::-1]
    route = dict(object_at(meta, "route"))
    messages, tools, input_note = _input_of(payload, started_payload, object_at(meta, "input"))
    raw_calls = result.get("tool_calls")

    return CallView(
        key=f"{step_id}:{attempt}",
        node_id=node_id,
        label=labels.get(node_id, node_id),
        step_id=None if step_id.startswith("node:") else step_id,
        attempt=attempt,
        status=status,
        lane=str(lane) if lane else None,
        start_s=_round(start_s),
        first_token_s=_round(first_token_s),
        end_s=_round(end_s),
        prompt_tokens=_latest(r.prompt_tokens for r in newest_first) or as_int(usage.get("prompt_tokens")),
        cached_tokens=_latest(r.cached_tokens for r in newest_first),
        generated_tokens=_latest(r.generated_tokens for r in newest_first) or as_int(usage.get("completion_tokens")),
        ttft_s=_latest(r.ttft_s for r in newest_first) or as_float(execution.get("ttft_s")),
        tokens_per_second=_latest(r.tokens_per_second for r in newest_first),
        prefill_tokens_per_second=_latest(r.prefill_tokens_per_second for r in newest_first),
        finish_reason=(last.finish_reason if last is not None else None) or as_str(result.get("finish_reason")),
        prompt=_prompt_as_sent(payload, started_payload, object_at(meta, "input")) or _last_text(messages, "user"),
        system_prompt=payload_text(payload, "system_prompt", started_payload) or _last_text(messages, "system"),
        response=_opt_text(result.get("content")) if ended is not None else None,
        error=ended.error if ended is not None else None,
        controls=_controls(meta, payload),
        usage=usage,
        execution=execution,
        speculation=dict(object_at(meta, "speculation")),
        prompt_cache=dict(object_at(meta, "prompt_cache")),
        prefix_break=prefix_break_text(object_at(object_at(meta, "prompt_cache"), "prefix_break")),
        prefetched_tokens=as_int(object_at(meta, "prompt_cache").get("prefetched_tokens")),
        prefix_warm=[dict(w) for w in array_at(meta, "prefix_warm") if isinstance(w, Mapping)],
        sibling_batch=dict(object_at(meta, "sibling_batch")),
        client=client,
        recorded=ended is not None,
        samples=samples,
        messages=messages,
        tools=tools,
        tool_calls=list(raw_calls) if isinstance(raw_calls, list) else [],
        input_note=input_note,
        model=as_str(object_at(route, "served").get("model")) or as_str(result.get("model")),
        route=route,
        request_params={k: v for k, v in object_at(payload, "params").items() if k != "trace_metadata"},
        load=_load_of(load_rows, origin),
        http=dict(object_at(payload, "http") or object_at(started_payload, "http")),
    )


_SEGMENT_ROLES = {"system": "system prompt", "user": "user turn", "assistant": "assistant turn", "tool": "tool result"}


def prefix_break_text(brk: Mapping[str, object], *, excerpts: bool = False) -> str | None:
    """``prefix broke at message 3 (tool result), token 1,412`` for a ``prompt_cache.prefix_break``
    (None for an empty one), with the reused / expected counts; ``excerpts`` adds both sides'
    text after the break."""
    token = as_int(brk.get("token"))
    if token is None:
        return None
    segment = brk.get("segment")
    index = as_int(brk.get("message_index"))
    if segment == "message" and index is not None:
        role = str(brk.get("role") or "?")
        where = f"at message {index} ({_SEGMENT_ROLES.get(role, role)})"
    elif segment == "tools":
        where = "in the tools block"
    elif segment == "generation_prompt":
        where = "in the generation prompt"
    elif segment == "prompt_end":
        where = "at the prompt's end"
    else:
        where = f"in an unknown place ({brk.get('reason') or 'not located'})"
    text = f"prefix broke {where}, token {token:,}"
    reused, expected = as_int(brk.get("reused_tokens")), as_int(brk.get("expected_tokens"))
    if reused is not None and expected is not None:
        text += f"; reused {reused:,} of {expected:,} tokens"
    if excerpts and "previous" in brk and "current" in brk:
        text += f"; was {json.dumps(brk['previous'], ensure_ascii=False)}, now {json.dumps(brk['current'], ensure_ascii=False)}"
    return text


def _last_text(messages: Sequence[JSONObject], role: str) -> str | None:
    """The text of the last ``role`` message: a call built from messages has its prompt (and
    system prompt) there, not in the payload's ``prompt``."""
    for message in reversed(messages):
        if message.get("role") == role and isinstance(message.get("content"), str):
            return str(message["content"])
    return None


def _load_of(rows: Sequence[ProgressRow], origin: dt.datetime) -> dict[str, object]:
    """The call's model load from its ``load`` phase rows (``ModelLoad``): when it began and, once
    over, ended; empty when the model was resident."""
    if not rows:
        return {}
    first, last = rows[0].event, rows[-1].event
    start = _secs(rows[0].created_at, origin)
    done = last.get("state") in ("loaded", "failed")
    return {
        "model": first.get("model"),
        "size_bytes": first.get("size_bytes"),
        "state": last.get("state"),
        "start_s": _round(start),
        "end_s": _round(_secs(rows[-1].created_at, origin)) if done else None,
        "seconds": as_float(last.get("elapsed_s")) if done else None,
    }


def _input_of(
    payload: Mapping[str, object], started_payload: Mapping[str, object], sent: Mapping[str, object]
) -> tuple[list[JSONObject], list[JSONValue], str | None]:
    """``(messages, tools, note)``: the conversation the model got, rebuilt from the step's
    payload (what the host slimmed away read back from its STARTED record) with the node's
    ``metadata.input`` (turns it sent without the host's timestamp stamps) applied; ``note``
    says what was not kept."""
    notes: list[str] = []
    history = payload_value(payload, "messages", started_payload, notes)
    system = payload_value(payload, "system_prompt", started_payload, notes)
    tools = payload_value(payload, "tools", started_payload, notes)
    rewritten = object_at(sent, "messages")
    history_list: list[JSONObject] = []
    if isinstance(history, list):
        for index, message in enumerate(history):
            if not isinstance(message, Mapping):
                continue
            item: JSONObject = {str(k): _json_value(v) for k, v in message.items()}
            if str(index) in rewritten:
                item["content"] = _json_value(rewritten[str(index)])
            history_list.append(item)
    prompt = _prompt_as_sent(payload, started_payload, sent)
    try:
        conversation = assemble_conversation(
            prompt=prompt, messages=history_list or None, system_prompt=system if isinstance(system, str) else None
        )
    except InvalidRequest:
        conversation = []
    return conversation, list(tools) if isinstance(tools, list) else [], "; ".join(notes) or None


def _prompt_as_sent(
    payload: Mapping[str, object], started_payload: Mapping[str, object], sent: Mapping[str, object]
) -> str | None:
    """The prompt the node sent: without the host's stamps when it removed them (``metadata.input``)."""
    if isinstance(sent.get("prompt"), str):
        return str(sent["prompt"])
    return payload_text(payload, "prompt", started_payload)


def _json_value(value: object) -> JSONValue:
    """``value`` when it is plain JSON (what the ledger stores always is), else its text."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return str(value)


SLIM_MARKER_KEY = "$slim"
"""The host's stand-in for a large payload field of a terminal step record: ``{"$slim": {"kind":
"started_payload_field", "field": ..., "step_id": ..., "sha256": ..., "bytes": ...}}``, naming
the STARTED record of the same step, which holds the value."""


def payload_text(payload: Mapping[str, object], name: str, started_payload: Mapping[str, object]) -> str | None:
    """Field ``name`` of a step's effect payload as text (``payload_value``); where the host
    kept no copy, a sentence says so (``prompt not kept by the host (2,715 bytes)``), never the
    marker itself."""
    notes: list[str] = []
    value = payload_value(payload, name, started_payload, notes)
    return notes[0] if notes else _opt_text(value)


def payload_value(
    payload: Mapping[str, object], name: str, started_payload: Mapping[str, object], notes: list[str]
) -> object:
    """Field ``name`` of a step's effect payload. Where the host slimmed it to a ``$slim``
    marker, the value comes from the STARTED record's payload (``started_payload``), checked
    against the marker's sha256; when that is not there, ``None``, and a sentence saying so is
    appended to ``notes``."""
    value = payload.get(name)
    marker = value.get(SLIM_MARKER_KEY) if isinstance(value, Mapping) else None
    if not isinstance(marker, Mapping):
        return value
    field_name = str(marker.get("field") or name)
    kept = started_payload.get(field_name)
    if marker.get("kind") == "started_payload_field" and kept is not None and _sha256_of(kept) == marker.get("sha256"):
        return kept
    size = marker.get("bytes")
    size_text = f" ({size:,} bytes)" if isinstance(size, int) else ""
    notes.append(f"{name.replace('_', ' ')} not kept by the host{size_text}")
    return None


def _sha256_of(value: object) -> str | None:
    """The sha256 the host records for a slimmed value: over its compact JSON, keys in order."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=False)
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _opt_text(value: object) -> str | None:
    return None if value is None else str(value)


def _controls(meta: Mapping[str, object], payload: Mapping[str, object]) -> list[ControlView]:
    recorded = object_at(meta, "controls")
    if recorded:
        names = [k for k in recorded if not k.endswith("_source")]
        return [ControlView(n, control_text(recorded[n]), str(recorded.get(f"{n}_source") or "?")) for n in names]
    params = object_at(payload, "params")
    return [ControlView(n, control_text(params[n]), "requested") for n in ("speculation", "thinking") if n in params]


def control_text(value: object) -> str:
    """A control value as a person reads it: ``off``, ``on``, ``native_mtp(depth=2)``, ``model default``."""
    if value is None:
        return "model default"
    if value is False:
        return "off"
    if value is True:
        return "on"
    if isinstance(value, Mapping):
        mode = value.get("mode") or "native_mtp"
        depth = value.get("num_draft_tokens")
        return f"{mode}(depth={depth})" if depth else str(mode)
    return str(value)


# --------------------------------------------------------------------------------------
# A run as ``runs show`` gives it: the run view with its nodes, events and child runs
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeOutcome:
    """One LLM node of a run as the ledger recorded it (``result`` is the handler's dict;
    ``run_id`` the run it ran in: the root or one of its subflow/agent runs)."""

    node_id: str
    step_id: str
    attempt: int
    result: dict[str, object]
    duration_s: float | None
    run_id: str = ""


def node_outcomes(ledger: Ledger, run_id: str) -> list[NodeOutcome]:
    """The completed LLM nodes of a run, in completion order, read from the ledger alone."""
    out: list[NodeOutcome] = []
    for step in ledger.run_steps(run_id):
        if step.effect_type != "llm_call" or step.status != "completed":
            continue
        result = step.record.get("result")
        if isinstance(result, dict):
            out.append(NodeOutcome(step.node_id, step.step_id, step.attempt, result, step.duration_s, run_id))
    return out


def node_dict(node: NodeOutcome) -> dict[str, object]:
    return {"node_id": node.node_id, "run_id": node.run_id, "result": node.result}


def run_dict(ledger: Ledger, run_id: str, *, events: bool = False, _depth: int = 0) -> dict[str, object]:
    """What ``runs show`` shows, as JSON-safe values: the web inspector's run view (summary,
    error, steps, LLM calls), what the run waits for, its LLM nodes' results, its phase events
    (with ``events``) and its child runs, nested."""
    detail = ledger.get_run(run_id)
    view = run_view(ledger, run_id)
    if detail is None or view is None:
        raise RunNotFound(f"no run {run_id!r} in {ledger.url}", details={"run_id": run_id[:255]})
    out: dict[str, object] = dict(view.as_dict())
    waiting = detail.state.get("waiting")
    out["waiting"] = waiting if detail.status == "waiting" and isinstance(waiting, dict) else None
    out["nodes"] = [node_dict(n) for n in node_outcomes(ledger, run_id)]
    if events:
        out["events"] = [event_dict(row, view.summary.created_at) for row in ledger.node_timeline(run_id)]
    children: list[dict[str, object]] = []
    for child in sorted(
        ledger.list_run_states(parent_run_id=run_id, limit=10_000), key=lambda c: str(c.get("created_at") or "")
    ):
        if _depth >= MAX_NESTING:
            children.append(
                {"run_id": child.get("run_id"), "workflow_id": child.get("workflow_id"), "deeper_than": MAX_NESTING}
            )
            continue
        children.append(run_dict(ledger, str(child["run_id"]), events=events, _depth=_depth + 1))
    out["children"] = children
    if _depth == 0:
        out["tree_calls"] = tree_call_summary(ledger, run_id)
    return out


def tree_call_summary(ledger: Ledger, run_id: str) -> dict[str, object]:
    """The LLM calls of the run and of its child runs (``tree_calls``): totals, and one entry per
    call naming its run."""
    calls = tree_calls(ledger, run_id, max_depth=MAX_NESTING)
    return {
        "calls": len(calls),
        "runs": len({owner for owner, _ in calls}),
        "prompt_tokens": sum(c.prompt_tokens or 0 for _, c in calls),
        "generated_tokens": sum(c.generated_tokens or 0 for _, c in calls),
        "by_call": [
            {
                "run_id": owner,
                "node_id": c.node_id,
                "label": c.label,
                "name": c.name,
                "step_id": c.step_id,
                "attempt": c.attempt,
                "status": c.status,
                "prompt_tokens": c.prompt_tokens,
                "generated_tokens": c.generated_tokens,
            }
            for owner, c in calls
        ],
    }


def event_dict(row: ProgressRow, run_start: dt.datetime) -> dict[str, object]:
    """One phase event: its time since the run started (``t_s``) and its columns."""
    fields = {name: getattr(row, name) for name in row.__dataclass_fields__ if name != "event"}
    return {"t_s": (row.created_at - run_start).total_seconds(), **fields}
