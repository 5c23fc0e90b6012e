"""Each report builder, from its inputs to the wire dict the result's metadata carries."""

from __future__ import annotations

import json

from abstractruntime_mlx.engine.cache.report import (
    ApcReport,
    PromptCacheReport,
    in_process_cache_report,
    unreached_cache_report,
)
from abstractruntime_mlx.engine.core.reports import SpeculationCounters, SpeculationPlan, speculation_report
from abstractruntime_mlx.engine.core.request import (
    DecodePath,
    EngineRequest,
    ExclusiveReason,
    ExecutionMode,
    execution_report,
)


def wire(value: dict) -> str:
    """The JSON the wire carries: key order included."""
    return json.dumps(value)


def test_execution_report_of_a_request_that_ran() -> None:
    request = EngineRequest("r", [1, 2, 3], max_tokens=4, submitted_at=10.0)
    request.mode, request.path, request.exclusive_reason = (
        ExecutionMode.EXCLUSIVE,
        DecodePath.SERIAL,
        ExclusiveReason.SERIALIZED_LANE,
    )
    request.peak_batch_size, request.started_at, request.first_token_at = 1, 10.5, 11.2500004
    assert wire(execution_report(request).to_wire()) == wire(
        {
            "mode": "exclusive",
            "path": "serial",
            "reason": "serialized_lane",
            "peak_batch_size": 1,
            "queue_s": 0.5,
            "ttft_s": 1.25,
        }
    )


def test_execution_report_of_a_request_that_never_started_is_empty() -> None:
    assert execution_report(EngineRequest("r", [1], max_tokens=1)).to_wire() == {}


OFF = SpeculationPlan(requested=False, mode="off", source="call", used=False, reason="disabled_for_this_call")
RUNS = SpeculationPlan(
    requested=True,
    mode="native_mtp",
    source="call",
    used=True,
    num_draft_tokens=2,
    require_acceleration=True,
    drafter="/m/head",
)


def test_speculation_off_names_its_reason() -> None:
    assert wire(speculation_report(OFF, None, False).to_wire()) == wire(
        {"requested": False, "mode": "off", "source": "call", "used": False, "reason": "disabled_for_this_call"}
    )


def test_speculation_refused_by_the_plan_keeps_its_depth_and_message() -> None:
    plan = SpeculationPlan(
        requested=True,
        mode="native_mtp",
        source="run",
        used=False,
        reason="structured_output",
        message="no drafts under a grammar",
        num_draft_tokens=3,
    )
    assert wire(speculation_report(plan, None, False).to_wire()) == wire(
        {
            "requested": True,
            "mode": "native_mtp",
            "source": "run",
            "num_draft_tokens": 3,
            "require_acceleration": False,
            "used": False,
            "reason": "structured_output",
            "message": "no drafts under a grammar",
        }
    )


def test_speculation_that_ran_carries_its_counters_per_request_or_per_cohort() -> None:
    head = {
        "requested": True,
        "mode": "native_mtp",
        "source": "call",
        "num_draft_tokens": 2,
        "require_acceleration": True,
    }
    ran = {**head, "used": True, "runtime": "mlx_vlm", "draft_kind": "mtp", "drafter": "/m/head"}
    alone = speculation_report(
        RUNS, SpeculationCounters(rounds=4, accepted_tokens=5.0, drafted_tokens=8, shared=False), False
    )
    assert wire(alone.to_wire()) == wire(
        {
            **ran,
            "rounds": 4,
            "accepted_tokens": 5.0,
            "drafted_tokens": 8,
            "accounting": "request",
            "counter_semantics": "request_tokens",
        }
    )
    cohort = speculation_report(
        RUNS, SpeculationCounters(rounds=4, accepted_tokens=1.5, drafted_tokens=8, shared=True), False
    )
    assert cohort.to_wire()["accounting"] == "cohort"
    assert cohort.to_wire()["counter_semantics"] == "sum_of_round_means_not_batch_token_totals"
    assert wire(speculation_report(RUNS, None, False).to_wire()) == wire(ran)


def test_speculation_deferred_under_load_ran_target_only() -> None:
    attached = SpeculationPlan(
        requested=True,
        mode="native_mtp",
        source="call",
        used=True,
        num_draft_tokens=2,
        drafter="/m/head",
        head_attach_s=0.25,
        head_bytes=1024,
    )
    counters = SpeculationCounters(rounds=1, accepted_tokens=1.0, drafted_tokens=2, shared=False)
    report = speculation_report(attached, counters, True)
    assert report.used is False and report.reason == "deferred_under_load" and report.counters is None
    assert wire(report.to_wire()) == wire(
        {
            "requested": True,
            "mode": "native_mtp",
            "source": "call",
            "num_draft_tokens": 2,
            "require_acceleration": False,
            "used": False,
            "head_attach_s": 0.25,
            "head_bytes": 1024,
            "reason": "deferred_under_load",
            "message": "optional MTP ran target-only in the continuous batch while target-only work waited or ran",
        }
    )


APC = ApcReport(
    stores=2,
    exact_stores=0,
    hits=1,
    exact_hits=0,
    misses=0,
    memory_skips=0,
    rejects=0,
    disk_hits=1,
    disk_corrupt=0,
    shared=True,
    memory_max_bytes=1 << 20,
    resident_bytes=4096,
)


def test_a_measured_prompt_cache_report_with_its_counters_and_break() -> None:
    report = PromptCacheReport(
        "k", "partial", backend="mlx_vlm_apc", cached_tokens=32, fed_tokens=8, apc=APC, degraded_reason="evicted"
    )
    located = {"token": 32, "segment": "message", "message_index": 1}
    assert wire(report.to_wire(located)) == wire(
        {
            "mode": "key",
            "key": "k",
            "backend": "mlx_vlm_apc",
            "cached_tokens": 32,
            "fed_tokens": 8,
            "outcome": "partial",
            "apc": {
                "stores": 2,
                "exact_stores": 0,
                "hits": 1,
                "exact_hits": 0,
                "misses": 0,
                "memory_skips": 0,
                "rejects": 0,
                "disk_hits": 1,
                "disk_corrupt": 0,
                "accounting": "shared",
                "memory_max_bytes": 1 << 20,
                "resident_bytes": 4096,
            },
            "degraded_reason": "evicted",
            "prefix_break": located,
        }
    )
    assert "prefix_break" not in report.to_wire()


def test_prompt_cache_reports_of_requests_the_cache_did_not_serve() -> None:
    assert wire(in_process_cache_report("k").to_wire()) == wire(
        {
            "mode": "key",
            "key": "k",
            "outcome": "not_supported",
            "reason": "in_process_lane",
            "message": "mlx-vlm's in-process lane (mlx_batching=False with MTP) prefills every prompt in full; "
            "prefix reuse runs on the mlx-lm lane (speculation=False) or with mlx_batching=True",
        }
    )
    assert wire(unreached_cache_report("k").to_wire()) == wire({"mode": "key", "key": "k", "outcome": "not_reached"})
