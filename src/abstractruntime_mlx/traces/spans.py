"""OpenTelemetry spans of recorded runs, built from the ledger alone.

    spans = tree_spans(ledger, run_id)   # the run, its nodes, calls and child runs

The tree of one root run, in one trace:

    run <workflow>                    the run: created → last checkpoint
    └── node <label>                  one visit of a node: its first step's start → its last step's end
        ├── chat <model>              one LLM call (GenAI semantic conventions)
        │   ├── load                  the model load the call waited for (when it did)
        │   ├── queue                 waiting for a batch slot (when the result reports it)
        │   ├── prefill               call start (after the queue) → first token
        │   └── decode                first token → complete
        └── run <child workflow>      a subflow or agent run the node started, nested the same way

Times come from the ledger: runs' and steps' recorded times, and the calls' phase events
(``inspection.CallView.segments``). Ids are derived from run ids: the trace id from the root
run's id, each span id from its run id and what it is (a node visit by its first step id, a
call by its step id and attempt), so exporting a run again sends the same spans.
"""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import RunNotFound
from ..inspection import (
    AGENT_WORKFLOW_PREFIX,
    MAX_NESTING,
    TERMINAL_STEP_STATUSES,
    CallView,
    child_run_steps,
    child_runs,
    descendants,
    node_labels,
    run_flow_document,
    run_view,
)
from ..json_values import JSONObject, JSONValue, as_bool, as_float, as_int, as_str, object_at
from ..ledger import Ledger, StepRow
from ..run_graph import display_labels

__all__ = [
    "CONTENT_ATTRIBUTES",
    "PROGRESS_EVENT",
    "SEMCONV_OPT_IN",
    "AttributeValue",
    "SpanEvent",
    "SpanKind",
    "SpanStatus",
    "TraceSpan",
    "node_visits",
    "root_run_id",
    "run_spans",
    "span_id_of",
    "trace_id_of",
    "tree_spans",
]

AttributeValue = str | int | float | bool | list[str]

SEMCONV_OPT_IN = "gen_ai_latest_experimental"
"""The GenAI semantic conventions the attributes follow: the latest experimental ones (what
``OTEL_SEMCONV_STABILITY_OPT_IN`` names so), v1.37.0 and later: ``gen_ai.provider.name`` (not the
deprecated ``gen_ai.system``), ``gen_ai.usage.cache_read.input_tokens``,
``gen_ai.response.time_to_first_chunk``, content attributes opt-in."""
GEN_AI_OPERATION = "chat"
DEFAULT_PROVIDER = "mlx"
CONTENT_ATTRIBUTES: tuple[str, ...] = ("gen_ai.system_instructions", "gen_ai.input.messages", "gen_ai.output.messages")
"""The attributes that hold prompts and answers: sent only when content is asked for (the
conventions make them opt-in)."""
PROGRESS_EVENT = "abstract.progress"
"""The name of a span event made from a call's phase event (the ledger's ``abstract.progress`` row)."""
SEGMENT_NAMES: Mapping[str, str] = {"load": "load", "queue": "queue", "prefill": "prefill", "generate": "decode"}
"""``CallView.segments`` phase -> child span name."""


class SpanKind(enum.IntEnum):
    """OTLP ``Span.SpanKind`` values."""

    INTERNAL = 1
    SERVER = 2
    CLIENT = 3


class SpanStatus(enum.IntEnum):
    """OTLP ``Status.StatusCode`` values."""

    UNSET = 0
    OK = 1
    ERROR = 2


