"""Where a batched decode step's time goes: the model's forward alone against upstream's
decoding batch, and a batch formed by the single-request lane's hand-off.

    python bench/decode_step.py --model 4b --widths 16,32     # a GPU (random bf16 Qwen3-4B shape)
    python bench/decode_step.py --model tiny --widths 4,8      # this machine: checks it runs

Every figure is a median ms per decode step at batch width B (B rows of 60-89 prompt tokens,
greedy), measured in one process over the same checkpoint:

- ``forward_lm`` / ``forward_vlm``: ``argmax(model(y, cache))`` over mlx-lm's ``BatchKVCache``,
  step n+1 queued (``mx.async_eval``) before token n is read, with mlx-lm's and mlx-vlm's
  implementation of the model: the floor any batch loop in Python pays.
- ``forward_compiled``: the same forward under ``mx.compile`` over a fixed-capacity cache
  (written in place with ``mx.slice_update`` at an index held in an array, so one trace
  serves every step): what compiling the step would save.
- ``upstream``: mlx-vlm's ``BatchGenerator`` (our ``BatchBackend``) once all B rows decode.
- ``handed_off``: the same after the first row decoded alone on the single lane and moved in
  (``BatchBackend.adopt``) before the others were inserted.

A second table times one prefill forward in a fixed order of shapes: a width and length never
seen, the same again, one row fewer at that length, then a second length: what a new shape
costs beyond the compute, and whether the cost follows the length, the width or both.

A third table (``--single``) times one request decoding alone (ms per token): mlx-lm's
``generate_step`` over mlx-lm's model and over mlx-vlm's, against our single lane
(``SingleBackend``) over mlx-vlm's model: whether a lone request's gap to ``stream_generate``
lies in the model's implementation or in the lane.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import _models  # bench/_models.py (``python bench/X.py`` puts bench/ first on sys.path)

STEPS = 48


def prompts(width: int, vocab: int) -> list[list[int]]:
    return [[(i * 7 + j * 13) % (vocab - 20) + 10 for j in range(60 + (i * 5) % 30)] for i in range(width)]


class _FixedCache:
    """One layer's keys and values in a buffer of fixed capacity, for a compiled step."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    @property
    def offset(self) -> Any:
        return self.state["offset"]

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        import mlx.core as mx

        s = self.state
        s["keys"] = mx.slice_update(s["keys"], keys, s["idx"], axes=(2,))
        s["values"] = mx.slice_update(s["values"], values, s["idx"], axes=(2,))
        s["offset"] = s["offset"] + 1
        s["idx"] = s["idx"] + 1
        return s["keys"], s["values"]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        import mlx.core as mx

        s = self.state
        pos = mx.arange(s["keys"].shape[2])
        keep = (pos[None, :] >= s["left_padding"][:, None]) & (pos[None, :] <= s["idx"])
        return keep[:, None, None, :]


