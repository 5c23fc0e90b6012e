"""Read-side queries for inspection and replay. Each takes an open ``Session`` and returns plain
frozen dataclasses, never ORM rows (``Ledger`` wraps them in a read transaction)."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, distinct, func, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from .models import Progress, Run, Step

__all__ = [
    "ProgressRow",
    "RunDetail",
    "RunCursor",
    "RunSummary",
    "StepRow",
    "get_run",
    "list_runs",
    "list_workflows",
    "node_timeline",
    "progress_record",
    "run_cursor",
    "run_records",
    "run_steps",
    "step_record",
]


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One line of ``runs``.

    ``duration_s`` is ``updated_at - created_at`` (up to the last checkpoint); ``node_count``
    counts distinct node ids among the run's step records; ``progress_count`` its progress rows.
    ``prompt_tokens`` / ``generated_tokens`` / ``cached_tokens`` (prompt tokens a prompt cache
    restored) sum, over the run's LLM calls (node, step, attempt), the largest count any of the
    call's progress rows reported (so a call still running counts what it has so far).
    """

    run_id: str
    workflow_id: str
    status: str
    created_at: dt.datetime
    updated_at: dt.datetime
    duration_s: float
    node_count: int
    progress_count: int
    parent_run_id: str | None
    wait_reason: str | None
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class RunCursor:
    """What changes while a run is live: a poller compares two cursors to know whether to re-read."""

    run_id: str
    status: str
    updated_at: dt.datetime
    last_step_seq: int
    last_progress_seq: int


@dataclass(frozen=True, slots=True)
class RunDetail(RunSummary):
    """A run summary plus its provenance, its step count and the saved run-state dict."""

    session_id: str | None
    actor_id: str | None
    step_count: int
    state: dict[str, object]


@dataclass(frozen=True, slots=True)
class StepRow:
    """One step record. ``record`` is the record exactly as appended."""

    seq: int
    step_id: str
    node_id: str
    status: str
    attempt: int
    idempotency_key: str | None
    effect_type: str | None
    started_at: dt.datetime | None
    ended_at: dt.datetime | None
    duration_s: float | None
    error: str | None
    record: dict[str, object]


@dataclass(frozen=True, slots=True)
class ProgressRow:
    """One ``abstract.progress`` row; a key the event did not carry is None. ``event`` is the whole event."""

    seq: int
    run_id: str
    workflow_id: str | None
    node_id: str
    step_id: str | None
    attempt: int | None
    idempotency_key: str
    kind: str | None
    phase: str | None
    prompt_tokens: int | None
    cached_tokens: int | None
    fed_tokens: int | None
    generated_tokens: int | None
    prefill_processed_tokens: int | None
    ttft_s: float | None
    tokens_per_second: float | None
    prefill_tokens_per_second: float | None
    elapsed_s: float | None
    event_index: int | None
    final: bool | None
    finish_reason: str | None
    created_at: dt.datetime
    event: dict[str, object]


def step_record(row: Step) -> dict[str, object]:
    """The step record as appended: ``other_fields`` plus ``effect`` and ``result``."""
    record = dict(row.other_fields)
    record["effect"] = row.effect
    record["result"] = row.result
    return record


