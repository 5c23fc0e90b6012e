"""The model the text lane steps, and which models have the lane.

``language_model`` builds mlx-lm's own class for the checkpoint (lazily, by mlx-lm's loader)
and gives it the resident mlx-vlm model's weight arrays, so the weights are held once: the
class mlx-lm's loops are tuned for (on CUDA mlx-vlm's language model took ~10 ms more per step
at 32-64 rows). Where mlx-lm has no class for the checkpoint, or its parameters differ, the
model has no text lane (``None``): its rows run in mlx-vlm's batch and report ``batch``.

``supports_model`` is the rule the single lane and the text lane share: a plain ``KVCache``
per layer (what a batch cache merges) and no per-row position ids. ``make_cache`` builds a
row's cache from mlx-lm's classes, for the single lane, whose row may move into a text batch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

__all__ = ["language_model", "make_cache", "needs_positions", "supports_model", "upstream_kv_cache"]

log = logging.getLogger(__name__)


def needs_positions(model: Any) -> bool:
    """Whether ``model``'s rows carry position ids (Qwen3.5's multimodal rope)."""
    model_type = getattr(getattr(model, "config", None), "model_type", "") or ""
    return model_type.startswith("qwen3_5")


def supports_model(model: Any) -> bool:
    """True when ``model``'s decoding can move into a batch as is: a plain KV cache per
    layer (what mlx-vlm's ``BatchKVCache.merge`` takes) and no per-row position ids."""
    from mlx_vlm.models.cache import KVCache

    lm = getattr(model, "language_model", model)
    if needs_positions(model):
        return False
    make = getattr(lm, "make_cache", None)
    if make is None:
        return hasattr(lm, "layers")
    return all(type(c) is KVCache for c in make())


def language_model(path: Path, model: Any) -> Any | None:
    """mlx-lm's class for the checkpoint at ``path`` holding the resident ``model``'s weight
    arrays, or None where mlx-lm cannot build one with the same parameters."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model as load_lm

    resident = getattr(model, "language_model", model)
    try:
        twin, _config = load_lm(path, lazy=True)  # lazy: its own arrays are never read
    except Exception as exc:  # noqa: BLE001 - no mlx-lm class for this checkpoint: no text lane
        log.info("no text lane: mlx-lm cannot build %s (%s); its rows run in mlx-vlm's batch", path, exc)
        return None
    ours = dict(tree_flatten(resident.parameters()))
    theirs = dict(tree_flatten(twin.parameters()))
    same = ours.keys() == theirs.keys() and all(
        ours[k].shape == theirs[k].shape and ours[k].dtype == theirs[k].dtype for k in ours
    )
    if not same:
        log.info(
            "no text lane: mlx-lm's parameters for %s differ from mlx-vlm's; its rows run in mlx-vlm's batch", path
        )
        return None
    twin.load_weights(list(ours.items()))  # the resident arrays, shared
    return twin


def make_cache(model: Any) -> list[Any]:
    """A fresh per-layer KV cache of the kind the text lane's batch merges, for ``model`` (what
    ``language_model`` returned): for the single lane, whose row may move into a text batch."""
    from mlx_lm.models.cache import make_prompt_cache

    caches: list[Any] = make_prompt_cache(model)
    return caches


def upstream_kv_cache(model: Any) -> list[Any]:
    """A fresh per-layer KV cache of mlx-vlm's classes for ``model`` (what ``language_model``
    returned): for a single-lane row that may move into the batch lane, whose generator merges
    mlx-vlm's caches. mlx-lm's model runs on them as on its own (``update_and_fetch``,
    ``offset``, ``make_mask``); ``supports_model`` admits plain-KV models only."""
    from mlx_vlm.models.cache import KVCache

    return [KVCache() for _ in model.layers]
