"""A burst of concurrent streamed requests through our provider, step by step.

    python bench/burst.py --model tiny --concurrency 8
    python bench/burst.py --model 4b --concurrency 16 --burst-gap-ms 2 --single-lane on   # a GPU

c client threads send one request each at once (64 greedy tokens); after two warm-up bursts,
each measured burst prints its wall time, tok/s and TTFT p50, then the worker's steps run-length
encoded: when each run of steps began (ms after the first submit), its backend (``SingleBackend``
= the single lane), how many rows it held, whether a prompt batch was mid-prefill, how many steps
and their mean and max duration. It shows how a burst was admitted: in one prefill, in two, or
through the single lane and its hand-off.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _models  # bench/_models.py (``python bench/X.py`` puts bench/ first on sys.path)

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
MAX_TOKENS = 64


def prompt(i: int, tag: str) -> str:
    return " ".join(WORDS[(i * 3 + k + len(tag)) % len(WORDS)] for k in range(40)) + f" {tag} {i}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", *_models.SHAPES])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--single-lane", choices=["on", "off"], default="on")
    ap.add_argument("--burst-gap-ms", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model-dir", default="/tmp/bench-models")
    args = ap.parse_args(argv)

    from abstractruntime_mlx import create_llm

    root = Path(args.model_dir)
    path = _models.tiny(root / "tiny") if args.model == "tiny" else _models.shaped_model(root / args.model, args.model)
    c = args.concurrency
    llm = create_llm(
        "mlx",
        model=str(path),
        mlx_batching=True,
        mlx_max_batch_size=max(4, c),
        mlx_max_queue_size=max(32, 2 * c),
        speculation=False,
        mlx_single_lane=args.single_lane == "on",
        mlx_burst_gap_ms=args.burst_gap_ms,
    )
    engine = llm._engine
    steps: list[tuple[float, float, str, int, bool]] = []
    step_group = engine._step_group

    def timed_step() -> None:
        group = engine._group
        start = time.perf_counter()
        backend, rows, prefilling = type(group.backend).__name__, len(group.running), bool(group.backend.prefilling)
        step_group()
        steps.append((start, time.perf_counter() - start, backend, rows, prefilling))

    engine._step_group = timed_step

    def call(i: int, tag: str) -> dict[str, Any]:
        start, first = time.perf_counter(), None
        for chunk in llm.generate(
            prompt(i, tag), stream=True, thinking=False, temperature=0, max_output_tokens=MAX_TOKENS
        ):
            if first is None and getattr(chunk, "content", None):
                first = time.perf_counter() - start
        return {"end": time.perf_counter(), "ttft": first}

    def burst(tag: str) -> tuple[float, float, list[dict[str, Any]]]:
        steps.clear()
        with ThreadPoolExecutor(c) as pool:
            t0 = time.perf_counter()
            results = list(pool.map(lambda i: call(i, tag), range(c)))
        return t0, max(r["end"] for r in results) - t0, results

    try:
        for tag in ("warm-1", "warm-2"):
            burst(tag)
        print(f"# burst, {args.model}, c={c}, single lane {args.single_lane}, burst gap {args.burst_gap_ms:g} ms")
        for r in range(args.repeats):
            t0, wall, results = burst(f"r{r}")
            ttft = statistics.median(x["ttft"] for x in results if x["ttft"] is not None) * 1000
            print(
                f"\nburst {r + 1}: wall {wall * 1000:.0f} ms, {c * MAX_TOKENS / wall:.0f} tok/s, TTFT p50 {ttft:.0f} ms"
            )
            print("| at ms | backend | rows | prefilling | steps | mean ms | max ms |")
            print("|---|---|---|---|---|---|---|")
            runs: list[list[Any]] = []
            for start, duration, backend, rows, prefilling in steps:
                if runs and runs[-1][0] == (backend, rows, prefilling):
                    runs[-1][1].append(duration)
                else:
                    runs.append([(backend, rows, prefilling), [duration], start - t0])
            for (backend, rows, prefilling), durations, at in runs:
                print(
                    f"| {at * 1000:.1f} | {backend} | {rows} | {prefilling} | {len(durations)} | "
                    f"{statistics.mean(durations) * 1000:.2f} | {max(durations) * 1000:.1f} |"
                )
    finally:
        llm.unload_model(llm.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
