"""AbstractRuntime ``RunStore`` / ``LedgerStore`` adapters over our SQLAlchemy ``Ledger``.

    ledger = Ledger("sqlite:///runs.sqlite")
    Runtime(run_store=LedgerRunStore(ledger), ledger_store=LedgerStepStore(ledger), ...)

``LedgerRunStore``: ``save`` / ``load`` / ``create_if_absent`` (first creation wins, identity
checked with AbstractRuntime's ``verify_run_identity``) / ``list_runs`` / ``list_children`` /
``list_due_wait_until``: with ``list_runs`` it makes the store a ``QueryableRunStore``, which
the host requires for ``emit_event`` (finding the runs that wait for an event) and for its
``Scheduler`` (timers).
``LedgerStepStore``: ``append`` (append-only; a retried append of the same record is stored
once) / ``list`` (append order, phase events included as the host's ``abstract.progress``
records) / ``list_after`` (cursor paging) / ``subscribe`` (observers, as
``ObservableLedgerStore`` offers) / ``find_completed_result`` (an indexed point query) /
``last_record``. The run state and step records are stored as the dicts AbstractRuntime
serialises them to, so a stored run round-trips exactly.
"""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Callable, Mapping

from abstractruntime.core.models import RunState, RunStatus, StepRecord, WaitReason, WaitState
from abstractruntime.core.run_attribution import automation_index_fields
from abstractruntime.core.run_identity import verify_run_identity
from abstractruntime.storage.base import LedgerStore, RunStore
from abstractruntime.storage.serialize import runstate_to_dict, steprecord_to_dict

from ...json_values import object_at
from ...ledger import Ledger
from ...ledger.store import parse_timestamp

__all__ = ["LedgerRunStore", "LedgerStepStore", "run_from_dict"]


def run_from_dict(data: Mapping[str, object]) -> RunState:
    """A ``RunState`` from its stored dict (the inverse of ``runstate_to_dict``)."""
    raw_waiting = data.get("waiting")
    waiting: WaitState | None = None
    if isinstance(raw_waiting, dict):
        reason = raw_waiting.get("reason")
        if reason is None:
            raise ValueError(f"stored run {data.get('run_id')!r}: waiting state has no reason")
        waiting = WaitState(
            reason=reason if isinstance(reason, WaitReason) else WaitReason(str(reason)),
            wait_key=raw_waiting.get("wait_key"),
            until=raw_waiting.get("until"),
            resume_to_node=raw_waiting.get("resume_to_node"),
            result_key=raw_waiting.get("result_key"),
            prompt=raw_waiting.get("prompt"),
            choices=raw_waiting.get("choices"),
            allow_free_text=bool(raw_waiting.get("allow_free_text", True)),
            details=raw_waiting.get("details"),
        )
    status = data.get("status")
    return RunState(
        run_id=str(data.get("run_id") or ""),
        workflow_id=str(data.get("workflow_id") or ""),
        status=status if isinstance(status, RunStatus) else RunStatus(str(status)),
        current_node=str(data.get("current_node") or ""),
        vars=dict(object_at(data, "vars")),
        waiting=waiting,
        output=data.get("output"),
        error=data.get("error"),
        created_at=str(data.get("created_at") or ""),
        updated_at=str(data.get("updated_at") or ""),
        actor_id=data.get("actor_id"),
        session_id=data.get("session_id"),
        parent_run_id=data.get("parent_run_id"),
    )