@dataclass(frozen=True, slots=True)
class SpanEvent:
    """One point in a span's time (OTLP ``Span.Event``)."""

    name: str
    time_ns: int
    attributes: dict[str, AttributeValue] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TraceSpan:
    """One span, ready to encode as OTLP. Ids are lowercase hex (32 and 16 digits)."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_ns: int
    end_ns: int
    kind: SpanKind = SpanKind.INTERNAL
    attributes: dict[str, AttributeValue] = field(default_factory=dict)
    status: SpanStatus = SpanStatus.UNSET
    status_message: str | None = None
    finished: bool = True
    """What it stands for has ended (a run still running, a call still generating: False)."""
    events: tuple[SpanEvent, ...] = ()


def trace_id_of(root_run_id: str) -> str:
    return hashlib.sha256(f"trace:{root_run_id}".encode()).hexdigest()[:32]


def span_id_of(run_id: str, part: str) -> str:
    """The span id of ``part`` of ``run_id``: ``run``, ``node:<step id>``, ``call:<step id>:<attempt>``, ..."""
    return hashlib.sha256(f"span:{run_id}:{part}".encode()).hexdigest()[:16]


def _ns(when: dt.datetime) -> int:
    return (when - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1) * 1000


def root_run_id(ledger: Ledger, run_id: str) -> str:
    """The root of the run's tree (itself when it has no parent run)."""
    current = run_id
    for _ in range(MAX_NESTING + 1):
        detail = ledger.get_run(current)
        if detail is None or detail.parent_run_id is None:
            return current
        current = detail.parent_run_id
    return current


# --------------------------------------------------------------------------------------
# Node visits
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Visit:
    node_id: str
    first_step_id: str
    step_ids: set[str]
    start: dt.datetime
    end: dt.datetime | None
    status: str
    effects: list[str]


def node_visits(steps: Sequence[StepRow]) -> list[_Visit]:
    """The run's steps (in append order) grouped into node visits: the records of one step id;
    a step of a node that waits (a subflow, an answer) joins the visit it continues; a step of
    the node whose step was recorded just before it (a node that runs several steps, such as
    ``on_flow_end`` and its ``emit_event``) joins that visit. A node reached again after another
    node ran is a new visit."""
    visits: list[_Visit] = []
    by_step: dict[str, _Visit] = {}
    waiting: dict[str, _Visit] = {}
    previous: _Visit | None = None
    for step in steps:
        visit = by_step.get(step.step_id) or waiting.pop(step.node_id, None)
        if visit is None and previous is not None and previous.node_id == step.node_id:
            visit = previous  # the node's next step (``on_flow_end`` then its ``emit_event``): the same visit
        when = step.started_at or step.ended_at
        if visit is None:
            if when is None:
                continue
            visit = _Visit(step.node_id, step.step_id, set(), when, None, step.status, [])
            visits.append(visit)
        visit.step_ids.add(step.step_id)
        by_step[step.step_id] = visit
        visit.status = step.status
        if step.effect_type and step.effect_type not in visit.effects:
            visit.effects.append(step.effect_type)
        if when is not None and when < visit.start:
            visit.start = when
        if step.ended_at is not None and (visit.end is None or step.ended_at > visit.end):
            visit.end = step.ended_at
        if step.status == "waiting":
            waiting[step.node_id] = visit
        previous = visit
    return visits


# --------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------


def tree_spans(ledger: Ledger, run_id: str, *, content: bool = False) -> list[TraceSpan]:
    """The spans of the run and of every run below it (``run_spans`` each), parents first.
    Raises ``RunNotFound`` for an unknown run."""
    spans = run_spans(ledger, run_id, content=content)
    for child in descendants(run_id, child_runs(ledger, [run_id])):
        spans.extend(run_spans(ledger, child.run_id, content=content))
    return spans


