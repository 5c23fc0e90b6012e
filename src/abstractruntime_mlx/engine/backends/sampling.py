"""Samplers: one random stream per request, drawn row by row inside a shared batch.

Sampling draws from explicit keys, never from MLX's global random state: that global
state, advanced on the worker thread, aborts the interpreter at exit ("terminate called
without an active exception"). mlx-lm's samplers are compiled over the global state, hence
these.

Each sampled request owns a ``RowStream``: its temperature, top_k, top_p, min_p and seed.
Its n-th token draws with a key derived from ``(seed, n)`` alone, so a seeded request gets
the same tokens whatever else shares its batch, and in whichever lane it runs.
``sample_rows`` draws one token for every row of a batch, each with its own controls;
greedy rows (``None``) take the argmax. Penalties and logit bias are logits processors,
applied per row before sampling (``backend.make_logits_processors``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import cast

import mlx.core as mx

from ...controls import Sampling
from .rows import SampledLogprob

_NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1


def _stream_key(seed: int, position: int) -> tuple[int, int]:
    """The key of token ``position`` of the stream ``seed`` (splitmix64 of both), as MLX's two words."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z >> 32, z & 0xFFFFFFFF


class RowStream:
    """One sampled request's controls and random stream; ``position`` counts its draws."""

    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "position")

    def __init__(self, sampling: Sampling) -> None:
        self.temperature = float(sampling.temperature or 0.0)
        self.top_k = int(sampling.top_k or 0)
        self.top_p = float(sampling.top_p or 0.0)
        self.min_p = float(sampling.min_p or 0.0)
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little")
        if not 0 <= seed <= _MASK64:
            raise ValueError(f"seed {seed} is outside [0, 2**64 - 1]")
        self.seed = int(seed)
        self.position = 0

    @classmethod
    def for_sampling(cls, sampling: Sampling) -> RowStream | None:
        """The stream of a sampled request, or None for a greedy one (temperature 0)."""
        return None if not sampling.temperature else cls(sampling)

    def next_key(self) -> tuple[int, int]:
        key = _stream_key(self.seed, self.position)
        self.position += 1
        return key


def sample_rows(logprobs: mx.array, rows: Sequence[RowStream | None]) -> mx.array:
    """One token per row of ``logprobs`` (B, V), row ``i`` drawn with ``rows[i]``'s controls.

    A control no row uses adds no work; a row that does not use a control present in the
    batch sees it as the identity, so each row's draw is the same in any batch.
    """
    if not any(rows):
        return mx.argmax(logprobs, axis=-1)
    lp = logprobs
    top_k = [r.top_k if r else 0 for r in rows]
    top_p = [r.top_p if r and 0.0 < r.top_p < 1.0 else 1.0 for r in rows]
    if any(top_k) or any(p < 1.0 for p in top_p):
        # One sort serves both (a sort of values is far cheaper than an argsort on CPU).
        descending = -mx.sort(-lp, axis=-1)
        if any(top_k):
            lp, descending = _top_k(lp, descending, mx.array(top_k)[:, None])
        if any(p < 1.0 for p in top_p):
            lp = _top_p(lp, descending, mx.array(top_p)[:, None])
    min_p = [r.min_p if r else 0.0 for r in rows]
    if any(min_p):
        lp = _min_p(lp, mx.array(min_p)[:, None])
    inverse_temperature = mx.array([1.0 / r.temperature if r else 1.0 for r in rows])[:, None]
    keys = mx.array([r.next_key() if r else (0, 0) for r in rows], dtype=mx.uint32)
    drawn = mx.vmap(_draw)(lp * inverse_temperature, keys)
    if all(rows):
        return drawn
    greedy = mx.array([r is None for r in rows])
    return mx.where(greedy, mx.argmax(logprobs, axis=-1), drawn)


def make_sampler(sampling: Sampling) -> Callable[[mx.array], mx.array]:
    """A sampler for one request (the serialized and speculative lanes): the same stream and
    draws as its row in a shared batch. Speculative verification hands several positions at
    once; each takes the stream's next key."""
    row = RowStream.for_sampling(sampling)

    def sample(logprobs: mx.array) -> mx.array:
        if row is None:
            return mx.argmax(logprobs, axis=-1)
        flat = logprobs.reshape(-1, logprobs.shape[-1])
        return sample_rows(flat, [row] * flat.shape[0]).reshape(logprobs.shape[:-1])

    return sample


