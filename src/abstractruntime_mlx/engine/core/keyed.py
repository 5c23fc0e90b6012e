"""What the engine does for keyed requests (``prompt_cache_key``) with the resident prefix
cache: how an admitted request reuses stored prefixes in its group's layout, what its report
says, and how the scheduler and a warm see the cache. Plain functions over the cache and the
request; ``loop.Engine`` calls them on the worker (``restorable_prefix_tokens``: the caller's
thread).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from ..backends.rows import LaneName, PrefixReuse
from ..cache.prefix_cache import PrefixCache
from ..cache.report import PromptCacheReport, in_process_cache_report
from ..model.model import LoadedModel, Upstream
from .request import EngineRequest, ExecutionMode

__all__ = [
    "SharedPrefixes",
    "cache_report",
    "prefix_reuse",
    "restorable_prefix_tokens",
    "shared_prefixes",
    "warm_stores",
]

log = logging.getLogger(__name__)


def prefix_reuse(
    cache: PrefixCache | None, model: LoadedModel, request: EngineRequest, *, lane: LaneName, mode: ExecutionMode
) -> PrefixReuse | None:
    """How keyed ``request`` reuses stored prefixes in its group's layout (None: unkeyed, or no
    prefix cache); records the layout and the cache's counters on it for its report."""
    if request.prompt_cache_key is None or cache is None:
        return None
    if model.upstream == Upstream.MLX_VLM:
        # mlx-vlm's in-process generation takes no restored cache without the full prompt's
        # rope positions; the key is served by a full prefill, said by name.
        request.prompt_cache = in_process_cache_report(request.prompt_cache_key)
        return None
    if lane == LaneName.SERIAL:
        layout = "serial"
    else:
        layout = "exclusive" if mode == ExecutionMode.EXCLUSIVE else "batch"
    request.cache_layout = layout
    request.cache_counters = cache.counters()
    salt = cache.admit(request, layout)
    if request.warm:
        request.warm_ram_tokens = cache.resident_prefix_tokens(request.prompt_ids, salt, ssd=False)
    return PrefixReuse(
        salt,
        serial=cache.serial if layout == "serial" else None,
        # A warm leaves shared blocks only: its key's resident KV is its real request's.
        key=None if request.warm else request.prompt_cache_key,
    )


def cache_report(cache: PrefixCache, request: EngineRequest) -> PromptCacheReport | None:
    """What the prefix cache did for a keyed request that reached it (``prefix_reuse``); the
    report set at admission if building one fails (a report never fails its request)."""
    assert request.cache_counters is not None and request.cache_layout is not None
    try:
        return cache.report(
            request, request.cache_counters, shared=request.peak_batch_size > 1, layout=request.cache_layout
        )
    except Exception:  # noqa: BLE001 - a report must never fail the request it describes
        log.exception("prefix-cache report failed")
        return request.prompt_cache


def restorable_prefix_tokens(
    loaded: LoadedModel | None, cache: PrefixCache | None, request: EngineRequest
) -> int | None:
    """The prompt tokens of keyed ``request`` the serialized lane's snapshot store restores
    now (the split a start event reports); None on the batched lanes, whose prefix blocks are
    looked up on the worker as prefill starts."""
    if (
        loaded is None
        or loaded.upstream != Upstream.MLX_LM
        or cache is None
        or cache.serial is None
        or request.prompt_cache_key is None
    ):
        return None
    return cache.serial.peek(cache.salt(request, "serial"), request.prompt_ids)


class SharedPrefixes:
    """``scheduler.PrefixIndex`` over the resident prefix cache, in a batch's layout."""

    def __init__(self, cache: PrefixCache) -> None:
        self._cache = cache

    def salt(self, request: EngineRequest) -> int:
        return self._cache.salt(request, "batch")

    def resident_tokens(self, prompt_ids: list[int], salt: int) -> int:
        return self._cache.resident_prefix_tokens(prompt_ids, salt)


def shared_prefixes(cache: PrefixCache | None, model: Any) -> SharedPrefixes | None:
    """The prefix cache as the scheduler sees it, where ``model``'s prefixes are shared as blocks."""
    if cache is None or not cache.shares_blocks(model):
        return None
    return SharedPrefixes(cache)


def warm_stores(cache: PrefixCache | None, rows: Sequence[EngineRequest]) -> contextlib.AbstractContextManager[None]:
    """A warm runs alone on an idle engine: while it does, the blocks it stores make room only
    from blocks needed later than its own (``PrefixCache.storing_ahead``)."""
    if cache is None or not rows or not all(r.warm for r in rows):
        return contextlib.nullcontext()
    return cache.storing_ahead(str(rows[0].prompt_cache_key))