def run_spans(ledger: Ledger, run_id: str, *, content: bool = False) -> list[TraceSpan]:
    """The run's own spans: the run, its node visits, its calls and their phases (child runs
    are theirs). ``content``: the calls' prompts and answers too (``CONTENT_ATTRIBUTES``).
    Raises ``RunNotFound`` for an unknown run."""
    view = run_view(ledger, run_id, tree=False)
    if view is None:
        raise RunNotFound(f"no run {run_id!r} in {ledger.url}", details={"run_id": run_id[:255]})
    summary = view.summary
    detail = ledger.get_run(run_id)
    assert detail is not None
    trace_id = trace_id_of(root_run_id(ledger, run_id))
    origin = summary.created_at
    run_span_id = span_id_of(run_id, "run")
    session_id = detail.session_id

    calls = [c for c in view.calls if c.start_s is not None or c.segments()]
    visits = node_visits(view.steps)
    visit_of_step = {step_id: visit for visit in visits for step_id in visit.step_ids}
    last_visit_of_node = {visit.node_id: visit for visit in visits}
    flow = run_flow_document(ledger, detail)
    labels = {
        **(display_labels(flow) if flow is not None else node_labels(detail.state)),
        **{c.node_id: c.label for c in view.calls},
    }

    out: list[TraceSpan] = []
    call_spans: list[TraceSpan] = []
    widen: dict[str, tuple[int, int]] = {}
    for call in calls:
        visit = visit_of_step.get(call.step_id or "") or last_visit_of_node.get(call.node_id)
        parent = span_id_of(run_id, f"node:{visit.first_step_id}") if visit is not None else run_span_id
        spans = _call_spans(
            call, trace_id=trace_id, run_id=run_id, parent=parent, origin=origin, session_id=session_id, content=content
        )
        if spans:
            call_spans.extend(spans)
            low, high = widen.get(parent, (spans[0].start_ns, spans[0].end_ns))
            widen[parent] = (min(low, spans[0].start_ns), max(high, spans[0].end_ns))

    run_end_ns = _ns(summary.updated_at)
    node_spans: list[TraceSpan] = []
    for visit in visits:
        span_id = span_id_of(run_id, f"node:{visit.first_step_id}")
        start_ns = _ns(visit.start)
        end_ns = _ns(visit.end) if visit.end is not None else max(start_ns, run_end_ns)
        low, high = widen.get(span_id, (start_ns, end_ns))
        start_ns, end_ns = min(start_ns, low), max(end_ns, high)
        failed = visit.status == "failed"
        node_spans.append(
            TraceSpan(
                trace_id=trace_id,
                span_id=span_id,
                parent_span_id=run_span_id,
                name=f"node {labels.get(visit.node_id, visit.node_id)}",
                start_ns=start_ns,
                end_ns=end_ns,
                attributes=_clean(
                    {
                        "abstractruntime.run.id": run_id,
                        "abstractruntime.node.id": visit.node_id,
                        "abstractruntime.node.label": labels.get(visit.node_id),
                        "abstractruntime.step.id": visit.first_step_id,
                        "abstractruntime.step.status": visit.status,
                        "abstractruntime.step.effects": list(visit.effects) or None,
                    }
                ),
                status=SpanStatus.ERROR if failed else SpanStatus.UNSET,
                status_message=_step_error(view.steps, visit) if failed else None,
                finished=visit.status in TERMINAL_STEP_STATUSES,
            )
        )

    run_start_ns = _ns(origin)
    run_end_ns = max([run_end_ns, *(s.end_ns for s in node_spans), *(s.end_ns for s in call_spans)])
    run_start_ns = min([run_start_ns, *(s.start_ns for s in node_spans), *(s.start_ns for s in call_spans)])
    agent = summary.workflow_id.startswith(AGENT_WORKFLOW_PREFIX)
    failed = summary.status == "failed"
    attributes: dict[str, AttributeValue | None] = {
        "abstractruntime.run.id": run_id,
        "abstractruntime.workflow.id": summary.workflow_id,
        "abstractruntime.run.status": summary.status,
        "abstractruntime.run.parent_id": summary.parent_run_id,
        "session.id": session_id,
        "gen_ai.conversation.id": session_id,
    }
    if agent:
        attributes["gen_ai.operation.name"] = "invoke_agent"
    out.append(
        TraceSpan(
            trace_id=trace_id,
            span_id=run_span_id,
            parent_span_id=_parent_span(ledger, summary.parent_run_id, run_id),
            name=f"{'invoke_agent' if agent else 'run'} {summary.workflow_id}",
            start_ns=run_start_ns,
            end_ns=run_end_ns,
            attributes=_clean(attributes),
            status=SpanStatus.ERROR if failed else SpanStatus.UNSET,
            status_message=view.error if failed else None,
            finished=summary.status in ("completed", "failed", "cancelled"),
        )
    )
    return out + node_spans + call_spans


