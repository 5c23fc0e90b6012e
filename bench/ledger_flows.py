"""Flow benchmark: what recording every phase event costs concurrent flows, end to end.

    python bench/ledger_flows.py                          # tiny model, 2 concurrent runs, 512-token nodes, 12 rounds
    python bench/ledger_flows.py --runs 8 --rounds 8 --max-output-tokens 64
    python bench/ledger_flows.py --small                  # the ~27M-parameter bench model (slow on CPU)
    python bench/ledger_flows.py --model /path/to/mlx-model --json out.json
    python bench/ledger_flows.py --sibling-ab              # also: sibling-branch batching on vs off

In one process, on one resident model and one SQLite ledger, it runs ``examples/fanout.json``
(four LLM nodes under a parallel node) as ``--runs`` concurrent runs per round, rotating three
identical packs except for one switch:

- ``on``: progress recording on (every phase event becomes a ``progress`` row through the
  batching writer; each node flushes its rows before returning);
- ``off``: the same pack without recording (no ``on_progress`` at all, so no event is even
  computed);
- ``off_b``: a second ``off`` pack, the A/A control: ``off_b / off`` is the noise floor of
  this machine, against which ``on / off`` is read.

Runs, steps and checkpoints are recorded in all three. The order rotates each cycle so that
drift cancels; one warm-up round per pack is dropped. Throughput = completion tokens / wall
seconds of a round. The headline ratio is the median over cycles of (pack / ``off``) in the
same cycle: rounds seconds apart share the machine's background load, so pairing cancels it.

It also accounts for the recording work directly on the ``on`` pack: time the run threads
spend in ``put()`` and blocked in ``flush()``, and the writer thread's CPU time; these are the
only things recording adds, so their share of the round is the cost with no noise.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
EXAMPLE = ROOT / "examples" / "fanout.json"


@dataclass(slots=True)
class Round:
    mode: str
    wall_s: float
    completion_tokens: int
    progress_rows: int

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s


@dataclass(slots=True)
class Accounting:
    """Where recording spends time on the ``on`` pack (summed over measured rounds)."""

    put_calls: int = 0
    put_s: float = 0.0
    flush_calls: int = 0
    flush_s: float = 0.0
    writer_cpu_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def timed(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - started
                with self.lock:
                    if kind == "put":
                        self.put_calls += 1
                        self.put_s += spent
                    else:
                        self.flush_calls += 1
                        self.flush_s += spent

        return wrapper


def _writer_cpu_s(writer: Any) -> float:
    thread = getattr(writer, "_thread", None)  # bench-only peek at the writer's thread
    if thread is None or thread.ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except OSError:
        return 0.0


def _flow(max_output_tokens: int) -> dict[str, Any]:
    flow = json.loads(EXAMPLE.read_text())
    for node in flow["nodes"]:
        if node["type"] == "llm_call":
            node["data"]["effectConfig"]["max_output_tokens"] = max_output_tokens
    return flow


def _round(pack: Any, flow: dict[str, Any], runs: int, mode: str) -> Round:
    from abstractruntime_mlx.runtime_plugin import run_flow

    started = time.perf_counter()
    results = run_flow(copy.deepcopy(flow), runs=runs, pack=pack)
    wall = time.perf_counter() - started
    bad = [r for r in results if r.status != "completed"]
    if bad:
        raise SystemExit(f"run {bad[0].run_id} ended {bad[0].status}: {bad[0].error}")
    tokens = sum(int(n.result["usage"].get("completion_tokens", 0)) for r in results for n in r.nodes)
    rows = sum(len(pack.ledger.node_timeline(r.run_id)) for r in results)
    return Round(mode, wall, tokens, rows)


def compare(packs: dict[str, Any], flow: dict[str, Any], *, runs: int, rounds: int) -> dict[str, Any]:
    """Rotate the packs ``rounds`` times (after one warm-up round each); medians per pack."""
    modes = list(packs)
    for mode in modes:
        _round(packs[mode], flow, runs, mode)
    measured: list[Round] = []
    cycles: list[dict[str, Round]] = []
    for cycle in range(rounds):
        shift = cycle % len(modes)
        order = modes[shift:] + modes[:shift]
        if cycle % 2:
            order.reverse()
        this = {mode: _round(packs[mode], flow, runs, mode) for mode in order}
        cycles.append(this)
        measured.extend(this.values())
    summary: dict[str, Any] = {
        "rounds": [
            {
                "mode": r.mode,
                "wall_s": r.wall_s,
                "tokens": r.completion_tokens,
                "rows": r.progress_rows,
                "tokens_per_s": r.tokens_per_s,
            }
            for r in measured
        ]
    }
    for mode in modes:
        mine = [r for r in measured if r.mode == mode]
        summary[mode] = {
            "median_tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
            "median_wall_s": statistics.median(r.wall_s for r in mine),
            "total_wall_s": sum(r.wall_s for r in mine),
            "progress_rows_per_round": statistics.median(r.progress_rows for r in mine),
            # throughput relative to the baseline (the second pack) in the same cycle: rounds
            # seconds apart share the machine's background load, so the ratio cancels it
            "median_paired_ratio": statistics.median(c[mode].tokens_per_s / c[modes[1]].tokens_per_s for c in cycles),
        }
    return summary


def _load_small_model(path: Path) -> str:
    import _models  # bench/_models.py (bench/ is first on sys.path)

    return str(_models.small_model(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the tiny dense model, or --small)")
    parser.add_argument("--small", action="store_true", help="use bench/_models.small_model (~27M params)")
    parser.add_argument("--runs", type=int, default=2, help="concurrent runs per round")
    parser.add_argument("--rounds", type=int, default=12, help="measured rounds per pack")
    parser.add_argument("--max-output-tokens", type=int, default=512)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--sibling-ab", action="store_true", help="also compare sibling-branch batching on/off")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)

    from abstractruntime_mlx.nodes import ProviderRegistry
    from abstractruntime_mlx.runtime_plugin import build_pack

    report: dict[str, Any] = {"runs": args.runs, "rounds": args.rounds, "max_output_tokens": args.max_output_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model = args.model
        elif args.small:
            model = _load_small_model(Path(tmp) / "small")
        else:
            from abstractruntime_mlx.testing import tiny_model

            model = str(tiny_model(Path(tmp) / "tiny", kind="dense"))
        report["model"] = model
        registry = ProviderRegistry()
        options = {"mlx_max_batch_size": args.max_batch_size}
        url = f"sqlite:///{tmp}/bench.sqlite"
        flow = _flow(args.max_output_tokens)

        def pack(**extra: Any) -> Any:
            return build_pack(url, model=model, registry=registry, provider_options=options, **extra)

        packs = {
            "on": pack(record_progress=True),
            "off": pack(record_progress=False),
            "off_b": pack(record_progress=False),
        }
        accounting = Accounting()
        writer = packs["on"].node.writer
        writer.put = accounting.timed(writer.put, "put")  # type: ignore[method-assign]
        writer.flush = accounting.timed(writer.flush, "flush")  # type: ignore[method-assign]
        cpu_before = _writer_cpu_s(writer)
        try:
            recording = compare(packs, flow, runs=args.runs, rounds=args.rounds)
            accounting.writer_cpu_s = _writer_cpu_s(writer) - cpu_before
        finally:
            for p in packs.values():
                p.close()
        ratio = recording["on"]["median_paired_ratio"]
        noise = recording["off_b"]["median_paired_ratio"]
        on_wall = recording["on"]["total_wall_s"] * (args.rounds + 1) / args.rounds  # accounting includes warm-up
        accounted = {
            "put_us_per_event": 1e6 * accounting.put_s / max(1, accounting.put_calls),
            "events": accounting.put_calls,
            "flush_ms_per_node": 1e3 * accounting.flush_s / max(1, accounting.flush_calls),
            "nodes": accounting.flush_calls,
            "writer_cpu_s": accounting.writer_cpu_s,
            "put_plus_flush_share_pct": 100 * (accounting.put_s + accounting.flush_s) / (on_wall * args.runs),
            "writer_cpu_share_pct": 100 * accounting.writer_cpu_s / on_wall,
        }
        report["recording"] = recording | {
            "ratio_on_over_off": ratio,
            "cost_pct": 100 * (1 - ratio),
            "aa_ratio_off_b_over_off": noise,
            "accounted": accounted,
        }
        print(
            f"model {model}\n{args.runs} concurrent runs x 4 LLM nodes x {args.max_output_tokens} tokens per round; "
            f"{args.rounds} measured rounds per pack (rotating), medians"
        )
        for mode in packs:
            m = recording[mode]
            print(
                f"  {mode:5}: {m['median_tokens_per_s']:9.1f} tok/s  median round {m['median_wall_s']:.3f}s"
                f"  progress rows/round {m['progress_rows_per_round']:.0f}"
            )
        print(
            f"  throughput ratio on/off (median of per-cycle ratios) = {ratio:.4f}  "
            f"-> recording cost {100 * (1 - ratio):+.2f} % (target <= 2 %)"
        )
        print(f"  A/A noise floor off_b/off (same statistic)         = {noise:.4f}  ({100 * (1 - noise):+.2f} %)")
        print(
            f"  accounted recording work: put {accounted['put_us_per_event']:.1f} us/event x {accounted['events']}, "
            f"flush wait {accounted['flush_ms_per_node']:.2f} ms/node x {accounted['nodes']}; "
            f"run-thread share {accounted['put_plus_flush_share_pct']:.2f} %, writer-thread CPU "
            f"{accounted['writer_cpu_s']:.3f}s = {accounted['writer_cpu_share_pct']:.2f} % of the 'on' wall time"
        )

        if args.sibling_ab:
            packs = {"batched": pack(sibling_batching=True), "sequential": pack(sibling_batching=False)}
            try:
                siblings = compare(packs, flow, runs=1, rounds=args.rounds)
            finally:
                for p in packs.values():
                    p.close()
            speedup = siblings["batched"]["median_paired_ratio"]  # throughput batched / sequential
            report["sibling_batching"] = siblings | {"speedup": speedup}
            print("one run of the fan-out flow, sibling-branch batching on vs off:")
            for mode in packs:
                print(f"  {mode:10}: median run {siblings[mode]['median_wall_s']:.3f}s")
            print(f"  throughput batched/sequential (median of per-cycle ratios) = {speedup:.2f}x")
        registry.close()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
