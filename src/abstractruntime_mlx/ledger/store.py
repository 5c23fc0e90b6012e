"""``Ledger``: one database URL, one engine, short units of work.

The store speaks plain dicts (the shapes AbstractRuntime serialises ``RunState`` and
``StepRecord`` to) and never imports AbstractRuntime; ``runtime_plugin`` adapts it to
``RunStore`` / ``LedgerStore``.

Concurrency: every write is one transaction. On SQLite a write transaction starts with
``BEGIN IMMEDIATE`` (it holds the database write lock from its first statement, so the
read-then-write inside it is atomic, and ``busy_timeout`` absorbs contention); reads use a
plain deferred ``BEGIN``. On PostgreSQL the per-run sequence head is locked with
``SELECT ... FOR UPDATE`` before it is read, so two writers of one run serialise there.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import logging
import os
import sqlite3
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, TypedDict, TypeVar, cast

from sqlalchemy import URL, Connection, Engine, Table, create_engine, event, insert, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

from ..json_values import as_bool, as_float, as_int, as_str
from . import queries, schema
from .errors import LedgerError, wrap_db_errors
from .keys import ProgressEvent
from .models import (
    PROGRESS_FLOAT_KEYS,
    PROGRESS_INT_KEYS,
    PROGRESS_STR_KEYS,
    Base,
    LedgerMeta,
    Progress,
    Run,
    SeqHead,
    Step,
)
from .writer import DEFAULT_IDLE_WAIT_S, DEFAULT_LINGER_S, DEFAULT_MAX_BATCH, ProgressWriter

__all__ = [
    "DEFAULT_BUSY_TIMEOUT_MS",
    "Ledger",
    "open_ledger",
    "sqlite_url",
]

log = logging.getLogger(__name__)

DEFAULT_BUSY_TIMEOUT_MS = 30_000
RECORDS_STREAM = "records"  # steps and progress rows of a run share one sequence
_IN_CHUNK = 500  # bound on bind parameters per IN (...) list
INTERRUPTED = "interrupted"
"""A run's status column once its driver was stopped (``Ledger.mark_interrupted``); not a host status."""
_PG_SCHEMA_LOCK_KEY = 0x4D4C584C  # pg_advisory_xact_lock key serialising schema creation

SqliteSynchronous = Literal["OFF", "NORMAL", "FULL", "EXTRA"]

T = TypeVar("T")


# --------------------------------------------------------------------------------------
# Value helpers
# --------------------------------------------------------------------------------------


def sqlite_url(path: str | os.PathLike[str]) -> str:
    """``sqlite:///<absolute path>`` for a file path (``~`` expanded)."""
    return f"sqlite:///{Path(path).expanduser().resolve()}"


def normalize_ledger_url(url_or_path: str) -> str:
    """A SQLAlchemy URL: URLs pass through, plain paths become ``sqlite:///<absolute path>``."""
    text = str(url_or_path)
    return text if "://" in text else sqlite_url(text)


def _json_default(obj: object) -> dict[str, object]:
    # Same rule as AbstractRuntime's serializer: dataclasses nested in run vars become dicts.
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


_json_dumps = functools.partial(json.dumps, separators=(",", ":"), ensure_ascii=False, default=_json_default)


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _enum_value(value: object) -> object:
    return getattr(value, "value", value)


def _opt_str(value: object) -> str | None:
    if value is None:
        return None
    return str(_enum_value(value))


def _required_str(data: Mapping[str, object], name: str, what: str) -> str:
    value = data.get(name)
    if value is None or not str(_enum_value(value)).strip():
        raise ValueError(f"{what}.{name} must be a non-empty string (got {value!r})")
    return str(_enum_value(value))