def _parent_span(ledger: Ledger, parent_run_id: str | None, run_id: str) -> str | None:
    """The span a child run hangs under: the visit of the parent's node that started it (else
    the parent run's own span); None for a root run."""
    if parent_run_id is None:
        return None
    steps = ledger.run_steps(parent_run_id)
    started_by = child_run_steps(steps).get(run_id)
    if started_by is not None:
        for visit in node_visits(steps):
            if started_by.step_id in visit.step_ids:
                return span_id_of(parent_run_id, f"node:{visit.first_step_id}")
    return span_id_of(parent_run_id, "run")


def _step_error(steps: Sequence[StepRow], visit: _Visit) -> str | None:
    errors = [s.error for s in steps if s.step_id in visit.step_ids and s.error]
    return errors[-1] if errors else None


def _call_spans(
    call: CallView,
    *,
    trace_id: str,
    run_id: str,
    parent: str,
    origin: dt.datetime,
    session_id: str | None,
    content: bool,
) -> list[TraceSpan]:
    """The call's span and its phase spans (``load``, ``queue``, ``prefill``, ``decode``; the
    last two carry the call's phase events as ``abstract.progress`` span events)."""
    segments = call.segments()
    if not segments:
        return []
    origin_ns = _ns(origin)

    def at(seconds: float) -> int:
        return origin_ns + round(seconds * 1e9)

    start_ns = at(segments[0][1])
    end_ns = max(at(max(b for _, _, b in segments)), start_ns)
    span_id = span_id_of(run_id, f"call:{call.step_id or call.node_id}:{call.attempt}")
    # Its last phase event comes before its terminal record (the route, the model): ended only with the record.
    finished = call.recorded
    failed = call.status == "failed"
    remote = call.client.get("kind") == "remote"
    engine = [(phase, a) for phase, a, _ in segments if phase != "load"]
    following = {phase: nxt for (phase, _), (_, nxt) in zip(engine, engine[1:])}  # phase -> the next one's start
    children = [
        TraceSpan(
            trace_id=trace_id,
            span_id=span_id_of(run_id, f"{phase}:{call.step_id or call.node_id}:{call.attempt}"),
            parent_span_id=span_id,
            name=SEGMENT_NAMES.get(phase, phase),
            start_ns=at(a),
            end_ns=max(at(b), at(a)),
            attributes=_clean(_phase_attributes(phase, call)),
            finished=finished or phase != segments[-1][0],
            events=tuple(_progress_events(call, at, a, following.get(phase)) if phase != "load" else ()),
        )
        for phase, a, b in segments
    ]
    request_model = _request_model(call)
    span = TraceSpan(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent,
        name=f"{GEN_AI_OPERATION} {request_model}" if request_model else GEN_AI_OPERATION,
        start_ns=start_ns,
        end_ns=end_ns,
        kind=SpanKind.CLIENT if remote else SpanKind.INTERNAL,
        attributes=_clean(_call_attributes(call, request_model, run_id=run_id, session_id=session_id, content=content)),
        status=SpanStatus.ERROR if failed else SpanStatus.UNSET,
        status_message=call.error if failed else None,
        finished=finished,
    )
    return [span, *children]


def _request_model(call: CallView) -> str | None:
    asked = object_at(call.route, "asked")
    return as_str(asked.get("model")) or call.model


