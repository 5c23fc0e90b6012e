"""The ledger as first released (``ledger_meta.schema_version`` 1): runs, steps, progress,
per-run sequence heads (one stream for steps, one for progress).

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
UTC = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(255), nullable=False),
        sa.Column("workflow_id", sa.String(255), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("created_at", UTC, nullable=False),
        sa.Column("updated_at", UTC, nullable=False),
        sa.Column("parent_run_id", sa.String(255), nullable=True),
        sa.Column("session_id", sa.String(255), nullable=True),
        sa.Column("actor_id", sa.String(255), nullable=True),
        sa.Column("wait_reason", sa.String(64), nullable=True),
        sa.Column("run_json", JSON, nullable=False),
        sa.PrimaryKeyConstraint("run_id", name="pk_runs"),
    )
    op.create_index("ix_runs_status_updated_at", "runs", ["status", "updated_at"])
    op.create_index("ix_runs_workflow_id_updated_at", "runs", ["workflow_id", "updated_at"])
    op.create_index("ix_runs_updated_at", "runs", ["updated_at"])
    op.create_index("ix_runs_parent_run_id", "runs", ["parent_run_id"])
    op.create_table(
        "steps",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(255), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("step_id", sa.String(255), nullable=False),
        sa.Column("node_id", sa.String(255), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("effect", JSON, nullable=True),
        sa.Column("result", JSON, nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", UTC, nullable=True),
        sa.Column("ended_at", UTC, nullable=True),
        sa.Column("actor_id", sa.String(255), nullable=True),
        sa.Column("session_id", sa.String(255), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("idempotency_key", sa.String(512), nullable=True),
        sa.Column("prev_hash", sa.String(255), nullable=True),
        sa.Column("record_hash", sa.String(255), nullable=True),
        sa.Column("signature", sa.Text(), nullable=True),
        sa.Column("other_fields", JSON, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_steps"),
        sa.UniqueConstraint("run_id", "seq", name="uq_steps_run_id_seq"),
        sa.UniqueConstraint("run_id", "step_id", "status", name="uq_steps_run_id_step_id_status"),
    )
    op.create_index("ix_steps_run_id_idempotency_key_status", "steps", ["run_id", "idempotency_key", "status"])
    op.create_index("ix_steps_run_id_node_id", "steps", ["run_id", "node_id"])
    op.create_table(
        "progress",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(255), nullable=False),
        sa.Column("workflow_id", sa.String(255), nullable=True),
        sa.Column("node_id", sa.String(255), nullable=False),
        sa.Column("step_id", sa.String(255), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("idempotency_key", sa.String(512), nullable=False),
        sa.Column("kind", sa.String(32), nullable=True),
        sa.Column("phase", sa.String(32), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("fed_tokens", sa.Integer(), nullable=True),
        sa.Column("generated_tokens", sa.Integer(), nullable=True),
        sa.Column("prefill_processed_tokens", sa.Integer(), nullable=True),
        sa.Column("ttft_s", sa.Double(), nullable=True),
        sa.Column("tokens_per_second", sa.Double(), nullable=True),
        sa.Column("prefill_tokens_per_second", sa.Double(), nullable=True),
        sa.Column("elapsed_s", sa.Double(), nullable=True),
        sa.Column("event_index", sa.Integer(), nullable=True),
        sa.Column("final", sa.Boolean(), nullable=True),
        sa.Column("finish_reason", sa.String(64), nullable=True),
        sa.Column("created_at", UTC, nullable=False),
        sa.Column("event", JSON, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_progress"),
        sa.UniqueConstraint("run_id", "seq", name="uq_progress_run_id_seq"),
        sa.UniqueConstraint("idempotency_key", name="uq_progress_idempotency_key"),
    )
    op.create_index("ix_progress_run_id_node_id_seq", "progress", ["run_id", "node_id", "seq"])
    op.create_table(
        "ledger_seq_heads",
        sa.Column("run_id", sa.String(255), nullable=False),
        sa.Column("stream", sa.String(16), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "stream", name="pk_ledger_seq_heads"),
    )
    op.create_table(
        "ledger_meta",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("value", sa.String(255), nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_ledger_meta"),
    )
    op.execute(sa.text("INSERT INTO ledger_meta (key, value) VALUES ('schema_version', '1')"))


def downgrade() -> None:
    for table in ("ledger_meta", "ledger_seq_heads", "progress", "steps", "runs"):
        op.drop_table(table)
