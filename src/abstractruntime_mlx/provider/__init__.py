"""The local model API."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequest
from .mlx_provider import MLXProvider

__all__ = ["MLXProvider", "create_llm"]


def create_llm(provider: str = "mlx", model: str | None = None, **options: Any) -> MLXProvider:
    if str(provider).strip().lower() != "mlx":
        raise InvalidRequest(f"abstractruntime-mlx serves the 'mlx' provider only, not {provider!r}")
    if not model:
        raise InvalidRequest("create_llm needs model=NAME_OR_PATH")
    return MLXProvider(model, **options)