def parse_timestamp(value: object) -> dt.datetime | None:
    """An aware UTC datetime from an ISO-8601 string or a datetime; naive values are read as UTC."""
    if value is None or value == "":
        return None
    if isinstance(value, dt.datetime):
        parsed = value
    elif isinstance(value, str):
        try:
            parsed = dt.datetime.fromisoformat(value)
        except ValueError as exc:
            raise ValueError(f"not an ISO-8601 timestamp: {value!r}") from exc
    else:
        raise ValueError(f"not a timestamp: {value!r}")
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=dt.UTC)
    return parsed.astimezone(dt.UTC)


def _chunks(items: Sequence[T], size: int = _IN_CHUNK) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class _RunColumns(TypedDict):
    """One ``runs`` row as inserted."""

    run_id: str
    workflow_id: str
    status: str
    created_at: dt.datetime
    updated_at: dt.datetime
    parent_run_id: str | None
    session_id: str | None
    actor_id: str | None
    wait_reason: str | None
    run_json: dict[str, object]


class _StepColumns(TypedDict):
    """One ``steps`` row as inserted, less ``seq`` (allocated in the write transaction)."""

    run_id: str
    step_id: str
    node_id: str
    status: str
    effect: object
    result: object
    started_at: dt.datetime | None
    ended_at: dt.datetime | None
    attempt: int
    error: str | None
    actor_id: str | None
    session_id: str | None
    idempotency_key: str | None
    prev_hash: str | None
    record_hash: str | None
    signature: str | None
    other_fields: dict[str, object]


def _run_row(run: Mapping[str, object]) -> _RunColumns:
    run_id = _required_str(run, "run_id", "run")
    waiting = run.get("waiting")
    wait_reason = _opt_str(waiting.get("reason")) if isinstance(waiting, Mapping) else None
    now = _utcnow()
    return {
        "run_id": run_id,
        "workflow_id": _required_str(run, "workflow_id", "run"),
        "status": _required_str(run, "status", "run"),
        "created_at": parse_timestamp(run.get("created_at")) or now,
        "updated_at": parse_timestamp(run.get("updated_at")) or now,
        "parent_run_id": _opt_str(run.get("parent_run_id")),
        "session_id": _opt_str(run.get("session_id")),
        "actor_id": _opt_str(run.get("actor_id")),
        "wait_reason": wait_reason,
        "run_json": dict(run),
    }


def _step_row(record: Mapping[str, object]) -> _StepColumns:
    other = dict(record)
    effect = other.pop("effect", None)
    result = other.pop("result", None)
    attempt = as_int(record.get("attempt"))
    return {
        "run_id": _required_str(record, "run_id", "step record"),
        "step_id": _required_str(record, "step_id", "step record"),
        "node_id": _opt_str(record.get("node_id")) or "",
        "status": _required_str(record, "status", "step record"),
        "effect": effect,
        "result": result,
        "started_at": parse_timestamp(record.get("started_at")),
        "ended_at": parse_timestamp(record.get("ended_at")),
        "attempt": 1 if attempt is None else attempt,
        "error": _opt_str(record.get("error")),
        "actor_id": _opt_str(record.get("actor_id")),
        "session_id": _opt_str(record.get("session_id")),
        "idempotency_key": _opt_str(record.get("idempotency_key")),
        "prev_hash": _opt_str(record.get("prev_hash")),
        "record_hash": _opt_str(record.get("record_hash")),
        "signature": _opt_str(record.get("signature")),
        "other_fields": other,
    }


def _progress_row(item: ProgressEvent, seq: int) -> dict[str, object]:
    """One ``progress`` row (column name -> value): the typed columns are projections of the
    event, named by ``PROGRESS_*_KEYS``."""
    event = item.event
    key = item.key
    row: dict[str, object] = {
        "run_id": key.run_id,
        "workflow_id": key.workflow_id,
        "node_id": key.node_id,
        "step_id": key.step_id,
        "attempt": key.attempt,
        "seq": seq,
        "idempotency_key": item.idempotency_key,
        "final": as_bool(event.get("final")),
        "created_at": dt.datetime.fromtimestamp(item.created_at, dt.UTC),
        "event": event,
    }
    for name in PROGRESS_INT_KEYS:
        row[name] = as_int(event.get(name))
    for name in PROGRESS_FLOAT_KEYS:
        row[name] = as_float(event.get(name))
    for name in PROGRESS_STR_KEYS:
        row[name] = as_str(event.get(name))
    return row


