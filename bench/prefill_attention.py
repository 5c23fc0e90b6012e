"""Prompt chunks' attention in plain ops (``engine/model/cuda_attention.py``, ``prefill_attention``)
against upstream's path (cuDNN's fused kernel), on MLX's CUDA backend.

Two measurements, in one process, on the thread that runs everything (cuDNN keeps its plans
per thread):

1. Attention alone: a prompt chunk's attention over a left-padded batch, as many chained calls
   as the model has layers, for each (rows, queries, keys): the first call at that shape (what
   a server meeting it pays) and the warm call, upstream against plain ops. Sets
   ``SMALL_SCORES``: where ops stop being as fast as cuDNN once both are warm.
2. A server's prefill: mlx-lm's ``PromptProcessingBatch`` prefilling rows of 51-94 tokens at
   widths never seen before (as arrivals make them), then the first decode steps at that width,
   upstream against plain ops (with the fused decode kernel on in both). The two paths run at
   different widths so that each meets its shapes first.

Usage (a GPU machine with mlx-cuda): ``python bench/prefill_attention.py --model 4b
--model-dir /tmp/models``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from decode_attention import routed_model

from abstractruntime_mlx.engine.model import cuda_attention

CHUNKS = (
    (1, 64, 64),
    (8, 64, 64),
    (64, 64, 64),
    (64, 96, 96),
    (8, 256, 256),
    (64, 128, 128),
    (64, 256, 256),
    (1, 256, 1024),
    (1, 256, 4096),
    (8, 256, 1024),
    (8, 256, 2048),
    (1, 2048, 2048),
    (4, 512, 512),
)


def ms(t0: float) -> float:
    return 1e3 * (time.perf_counter() - t0)


def attention_alone(
    width: int, length: int, keys: int, layers: int, heads: int, kv_heads: int, dim: int
) -> dict[str, float]:
    rng = random.Random(width * keys)
    q = mx.random.normal((width, heads, length, dim)).astype(mx.bfloat16)
    k = mx.random.normal((width, kv_heads, keys, dim)).astype(mx.bfloat16)
    v = mx.random.normal((width, kv_heads, keys, dim)).astype(mx.bfloat16)
    # Left-padded rows, causal within the chunk: the mask mlx-lm's batch cache makes.
    start = mx.array([rng.randrange(0, max(1, (keys - length) // 2 + 1)) for _ in range(width)])
    causal = mx.arange(keys - length, keys)[:, None] >= mx.arange(keys)[None]
    mask = (causal[None] & (mx.arange(keys)[None, None, :] >= start[:, None, None]))[:, None]
    mx.eval(q, k, v, mask)
    scale = dim**-0.5
    calls: dict[str, Callable[[mx.array], mx.array]] = {
        "upstream": lambda x: mx.fast.scaled_dot_product_attention(x, k, v, scale=scale, mask=mask),
        "ops": lambda x: cuda_attention.prefill_attention(x, k, v, scale, mask),
    }
    result: dict[str, float] = {}
    for name, call in calls.items():

        def run() -> mx.array:
            x = q
            for _ in range(layers):
                x = call(x)
            return x

        t0 = time.perf_counter()
        mx.eval(call(q))  # the first call at this shape, one layer
        result[f"{name} first"] = ms(t0)
        mx.eval(run())
        repeats = 5
        t0 = time.perf_counter()
        for _ in range(repeats):
            mx.eval(run())
        result[f"{name} warm"] = ms(t0) / repeats
    got = calls["ops"](q).astype(mx.float32)
    want = calls["upstream"](q).astype(mx.float32)
    result["max abs diff"] = float(mx.abs(got - want).max().item())
    return result


def serving_prefill(model: Any, width: int, rng: random.Random) -> dict[str, float]:
    """One prompt batch at ``width`` rows: the prefill (its first run at that shape) and the
    first two decode steps at that width, as mlx-lm's batch loop runs them."""
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import make_prompt_cache

    prompts = [[rng.randrange(100, 5000) for _ in range(rng.randrange(51, 95))] for _ in range(width)]
    timings = []
    for _ in range(2):  # the first run at this shape, then a warm one
        batch = PromptProcessingBatch(
            model,
            uids=list(range(width)),
            caches=[make_prompt_cache(model) for _ in range(width)],
            prefill_step_size=256,
        )
        t0 = time.perf_counter()
        batch.prompt([p[:-1] for p in prompts])
        timings.append(ms(t0))
    t0 = time.perf_counter()
    gen = batch.generate([p[-1:] for p in prompts])
    gen.next()
    first_step = ms(t0)
    t0 = time.perf_counter()
    gen.next()
    gen.next()
    later_step = ms(t0) / 2
    return {
        "prefill": timings[0],
        "warm prefill": timings[1],
        "first decode step": first_step,
        "later decode step": later_step,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="4b", choices=["tiny", "0.6b", "4b"])
    parser.add_argument("--model-dir", default="/tmp/arm-bench-models")
    parser.add_argument(
        "--widths", default="5,13,21,29,37,45,53,61", help="widths the upstream path meets; ops meets each + 1"
    )
    args = parser.parse_args(argv)
    if not cuda_attention.available():
        raise SystemExit("this compares against cuDNN: it needs MLX's CUDA backend (mlx-cuda)")
    model, heads, kv_heads, dim = routed_model(args.model, args.model_dir)
    layers = len(model.layers)
    print(
        f"model {args.model}: {layers} layers, {heads} query / {kv_heads} KV "
        f"heads of {dim}; SMALL_SCORES = {cuda_attention.SMALL_SCORES:,}"
    )

    print(f"\n1. a prompt chunk's attention alone (ms: the first call at the shape, one layer; warm, {layers} layers)")
    columns = ["upstream first", "ops first", "upstream warm", "ops warm", "max abs diff"]
    print("| rows | queries | keys | scores | routed | " + " | ".join(columns) + " | ops / upstream warm |")
    print("|---" * (len(columns) + 6) + "|")
    for width, length, keys in CHUNKS:
        scores = width * heads * length * keys
        r = attention_alone(width, length, keys, layers, heads, kv_heads, dim)
        cells = " | ".join(f"{r[c]:.4f}" if c == "max abs diff" else f"{r[c]:.2f}" for c in columns)
        print(
            f"| {width} | {length} | {keys} | {scores:,} | "
            f"{'ops' if scores <= cuda_attention.SMALL_SCORES else 'cuDNN'} "
            f"| {cells} | {r['ops warm'] / r['upstream warm']:.2f} |",
            flush=True,
        )

    print("\n2. a server's prompt batch at a width never seen before, 51-94-token prompts (ms)")
    print("| path | rows | prefill (first at the shape) | prefill (warm) | first decode step | later decode step |")
    print("|---|---|---|---|---|---|")
    rng = random.Random(0)
    totals: dict[str, list[float]] = {"upstream": [], "ops": []}
    for width in (int(w) for w in args.widths.split(",")):
        for name, w in (("upstream", width), ("ops", width + 1)):
            cuda_attention.enable(decode=True, prefill=name == "ops")
            try:
                r = serving_prefill(model, w, rng)
            finally:
                cuda_attention.enable(decode=False, prefill=False)
            totals[name].append(r["prefill"])
            print(
                f"| {name} | {w} | {r['prefill']:.1f} | {r['warm prefill']:.1f} | {r['first decode step']:.1f} | "
                f"{r['later decode step']:.1f} |",
                flush=True,
            )
    for name, values in totals.items():
        print(
            f"{name}: prefill at first-seen widths, mean {sum(values) / len(values):.1f} ms, sum {sum(values):.0f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
