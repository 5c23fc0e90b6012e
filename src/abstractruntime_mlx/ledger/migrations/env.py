"""Alembic environment: migrations always run on a connection the ledger hands over
(``config.attributes["connection"]``), inside its transaction; there is no ``alembic.ini``."""

from __future__ import annotations

from alembic import context

from abstractruntime_mlx.ledger.models import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
    transactional_ddl=True,
)
with context.begin_transaction():
    context.run_migrations()