# --------------------------------------------------------------------------------------
# Dialect-specific statements
# --------------------------------------------------------------------------------------


def _table(model: type[Base]) -> Table:
    return cast(Table, model.__table__)


def _insert_ignoring_conflicts(
    session: Session, model: type[Base], rows: Sequence[Mapping[str, object]], conflict_columns: Sequence[str]
) -> int:
    """Insert ``rows``, skipping any whose ``conflict_columns`` key exists. Returns rows inserted
    when one row is given (exact on every dialect); for several, callers must not rely on it.

    SQLite and PostgreSQL: ``INSERT ... ON CONFLICT DO NOTHING`` (executemany for several rows).
    Other dialects: one insert per row inside a SAVEPOINT, skipping unique violations.
    """
    if not rows:
        return 0
    table = _table(model)  # Core statements: a CursorResult with a rowcount, no ORM bulk path
    name = session.get_bind().dialect.name
    if name in ("sqlite", "postgresql"):
        dialect_insert = sqlite_insert if name == "sqlite" else pg_insert
        stmt = dialect_insert(table).on_conflict_do_nothing(index_elements=list(conflict_columns))
        if len(rows) == 1:
            # rowcount of an INSERT is only kept (psycopg) when asked for
            result = session.execute(stmt.execution_options(preserve_rowcount=True), rows[0])
            return int(result.rowcount)  # type: ignore[attr-defined]
        session.execute(stmt, list(rows))
        return len(rows)
    inserted = 0
    for row in rows:
        try:
            with session.begin_nested():
                session.execute(insert(table), row)
            inserted += 1
        except IntegrityError:
            continue
    return inserted


def _lock_heads(session: Session, stream: str, run_ids: Sequence[str]) -> dict[str, int]:
    """Create missing heads, lock them (PostgreSQL ``FOR UPDATE``; SQLite holds the write lock
    already) and return ``run_id -> last_seq``."""
    _insert_ignoring_conflicts(
        session,
        SeqHead,
        [{"run_id": run_id, "stream": stream, "last_seq": 0} for run_id in run_ids],
        ("run_id", "stream"),
    )
    heads: dict[str, int] = {}
    for chunk in _chunks(run_ids):
        stmt = (
            select(SeqHead.run_id, SeqHead.last_seq)
            .where(SeqHead.stream == stream, SeqHead.run_id.in_(chunk))
            .order_by(SeqHead.run_id)
            .with_for_update()
        )
        heads.update({run_id: int(last) for run_id, last in session.execute(stmt)})
    return heads


def _advance_head(session: Session, stream: str, run_id: str, last_seq: int) -> None:
    session.execute(
        update(_table(SeqHead)).where(SeqHead.run_id == run_id, SeqHead.stream == stream).values(last_seq=last_seq)
    )


# --------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------


