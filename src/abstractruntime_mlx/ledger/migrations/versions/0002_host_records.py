"""Phase events as the host's own ledger records: step records and progress rows of a run share
one sequence (stream ``records``), so their union ordered by ``seq`` is the run's ledger in
append order; progress idempotency keys take the host's form
``system:progress:<step_id>:<12 hex>`` and are unique within their run.

Existing rows are renumbered per run: each progress row goes right after the STARTED record of
the LLM step it belongs to (its ``step_id``), in its own order; rows with no such record go at
the end. Keys are rewritten from the old ones (``sha256(old key)[:12]``), which is the rule new
rows follow too, so a re-delivered event is still recognised.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import hashlib

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

steps = sa.table(
    "steps", sa.column("id"), sa.column("run_id"), sa.column("seq"), sa.column("step_id"), sa.column("status")
)
progress = sa.table(
    "progress",
    sa.column("id"),
    sa.column("run_id"),
    sa.column("seq"),
    sa.column("step_id"),
    sa.column("idempotency_key"),
)
heads = sa.table("ledger_seq_heads", sa.column("run_id"), sa.column("stream"), sa.column("last_seq"))
meta = sa.table("ledger_meta", sa.column("key"), sa.column("value"))


def host_key(anchor: str, legacy_key: str) -> str:
    return f"system:progress:{anchor}:{hashlib.sha256(legacy_key.encode('utf-8')).hexdigest()[:12]}"


def _run_ids(bind: sa.Connection) -> list[str]:
    ids = set(bind.scalars(sa.select(steps.c.run_id).distinct()))
    ids.update(bind.scalars(sa.select(progress.c.run_id).distinct()))
    return sorted(ids)


def _renumber(bind: sa.Connection, table: sa.TableClause, new_seqs: list[tuple[int, int]]) -> None:
    if new_seqs:
        stmt = sa.update(table).where(table.c.id == sa.bindparam("b_id")).values(seq=sa.bindparam("b_seq"))
        bind.execute(stmt, [{"b_id": row_id, "b_seq": seq} for row_id, seq in new_seqs])


def _park(bind: sa.Connection, run_id: str) -> None:
    """Negative seqs first, so ``(run_id, seq)`` stays unique while rows are renumbered."""
    for table in (steps, progress):
        bind.execute(sa.update(table).where(table.c.run_id == run_id).values(seq=-table.c.seq))


def upgrade() -> None:
    bind = op.get_bind()
    with op.batch_alter_table("progress") as batch:
        batch.drop_constraint("uq_progress_idempotency_key", type_="unique")
        batch.create_unique_constraint("uq_progress_run_id_idempotency_key", ["run_id", "idempotency_key"])
    for run_id in _run_ids(bind):
        step_rows = bind.execute(
            sa.select(steps.c.id, steps.c.step_id, steps.c.status).where(steps.c.run_id == run_id).order_by(steps.c.seq)
        ).all()
        progress_rows = bind.execute(
            sa.select(progress.c.id, progress.c.step_id, progress.c.idempotency_key)
            .where(progress.c.run_id == run_id)
            .order_by(progress.c.seq)
        ).all()
        by_step: dict[str | None, list[int]] = {}
        for row in progress_rows:
            by_step.setdefault(row.step_id, []).append(row.id)
        order: list[tuple[str, int]] = []
        placed: set[str] = set()
        for row in step_rows:
            order.append(("steps", row.id))
            if row.status == "started" and row.step_id in by_step and row.step_id not in placed:
                placed.add(row.step_id)
                order.extend(("progress", pid) for pid in by_step[row.step_id])
        order.extend(("progress", row.id) for row in progress_rows if row.step_id not in placed)
        _park(bind, run_id)
        _renumber(bind, steps, [(row_id, seq) for seq, (name, row_id) in enumerate(order, 1) if name == "steps"])
        _renumber(bind, progress, [(row_id, seq) for seq, (name, row_id) in enumerate(order, 1) if name == "progress"])
        bind.execute(sa.delete(heads).where(heads.c.run_id == run_id))
        bind.execute(sa.insert(heads).values(run_id=run_id, stream="records", last_seq=len(order)))
        if progress_rows:
            bind.execute(
                sa.update(progress)
                .where(progress.c.id == sa.bindparam("b_id"))
                .values(idempotency_key=sa.bindparam("b_key")),
                [
                    {"b_id": row.id, "b_key": host_key(row.step_id or run_id, row.idempotency_key)}
                    for row in progress_rows
                ],
            )
    bind.execute(sa.update(meta).where(meta.c.key == "schema_version").values(value="2"))


def downgrade() -> None:
    bind = op.get_bind()
    for run_id in _run_ids(bind):
        numbered: dict[str, list[tuple[int, int]]] = {}
        for name, table in (("steps", steps), ("progress", progress)):
            ids = bind.scalars(sa.select(table.c.id).where(table.c.run_id == run_id).order_by(table.c.seq)).all()
            numbered[name] = [(row_id, seq) for seq, row_id in enumerate(ids, 1)]
        _park(bind, run_id)
        bind.execute(sa.delete(heads).where(heads.c.run_id == run_id))
        for name, table in (("steps", steps), ("progress", progress)):
            _renumber(bind, table, numbered[name])
            if numbered[name]:
                bind.execute(sa.insert(heads).values(run_id=run_id, stream=name, last_seq=len(numbered[name])))
    with op.batch_alter_table("progress") as batch:
        batch.drop_constraint("uq_progress_run_id_idempotency_key", type_="unique")
        batch.create_unique_constraint("uq_progress_idempotency_key", ["idempotency_key"])
    bind.execute(sa.update(meta).where(meta.c.key == "schema_version").values(value="1"))
