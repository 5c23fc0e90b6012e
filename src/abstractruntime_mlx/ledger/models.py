"""The ledger schema: SQLAlchemy 2.x typed ORM models, portable across SQLite and PostgreSQL.

Tables (revision ``SCHEMA_REVISION``; every change ships as an Alembic migration in
``ledger/migrations``, see ``docs/ledger.md``):

- ``runs``: one row per run, the whole run-state dict in ``run_json`` plus the columns the
  queries filter on. Backs AbstractRuntime's ``RunStore``.
- ``steps``: one row per appended step record (AbstractRuntime's ``StepRecord``).
- ``progress``: one row per phase event (``abstract.progress``), with an idempotency key in
  the host's form (``system:progress:<step_id>:<12 hex>``, unique within the run). Typed
  columns are projections of ``event``, which keeps the whole event.
- ``ledger_seq_heads``: the per-run sequence allocator. Step records and progress rows of a
  run share one ``seq`` (stream ``records``), so their union ordered by ``seq`` is the run's
  ledger in append order, as AbstractRuntime's own stores number it.
- ``ledger_meta``: ``schema_version`` (the revision number, read by releases that predate
  Alembic so that they refuse a newer database); ``alembic_version`` records the revision.

There are no foreign keys from ``steps``/``progress`` to ``runs``: the journal may be written
before (or without) the run checkpoint, exactly as AbstractRuntime's own SQLite schema allows.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_REVISION = "0002"
"""The Alembic revision this code reads and writes (``ledger/migrations/versions``)."""

SCHEMA_VERSION = 2
"""``SCHEMA_REVISION`` as the number kept in ``ledger_meta.schema_version``."""

NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class DateTimeUTC(TypeDecorator[dt.datetime]):
    """A timezone-aware UTC datetime on every database.

    Naive datetimes are refused on write (a programming error: which zone was meant?); values
    are stored in UTC and come back aware (UTC), so SQLite and PostgreSQL return equal values.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    @property
    def python_type(self) -> type[dt.datetime]:
        return dt.datetime

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise TypeError(f"naive datetime {value!r} refused: the ledger stores UTC-aware datetimes")
        return value.astimezone(dt.UTC)

    def process_result_value(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)


JsonB = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
"""JSON everywhere, JSONB on PostgreSQL; Python ``None`` is SQL NULL (not the JSON ``null``)."""

BigIntIdentity = BigInteger().with_variant(Integer(), "sqlite")
"""A 64-bit surrogate key; SQLite only auto-increments an ``INTEGER PRIMARY KEY``."""


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        dt.datetime: DateTimeUTC(),
        dict: JsonB,
        dict[str, object]: JsonB,
    }


class Run(Base):
    """One run checkpoint: the latest saved run state (``run_json``) plus filter columns."""

    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    workflow_id: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[dt.datetime]
    updated_at: Mapped[dt.datetime]
    parent_run_id: Mapped[str | None] = mapped_column(String(255))
    session_id: Mapped[str | None] = mapped_column(String(255))
    actor_id: Mapped[str | None] = mapped_column(String(255))
    wait_reason: Mapped[str | None] = mapped_column(String(64))
    run_json: Mapped[dict[str, object]]

    __table_args__ = (
        Index(None, "status", "updated_at"),
        Index(None, "workflow_id", "updated_at"),
        Index(None, "updated_at"),
        Index(None, "parent_run_id"),
    )


