"""The pure-forward ceiling: a loop that only calls the model, for ``bench/concurrency.py``.

At concurrency c, each wave takes c of the point's prompts (cut to the wave's shortest, so
one plain ``KVCache`` holds the batch), prefills them untimed, then times ``max_tokens``
greedy decode steps of ``argmax(model(y[:, None], cache))`` with ``mx.async_eval`` every step
and one sync at the end: no sampling, no detokenisation, no admission, no host read per step.
The waves cover the point's N requests (ceil(N / c) waves of c rows), so the target's tok/s
is c x max_tokens x waves over the summed decode time: what the forward alone sustains at
that width, measured in the same process as the serving targets. Prefill and first-token
latency are not part of it (its TTFT columns stay empty).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Protocol


class PromptIds(Protocol):
    ids: list[int]


class ForwardLoop:
    """``argmax(model(y[:, None], cache))`` over a batch of rows: decode steps and nothing else."""

    def __init__(self) -> None:
        self.model: Any = None

    def setup(self, path: Path) -> None:
        import mlx_lm

        self.model = mlx_lm.load(str(path))[0]

    def teardown(self) -> None:
        import mlx.core as mx

        self.model = None
        mx.clear_cache()

    def wave(self, rows: list[list[int]], max_tokens: int) -> float:
        """Prefill ``rows`` (untimed), then return the seconds of ``max_tokens`` decode steps."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        length = min(len(r) for r in rows)
        prompt = mx.array([r[:length] for r in rows])
        cache = make_prompt_cache(self.model)
        logits = self.model(prompt, cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y)
        t0 = time.perf_counter()
        for _ in range(max_tokens):
            logits = self.model(y[:, None], cache=cache)
            y = mx.argmax(logits[:, -1, :], axis=-1)
            mx.async_eval(y)
        mx.eval(y)
        return time.perf_counter() - t0

    def run(self, prompts: list[PromptIds], c: int, max_tokens: int) -> tuple[int, float, int]:
        """(tokens, decode seconds, decode steps) over ceil(N / c) waves of c rows."""
        waves = math.ceil(len(prompts) / c)
        tokens, seconds = 0, 0.0
        for w in range(waves):
            rows = [prompts[(w * c + i) % len(prompts)].ids for i in range(c)]
            seconds += self.wave(rows, max_tokens)
            tokens += c * max_tokens
        return tokens, seconds, waves * max_tokens
