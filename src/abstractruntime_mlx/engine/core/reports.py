"""The reports a finished request carries: how it ran, whether MTP ran, what the prefix cache did.

Each report is a frozen dataclass built by one function (the execution report beside the
request fields it reads, ``request.execution_report``), carried on the engine's
``Outcome`` and turned into its wire dict once, by ``to_wire()``, where the provider builds
the result's metadata (``metadata["execution"]``, ``["speculation"]``, ``["prompt_cache"]``).
Keys with no known value are absent, not zero; the key order is the wire's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# --- speculation -------------------------------------------------------------------------

DEFERRED_UNDER_LOAD = "deferred_under_load"
DEFERRED_MESSAGE = "optional MTP ran target-only in the continuous batch while target-only work waited or ran"


@dataclass(frozen=True, slots=True)
class SpeculationPlan:
    """What the provider decided before submit: whether MTP was asked for, by which level, and
    the depth it runs at (``used``) or the named reason it does not."""

    requested: bool
    mode: str
    source: str
    used: bool
    reason: str | None = None  # set when not used (None: the resolver named no reason)
    message: str | None = None
    num_draft_tokens: int | None = None  # set when requested
    require_acceleration: bool = False
    drafter: str | None = None  # the head that runs (used only)
    head_attach_s: float | None = None  # this request attached the head: what it cost
    head_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class SpeculationCounters:
    """MTP counters since the request's group started. A cohort's rounds are batch-wide and
    upstream sums the per-round mean acceptance, so when ``shared`` they are diagnostics of the
    cohort, not the request's token totals."""

    rounds: int
    accepted_tokens: float
    drafted_tokens: int
    shared: bool


@dataclass(frozen=True, slots=True)
class SpeculationReport:
    """``metadata["speculation"]``: the plan, and what ran (``used``/``reason``/``message`` may
    differ from the plan's: optional MTP deferred under load ran target-only)."""

    plan: SpeculationPlan
    used: bool
    reason: str | None
    message: str | None
    counters: SpeculationCounters | None

    def to_wire(self) -> dict[str, Any]:
        plan = self.plan
        out: dict[str, Any] = {"requested": plan.requested, "mode": plan.mode, "source": plan.source}
        if plan.num_draft_tokens is not None:
            out.update(num_draft_tokens=plan.num_draft_tokens, require_acceleration=plan.require_acceleration)
        out["used"] = self.used
        if self.used:
            out.update(runtime="mlx_vlm", draft_kind="mtp", drafter=plan.drafter)
        if plan.head_attach_s is not None:
            out.update(head_attach_s=plan.head_attach_s, head_bytes=plan.head_bytes)
        if not self.used:
            out["reason"] = self.reason
        if self.message is not None:
            out["message"] = self.message
        counters = self.counters
        if counters is not None:
            out.update(
                rounds=counters.rounds,
                accepted_tokens=counters.accepted_tokens,
                drafted_tokens=counters.drafted_tokens,
                accounting="cohort" if counters.shared else "request",
                counter_semantics="sum_of_round_means_not_batch_token_totals" if counters.shared else "request_tokens",
            )
        return out


def speculation_report(
    plan: SpeculationPlan, counters: SpeculationCounters | None, deferred: bool
) -> SpeculationReport:
    """What ran of ``plan``: deferred under load, it ran target-only (no counters)."""
    if deferred:
        return SpeculationReport(plan, used=False, reason=DEFERRED_UNDER_LOAD, message=DEFERRED_MESSAGE, counters=None)
    return SpeculationReport(plan, used=plan.used, reason=plan.reason, message=plan.message, counters=counters)


# --- prompt cache ------------------------------------------------------------------------

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