class Ledger:
    """The durable store of runs, step records and progress events behind one SQLAlchemy URL.

    ``Ledger("sqlite:///path/ledger.db")`` (the parent directory is created) or
    ``Ledger("postgresql+psycopg://user@host/db")``. Opening creates the newest schema on a
    fresh database and accepts one at ``SCHEMA_REVISION``. A database at an older revision is
    migrated when ``upgrade=True`` and refused otherwise, with a ``LedgerSchemaError`` naming
    ``abstractruntime-mlx ledger upgrade URL``; a newer or foreign one is refused. Thread-safe:
    share one instance per URL and process; every method is its own short transaction.
    """

    def __init__(
        self,
        url: str,
        *,
        busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
        sqlite_synchronous: SqliteSynchronous = "NORMAL",
        echo: bool = False,
        upgrade: bool = False,
    ) -> None:
        if busy_timeout_ms < 0:
            raise ValueError(f"busy_timeout_ms must be >= 0 (got {busy_timeout_ms})")
        if sqlite_synchronous not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"sqlite_synchronous must be OFF, NORMAL, FULL or EXTRA (got {sqlite_synchronous!r})")
        with wrap_db_errors(f"open ledger {url!r}"):
            parsed = make_url(url)
        self._url = parsed
        self._closed = False
        self._writers: weakref.WeakSet[ProgressWriter] = weakref.WeakSet()
        self._writers_lock = threading.Lock()
        self._listeners: list[Callable[[str, list[dict[str, object]]], None]] = []
        self.upgraded_from: str | None = None
        is_sqlite = parsed.get_backend_name() == "sqlite"
        self._read_only = is_sqlite and _sqlite_read_only(parsed.query)
        if is_sqlite:
            _prepare_sqlite_path(parsed.database, str(parsed.query.get("mode", "")), url)
        shown = parsed.render_as_string(hide_password=True)
        try:
            with wrap_db_errors(f"open ledger {shown}"):
                engine = create_engine(parsed, echo=echo, json_serializer=_json_dumps, json_deserializer=json.loads)
        except ImportError as exc:
            raise LedgerError(
                f"open ledger {shown}: the database driver is not installed ({exc}); "
                "for PostgreSQL: pip install 'psycopg[binary]'"
            ) from exc
        if is_sqlite:
            _install_sqlite_hooks(
                engine, busy_timeout_ms=busy_timeout_ms, synchronous=sqlite_synchronous, read_only=self._read_only
            )
        self._engine: Engine = engine
        write_engine = engine.execution_options(ledger_write=True)
        self._read_sessions = sessionmaker(bind=engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(bind=write_engine, expire_on_commit=False)
        try:
            self._init_schema(upgrade=upgrade)
        except BaseException:
            engine.dispose()
            raise

    # -- lifecycle ------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The URL, password hidden."""
        return self._url.render_as_string(hide_password=True)

    @property
    def database_url(self) -> URL:
        """The URL with its password, for a connection of its own (the run lock's)."""
        return self._url

    @property
    def dialect_name(self) -> str:
        return self._engine.dialect.name

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, *, timeout_s: float = 30.0) -> None:
        """Stop every writer made by ``progress_writer()`` (draining it), then dispose the engine.

        A writer's failure is re-raised after the engine is disposed. Idempotent.
        """
        if self._closed:
            return
        with self._writers_lock:
            writers = list(self._writers)
        first_error: BaseException | None = None
        for writer in writers:  # drain them while the engine is still open
            try:
                writer.stop(timeout_s=timeout_s)
            except LedgerError as exc:
                first_error = first_error or exc
        self._closed = True
        self._engine.dispose()
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({self.url!r})"

    def progress_writer(
        self,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        linger_s: float = DEFAULT_LINGER_S,
        idle_wait_s: float = DEFAULT_IDLE_WAIT_S,
    ) -> ProgressWriter:
        """A started ``ProgressWriter`` over this ledger; ``close()`` stops it (draining it first)."""
        self._check_open()
        writer = ProgressWriter(self, max_batch=max_batch, linger_s=linger_s, idle_wait_s=idle_wait_s)
        with self._writers_lock:
            self._writers.add(writer)
        return writer.start()

    # -- sessions -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    @contextmanager
    def _write(self, action: str) -> Iterator[Session]:
        self._check_open()
        with wrap_db_errors(action), self._write_sessions.begin() as session:
            yield session

    @contextmanager
    def _read(self, action: str) -> Iterator[Session]:
        self._check_open()
        with wrap_db_errors(action), self._read_sessions.begin() as session:
            yield session

    def _init_schema(self, *, upgrade: bool) -> None:
        with wrap_db_errors(f"open ledger {self.url}"), self._write_sessions.begin() as session:
            if self.dialect_name == "postgresql":
                session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_SCHEMA_LOCK_KEY})
            conn = session.connection()
            # A read-only SQLite URI (``file:PATH?mode=ro``) is named by its plain URL: the one
            # ``ledger upgrade`` takes, since upgrading writes.
            shown = _writable_sqlite_url(self._url.database or "") if self._read_only else self.url
            found = schema.read_revision(conn, shown_url=shown)
            action = schema.check_revision(found, shown_url=shown, may_upgrade=upgrade, read_only=self._read_only)
            if action == "create":
                schema.create_current(conn)
            elif action == "upgrade":
                assert found is not None
                schema.upgrade(conn, found)
                self.upgraded_from = found

    def schema_version(self) -> int:
        """``ledger_meta.schema_version`` (the revision as a number, for older releases to read)."""
        with self._read("read schema version") as session:
            value = session.scalar(select(LedgerMeta.value).where(LedgerMeta.key == "schema_version"))
        return int(value or 0)

    def schema_revision(self) -> str | None:
        """The Alembic revision the database records (``SCHEMA_REVISION`` once opened)."""
        with self._read("read schema revision") as session:
            return schema.read_revision(session.connection(), shown_url=self.url)

    # -- runs (RunStore) ------------------------------------------------------------

    def save_run(self, run: Mapping[str, object]) -> None:
        """Insert or replace a run checkpoint (``run`` is the run-state dict)."""
        row = _run_row(run)
        with self._write(f"save run {row['run_id']}") as session:
            if _insert_ignoring_conflicts(session, Run, [row], ("run_id",)) == 0:
                changes = {k: v for k, v in row.items() if k not in ("run_id", "created_at")}
                session.execute(update(_table(Run)).where(Run.run_id == row["run_id"]).values(**changes))

    def create_run_if_absent(self, run: Mapping[str, object]) -> tuple[dict[str, object], bool]:
        """Create the run unless its id exists: ``(run, True)``, or ``(stored run dict, False)``.

        Never overwrites. Checking that the stored run has the same creation identity is the
        caller's job (``runtime_plugin`` uses AbstractRuntime's ``verify_run_identity``).
        """
        row = _run_row(run)
        with self._write(f"create run {row['run_id']}") as session:
            created = _insert_ignoring_conflicts(session, Run, [row], ("run_id",)) == 1
            if created:
                return dict(run), True
            stored = session.scalar(select(Run.run_json).where(Run.run_id == row["run_id"]))
        if stored is None:  # pragma: no cover - the conflict implies the row
            raise LedgerError(f"run {row['run_id']} conflicted on insert but is not readable")
        return dict(stored), False

    def load_run(self, run_id: str) -> dict[str, object] | None:
        """The saved run-state dict, or None."""
        with self._read(f"load run {run_id}") as session:
            stored = session.scalar(select(Run.run_json).where(Run.run_id == run_id))
        return None if stored is None else dict(stored)

    def list_run_states(
        self,
        *,
        status: str | None = None,
        workflow_id: str | None = None,
        wait_reason: str | None = None,
        parent_run_id: str | None = None,
        session_id: str | None = None,
        limit: int = 100,
    ) -> list[dict[str, object]]:
        """Saved run-state dicts matching every given filter, most recently updated first."""
        stmt = select(Run.run_json)
        if session_id is not None:
            stmt = stmt.where(Run.session_id == session_id)
        if status is not None:
            stmt = stmt.where(Run.status == str(_enum_value(status)))
        if workflow_id is not None:
            stmt = stmt.where(Run.workflow_id == workflow_id)
        if wait_reason is not None:
            stmt = stmt.where(Run.wait_reason == str(_enum_value(wait_reason)))
        if parent_run_id is not None:
            stmt = stmt.where(Run.parent_run_id == parent_run_id)
        stmt = stmt.order_by(Run.updated_at.desc(), Run.run_id).limit(max(0, int(limit)))
        with self._read("list run states") as session:
            return [dict(value) for value in session.scalars(stmt)]

    def mark_interrupted(self, run_ids: Sequence[str]) -> list[str]:
        """Mark the runs of ``run_ids`` that are ``running`` as ``interrupted`` (their driver was
        stopped, e.g. by Ctrl-C); returns the ids marked. Only the status column changes: the
        saved run state still says running, so the host loads it as a run to continue, and its
        next checkpoint (``runs resume``) sets the column back."""
        marked: list[str] = []
        with self._write("mark runs interrupted") as session:
            for chunk in _chunks(list(run_ids)):
                rows = session.scalars(select(Run.run_id).where(Run.run_id.in_(chunk), Run.status == "running")).all()
                if rows:
                    session.execute(update(_table(Run)).where(Run.run_id.in_(rows)).values(status=INTERRUPTED))
                    marked.extend(rows)
        return sorted(marked)

    # -- steps (LedgerStore) --------------------------------------------------------

    def append_step(self, record: Mapping[str, object]) -> int:
        """Append one step record (the dict of an AbstractRuntime ``StepRecord``); returns its seq.

        ``seq`` is allocated per run, 1, 2, 3, ... in commit order, atomically across threads
        and processes. Appending a record whose ``(run_id, step_id, status)`` is already stored
        (a retried append) stores nothing and returns the stored seq.
        """
        row = _step_row(record)
        run_id = row["run_id"]
        with self._write(f"append step {row['step_id']} of run {run_id}") as session:
            last_seq = _lock_heads(session, RECORDS_STREAM, [run_id])[run_id]
            stored_seq = session.scalar(
                select(Step.seq).where(
                    Step.run_id == run_id, Step.step_id == row["step_id"], Step.status == row["status"]
                )
            )
            if stored_seq is not None:
                return int(stored_seq)
            seq = last_seq + 1
            _advance_head(session, RECORDS_STREAM, run_id, seq)
            session.execute(insert(_table(Step)), [{**row, "seq": seq}])
        self._notify([dict(record)])
        return seq

    def list_steps(self, run_id: str) -> list[dict[str, object]]:
        """Every step record of the run, in append order (as appended)."""
        with self._read(f"list steps of run {run_id}") as session:
            rows = session.scalars(select(Step).where(Step.run_id == run_id).order_by(Step.seq))
            return [queries.step_record(row) for row in rows]

    def last_step(self, run_id: str) -> dict[str, object] | None:
        """The run's most recently appended step record, or None."""
        with self._read(f"read last step of run {run_id}") as session:
            row = session.scalar(select(Step).where(Step.run_id == run_id).order_by(Step.seq.desc()).limit(1))
            return None if row is None else queries.step_record(row)

    def find_completed_result(self, run_id: str, idempotency_key: str) -> dict[str, object] | None:
        """The ``result`` of the oldest COMPLETED record with this key in the run, or None."""
        if not idempotency_key:
            return None
        stmt = (
            select(Step.result)
            .where(Step.run_id == run_id, Step.idempotency_key == idempotency_key, Step.status == "completed")
            .order_by(Step.seq)
            .limit(1)
        )
        with self._read(f"find completed result of run {run_id}") as session:
            result = session.scalar(stmt)
        return None if result is None else dict(result)

    # -- progress -------------------------------------------------------------------

    def append_progress(self, items: Iterable[ProgressEvent]) -> int:
        """Write progress events in one transaction; returns how many were new.

        Events whose ``idempotency_key`` is already stored (or repeated within ``items``) are
        skipped, so retrying a batch is safe. New rows get per-run ``seq`` values in ``items``
        order. ``ProgressWriter`` calls this from its thread; call it directly only for
        synchronous writes.
        """
        batch = list(items)
        if not batch:
            return 0
        with self._write(f"append {len(batch)} progress rows") as session:
            rows = _write_progress_batch(session, batch)
            records = queries.render_progress(session, [Progress(**row) for row in rows]) if self._listeners else []
        self._notify(records)
        return len(rows)

    # -- the run's ledger as AbstractRuntime records ---------------------------------

    def list_records(self, run_id: str) -> list[dict[str, object]]:
        """The run's whole ledger in append order, as AbstractRuntime's own stores list it: the
        step records as appended, and each phase event as the ``abstract.progress`` record the
        host writes itself (see ``queries.progress_record``)."""
        with self._read(f"list records of run {run_id}") as session:
            return [record for _, record in queries.run_records(session, run_id)]

    def records_after(self, run_id: str, after: int = 0, limit: int = 1000) -> tuple[list[dict[str, object]], int]:
        """A page of ``list_records``: the records with ``seq > after`` (at most ``limit``) and
        the cursor to pass next (the last ``seq`` returned, else ``after``)."""
        with self._read(f"list records of run {run_id}") as session:
            page = queries.run_records(session, run_id, after=max(0, int(after)), limit=max(1, int(limit)))
        return [record for _, record in page], (page[-1][0] if page else int(after))

    def last_record(self, run_id: str) -> dict[str, object] | None:
        """The run's most recent record (a step record or a progress record), or None."""
        with self._read(f"read last record of run {run_id}") as session:
            return queries.last_record(session, run_id)

    def subscribe(
        self, callback: Callable[[dict[str, object]], None], *, run_id: str | None = None
    ) -> Callable[[], None]:
        """Call ``callback(record)`` after each step record or progress record of ``run_id`` (or of
        every run) is committed through this ``Ledger``; returns the unsubscribe function.

        Progress records arrive from the writer thread, in commit order. A callback that raises
        is logged and skipped: observers never break a write.
        """

        def listener(rid: str, records: list[dict[str, object]]) -> None:
            if run_id is None or rid == run_id:
                for record in records:
                    callback(record)

        with self._writers_lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._writers_lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def _notify(self, records: list[dict[str, object]]) -> None:
        if not records or not self._listeners:
            return
        with self._writers_lock:
            listeners = list(self._listeners)
        for record in records:
            for listener in listeners:
                try:
                    listener(str(record.get("run_id")), [record])
                except Exception:  # noqa: BLE001 - observability must not break durability
                    log.warning("ledger subscriber raised; record skipped for it", exc_info=True)

    # -- queries (plain dataclasses) ------------------------------------------------

    def list_runs(
        self,
        limit: int = 50,
        *,
        status: str | None = None,
        workflow_id: str | None = None,
        session_id: str | None = None,
        created_after: dt.datetime | None = None,
        roots_only: bool = False,
        parent_run_ids: Sequence[str] | None = None,
    ) -> list[queries.RunSummary]:
        """Run summaries, most recently updated first (see ``queries.list_runs``)."""
        with self._read("list runs") as session:
            return queries.list_runs(
                session,
                limit=limit,
                status=status,
                workflow_id=workflow_id,
                session_id=session_id,
                created_after=created_after,
                roots_only=roots_only,
                parent_run_ids=parent_run_ids,
            )

    def list_workflows(self) -> list[str]:
        """Every workflow id with a run in this ledger, sorted."""
        with self._read("list workflows") as session:
            return queries.list_workflows(session)

    def run_cursor(self, run_id: str) -> queries.RunCursor | None:
        """Cheap change detection for a live run (see ``queries.RunCursor``)."""
        with self._read(f"read cursor of run {run_id}") as session:
            return queries.run_cursor(session, run_id)

    def get_run(self, run_id: str) -> queries.RunDetail | None:
        with self._read(f"get run {run_id}") as session:
            return queries.get_run(session, run_id)

    def run_steps(self, run_id: str) -> list[queries.StepRow]:
        with self._read(f"read steps of run {run_id}") as session:
            return queries.run_steps(session, run_id)

    def node_timeline(
        self, run_id: str, node_id: str | None = None, *, after_seq: int = 0
    ) -> list[queries.ProgressRow]:
        with self._read(f"read progress of run {run_id}") as session:
            return queries.node_timeline(session, run_id, node_id, after_seq=after_seq)


