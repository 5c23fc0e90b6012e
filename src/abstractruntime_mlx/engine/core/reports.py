"""The reports a finished request carries: how it ran and whether MTP ran (what the prefix cache
did: ``cache/report.py``).

Each report is a frozen dataclass built by one function (the execution report beside the
request fields it reads, ``request.execution_report``), carried on the engine's
``Outcome`` and turned into its wire dict once, by ``to_wire()``, where the provider builds
the result's metadata (``metadata["execution"]``, ``["speculation"]``, ``["prompt_cache"]``).
Keys with no known value are absent, not zero; the key order is the wire's.
"""

from __future__ import annotations

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
