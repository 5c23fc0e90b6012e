"""Fused projections (``EngineConfig.fused_projections``): a layer's q/k/v projections in one
matmul and its MLP's gate/up in another, against upstream's separate ones.

    python bench/projections.py --model 4b --widths 1,16,32,64    # a GPU (random bf16 Qwen3-4B shape)
    python bench/projections.py --model tiny --widths 1,4,8        # this machine: checks it runs

Two copies of one checkpoint are loaded with mlx-lm; ``fused_projections.fuse`` stacks the
second's. Per width B (rows of 60-89 prompt tokens over mlx-lm's ``BatchKVCache``, greedy):

- ``separate`` / ``fused``: median ms per decode step, the next step queued before the last
  token is read (``decode_step.forward``), alternating the two models ``--repeats`` times;
- ``prefill separate`` / ``prefill fused``: ms of one B x 256-token prompt forward (warm);
- ``same tokens``: how many of 32 greedy decode tokens per row the two models agree on.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import _models  # bench/_models.py
from decode_step import forward, prefill_ms, prompts

AGREE_STEPS = 32


def greedy_tokens(model: Any, width: int, vocab: int) -> list[list[int]]:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    rows = prompts(width, vocab)
    longest = max(map(len, rows))
    pads = [longest - len(r) for r in rows]
    cache = [BatchKVCache(pads) for _ in model.layers]
    y = mx.argmax(model(mx.array([[0] * p + r for p, r in zip(pads, rows)]), cache=cache)[:, -1, :], axis=-1)
    out = [y]
    for _ in range(AGREE_STEPS - 1):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        out.append(y)
    return mx.stack(out, axis=1).tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", *_models.SHAPES])
    ap.add_argument("--widths", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", default="/tmp/bench-models")
    args = ap.parse_args(argv)

    import mlx.core as mx
    import mlx_lm

    from abstractruntime_mlx.engine.model.fused_projections import fuse

    root = Path(args.model_dir)
    path = _models.tiny(root / "tiny") if args.model == "tiny" else _models.shaped_model(root / args.model, args.model)
    separate = mlx_lm.load(str(path))[0]
    fused = mlx_lm.load(str(path))[0]
    stacked = fuse(fused)
    vocab = int(separate.args.vocab_size)
    print(
        f"# fused projections, {args.model}, {mx.default_device()}, mlx {mx.__version__}; {len(stacked)} arrays stacked"
    )
    print(
        "| B | separate ms/step | fused ms/step | separate / fused | "
        "prefill separate ms | prefill fused ms | same tokens |"
    )
    print("|---|---|---|---|---|---|---|")
    for width in (int(w) for w in args.widths.split(",")):
        steps: dict[str, list[float]] = {"separate": [], "fused": []}
        for _ in range(args.repeats):
            steps["separate"].append(forward(separate, width, vocab))
            steps["fused"].append(forward(fused, width, vocab))
        prefill_ms(separate, width, 256, vocab), prefill_ms(fused, width, 256, vocab)  # shapes warmed
        pre_s, pre_f = prefill_ms(separate, width, 256, vocab), prefill_ms(fused, width, 256, vocab)
        a, b = greedy_tokens(separate, width, vocab), greedy_tokens(fused, width, vocab)
        same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
        s, f = statistics.median(steps["separate"]), statistics.median(steps["fused"])
        print(
            f"| {width} | {s:.2f} | {f:.2f} | {s / f:.2f} | {pre_s:.1f} | {pre_f:.1f} | {same}/{width * AGREE_STEPS} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