class LedgerRunStore(RunStore):
    """Run checkpoints in the ledger's ``runs`` table. Thread-safe (the ledger is)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def save(self, run: RunState) -> None:
        self.ledger.save_run(runstate_to_dict(run))

    def load(self, run_id: str) -> RunState | None:
        data = self.ledger.load_run(run_id)
        return None if data is None else run_from_dict(data)

    def create_if_absent(self, run: RunState) -> tuple[RunState, bool]:
        stored, created = self.ledger.create_run_if_absent(runstate_to_dict(run))
        if created:
            return run, True
        existing = run_from_dict(stored)
        verify_run_identity(existing, run)
        return existing, False

    def list_runs(
        self,
        *,
        status: RunStatus | None = None,
        wait_reason: WaitReason | None = None,
        workflow_id: str | None = None,
        limit: int = 100,
    ) -> list[RunState]:
        rows = self.ledger.list_run_states(
            status=None if status is None else str(getattr(status, "value", status)),
            wait_reason=None if wait_reason is None else str(getattr(wait_reason, "value", wait_reason)),
            workflow_id=workflow_id,
            limit=limit,
        )
        return [run_from_dict(row) for row in rows]

    def list_due_wait_until(self, *, now_iso: str, limit: int = 100) -> list[RunState]:
        """Runs waiting on a timer (``wait_until``) whose deadline is at or before ``now_iso``,
        earliest deadline first."""
        now = parse_timestamp(now_iso)
        if now is None:
            raise ValueError(f"now_iso is not an ISO timestamp: {now_iso!r}")
        due: list[tuple[dt.datetime, RunState]] = []
        for row in self.ledger.list_run_states(
            status=RunStatus.WAITING.value, wait_reason=WaitReason.UNTIL.value, limit=100_000
        ):
            run = run_from_dict(row)
            until = parse_timestamp(run.waiting.until) if run.waiting is not None else None
            if until is not None and until <= now:
                due.append((until, run))
        due.sort(key=lambda item: item[0])
        return [run for _, run in due[: max(0, int(limit))]]

    def list_run_index(
        self, *, session_id: str | None = None, role: str | None = None, limit: int = 100, **filters: object
    ) -> list[dict[str, object]]:
        """The host's run-index rows (``run_id``, ``session_id`` and the attribution fields) of a
        session's runs, which the host reads to attribute a session before starting a run in it."""
        if session_id is None or filters:
            raise NotImplementedError("the ledger's run index is searched by session_id (and role) only")
        rows: list[dict[str, object]] = []
        for data in self.ledger.list_run_states(session_id=session_id, limit=limit):
            run_id = str(data.get("run_id") or "")
            fields = automation_index_fields(object_at(data, "vars"), run_id=run_id)
            if role is None or fields.get("role") == role:
                rows.append({"run_id": run_id, "session_id": session_id, **fields})
        return rows

    def session_kinds(self, session_id: str) -> frozenset[str]:
        """The attribution kinds of a session's runs (empty: a new session)."""
        rows = self.list_run_index(session_id=session_id, limit=1_000_000) if session_id.strip() else []
        return frozenset(str(kind) for row in rows if (kind := row.get("session_kind")))

    def list_children(self, *, parent_run_id: str, status: RunStatus | None = None) -> list[RunState]:
        rows = self.ledger.list_run_states(
            parent_run_id=parent_run_id,
            status=None if status is None else str(getattr(status, "value", status)),
            limit=10_000,
        )
        return [run_from_dict(row) for row in rows]


class LedgerStepStore(LedgerStore):
    """Step records in the ledger's ``steps`` table: append-only and idempotent.

    Our LLM_CALL handler does not send phase events through ``append``: the node writes them to
    the ``progress`` table through a batching writer (see ``handler.LLMCallHandler``). Reads
    put them back where AbstractRuntime would have appended them: ``list``, ``list_after``,
    ``last_record`` and ``subscribe`` present every phase event as the ``abstract.progress``
    record the host writes itself, in order among the run's step records (one shared ``seq``).
    ``abstract.progress`` records that other handlers send through AbstractRuntime's channel
    are stored like any other step record.
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def append(self, record: StepRecord) -> None:
        self.ledger.append_step(steprecord_to_dict(record))

    def list(self, run_id: str) -> list[dict[str, object]]:
        return self.ledger.list_records(run_id)

    def list_after(self, *, run_id: str, after: int, limit: int = 1000) -> tuple[builtins.list[dict[str, object]], int]:
        """Records with ``seq > after`` (cursor semantics of AbstractRuntime's ``SqliteLedgerStore``)."""
        return self.ledger.records_after(run_id, after=after, limit=limit)

    def subscribe(
        self, callback: Callable[[dict[str, object]], None], *, run_id: str | None = None
    ) -> Callable[[], None]:
        """Observers (``Runtime.subscribe_ledger``): every committed record, progress records included."""
        return self.ledger.subscribe(callback, run_id=run_id)

    def find_completed_result(self, run_id: str, idempotency_key: str) -> dict[str, object] | None:
        return self.ledger.find_completed_result(run_id, idempotency_key)

    def last_record(self, run_id: str) -> dict[str, object] | None:
        return self.ledger.last_record(run_id)
