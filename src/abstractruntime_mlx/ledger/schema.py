"""The ledger's schema revision: read it, create the newest schema, migrate an older one.

Migrations are Alembic revisions shipped in ``ledger/migrations/versions`` and always run on
the connection (and inside the transaction) the ledger hands over; there is no ``alembic.ini``.
A database records its revision in Alembic's ``alembic_version`` table. Databases made before
the ledger used Alembic carry only ``ledger_meta.schema_version = 1``, which is revision
``0001``.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from sqlalchemy import Connection, inspect, text

from ..errors import LedgerNotFound
from .errors import LedgerSchemaError
from .models import LEDGER_TABLES, SCHEMA_REVISION, SCHEMA_VERSION, Base

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = ["MIGRATIONS_DIR", "UPGRADE_COMMAND", "create_current", "known_revisions", "read_revision", "upgrade"]

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
UPGRADE_COMMAND = "abstractruntime-mlx ledger upgrade {url}"
_LEGACY_REVISIONS = {"1": "0001"}  # ledger_meta.schema_version of databases made before Alembic


def _config(connection: Connection) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def known_revisions() -> list[str]:
    """Every shipped revision, oldest first."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(MIGRATIONS_DIR))
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]


def read_revision(connection: Connection, *, shown_url: str) -> str | None:
    """The database's revision; None for a database with none of the ledger's tables.

    Raises ``LedgerSchemaError`` when ledger tables exist without any revision marker (not
    made by this ledger).
    """
    tables = set(inspect(connection).get_table_names())
    if "alembic_version" in tables:
        found = connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
        if len(found) == 1:
            return str(found[0])
        raise LedgerSchemaError(f"{shown_url}: alembic_version holds {found!r}, not one revision")
    if "ledger_meta" in tables:
        version = connection.execute(text("SELECT value FROM ledger_meta WHERE key = 'schema_version'")).scalar()
        if version is None:
            raise LedgerSchemaError(f"{shown_url}: table ledger_meta has no schema_version row")
        if str(version) in _LEGACY_REVISIONS:
            return _LEGACY_REVISIONS[str(version)]
        raise LedgerSchemaError(
            f"{shown_url}: ledger schema_version {version!r} has no revision marker this abstractruntime-mlx knows",
            details={"found": str(version), "supported": SCHEMA_REVISION},
        )
    clashing = sorted(tables & set(LEDGER_TABLES))
    if clashing:
        raise LedgerSchemaError(
            f"{shown_url}: tables {clashing} exist but were not created by the abstractruntime-mlx ledger "
            "(no ledger_meta or alembic_version table); use another database",
            details={"tables": clashing},
        )
    return None


def create_current(connection: Connection) -> None:
    """Create the newest schema on an empty database and record its revision."""
    from alembic import command

    Base.metadata.create_all(connection)
    connection.execute(
        text("INSERT INTO ledger_meta (key, value) VALUES ('schema_version', :version)"),
        {"version": str(SCHEMA_VERSION)},
    )
    command.stamp(_config(connection), SCHEMA_REVISION)


def upgrade(connection: Connection, found: str) -> None:
    """Migrate a database at revision ``found`` to ``SCHEMA_REVISION`` (inside the caller's transaction)."""
    from alembic import command

    config = _config(connection)
    if found in _LEGACY_REVISIONS.values() and not _has_version_table(connection):
        command.stamp(config, found)
    command.upgrade(config, SCHEMA_REVISION)


def _has_version_table(connection: Connection) -> bool:
    return "alembic_version" in set(inspect(connection).get_table_names())


def check_revision(
    found: str | None, *, shown_url: str, may_upgrade: bool, read_only: bool = False, upgrade_url: str | None = None
) -> str:
    """What opening must do with a database at ``found``: ``"create"``, ``"open"`` or ``"upgrade"``.

    Raises ``LedgerSchemaError`` for a revision this code does not know (made by a newer
    release) and for an older one when upgrading was not asked for: its command names
    ``upgrade_url`` (default ``shown_url``), the URL that opens the database for writing.
    A database opened ``read_only`` that has no ledger in it is ``LedgerNotFound``: nothing is
    created in a file that was only to be read.
    """
    if found is None:
        if read_only:
            raise LedgerNotFound(
                f"{shown_url} is not an abstractruntime-mlx ledger: it has none of the ledger's tables "
                "(it was opened read-only and left as it was)",
                details={"url": shown_url},
            )
        return "create"
    if found == SCHEMA_REVISION:
        return "open"
    known = known_revisions()
    if found not in known:
        raise LedgerSchemaError(
            f"{shown_url}: the ledger is at schema revision {found!r}, which this abstractruntime-mlx does not know "
            f"(it reads and writes revision {SCHEMA_REVISION}); a newer release made it: upgrade abstractruntime-mlx",
            details={"found": found, "supported": SCHEMA_REVISION},
        )
    if known.index(found) > known.index(SCHEMA_REVISION):  # pragma: no cover - head is the newest shipped
        raise LedgerSchemaError(f"{shown_url}: revision {found!r} is newer than {SCHEMA_REVISION!r}")
    if not may_upgrade:
        command = UPGRADE_COMMAND.format(url=shlex.quote(upgrade_url or shown_url))
        raise LedgerSchemaError(
            f"{shown_url}: the ledger is at schema revision {found}, older than this abstractruntime-mlx's "
            f"{SCHEMA_REVISION}; migrate it with `{command}` (back it up first), then open it again",
            details={"found": found, "supported": SCHEMA_REVISION, "command": command},
        )
    return "upgrade"


class SchemaStatus(TypedDict):
    """Where a database stands: its revision, the newest one, and the revisions between."""

    revision: str | None
    head: str
    pending: list[str]


def describe(connection: Connection, *, shown_url: str) -> SchemaStatus:
    """``{"revision", "head", "pending": [...]}`` for ``ledger status``-style reports."""
    found = read_revision(connection, shown_url=shown_url)
    known = known_revisions()
    pending = known[known.index(found) + 1 :] if found in known else []
    return {"revision": found, "head": SCHEMA_REVISION, "pending": pending}