def _call_attributes(
    call: CallView, request_model: str | None, *, run_id: str, session_id: str | None, content: bool
) -> dict[str, AttributeValue | None]:
    served = object_at(call.route, "served")
    provider = as_str(served.get("provider")) or DEFAULT_PROVIDER
    params = call.request_params
    out: dict[str, AttributeValue | None] = {
        "gen_ai.operation.name": GEN_AI_OPERATION,
        "gen_ai.provider.name": provider,
        "gen_ai.request.model": request_model,
        "gen_ai.response.model": call.model,
        "gen_ai.request.max_tokens": as_int(params.get("max_output_tokens")) or as_int(params.get("max_tokens")),
        "gen_ai.request.temperature": as_float(params.get("temperature")),
        "gen_ai.request.top_p": as_float(params.get("top_p")),
        "gen_ai.request.seed": as_int(params.get("seed")),
        "gen_ai.usage.input_tokens": call.prompt_tokens,
        "gen_ai.usage.output_tokens": call.generated_tokens,
        "gen_ai.usage.cache_read.input_tokens": call.cached_tokens,
        "gen_ai.response.finish_reasons": [call.finish_reason] if call.finish_reason else None,
        "gen_ai.response.time_to_first_chunk": call.ttft_s,
        "gen_ai.server.time_to_first_token": call.ttft_s,
        "gen_ai.request.stream": as_bool(call.http.get("stream")),
        "gen_ai.conversation.id": session_id,
        "http.route": as_str(call.http.get("route")),
        "http.request.method": as_str(call.http.get("method")),
        "abstractruntime.run.id": run_id,
        "abstractruntime.node.id": call.node_id,
        "abstractruntime.step.id": call.step_id,
        "abstractruntime.call.attempt": call.attempt,
        "abstractruntime.call.status": call.status,
        "abstractruntime.call.lane": call.lane,
        "abstractruntime.call.tokens_per_second": call.tokens_per_second,
        "abstractruntime.route.rule": as_str(call.route.get("rule")),
        "error.type": _error_type(call.error) if call.status == "failed" else None,
    }
    drafted, accepted = as_int(call.speculation.get("drafted_tokens")), as_int(call.speculation.get("accepted_tokens"))
    out["abstractruntime.speculation.drafted_tokens"] = drafted
    out["abstractruntime.speculation.accepted_tokens"] = accepted
    if content:
        out["gen_ai.system_instructions"] = _json_text(_system_parts(call.messages))
        out["gen_ai.input.messages"] = _json_text(_input_messages(call.messages))
        out["gen_ai.output.messages"] = _json_text(_output_messages(call))
    return out


def _progress_events(
    call: CallView, at: Callable[[float], int], start_s: float, next_start_s: float | None
) -> list[SpanEvent]:
    """The call's phase events from ``start_s`` until the next phase span starts, as span events:
    the phase, how far it was (``fraction``, 0..1: prompt tokens in the KV cache over the prompt's
    in prefill; generated tokens over ``max_tokens`` after), the token counts and the rate. The
    prefill start event comes before the call is admitted: on the ``queue`` span when there is one."""
    max_tokens = as_int(call.request_params.get("max_output_tokens")) or as_int(call.request_params.get("max_tokens"))
    events: list[SpanEvent] = []
    for sample in call.samples:
        if sample.t < start_s or (next_start_s is not None and sample.t >= next_start_s):
            continue
        if sample.phase == "prefill":
            done, total = sample.prefill_processed_tokens, sample.prompt_tokens
            rate = sample.prefill_tokens_per_second
        else:
            done, total = sample.generated_tokens, max_tokens
            rate = sample.tokens_per_second
        fraction = round(min(done / total, 1.0), 6) if done is not None and total else None
        if sample.phase == "complete":
            fraction = 1.0
        attributes: dict[str, AttributeValue | None] = {
            "abstractruntime.progress.phase": sample.phase,
            "abstractruntime.progress.fraction": fraction,
            "abstractruntime.progress.prompt_tokens": sample.prompt_tokens,
            "abstractruntime.progress.cached_tokens": sample.cached_tokens,
            "abstractruntime.progress.prefill_processed_tokens": sample.prefill_processed_tokens,
            "abstractruntime.progress.generated_tokens": sample.generated_tokens,
            "abstractruntime.progress.tokens_per_second": rate,
            "abstractruntime.progress.ttft_s": sample.ttft_s if sample.phase != "prefill" else None,
        }
        events.append(SpanEvent(PROGRESS_EVENT, at(sample.t), _clean(attributes)))
    return events


