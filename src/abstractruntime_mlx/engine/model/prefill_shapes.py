"""Bounded prefill lengths for the text lane: each prompt chunk padded to a length bucket, and
the (width, length) shapes run once when the model loads (``EngineConfig.prefill_buckets``).

Why: on MLX's CUDA backend a prefill at a (width, length) never seen before costs 60-470 ms of
host time beyond its compute (cuDNN builds and NVRTC-compiles an attention plan per shape, and
keeps at most 256 plans, per thread), and mlx-lm's batch loop pads a chunk only to its longest
row, so a server meeting varied prompt lengths meets new shapes for as long as it runs. With
buckets the lengths are a fixed few, warmed on the worker thread that will run them
(``docs/provider.md``, "Prefill shapes"; measured in ``docs/benchmarks.md``).

Padding is upstream's own: rows are right-padded (the real tokens never attend to the padding,
the attention being causal) and ``BatchKVCache.finalize`` turns the padding into left padding,
which the mask hides from then on, exactly as upstream pads a batch's shorter rows. The tokens
are the same as unpadded (``tests/test_prefill_shapes.py``); the cost is the padding's compute
and attention over the extra masked positions.

With ``EngineConfig.prefill_attention_ops`` (on by default) chunks of up to
``cuda_attention.SMALL_SCORES`` attention scores build no cuDNN plan at all, so the buckets
matter for longer chunks only.

The warm-up's prompt batch is mlx-lm's, padded to the buckets (``upstream.bucketed_prompt_batch``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx

from .upstream import bucketed_prompt_batch

__all__ = ["Buckets", "length_buckets", "warm", "width_buckets"]

log = logging.getLogger(__name__)

# The shortest length bucket: shorter chunks pad up to it (a few masked positions, not a shape).
SHORTEST = 32


def length_buckets(prefill_step_size: int) -> tuple[int, ...]:
    """Powers of two from ``SHORTEST`` up to the chunk size, which is the last bucket (a chunk
    is never longer)."""
    buckets = []
    length = SHORTEST
    while length < prefill_step_size:
        buckets.append(length)
        length *= 2
    buckets.append(prefill_step_size)
    return tuple(buckets)


def width_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The widths warmed at load: powers of two up to the batch size (a burst's common widths)."""
    return tuple(1 << i for i in range(max_batch_size.bit_length()))


class Buckets:
    """The length and width buckets of one engine (``EngineConfig.prefill_buckets``)."""

    def __init__(self, *, prefill_step_size: int, max_batch_size: int) -> None:
        self.lengths = length_buckets(prefill_step_size)
        self.widths = width_buckets(max_batch_size)

    def length(self, longest: int) -> int:
        return next((b for b in self.lengths if b >= longest), longest)


def warm(model: Any, buckets: Buckets) -> None:
    """Run one prefill at every (width, length) bucket on this thread (cuDNN keeps its plans per
    thread: call it on the worker)."""
    from mlx_lm.models.cache import make_prompt_cache

    cls = bucketed_prompt_batch()
    t0 = time.perf_counter()
    for width in buckets.widths:
        for length in buckets.lengths:
            # The last length bucket is the chunk size: each warm-up prompt is one chunk.
            batch = cls(
                model,
                uids=list(range(width)),
                caches=[make_prompt_cache(model) for _ in range(width)],
                prefill_step_size=buckets.lengths[-1],
            )
            batch.buckets = buckets
            # Every other row one token short: the padded path, as most real batches take it.
            batch.prompt([[1] * (length - (i % 2)) for i in range(width)])
    mx.clear_cache()
    log.info(
        "prefill shapes: %d (width x length) warmed in %.2fs",
        len(buckets.widths) * len(buckets.lengths),
        time.perf_counter() - t0,
    )
