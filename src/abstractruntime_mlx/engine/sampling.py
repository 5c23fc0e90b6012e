"""Samplers for the exclusive lane.

Sampling draws from an explicit key chain, never from MLX's global random state: that
global state, advanced on the worker thread, aborts the interpreter at exit ("terminate
called without an active exception"). It also makes a seeded request reproducible whatever
ran before it. mlx-lm's samplers are compiled over the global state, hence these.
"""

from __future__ import annotations

import os
from typing import Callable

import mlx.core as mx

from .request import Sampling

_NEG_INF = float("-inf")


def make_sampler(sampling: Sampling) -> Callable[[mx.array], mx.array]:
    seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
    state = {"key": mx.random.key(int(seed))}
    temperature = float(sampling.temperature)
    top_k = int(sampling.top_k or 0)
    top_p = float(sampling.top_p or 0.0)
    min_p = float(sampling.min_p or 0.0)

    def sample(logprobs: mx.array) -> mx.array:
        if temperature == 0:
            return mx.argmax(logprobs, axis=-1)
        if top_k > 0:
            logprobs = _top_k(logprobs, top_k)
        if 0.0 < top_p < 1.0:
            logprobs = _top_p(logprobs, top_p)
        if min_p > 0.0:
            logprobs = _min_p(logprobs, min_p)
        key, sub = mx.random.split(state["key"])
        state["key"] = key
        return mx.random.categorical(logprobs * (1.0 / temperature), key=sub)

    return sample


def _top_k(logprobs: mx.array, k: int) -> mx.array:
    k = min(k, logprobs.shape[-1])
    kth = mx.sort(logprobs, axis=-1)[..., -k][..., None]
    return mx.where(logprobs < kth, _NEG_INF, logprobs)


def _top_p(logprobs: mx.array, top_p: float) -> mx.array:
    order = mx.argsort(-logprobs, axis=-1)
    sorted_lp = mx.take_along_axis(logprobs, order, axis=-1)
    probs = mx.softmax(sorted_lp, axis=-1)
    cumulative = mx.cumsum(probs, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    keep_sorted = (cumulative - probs) < top_p
    filtered_sorted = mx.where(keep_sorted, sorted_lp, _NEG_INF)
    inverse = mx.argsort(order, axis=-1)
    return mx.take_along_axis(filtered_sorted, inverse, axis=-1)


def _min_p(logprobs: mx.array, min_p: float) -> mx.array:
    probs = mx.softmax(logprobs, axis=-1)
    threshold = mx.max(probs, axis=-1, keepdims=True) * min_p
    return mx.where(probs < threshold, _NEG_INF, logprobs)