class Step(Base):
    """One appended step record, in per-run append order (``seq`` increasing, shared with ``progress``).

    ``effect`` and ``result`` are stored once, in their columns; ``other_fields`` holds every
    other key of the record (so a field added to ``StepRecord`` later still round-trips).
    ``(run_id, step_id, status)`` is unique: re-appending the same record is a no-op.
    ``idempotency_key`` is indexed, not unique: AbstractRuntime writes the STARTED and the
    terminal record of one effect (and every retry attempt) under the same key.
    """

    __tablename__ = "steps"

    id: Mapped[int] = mapped_column(BigIntIdentity, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(255))
    seq: Mapped[int] = mapped_column(BigInteger)
    step_id: Mapped[str] = mapped_column(String(255))
    node_id: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(32))
    effect: Mapped[dict[str, object] | None]
    result: Mapped[dict[str, object] | None]
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[dt.datetime | None]
    ended_at: Mapped[dt.datetime | None]
    actor_id: Mapped[str | None] = mapped_column(String(255))
    session_id: Mapped[str | None] = mapped_column(String(255))
    attempt: Mapped[int] = mapped_column(Integer)
    idempotency_key: Mapped[str | None] = mapped_column(String(512))
    prev_hash: Mapped[str | None] = mapped_column(String(255))
    record_hash: Mapped[str | None] = mapped_column(String(255))
    signature: Mapped[str | None] = mapped_column(Text)
    other_fields: Mapped[dict[str, object]]

    __table_args__ = (
        UniqueConstraint("run_id", "seq"),
        UniqueConstraint("run_id", "step_id", "status"),
        Index(None, "run_id", "idempotency_key", "status"),
        Index(None, "run_id", "node_id"),
    )


class Progress(Base):
    """One ``abstract.progress`` phase event. Absent event keys are NULL columns. ``seq`` is
    the event's place in the run's ledger, shared with ``steps``."""

    __tablename__ = "progress"

    id: Mapped[int] = mapped_column(BigIntIdentity, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(255))
    workflow_id: Mapped[str | None] = mapped_column(String(255))
    node_id: Mapped[str] = mapped_column(String(255))
    step_id: Mapped[str | None] = mapped_column(String(255))
    attempt: Mapped[int | None] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(BigInteger)
    idempotency_key: Mapped[str] = mapped_column(String(512))
    kind: Mapped[str | None] = mapped_column(String(32))
    phase: Mapped[str | None] = mapped_column(String(32))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    fed_tokens: Mapped[int | None] = mapped_column(Integer)
    generated_tokens: Mapped[int | None] = mapped_column(Integer)
    prefill_processed_tokens: Mapped[int | None] = mapped_column(Integer)
    ttft_s: Mapped[float | None]
    tokens_per_second: Mapped[float | None]
    prefill_tokens_per_second: Mapped[float | None]
    elapsed_s: Mapped[float | None]
    event_index: Mapped[int | None] = mapped_column(Integer)
    final: Mapped[bool | None]
    finish_reason: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[dt.datetime]
    event: Mapped[dict[str, object]]

    __table_args__ = (
        UniqueConstraint("run_id", "seq"),
        UniqueConstraint("run_id", "idempotency_key"),
        Index(None, "run_id", "node_id", "seq"),
    )


class SeqHead(Base):
    """Per-run sequence allocator: ``last_seq`` of ``stream`` (``records``: steps and progress)."""

    __tablename__ = "ledger_seq_heads"

    run_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    stream: Mapped[str] = mapped_column(String(16), primary_key=True)
    last_seq: Mapped[int] = mapped_column(BigInteger)


class LedgerMeta(Base):
    """Key/value facts about the database itself (``schema_version``)."""

    __tablename__ = "ledger_meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(255))


LEDGER_TABLES: tuple[str, ...] = tuple(Base.metadata.tables)
"""Every table this schema creates."""

PROGRESS_INT_KEYS: tuple[str, ...] = (
    "prompt_tokens",
    "cached_tokens",
    "fed_tokens",
    "generated_tokens",
    "prefill_processed_tokens",
    "event_index",
)
PROGRESS_FLOAT_KEYS: tuple[str, ...] = (
    "ttft_s",
    "tokens_per_second",
    "prefill_tokens_per_second",
    "elapsed_s",
)
PROGRESS_STR_KEYS: tuple[str, ...] = ("kind", "phase", "finish_reason")