def _draw(logits: mx.array, key: mx.array) -> mx.array:
    return mx.random.categorical(logits, key=key)


def _top_k(logprobs: mx.array, descending: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
    """Keep each row's ``k`` best, ties included (``k`` == 0: keep all); masks the sorted copy alike."""
    vocab = logprobs.shape[-1]
    kth = mx.take_along_axis(descending, mx.clip(k, 1, vocab) - 1, axis=-1)
    on = k > 0
    return mx.where(on & (logprobs < kth), _NEG_INF, logprobs), mx.where(on & (descending < kth), _NEG_INF, descending)


def _top_p(logprobs: mx.array, descending: mx.array, top_p: mx.array) -> mx.array:
    """Keep each row's smallest prefix (by probability) whose mass reaches ``top_p``, ties at
    the cut included (1.0: keep all). The first token always stays."""
    probs = mx.softmax(descending, axis=-1)
    cumulative = mx.cumsum(probs, axis=-1)
    keep = ((cumulative - probs) < top_p) | (top_p >= 1.0)
    count = mx.sum(keep, axis=-1, keepdims=True)
    cutoff = mx.take_along_axis(descending, count - 1, axis=-1)
    return mx.where(logprobs < cutoff, _NEG_INF, logprobs)


def _min_p(logprobs: mx.array, min_p: mx.array) -> mx.array:
    """Drop tokens below ``min_p`` times each row's top probability (0: keep all)."""
    probs = mx.softmax(logprobs, axis=-1)
    threshold = mx.max(probs, axis=-1, keepdims=True) * min_p
    return mx.where(probs < threshold, _NEG_INF, logprobs)


class PendingLogprobs:
    """One row's logprobs of the token in flight, still on the device: the chosen token's
    log-probability and its ``top`` best alternatives (lazy arrays, read once delivered)."""

    __slots__ = ("chosen", "top_ids", "top_values")

    def __init__(self, chosen: mx.array, top_ids: mx.array | None, top_values: mx.array | None) -> None:
        self.chosen, self.top_ids, self.top_values = chosen, top_ids, top_values

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_values) if a is not None]

    def read(self, token_id: int) -> SampledLogprob:
        top: tuple[tuple[int, float], ...] = ()
        if self.top_ids is not None and self.top_values is not None:
            ids, values = self.top_ids.tolist(), self.top_values.tolist()
            top = tuple((int(i), float(v)) for i, v in zip(ids, values))  # type: ignore[arg-type]
        return SampledLogprob(token_id, float(cast(float, self.chosen.item())), top)


def row_logprobs(
    logprobs: mx.array, tokens: mx.array, rows: Sequence[int], tops: Sequence[int]
) -> list[PendingLogprobs]:
    """The logprobs of ``tokens`` (B,) drawn from ``logprobs`` (B, V), for the batch rows
    ``rows`` only, each with its ``tops[i]`` best alternatives.
    Lazy: nothing is computed until the arrays are evaluated. Rows that did not ask cost nothing."""
    index = mx.array(list(rows))
    sub = logprobs[index]
    chosen = mx.take_along_axis(sub, tokens[index][:, None].astype(mx.int32), axis=-1)[:, 0]
    k = min(max(tops), sub.shape[-1])
    top_ids = top_values = None
    if k > 0:
        candidates = mx.argpartition(-sub, kth=k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(sub, candidates, axis=-1)
        order = mx.argsort(-values, axis=-1)
        top_ids = mx.take_along_axis(candidates, order, axis=-1)
        top_values = mx.take_along_axis(values, order, axis=-1)
    out = []
    for j, want in enumerate(tops):
        ids = None if top_ids is None or want == 0 else top_ids[j, :want]
        vals = None if top_values is None or want == 0 else top_values[j, :want]
        out.append(PendingLogprobs(chosen[j], ids, vals))
    return out
