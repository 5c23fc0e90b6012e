"""What the prefix cache did for a keyed request: ``metadata["prompt_cache"]``.

A frozen dataclass built by the cache (``PrefixCache.report``) or by the engine where the
request never reached it, carried on the engine's ``Outcome`` and turned into its wire dict
once, by ``to_wire()``, as the other reports (``core/reports.py``). Keys with no known value are
absent, not zero; the key order is the wire's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

IN_PROCESS_LANE = "in_process_lane"
IN_PROCESS_MESSAGE = (
    "mlx-vlm's in-process lane (mlx_batching=False with MTP) prefills every prompt in full; "
    "prefix reuse runs on the mlx-lm lane (speculation=False) or with mlx_batching=True"
)


@dataclass(frozen=True, slots=True)
class ApcReport:
    """``prompt_cache.apc``: the cache's counters over the request's lifetime (``shared``: other
    rows ran beside it, so the deltas include theirs), its budget and resident bytes at the end."""

    stores: int
    exact_stores: int
    hits: int
    exact_hits: int
    misses: int
    memory_skips: int
    rejects: int
    disk_hits: int
    disk_corrupt: int
    shared: bool
    memory_max_bytes: int
    resident_bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "stores": self.stores,
            "exact_stores": self.exact_stores,
            "hits": self.hits,
            "exact_hits": self.exact_hits,
            "misses": self.misses,
            "memory_skips": self.memory_skips,
            "rejects": self.rejects,
            "disk_hits": self.disk_hits,
            "disk_corrupt": self.disk_corrupt,
            "accounting": "shared" if self.shared else "request",
            "memory_max_bytes": self.memory_max_bytes,
            "resident_bytes": self.resident_bytes,
        }


@dataclass(frozen=True, slots=True)
class PromptCacheReport:
    """``metadata["prompt_cache"]`` of a keyed request: ``outcome`` is ``hit``, ``partial``,
    ``miss`` or ``not_retained`` (measured by the cache, with the counts, ``apc`` and, once a
    prefix warm ran on this cache, ``prefetched_tokens``),
    ``not_supported`` (with ``reason``/``message``) or ``not_reached`` (it ended first)."""

    key: str | None
    outcome: str
    backend: str | None = None
    cached_tokens: int | None = None
    fed_tokens: int | None = None
    apc: ApcReport | None = None
    degraded_reason: str | None = None
    reason: str | None = None
    message: str | None = None
    # Of ``cached_tokens``, those a prefix warm put in RAM (None: no warm ran on this cache).
    prefetched_tokens: int | None = None

    def to_wire(self, prefix_break: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The wire dict; ``prefix_break`` is the located break (``prefix_break.attribute``)."""
        out: dict[str, Any] = {"mode": "key", "key": self.key}
        if self.backend is not None:
            out.update(backend=self.backend, cached_tokens=self.cached_tokens, fed_tokens=self.fed_tokens)
        out["outcome"] = self.outcome
        if self.apc is not None:
            out["apc"] = self.apc.to_wire()
        if self.prefetched_tokens is not None:
            out["prefetched_tokens"] = self.prefetched_tokens
        for name in ("degraded_reason", "reason", "message"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if prefix_break is not None:
            out["prefix_break"] = prefix_break
        return out


def in_process_cache_report(key: str | None) -> PromptCacheReport:
    """mlx-vlm's in-process lane serves a key by a full prefill: said by name."""
    return PromptCacheReport(key, "not_supported", reason=IN_PROCESS_LANE, message=IN_PROCESS_MESSAGE)


def unreached_cache_report(key: str | None) -> PromptCacheReport:
    """The request ended before it reached the cache (rejected, cancelled while waiting)."""
    return PromptCacheReport(key, "not_reached")
