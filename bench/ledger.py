"""Ledger benchmark: what recording phase events costs.

    python bench/ledger.py                       # SQLite file in a temporary directory
    python bench/ledger.py --rows 200000 --url postgresql+psycopg://user@host/db
    python bench/ledger.py --json out.json

Measures, in one process:

1. sustained append rate: rows/s from the first ``put()`` until ``flush()`` returns, through
   ``ProgressWriter`` (batched, one transaction per batch), against one row per transaction
   (``Ledger.append_progress([row])``, what recording synchronously would cost);
2. enqueue cost: µs per event of a producer loop calling ``writer.put()`` while the writer is
   busy writing, against the same loop calling a no-op sink (``NullSink.put``), with the
   per-call p50/p99/max of ``put()`` itself (flooded: the queue backs up);
3. ``put()`` latency when events arrive paced at ``--paced-rate`` events/s.

``compare_flow(run_flow)`` is the hook for the flow-level on/off comparison: pass a callable
that runs a flow once with a ``ProgressWriter`` (recording on) or ``None`` (off).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from abstractruntime_mlx.ledger import Ledger, NodeKey, ProgressEvent, ProgressWriter, sqlite_url

EVENT_TEMPLATE: dict[str, Any] = {
    "kind": "llm",
    "phase": "generate",
    "prompt_tokens": 812,
    "cached_tokens": 512,
    "fed_tokens": 300,
    "generated_tokens": 0,
    "ttft_s": 0.131,
    "tokens_per_second": 48.2,
    "elapsed_s": 1.25,
    "final": False,
}


class NullSink:
    """The no-op baseline: same call shape as ``ProgressWriter.put``."""

    def put(self, event: dict[str, Any], key: NodeKey, *, idempotency_key: str | None = None) -> str:
        return ""


@dataclass(frozen=True, slots=True)
class SustainedRate:
    rows: int
    seconds: float
    rows_per_s: float
    batches: int
    mean_batch: float


@dataclass(frozen=True, slots=True)
class EnqueueCost:
    rows: int
    baseline_us_per_row: float  # build the event + call NullSink.put
    writer_us_per_row: float  # build the event + call ProgressWriter.put (writer thread busy)
    put_overhead_us: float  # the difference
    ratio: float  # writer / baseline
    put_p50_us: float
    put_p99_us: float
    put_max_us: float


@dataclass(frozen=True, slots=True)
class PacedPut:
    rows: int
    events_per_s: float  # achieved producer rate
    put_p50_us: float
    put_p99_us: float
    put_max_us: float
    batches: int


@dataclass(frozen=True, slots=True)
class FlowComparison:
    off_s: list[float]
    on_s: list[float]
    median_off_s: float
    median_on_s: float
    overhead_ratio: float  # median_on / median_off


def _keys(run_id: str, nodes: int) -> list[NodeKey]:
    return [NodeKey(run_id, f"llm{n}", workflow_id="bench", step_id=f"step{n}", attempt=1) for n in range(nodes)]


def measure_sustained_rate(
    ledger: Ledger, rows: int, *, nodes: int = 8, run_id: str = "bench-sustained"
) -> SustainedRate:
    keys = _keys(run_id, nodes)
    writer = ledger.progress_writer()
    try:
        start = time.perf_counter()
        for i in range(rows):
            event = dict(EVENT_TEMPLATE)
            event["event_index"] = i
            writer.put(event, keys[i % nodes])
        writer.flush(timeout_s=600)
        seconds = time.perf_counter() - start
        batches = writer.batches
    finally:
        writer.stop()
    return SustainedRate(rows, seconds, rows / seconds, batches, rows / max(1, batches))


def measure_sync_rate(ledger: Ledger, rows: int, *, run_id: str = "bench-sync") -> SustainedRate:
    key = _keys(run_id, 1)[0]
    start = time.perf_counter()
    for i in range(rows):
        event = dict(EVENT_TEMPLATE)
        event["event_index"] = i
        ledger.append_progress([ProgressEvent(key, event, f"{run_id}:{i}", time.time())])
    seconds = time.perf_counter() - start
    return SustainedRate(rows, seconds, rows / seconds, rows, 1.0)


def _producer_loop(sink: NullSink | ProgressWriter, keys: list[NodeKey], rows: int, offset: int) -> float:
    nodes = len(keys)
    start = time.perf_counter_ns()
    for i in range(offset, offset + rows):
        event = dict(EVENT_TEMPLATE)
        event["event_index"] = i
        sink.put(event, keys[i % nodes])
    return (time.perf_counter_ns() - start) / 1000 / rows


def _put_latencies(writer: ProgressWriter, keys: list[NodeKey], rows: int, offset: int) -> list[float]:
    nodes = len(keys)
    out: list[float] = []
    clock = time.perf_counter_ns
    for i in range(offset, offset + rows):
        event = dict(EVENT_TEMPLATE)
        event["event_index"] = i
        t0 = clock()
        writer.put(event, keys[i % nodes])
        out.append((clock() - t0) / 1000)
    return out


def measure_enqueue_cost(ledger: Ledger, rows: int, *, nodes: int = 8, rounds: int = 3) -> EnqueueCost:
    keys = _keys("bench-enqueue", nodes)
    null = NullSink()
    writer = ledger.progress_writer()
    baseline: list[float] = []
    with_writer: list[float] = []
    offset = 0
    try:
        _producer_loop(null, keys, min(rows, 10_000), 0)  # warm-up
        for _ in range(rounds):  # interleaved, best of rounds, so drift hits both sides
            baseline.append(_producer_loop(null, keys, rows, 0))
            with_writer.append(_producer_loop(writer, keys, rows, offset))
            offset += rows
        latencies = sorted(_put_latencies(writer, keys, rows, offset))
        writer.flush(timeout_s=600)
    finally:
        writer.stop()
    base, mine = min(baseline), min(with_writer)
    return EnqueueCost(
        rows=rows,
        baseline_us_per_row=base,
        writer_us_per_row=mine,
        put_overhead_us=mine - base,
        ratio=mine / base,
        put_p50_us=latencies[len(latencies) // 2],
        put_p99_us=latencies[int(len(latencies) * 0.99)],
        put_max_us=latencies[-1],
    )


def measure_paced_put(ledger: Ledger, *, events_per_s: float = 1000.0, seconds: float = 3.0) -> PacedPut:
    """``put()`` latency when events arrive at a steady rate (a few busy nodes), not as a flood."""
    keys = _keys("bench-paced", 8)
    rows = int(events_per_s * seconds)
    period = 1.0 / events_per_s
    latencies: list[float] = []
    writer = ledger.progress_writer()
    try:
        start = time.perf_counter()
        for i in range(rows):
            event = dict(EVENT_TEMPLATE)
            event["event_index"] = i
            t0 = time.perf_counter_ns()
            writer.put(event, keys[i % 8])
            latencies.append((time.perf_counter_ns() - t0) / 1000)
            delay = start + (i + 1) * period - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        elapsed = time.perf_counter() - start
        writer.flush(timeout_s=600)
        batches = writer.batches
    finally:
        writer.stop()
    latencies.sort()
    return PacedPut(
        rows=rows,
        events_per_s=rows / elapsed,
        put_p50_us=latencies[len(latencies) // 2],
        put_p99_us=latencies[int(len(latencies) * 0.99)],
        put_max_us=latencies[-1],
        batches=batches,
    )


def compare_flow(
    run_flow: Callable[[ProgressWriter | None], object],
    *,
    url: str | None = None,
    repeats: int = 3,
) -> FlowComparison:
    """Time ``run_flow(None)`` (recording off) against ``run_flow(writer)`` (recording on).

    ``run_flow`` runs one flow to completion; with a writer it must ``put()`` its phase events
    and ``flush()`` before returning, as the nodes do. Runs alternate off/on ``repeats`` times
    on a ledger at ``url`` (default: a fresh SQLite file).
    """
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger(url or sqlite_url(Path(tmp) / "flow.db"))
        off: list[float] = []
        on: list[float] = []
        try:
            writer = ledger.progress_writer()
            for _ in range(repeats):
                start = time.perf_counter()
                run_flow(None)
                off.append(time.perf_counter() - start)
                start = time.perf_counter()
                run_flow(writer)
                on.append(time.perf_counter() - start)
            writer.stop()
        finally:
            ledger.close()
    median_off, median_on = statistics.median(off), statistics.median(on)
    return FlowComparison(off, on, median_off, median_on, median_on / median_off)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000, help="rows for the sustained-rate run")
    parser.add_argument("--enqueue-rows", type=int, default=50_000, help="rows per enqueue-cost round")
    parser.add_argument("--sync-rows", type=int, default=2_000, help="rows for the one-row-per-transaction run")
    parser.add_argument("--paced-rate", type=float, default=1000.0, help="events/s for the paced put() run")
    parser.add_argument("--url", help="ledger URL (default: SQLite file in a temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        url = args.url or sqlite_url(Path(tmp) / "bench.db")
        with Ledger(url) as ledger:
            sustained = measure_sustained_rate(ledger, args.rows)
            sync = measure_sync_rate(ledger, args.sync_rows)
            enqueue = measure_enqueue_cost(ledger, args.enqueue_rows)
            paced = measure_paced_put(ledger, events_per_s=args.paced_rate)

    print(f"ledger on {url.split(':', 1)[0]}, python {sys.version.split()[0]}")
    print(
        f"sustained via ProgressWriter : {sustained.rows_per_s:>10,.0f} rows/s "
        f"({sustained.rows:,} rows in {sustained.seconds:.2f}s, {sustained.batches} batches, "
        f"mean batch {sustained.mean_batch:.0f})"
    )
    print(f"one row per transaction      : {sync.rows_per_s:>10,.0f} rows/s ({sync.rows:,} rows)")
    print(f"  batching speed-up          : {sustained.rows_per_s / sync.rows_per_s:>10.1f}x")
    print(f"producer loop, no-op sink    : {enqueue.baseline_us_per_row:>10.2f} us/event (build event + call)")
    print(f"producer loop, writer.put    : {enqueue.writer_us_per_row:>10.2f} us/event (writer busy)")
    print(f"  put() overhead             : {enqueue.put_overhead_us:>10.2f} us/event")
    print(f"  ratio writer / no-op       : {enqueue.ratio:>10.2f}x")
    print(
        f"  put() latency              :   p50 {enqueue.put_p50_us:.2f} us, p99 {enqueue.put_p99_us:.2f} us, "
        f"max {enqueue.put_max_us:.0f} us  (flooded: backlog of queued rows)"
    )
    print(
        f"paced at {paced.events_per_s:,.0f} events/s     :   p50 {paced.put_p50_us:.2f} us, "
        f"p99 {paced.put_p99_us:.2f} us, max {paced.put_max_us:.0f} us ({paced.batches} batches)"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "url_scheme": url.split(":", 1)[0],
                    "sustained": asdict(sustained),
                    "sync": asdict(sync),
                    "enqueue": asdict(enqueue),
                    "paced": asdict(paced),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