def forward(model: Any, width: int, vocab: int, *, compiled: bool = False) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    rows = prompts(width, vocab)
    longest = max(map(len, rows))
    pads = [longest - len(r) for r in rows]
    cache = [BatchKVCache(pads) for _ in model.layers]
    out = model(mx.array([[0] * p + r for p, r in zip(pads, rows)]), cache=cache)
    y = mx.argmax(getattr(out, "logits", out)[:, -1, :], axis=-1)
    mx.eval(y, [c.state for c in cache])
    layers: Any = cache
    if compiled:
        capacity = ((longest + STEPS + 2 + 255) // 256) * 256
        states = []
        for c in cache:
            pad = [(0, 0), (0, 0), (0, capacity - c._idx), (0, 0)]
            states.append(
                {
                    "keys": mx.pad(c.keys[..., : c._idx, :], pad),
                    "values": mx.pad(c.values[..., : c._idx, :], pad),
                    "offset": c.offset,
                    "left_padding": c.left_padding,
                    "idx": mx.array(c._idx, mx.int32),
                }
            )
        mx.eval(states)
        layers = [_FixedCache(s) for s in states]

    def step(y: Any) -> Any:
        out = model(y[:, None], cache=layers)
        return mx.argmax(getattr(out, "logits", out)[:, -1, :], axis=-1)

    fn = mx.compile(step, inputs=states, outputs=states) if compiled else step
    y = fn(y)  # the trace (compiled) or a warm step
    mx.eval(y)
    times = []
    for _ in range(STEPS):
        t = time.perf_counter()
        nxt = fn(y)
        mx.async_eval(nxt)
        y.tolist()
        y = nxt
        times.append(time.perf_counter() - t)
    mx.eval(y)
    return statistics.median(times) * 1000


def prefill_ms(model: Any, width: int, length: int, vocab: int) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    tokens = mx.array([[(i * 7 + j * 13) % (vocab - 20) + 10 for j in range(length)] for i in range(width)])
    cache = [BatchKVCache([0] * width) for _ in model.layers]
    mx.eval(tokens)
    t = time.perf_counter()
    out = model(tokens, cache=cache)
    mx.eval(getattr(out, "logits", out)[:, -1, :], [c.state for c in cache])
    return (time.perf_counter() - t) * 1000


PREFILL_SHAPES = ((0, 101), (0, 101), (-1, 101), (0, 128), (0, 128), (-4, 128), (-1, 101), (0, 109))
"""(width offset, length) in order: each new (width, length) pair first appears once."""


class _LogitsOf:
    """mlx-vlm's language model as mlx-lm's ``generate_step`` calls a model (logits out)."""

    def __init__(self, lm: Any) -> None:
        self.lm, self.layers = lm, lm.layers

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        return self.lm(inputs, cache=cache, **kwargs).logits


def single_ms(model: Any, vocab: int, stream: Any, *, lane: bool) -> float:
    """Median ms per token of one request decoding 64 tokens alone."""
    import mlx.core as mx

    row = prompts(1, vocab)[0]
    times = []
    if lane:
        from abstractruntime_mlx.engine.backends.rows import RowInput
        from abstractruntime_mlx.engine.backends.single import SingleBackend

        single = SingleBackend(model, stop_criteria=lambda t: False, prefill_step_size=256, stream=stream)
        single.insert(RowInput(row, STEPS + 16))
        while not single.decoding:
            single.step(observe_prefill=False)
        for _ in range(STEPS):
            t = time.perf_counter()
            single.step(observe_prefill=False)
            times.append(time.perf_counter() - t)
        single.close()
    else:
        from mlx_lm.generate import generate_step

        lm = getattr(model, "language_model", model)
        steps = generate_step(mx.array(row), _LogitsOf(lm) if lm is not model else lm, max_tokens=STEPS + 16)
        next(steps)
        for _ in range(STEPS):
            t = time.perf_counter()
            next(steps)
            times.append(time.perf_counter() - t)
        steps.close()
    return statistics.median(times) * 1000


def batch_steps(backend: Any, width: int) -> float:
    gen = backend._gen
    while len(gen._generation_batch) < width or gen._prompt_batch is not None or gen._unprocessed_sequences:
        backend.allow_partial_prefill()
        backend.step(observe_prefill=False)
    times = []
    for _ in range(STEPS):
        t = time.perf_counter()
        backend.step(observe_prefill=False)
        times.append(time.perf_counter() - t)
    backend.close()
    return statistics.median(times) * 1000


def upstream(model: Any, processor: Any, width: int, vocab: int, stream: Any, *, handed_off: bool) -> float:
    import mlx.core as mx

    from abstractruntime_mlx.engine.backends.backend import BatchBackend
    from abstractruntime_mlx.engine.backends.rows import RowInput
    from abstractruntime_mlx.engine.backends.single import SingleBackend

    rows = prompts(width, vocab)
    with mx.stream(stream):
        backend = BatchBackend(model, processor, max_batch_size=width, stream=stream)
        if handed_off:
            tokenizer = getattr(processor, "tokenizer", processor)
            single = SingleBackend(
                model, stop_criteria=tokenizer.stopping_criteria, prefill_step_size=256, stream=stream
            )
            single.insert(RowInput(rows[0], 10_000))
            while not single.decoding:
                single.step(observe_prefill=False)
            backend.adopt(single.detach()[1])
            rows = rows[1:]
        for row in rows:
            backend.insert(RowInput(row, 10_000))
        return batch_steps(backend, width)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", *_models.SHAPES])
    ap.add_argument("--widths", default="4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", default="/tmp/bench-models")
    ap.add_argument("--single", action="store_true", help="also time one request decoding alone")
    args = ap.parse_args(argv)

    import mlx.core as mx
    import mlx_lm
    import mlx_vlm

    root = Path(args.model_dir)
    path = _models.tiny(root / "tiny") if args.model == "tiny" else _models.shaped_model(root / args.model, args.model)
    lm_model = mlx_lm.load(str(path))[0]
    vlm_model, processor = mlx_vlm.load(str(path))
    vlm_lm = getattr(vlm_model, "language_model", vlm_model)
    vocab = int(vlm_lm.args.vocab_size) if hasattr(vlm_lm, "args") else 2000
    stream = mx.new_stream(mx.default_device())
    print(
        f"# decode step, {args.model}, {mx.default_device()}, mlx "
        f"{mx.__version__}; median ms per step over {STEPS} steps"
    )
    print("| B | repeat | forward_lm | forward_vlm | forward_compiled | upstream | handed_off |")
    print("|---|---|---|---|---|---|---|")
    for width in (int(w) for w in args.widths.split(",")):
        for r in range(args.repeats):
            cells = [
                forward(lm_model, width, vocab),
                forward(vlm_lm, width, vocab),
                forward(lm_model, width, vocab, compiled=True),
                upstream(vlm_model, processor, width, vocab, stream, handed_off=False),
                upstream(vlm_model, processor, width, vocab, stream, handed_off=True),
            ]
            print(f"| {width} | {r + 1} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)
    print("\n| B | prompt length | ms |")
    print("|---|---|---|")
    for width in (int(w) for w in args.widths.split(",")):
        for offset, length in PREFILL_SHAPES:
            ms = prefill_ms(vlm_lm, max(1, width + offset), length, vocab)
            print(f"| {max(1, width + offset)} | {length} | {ms:.1f} |", flush=True)
    if args.single:
        print("\n| repeat | generate_step, mlx-lm model | generate_step, mlx-vlm model | single lane, mlx-vlm model |")
        print("|---|---|---|---|")
        for r in range(args.repeats):
            cells = [
                single_ms(lm_model, vocab, stream, lane=False),
                single_ms(vlm_model, vocab, stream, lane=False),
                single_ms(vlm_model, vocab, stream, lane=True),
            ]
            print(f"| {r + 1} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
