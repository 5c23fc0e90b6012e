"""abstractruntime-mlx: LLM nodes of AbstractRuntime flows on MLX."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import MLXRuntimeError
from .results import GenerationChunk, GenerationResult

if TYPE_CHECKING:
    from .provider import MLXProvider

__version__ = "0.1.0"

__all__ = [
    "GenerationChunk",
    "GenerationResult",
    "MLXRuntimeError",
    "create_llm",
    "get_execution_capabilities",
    "__version__",
]


def create_llm(provider: str = "mlx", model: str | None = None, **options: Any) -> MLXProvider:
    """Create the local MLX provider: ``create_llm("mlx", model=NAME_OR_PATH, mlx_batching=True, ...)``."""
    from .provider import create_llm as _create

    return _create(provider, model=model, **options)


def get_execution_capabilities(
    model_name: str,
    provider: str = "mlx",
    instance: Any = None,
    *,
    head: str | None = None,
    policy_path: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Describe backend support, MTP readiness and concurrency without loading weights
    (``capabilities.get_execution_capabilities``, also at the seed's path
    ``abstractruntime_mlx.providers.speculation``)."""
    from .capabilities import get_execution_capabilities as _caps

    return _caps(
        model_name, provider=provider, instance=instance, head=head, policy_path=policy_path, cache_dir=cache_dir
    )
