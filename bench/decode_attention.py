"""Fused decode attention (``engine/model/cuda_attention.py``) against upstream's masked path, on
MLX's CUDA backend.

Two measurements, in one process:

1. Attention alone: one decode step's attention over a left-padded batch, as many calls as
   the model has layers, for upstream's masked attention (unfused on CUDA), the kernel, and
   upstream's attention without a mask (the fused vector kernel a plain ``KVCache`` gets).
   Also the largest difference between the kernel's output and upstream's masked output.
2. The model's decode step: ``argmax(model(y, cache))`` with ``mx.async_eval`` each step, at
   each width, on a plain ``KVCache`` (rows of one length, no mask: the forward ceiling of
   ``bench/forward.py``), on mlx-lm's ``BatchKVCache`` with rows of different lengths
   (upstream's masked path: every batch loop's decode), and on that cache with the kernel.

Usage (a GPU machine with mlx-cuda): ``python bench/decode_attention.py --model 4b
--model-dir /tmp/models --widths 16,32,64``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _models
import mlx.core as mx

from abstractruntime_mlx.engine.model import cuda_attention

WARPS = (8, 16)  # the kernel's block sizes compared (32 warps exceed the registers a thread may use)


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Seconds per call of ``fn`` (which returns arrays to evaluate), after one warm call."""
    mx.eval(fn())
    t0 = time.perf_counter()
    out = None
    for _ in range(repeats):
        out = fn()
        mx.async_eval(out)
    mx.eval(out)
    return (time.perf_counter() - t0) / repeats


def attention_alone(width: int, layers: int, heads: int, kv_heads: int, dim: int, length: int) -> dict[str, float]:
    rng = random.Random(width)
    q = mx.random.normal((width, heads, 1, dim)).astype(mx.bfloat16)
    buf = ((length + 255) // 256) * 256  # mlx-lm's cache grows in steps of 256
    k = mx.random.normal((width, kv_heads, buf, dim)).astype(mx.bfloat16)[..., :length, :]
    v = mx.random.normal((width, kv_heads, buf, dim)).astype(mx.bfloat16)[..., :length, :]
    start = mx.array([rng.randrange(0, length // 2) for _ in range(width)], dtype=mx.int32)
    mask = (mx.arange(length)[None, :] >= start[:, None])[:, None, None, :]
    scale = dim**-0.5
    mx.eval(q, k, v, start, mask)

    def chain(call: Callable[[mx.array], mx.array]) -> Callable[[], mx.array]:
        def run() -> mx.array:
            x = q
            for _ in range(layers):  # each layer's output feeds the next query, as in a model
                x = call(x)
            return x

        return run

    repeats = 50 if length < 2000 else 10
    result = {
        "upstream masked": 1e3
        * timed(chain(lambda x: mx.fast.scaled_dot_product_attention(x, k, v, scale=scale, mask=mask)), repeats),
        "upstream unmasked": 1e3
        * timed(chain(lambda x: mx.fast.scaled_dot_product_attention(x, k, v, scale=scale)), repeats),
    }
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask).astype(mx.float32)
    for warps in WARPS:
        result[f"kernel w{warps}"] = 1e3 * timed(
            chain(lambda x: cuda_attention.decode_attention(x, k, v, start, scale, warps=warps)), repeats
        )
        got = cuda_attention.decode_attention(q, k, v, start, scale, warps=warps).astype(mx.float32)
        result["max abs diff"] = max(result.get("max abs diff", 0.0), float(mx.abs(got - want).max().item()))
    return result


def decode_steps(model: Any, rows: list[list[int]], steps: int, kind: str) -> float:
    """Seconds per decode step after prefilling ``rows`` into the cache ``kind`` names."""
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    if kind == "plain":
        length = min(len(r) for r in rows)
        prompt = mx.array([r[:length] for r in rows])
        cache: list[Any] = make_prompt_cache(model)
    else:
        longest = max(len(r) for r in rows)
        padding = [longest - len(r) for r in rows]
        prompt = mx.array([[0] * p + r for p, r in zip(padding, rows)])
        cache = [BatchKVCache(padding) for _ in model.layers]
    cuda_attention.enable(decode=kind == "batch_kernel", prefill=False)
    try:
        y = mx.argmax(model(prompt, cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        t0 = time.perf_counter()
        for _ in range(steps):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(y)
        mx.eval(y)
        return (time.perf_counter() - t0) / steps
    finally:
        cuda_attention.enable(decode=False, prefill=False)


def routed_model(name: str, model_dir: str) -> tuple[Any, int, int, int]:
    """The bench model ``name`` (built under ``model_dir`` if missing) with ``cuda_attention``
    installed, and its query heads, KV heads and head size."""
    import mlx_lm

    root = Path(model_dir)
    path = _models.tiny(root / "tiny") if name == "tiny" else _models.shaped_model(root / f"qwen3-{name}-shape", name)
    model, _ = mlx_lm.load(str(path))
    assert cuda_attention.install(model), "the model's module does not call mlx-lm's attention function"
    layer = model.layers[0].self_attn
    return model, layer.n_heads, layer.n_kv_heads, model.args.head_dim or model.args.hidden_size // layer.n_heads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="4b", choices=["tiny", "0.6b", "4b"])
    parser.add_argument("--model-dir", default="/tmp/arm-bench-models")
    parser.add_argument("--widths", default="16,32,64")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    if not cuda_attention.available():
        raise SystemExit("the kernel needs MLX's CUDA backend (mlx-cuda)")
    model, heads, kv_heads, dim = routed_model(args.model, args.model_dir)
    widths = [int(w) for w in args.widths.split(",")]
    print(f"model {args.model}: {len(model.layers)} layers, {heads} query / {kv_heads} KV heads of {dim}")

    rng = random.Random(0)
    print("\n1. attention alone, one decode step over every layer (ms; the kernel at 8 and 16 warps a block)")
    columns = ["upstream masked", "upstream unmasked", *(f"kernel w{w}" for w in WARPS), "max abs diff"]
    print("| B | keys | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 2) + "|")
    for width in sorted({1, 4, *widths}):
        for length in (150, 600, 4000):
            r = attention_alone(width, len(model.layers), heads, kv_heads, dim, length)
            print(
                f"| {width} | {length} | "
                + " | ".join(f"{r[c]:.3f}" if c == "max abs diff" else f"{r[c]:.2f}" for c in columns)
                + " |"
            )

    print(f"\n2. the model's decode step ({args.steps} steps after the prefill; ms per step, best of {args.repeats})")
    print(
        "| B | plain KVCache (ceiling) | BatchKVCache, upstream | "
        "BatchKVCache, kernel | kernel / upstream | kernel / ceiling |"
    )
    print("|---|---|---|---|---|---|")
    for width in widths:
        rows = [[rng.randrange(100, 5000) for _ in range(rng.randrange(49, 95))] for _ in range(width)]
        best = {
            kind: min(decode_steps(model, rows, args.steps, kind) for _ in range(args.repeats))
            for kind in ("plain", "batch_upstream", "batch_kernel")
        }
        ms = {k: 1e3 * v for k, v in best.items()}
        print(
            f"| {width} | {ms['plain']:.2f} | {ms['batch_upstream']:.2f} | {ms['batch_kernel']:.2f} | "
            f"{ms['batch_upstream'] / ms['batch_kernel']:.2f}x | {ms['plain'] / ms['batch_kernel']:.2f} |"
        )

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
