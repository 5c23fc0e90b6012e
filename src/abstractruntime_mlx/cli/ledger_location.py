"""Where the CLI's ledger is when a command is not told, and how a read-only view opens it
(shared by every command that opens it). The ledger package (SQLAlchemy) is imported when a
ledger is opened, not when the parser is built."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

from ..errors import LedgerNotFound, RunNotFound

if TYPE_CHECKING:
    from ..ledger import Ledger

LEDGER_ENV: Final = "ABSTRACTRUNTIME_MLX_LEDGER"
DEFAULT_LEDGER_PATH: Final = Path("~/.abstractruntime-mlx/ledger.sqlite")


def default_ledger_url(explicit: str | None = None, env: Mapping[str, str] = os.environ) -> str:
    """``explicit``, else ``$ABSTRACTRUNTIME_MLX_LEDGER``, else ``~/.abstractruntime-mlx/ledger.sqlite``."""
    from ..ledger import normalize_ledger_url

    chosen = explicit or env.get(LEDGER_ENV) or str(DEFAULT_LEDGER_PATH.expanduser())
    return normalize_ledger_url(chosen)


def existing_ledger_file(url: str) -> Path | None:
    """The file of a plain SQLite ledger URL (``sqlite:///PATH``); ``LedgerNotFound`` when it does
    not exist, so no command creates a ledger by reading or upgrading one. None for other
    databases, in-memory SQLite and ``file:`` URIs.
    """
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or not database or database.startswith("file:") or parsed.query:
        return None
    path = Path(database).expanduser().resolve()
    if not path.is_file():
        raise LedgerNotFound(
            f"no ledger at {path}: no run has been recorded there "
            f"(`abstractruntime-mlx run FLOW --ledger {path}` creates it)",
            details={"path": str(path)},
        )
    return path


def open_for_inspection(url: str) -> Ledger:
    """``Ledger(url)`` for reading: a missing SQLite file is ``LedgerNotFound``, an existing one opens read-only.

    Read-only is SQLite's ``mode=ro``; where the directory cannot be written either (a
    read-only file system) the file is also opened ``immutable``, since no one can change it.
    Other databases open as usual.
    """
    from ..ledger import Ledger

    path = existing_ledger_file(url)
    if path is None:
        return Ledger(url)
    options = "mode=ro&uri=true"
    if not os.access(path.parent, os.W_OK):
        options += "&immutable=1"
    return Ledger(f"sqlite:///file:{path}?{options}")


def resolve_run_id(ledger: Ledger, run_id: str) -> str:
    """``run_id``, or the one run whose id starts with it (``runs show 3f3e``)."""
    if ledger.get_run(run_id) is not None:
        return run_id
    matches = [r.run_id for r in ledger.list_runs(limit=100_000) if r.run_id.startswith(run_id)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise RunNotFound(f"no run {run_id!r} in {ledger.url}", details={"run_id": run_id[:255]})
    raise SystemExit(f"run id prefix {run_id!r} is ambiguous: {', '.join(sorted(matches)[:5])}...")
