"""The durable ledger: runs, step records and ``abstract.progress`` rows behind one SQLAlchemy URL.

    ledger = Ledger("sqlite:///~/.abstractruntime-mlx/ledger.db")   # or postgresql+psycopg://...
    writer = ledger.progress_writer()
    key = NodeKey(run_id, node_id, workflow_id=..., step_id=..., attempt=1)
    writer.put({"kind": "llm", "phase": "prefill", "prompt_tokens": 812}, key)   # non-blocking
    writer.flush(key)            # every event of that node so far is committed
    ledger.node_timeline(run_id) # -> [ProgressRow, ...]
    ledger.close()

Imports neither AbstractRuntime, MLX nor HTTP; ``runtime_plugin`` adapts it to AbstractRuntime's
``RunStore`` / ``LedgerStore``. See ``docs/ledger.md``.
"""

from __future__ import annotations

from .errors import (
    DuplicateEvent,
    LedgerError,
    LedgerSchemaError,
    LedgerTimeout,
    LedgerWriteFailed,
    wrap_db_errors,
)
from .keys import NodeKey, ProgressEvent, host_progress_key, progress_idempotency_key
from .models import SCHEMA_REVISION, SCHEMA_VERSION
from .queries import ProgressRow, RunCursor, RunDetail, RunSummary, StepRow
from .store import DEFAULT_BUSY_TIMEOUT_MS, Ledger, normalize_ledger_url, open_ledger, sqlite_url
from .writer import ProgressWriter, WriterState

__all__ = [
    "DEFAULT_BUSY_TIMEOUT_MS",
    "SCHEMA_REVISION",
    "SCHEMA_VERSION",
    "DuplicateEvent",
    "Ledger",
    "LedgerError",
    "LedgerSchemaError",
    "LedgerTimeout",
    "LedgerWriteFailed",
    "NodeKey",
    "ProgressEvent",
    "ProgressRow",
    "ProgressWriter",
    "RunCursor",
    "RunDetail",
    "RunSummary",
    "StepRow",
    "WriterState",
    "host_progress_key",
    "normalize_ledger_url",
    "open_ledger",
    "progress_idempotency_key",
    "sqlite_url",
    "wrap_db_errors",
]