def _phase_attributes(phase: str, call: CallView) -> dict[str, AttributeValue | None]:
    if phase == "prefill":
        return {
            "abstractruntime.prefill.prompt_tokens": call.prompt_tokens,
            "abstractruntime.prefill.cached_tokens": call.cached_tokens,
            "abstractruntime.prefill.tokens_per_second": call.prefill_tokens_per_second,
        }
    if phase == "generate":
        return {
            "abstractruntime.decode.generated_tokens": call.generated_tokens,
            "abstractruntime.decode.tokens_per_second": call.tokens_per_second,
        }
    if phase == "load":
        return {
            "abstractruntime.load.model": as_str(call.load.get("model")),
            "abstractruntime.load.size_bytes": as_int(call.load.get("size_bytes")),
            "abstractruntime.load.state": as_str(call.load.get("state")),
        }
    if phase == "queue":
        return {"abstractruntime.queue.seconds": as_float(call.execution.get("queue_s"))}
    return {}


def _error_type(error: str | None) -> str:
    """The stable code of a recorded error (``[code] message``), else ``error``."""
    if error and error.startswith("[") and "]" in error:
        return error[1 : error.index("]")]
    return "error"


# -- messages in the GenAI conventions' JSON shape (role + parts) -------------------------


def _text_parts(content: object) -> list[JSONValue]:
    if isinstance(content, str):
        return [{"type": "text", "content": content}] if content else []
    if isinstance(content, list):  # content parts: keep the text ones
        texts = [as_str(part.get("text")) if isinstance(part, Mapping) else None for part in content]
        return [{"type": "text", "content": t} for t in texts if t]
    return []


def _tool_call_parts(tool_calls: object) -> list[JSONValue]:
    parts: list[JSONValue] = []
    for raw in tool_calls if isinstance(tool_calls, list) else []:
        if not isinstance(raw, Mapping):
            continue
        function = object_at(raw, "function")
        name = as_str(raw.get("name")) or as_str(function.get("name"))
        arguments = raw.get("arguments", function.get("arguments"))
        part: JSONObject = {"type": "tool_call", "name": name or ""}
        if as_str(raw.get("id")):
            part["id"] = as_str(raw.get("id"))
        if isinstance(arguments, str):
            try:
                part["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                part["arguments"] = arguments
        elif arguments is not None:
            part["arguments"] = _plain(arguments)
        parts.append(part)
    return parts


def _plain(value: object) -> JSONValue:
    return json.loads(json.dumps(value, default=str))  # type: ignore[no-any-return]


def _system_parts(messages: Sequence[JSONObject]) -> list[JSONValue]:
    parts: list[JSONValue] = []
    for message in messages:
        if message.get("role") in ("system", "developer"):
            parts.extend(_text_parts(message.get("content")))
    return parts


def _input_messages(messages: Sequence[JSONObject]) -> list[JSONValue]:
    out: list[JSONValue] = []
    for message in messages:
        role = as_str(message.get("role")) or "user"
        if role in ("system", "developer"):
            continue
        if role == "tool":
            part: JSONObject = {"type": "tool_call_response", "response": _plain(message.get("content"))}
            if as_str(message.get("tool_call_id")):
                part["id"] = as_str(message.get("tool_call_id"))
            out.append({"role": "tool", "parts": [part]})
            continue
        parts = _text_parts(message.get("content")) + _tool_call_parts(message.get("tool_calls"))
        out.append({"role": role, "parts": parts})
    return out


def _output_messages(call: CallView) -> list[JSONValue]:
    if not call.recorded or call.status != "completed":
        return []
    parts = _text_parts(call.response) + _tool_call_parts(call.tool_calls)
    message: JSONObject = {"role": "assistant", "parts": parts}
    if call.finish_reason:
        message["finish_reason"] = call.finish_reason
    return [message]


def _json_text(value: list[JSONValue]) -> str | None:
    return json.dumps(value, ensure_ascii=False) if value else None


def _clean(attributes: Mapping[str, AttributeValue | None]) -> dict[str, AttributeValue]:
    """The attributes with a known value (absent, not zero, when not known)."""
    return {k: v for k, v in attributes.items() if v is not None}
