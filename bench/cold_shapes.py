"""What first-seen prefill shapes cost a fresh server, with and without ``mlx_prefill_buckets``.

    python bench/cold_shapes.py --model 4b --buckets on     # a GPU: one process per setting
    python bench/cold_shapes.py --model 4b --buckets off
    python bench/cold_shapes.py                             # this machine: tiny model, both settings

A fresh provider (its load timed, the warm-up included) then serves ``--bursts`` bursts of
``--width`` concurrent text requests (8 new tokens each, greedy), every burst at prompt lengths
no earlier burst had (40-250 tokens), as a server meets varied prompts. Printed per setting:
load seconds, TTFT p50/p95 of the bursts' requests, and the mean burst wall: on MLX's CUDA
backend each new (width, length) prefill pays its setup once per worker thread, which buckets
move to load time. Run one setting per process on a GPU (a second engine in the process may
reuse the first one's worker thread, and with it the attention plans that thread built).
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _models  # bench/_models.py


def prompt_of(length: int, salt: int) -> str:
    return " ".join(f"w{(salt * 31 + i * 7) % 97}" for i in range(length))


def run(path: Path, buckets: bool, bursts: int, width: int) -> dict[str, Any]:
    from abstractruntime_mlx import create_llm

    t0 = time.perf_counter()
    llm = create_llm(
        "mlx",
        model=str(path),
        mlx_batching=True,
        mlx_max_batch_size=max(width, 8),
        speculation=False,
        mlx_prefill_buckets=buckets,
    )
    load_s = time.perf_counter() - t0
    ttfts: list[float] = []
    walls: list[float] = []

    def one(text: str) -> float:
        result = llm.generate(text, thinking=False, temperature=0, max_output_tokens=8)
        return float(result.metadata["execution"]["ttft_s"])

    with ThreadPoolExecutor(max_workers=width) as pool:
        for b in range(bursts):
            # Word counts spread so no two bursts share a longest row (a chunk's length).
            lengths = [40 + (b * 23 + i * 11) % 200 for i in range(width)]
            t = time.perf_counter()
            ttfts += pool.map(one, [prompt_of(n, b * width + i) for i, n in enumerate(lengths)])
            walls.append(time.perf_counter() - t)
    llm.unload_model(llm.model)
    ttfts.sort()
    return {
        "buckets": buckets,
        "load_s": round(load_s, 2),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p95_ms": round(1000 * ttfts[int(0.95 * (len(ttfts) - 1))], 1),
        "burst_wall_ms": round(1000 * statistics.mean(walls), 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", *_models.SHAPES])
    ap.add_argument("--buckets", default="both", choices=["on", "off", "both"])
    ap.add_argument("--bursts", type=int, default=12)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--model-dir", default="/tmp/bench-models")
    args = ap.parse_args(argv)
    root = Path(args.model_dir)
    path = (
        _models.tiny(root / "tiny")
        if args.model == "tiny"
        else _models.shaped_model(root / f"qwen3-{args.model}-shape", args.model)
    )
    settings = {"on": [True], "off": [False], "both": [False, True]}[args.buckets]
    print("| buckets | load s | TTFT p50 ms | TTFT p95 ms | burst wall ms |")
    print("|---|---|---|---|---|")
    for buckets in settings:
        r = run(path, buckets, args.bursts, args.width)
        print(
            f"| {'on' if buckets else 'off'} | {r['load_s']} | {r['ttft_p50_ms']} "
            f"| {r['ttft_p95_ms']} | {r['burst_wall_ms']} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
