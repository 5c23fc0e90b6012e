"""Where the CLI's ledger is when a command is not told (shared by every command that opens it)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

LEDGER_ENV: Final = "ABSTRACTRUNTIME_MLX_LEDGER"
DEFAULT_LEDGER_PATH: Final = Path("~/.abstractruntime-mlx/ledger.sqlite")


def default_ledger_url(explicit: str | None = None, env: Mapping[str, str] = os.environ) -> str:
    """``explicit``, else ``$ABSTRACTRUNTIME_MLX_LEDGER``, else ``~/.abstractruntime-mlx/ledger.sqlite``."""
    from ..runtime_plugin import normalize_ledger_url

    chosen = explicit or env.get(LEDGER_ENV) or str(DEFAULT_LEDGER_PATH.expanduser())
    return normalize_ledger_url(chosen)