def open_ledger(
    url: str,
    *,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    sqlite_synchronous: SqliteSynchronous = "NORMAL",
    echo: bool = False,
    upgrade: bool = False,
) -> Ledger:
    """``Ledger(url, ...)`` with the same options."""
    return Ledger(
        url, busy_timeout_ms=busy_timeout_ms, sqlite_synchronous=sqlite_synchronous, echo=echo, upgrade=upgrade
    )


def _write_progress_batch(session: Session, batch: Sequence[ProgressEvent]) -> list[dict[str, object]]:
    run_ids = sorted({item.key.run_id for item in batch})
    heads = _lock_heads(session, RECORDS_STREAM, run_ids)
    keys = list(dict.fromkeys(item.idempotency_key for item in batch))
    seen: set[tuple[str, str]] = set()
    for chunk in _chunks(keys):
        found = session.execute(
            select(Progress.run_id, Progress.idempotency_key).where(
                Progress.run_id.in_(run_ids), Progress.idempotency_key.in_(chunk)
            )
        )
        seen.update((run_id, key) for run_id, key in found)
    rows: list[dict[str, object]] = []
    for item in batch:
        identity = (item.key.run_id, item.idempotency_key)
        if identity in seen:
            continue
        seen.add(identity)
        run_id = item.key.run_id
        heads[run_id] += 1
        rows.append(_progress_row(item, heads[run_id]))
    if not rows:
        return []
    for run_id in run_ids:
        _advance_head(session, RECORDS_STREAM, run_id, heads[run_id])
    _insert_ignoring_conflicts(session, Progress, rows, ("run_id", "idempotency_key"))
    return rows