def _seconds(start: dt.datetime | None, end: dt.datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return (end - start).total_seconds()


def _counts(
    session: Session, column: ColumnElement[int], run_column: InstrumentedAttribute[str], run_ids: Sequence[str]
) -> dict[str, int]:
    if not run_ids:
        return {}
    stmt = select(run_column, column).where(run_column.in_(run_ids)).group_by(run_column)
    return {run_id: int(count) for run_id, count in session.execute(stmt)}


def _token_sums(session: Session, run_ids: Sequence[str]) -> dict[str, tuple[int, int, int]]:
    if not run_ids:
        return {}
    per_call = (
        select(
            Progress.run_id.label("run_id"),
            func.max(Progress.prompt_tokens).label("prompt"),
            func.max(Progress.generated_tokens).label("generated"),
            func.max(Progress.cached_tokens).label("cached"),
        )
        .where(Progress.run_id.in_(run_ids))
        .group_by(Progress.run_id, Progress.node_id, Progress.step_id, Progress.attempt)
        .subquery()
    )
    stmt = select(
        per_call.c.run_id, func.sum(per_call.c.prompt), func.sum(per_call.c.generated), func.sum(per_call.c.cached)
    ).group_by(per_call.c.run_id)
    return {
        run_id: (int(prompt or 0), int(generated or 0), int(cached or 0))
        for run_id, prompt, generated, cached in session.execute(stmt)
    }


def _summary_fields(
    run: Run, node_counts: dict[str, int], progress_counts: dict[str, int], tokens: dict[str, tuple[int, int, int]]
) -> dict[str, Any]:
    """The keyword arguments of ``RunSummary`` (and the summary part of ``RunDetail``)."""
    prompt_tokens, generated_tokens, cached_tokens = tokens.get(run.run_id, (0, 0, 0))
    return {
        "run_id": run.run_id,
        "workflow_id": run.workflow_id,
        "status": run.status,
        "created_at": run.created_at,
        "updated_at": run.updated_at,
        "duration_s": (run.updated_at - run.created_at).total_seconds(),
        "node_count": node_counts.get(run.run_id, 0),
        "progress_count": progress_counts.get(run.run_id, 0),
        "parent_run_id": run.parent_run_id,
        "wait_reason": run.wait_reason,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated_tokens,
        "cached_tokens": cached_tokens,
    }


def list_runs(
    session: Session,
    *,
    limit: int = 50,
    status: str | None = None,
    workflow_id: str | None = None,
    session_id: str | None = None,
    created_after: dt.datetime | None = None,
    roots_only: bool = False,
    parent_run_ids: Sequence[str] | None = None,
) -> list[RunSummary]:
    """The ``limit`` most recently updated runs matching every given filter
    (``created_after``: created at or after that instant; ``roots_only``: runs without a parent
    run; ``parent_run_ids``: child runs of those runs)."""
    stmt = select(Run).order_by(Run.updated_at.desc(), Run.run_id).limit(max(0, int(limit)))
    if roots_only:
        stmt = stmt.where(Run.parent_run_id.is_(None))
    if parent_run_ids is not None:
        stmt = stmt.where(Run.parent_run_id.in_(list(parent_run_ids)))
    if status is not None:
        stmt = stmt.where(Run.status == str(getattr(status, "value", status)))
    if workflow_id is not None:
        stmt = stmt.where(Run.workflow_id == workflow_id)
    if session_id is not None:
        stmt = stmt.where(Run.session_id == session_id)
    if created_after is not None:
        stmt = stmt.where(Run.created_at >= created_after)
    runs = list(session.scalars(stmt))
    run_ids = [run.run_id for run in runs]
    node_counts = _counts(session, func.count(distinct(Step.node_id)), Step.run_id, run_ids)
    progress_counts = _counts(session, func.count(Progress.id), Progress.run_id, run_ids)
    tokens = _token_sums(session, run_ids)
    return [RunSummary(**_summary_fields(run, node_counts, progress_counts, tokens)) for run in runs]


def list_workflows(session: Session) -> list[str]:
    """Every workflow id with at least one run, sorted."""
    return sorted(session.scalars(select(Run.workflow_id).distinct()))


def run_cursor(session: Session, run_id: str) -> RunCursor | None:
    """The run's status, last checkpoint time and last step / progress ``seq`` (0 when none)."""
    run = session.execute(select(Run.status, Run.updated_at).where(Run.run_id == run_id)).first()
    if run is None:
        return None
    last_step = session.scalar(select(func.max(Step.seq)).where(Step.run_id == run_id))
    last_progress = session.scalar(select(func.max(Progress.seq)).where(Progress.run_id == run_id))
    return RunCursor(run_id, run.status, run.updated_at, int(last_step or 0), int(last_progress or 0))


def get_run(session: Session, run_id: str) -> RunDetail | None:
    run = session.get(Run, run_id)
    if run is None:
        return None
    node_counts = _counts(session, func.count(distinct(Step.node_id)), Step.run_id, [run_id])
    progress_counts = _counts(session, func.count(Progress.id), Progress.run_id, [run_id])
    step_counts = _counts(session, func.count(Step.id), Step.run_id, [run_id])
    return RunDetail(
        **_summary_fields(run, node_counts, progress_counts, _token_sums(session, [run_id])),
        session_id=run.session_id,
        actor_id=run.actor_id,
        step_count=step_counts.get(run_id, 0),
        state=dict(run.run_json),
    )


def run_steps(session: Session, run_id: str) -> list[StepRow]:
    """The run's step records in append order."""
    out: list[StepRow] = []
    for row in session.scalars(select(Step).where(Step.run_id == run_id).order_by(Step.seq)):
        effect = row.effect
        effect_type = effect.get("type") if isinstance(effect, dict) else None
        record = step_record(row)
        out.append(
            StepRow(
                seq=row.seq,
                step_id=row.step_id,
                node_id=row.node_id,
                status=row.status,
                attempt=row.attempt,
                idempotency_key=row.idempotency_key,
                effect_type=effect_type if isinstance(effect_type, str) else None,
                started_at=row.started_at,
                ended_at=row.ended_at,
                duration_s=_seconds(row.started_at, row.ended_at),
                error=row.error,
                record=record,
            )
        )
    return out


_PROGRESS_FIELDS = tuple(name for name in ProgressRow.__dataclass_fields__ if name != "event")


def node_timeline(
    session: Session, run_id: str, node_id: str | None = None, *, after_seq: int = 0
) -> list[ProgressRow]:
    """The run's progress rows (of one node, if given) with ``seq > after_seq``, ordered by ``seq``.

    ``seq`` is allocated per run in commit order on every dialect, so a tail that remembers the
    last ``seq`` it saw misses nothing.
    """
    stmt = select(Progress).where(Progress.run_id == run_id, Progress.seq > int(after_seq))
    if node_id is not None:
        stmt = stmt.where(Progress.node_id == node_id)
    stmt = stmt.order_by(Progress.seq)
    return [
        ProgressRow(**{name: getattr(row, name) for name in _PROGRESS_FIELDS}, event=dict(row.event))
        for row in session.scalars(stmt)
    ]


# --------------------------------------------------------------------------------------
# The run's ledger as AbstractRuntime records
# --------------------------------------------------------------------------------------

PROGRESS_EVENT_NAME = "abstract.progress"
_RECORD_ID_NAMESPACE = uuid.UUID("6f1c1a52-31f4-4d0e-9a55-6b3c9a6e2d10")


@dataclass(frozen=True, slots=True)
class _Anchor:
    """What a progress record copies from the STARTED record of its LLM step."""

    idempotency_key: str | None
    actor_id: str | None
    session_id: str | None


def progress_record(row: Progress, anchor: _Anchor | None = None) -> dict[str, object]:
    """A progress row as the record AbstractRuntime appends for ``abstract.progress`` itself:
    a completed ``emit_event`` step whose payload carries the run / workflow / node / step /
    attempt identity and the LLM step's idempotency key, then the event; idempotency key
    ``system:progress:<step_id>:<12 hex>``. The record's own ``step_id`` is derived from that key
    (stable across reads). Identity values the row does not know are absent."""
    identity: dict[str, object] = {
        "run_id": row.run_id,
        "workflow_id": row.workflow_id,
        "node_id": row.node_id,
        "step_id": row.step_id,
        "idempotency_key": anchor.idempotency_key if anchor is not None else None,
        "attempt": row.attempt,
    }
    payload = {k: v for k, v in identity.items() if v is not None}
    payload.update(row.event)
    at = row.created_at.isoformat()
    return {
        "run_id": row.run_id,
        "step_id": str(uuid.uuid5(_RECORD_ID_NAMESPACE, f"{row.run_id}:{row.idempotency_key}")),
        "node_id": row.node_id,
        "status": "completed",
        "effect": {
            "type": "emit_event",
            "payload": {"name": PROGRESS_EVENT_NAME, "scope": "run", "payload": dict(payload)},
            "result_key": None,
        },
        "result": {"emitted": True, "name": PROGRESS_EVENT_NAME, "payload": dict(payload)},
        "error": None,
        "started_at": at,
        "ended_at": at,
        "actor_id": anchor.actor_id if anchor is not None else None,
        "session_id": anchor.session_id if anchor is not None else None,
        "attempt": 1,
        "idempotency_key": row.idempotency_key,
        "prev_hash": None,
        "record_hash": None,
        "signature": None,
    }


def _anchors(session: Session, run_id: str, step_ids: Iterable[str | None]) -> dict[str, _Anchor]:
    wanted = sorted({s for s in step_ids if s})
    if not wanted:
        return {}
    stmt = select(Step.step_id, Step.idempotency_key, Step.actor_id, Step.session_id).where(
        Step.run_id == run_id, Step.status == "started", Step.step_id.in_(wanted)
    )
    return {step_id: _Anchor(key, actor, sess) for step_id, key, actor, sess in session.execute(stmt)}


def render_progress(session: Session, rows: Sequence[Progress]) -> list[dict[str, object]]:
    """Progress rows (of any runs) as host records, in the given order."""
    anchors: dict[tuple[str, str], _Anchor] = {}
    for run_id in sorted({row.run_id for row in rows}):
        found = _anchors(session, run_id, (row.step_id for row in rows if row.run_id == run_id))
        anchors.update({(run_id, step_id): anchor for step_id, anchor in found.items()})
    return [progress_record(row, anchors.get((row.run_id, row.step_id or ""))) for row in rows]


def run_records(
    session: Session, run_id: str, *, after: int = 0, limit: int | None = None
) -> list[tuple[int, dict[str, object]]]:
    """``(seq, record)`` of the run's ledger after ``after``, in order: step records as appended
    and progress rows as host ``abstract.progress`` records (they share one sequence)."""
    steps_stmt = select(Step).where(Step.run_id == run_id, Step.seq > after).order_by(Step.seq)
    progress_stmt = select(Progress).where(Progress.run_id == run_id, Progress.seq > after).order_by(Progress.seq)
    if limit is not None:
        steps_stmt = steps_stmt.limit(limit)
        progress_stmt = progress_stmt.limit(limit)
    steps = list(session.scalars(steps_stmt))
    progress = list(session.scalars(progress_stmt))
    merged: list[tuple[int, Step | Progress]] = sorted(
        [(row.seq, row) for row in steps] + [(row.seq, row) for row in progress], key=lambda item: item[0]
    )
    if limit is not None:
        merged = merged[:limit]
    used = [row for _, row in merged if isinstance(row, Progress)]
    anchors = _anchors(session, run_id, (row.step_id for row in used))
    return [
        (seq, step_record(row) if isinstance(row, Step) else progress_record(row, anchors.get(row.step_id or "")))
        for seq, row in merged
    ]


def last_record(session: Session, run_id: str) -> dict[str, object] | None:
    """The record with the highest seq of the run (a step record or a progress record)."""
    step = session.scalar(select(Step).where(Step.run_id == run_id).order_by(Step.seq.desc()).limit(1))
    prog = session.scalar(select(Progress).where(Progress.run_id == run_id).order_by(Progress.seq.desc()).limit(1))
    if prog is not None and (step is None or prog.seq > step.seq):
        return progress_record(prog, _anchors(session, run_id, [prog.step_id]).get(prog.step_id or ""))
    return None if step is None else step_record(step)
