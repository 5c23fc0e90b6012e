"""Where the milliseconds of one keyed turn go: timers around the pieces of the reuse path.

``install()`` wraps the prefix-reuse path's pieces (ours and mlx-vlm's) with timers that
synchronize MLX after each call, so lazy work is charged to the piece that queued it (the
profiled run is therefore a little slower than a plain one). ``take()`` returns the
milliseconds each piece took since the last ``take()``; one session runs one turn at a time,
so that is one turn's breakdown.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any

_totals: collections.Counter[str] = collections.Counter()
_first: dict[str, float] = {}  # the first call's ms since the last take (the decode step that gives token 1)

FIRST_TOKEN = "first token forward (single)"
# (label, module, class or None, attribute): every piece a keyed turn may run, on either lane.
PIECES = [
    (
        "admit: key bookkeeping (hash blocks, owners)",
        "abstractruntime_mlx.engine.cache.prefix_cache",
        "PrefixCache",
        "admit",
    ),
    ("embed whole prompt (batch lane)", "abstractruntime_mlx.engine.backends.backend", None, "text_prompt_kwargs"),
    ("lookup: hash + find blocks", "mlx_vlm.generate.ar", "BatchGenerator", "_apc_pick_for"),
    ("gather: concatenate blocks (batch)", "mlx_vlm.apc_coordinator", "APCCoordinator", "merge_rows"),
    (
        "restore: lookup + concatenate (single)",
        "abstractruntime_mlx.engine.backends.single",
        "SingleBackend",
        "_restore",
    ),
    ("resident: take + trim the key's KV", "abstractruntime_mlx.engine.cache.resident", "ResidentKV", "take"),
    ("suffix prefill chunks (batch)", "mlx_vlm.generate.ar", "PromptProcessingBatch", "prompt_step"),
    ("suffix prefill chunks (single)", "abstractruntime_mlx.engine.backends.single", "SingleBackend", "_prefill_chunk"),
    (
        "last prompt token + first token (batch, incl. store)",
        "mlx_vlm.generate.ar",
        "PromptProcessingBatch",
        "generate",
    ),
    ("store new blocks (batch)", "mlx_vlm.apc_coordinator", "APCCoordinator", "commit"),
    ("store new blocks (single)", "abstractruntime_mlx.engine.backends.single", "SingleBackend", "_store_prefix"),
    (FIRST_TOKEN, "abstractruntime_mlx.engine.backends.single", "SingleBackend", "_sample"),
    ("keep the key's KV resident", "abstractruntime_mlx.engine.cache.resident", "ResidentKV", "keep"),
    ("report building", "abstractruntime_mlx.engine.cache.prefix_cache", "PrefixCache", "report"),
]


def _timed(label: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import mlx.core as mx

        mx.synchronize()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            mx.synchronize()
            ms = (time.perf_counter() - t0) * 1000
            _totals[label] += ms
            _first.setdefault(label, ms)

    return wrapper


def install() -> None:
    import importlib

    for label, module_name, cls_name, attr in PIECES:
        module = importlib.import_module(module_name)
        owner = getattr(module, cls_name) if cls_name else module
        fn = getattr(owner, attr, None)
        if fn is not None:
            setattr(owner, attr, _timed(label, fn))


def take() -> dict[str, float]:
    """Milliseconds per piece since the last call; the single lane's decode step counts its
    first call only (the one that gives the first token)."""
    out = dict(_totals)
    if FIRST_TOKEN in out:
        out[FIRST_TOKEN] = _first[FIRST_TOKEN]
    _totals.clear()
    _first.clear()
    return out
