"""``get_execution_capabilities`` at the seed's path (``abstractcore.providers.speculation``);
the implementation is ``abstractruntime_mlx.capabilities``."""

from __future__ import annotations

from ..capabilities import SUPPORTED_DEPTHS, get_execution_capabilities

__all__ = ["SUPPORTED_DEPTHS", "get_execution_capabilities"]