# --------------------------------------------------------------------------------------
# SQLite specifics
# --------------------------------------------------------------------------------------


def _prepare_sqlite_path(database: str | None, mode: str, url: str) -> None:
    if not database or database == ":memory:" or mode == "memory":
        raise LedgerError(
            f"ledger URL {url!r} is an in-memory SQLite database, which every connection sees "
            "empty; use a file (sqlite:///path/ledger.db), a temporary one in tests"
        )
    if database.startswith("file:"):
        return
    try:
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LedgerError(f"cannot create the directory of ledger database {database!r}: {exc}") from exc


def _sqlite_read_only(query: Mapping[str, object]) -> bool:
    """Whether a SQLite URL's query opens the file read-only (``mode=ro``, or ``immutable=1``)."""
    return query.get("mode") == "ro" or query.get("immutable") == "1"


def _writable_sqlite_url(database: str) -> str:
    """``sqlite:///PATH`` for the database of a SQLite URL (``file:PATH`` URIs included)."""
    path = database.removeprefix("file:")
    if path.startswith("//"):  # file://host/path; the host is empty or localhost
        path = "/" + path[2:].partition("/")[2]
    return sqlite_url(path)


def _install_sqlite_hooks(
    engine: Engine, *, busy_timeout_ms: int, synchronous: SqliteSynchronous, read_only: bool = False
) -> None:
    """WAL, busy_timeout, foreign_keys and synchronous on every connection; SQLAlchemy emits BEGIN.
    A ``read_only`` connection leaves the journal mode as the file has it (setting it writes).

    pysqlite's own transaction handling is switched off (``isolation_level = None``) so that a
    write session can start with ``BEGIN IMMEDIATE`` and a read session with ``BEGIN``.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: ConnectionPoolEntry) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            if not read_only:
                cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute(f"PRAGMA synchronous = {synchronous}")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        immediate = conn.get_execution_options().get("ledger_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")
