"""Attention for the text lane's model on MLX's CUDA backend: decode steps in one fused kernel
(``EngineConfig.fused_decode_attention``), short prompt chunks in plain MLX ops
(``EngineConfig.prefill_attention_ops``). The single lane runs that model too, a keyed row on
mlx-vlm's cache classes (those the batch lane merges).

Decode, why: mlx-lm's ``BatchKVCache`` left-pads its rows, so every decode step hands each
layer an array mask, and MLX's CUDA vector-attention kernel refuses array masks
(``supports_sdpa_vector`` requires ``!has_arr_mask``; cuDNN's decode path refuses them too).
Each layer's decode attention then runs unfused (scores matmul, mask, softmax, values matmul),
in every batch loop built on that cache. A decode step's mask says one thing per row: the
first position that is not padding (``BatchKVCache.left_padding``). The kernel below is vector
attention with that start per row, reading the cache's keys and values in place.

Prefill, why: MLX sends a prompt chunk's attention to cuDNN, which builds (and NVRTC-compiles)
a plan for every (rows, queries, keys) shape it has not met on this thread: 41-718 ms of host
time each on the H200 (about 1 s the first time in a process), for a chunk whose attention then
computes in about a millisecond. A
server's prompt batches take their widths from arrivals and their lengths from the prompts,
so it keeps meeting new shapes (``docs/benchmarks.md``). For chunks whose score matrix is small
(``SMALL_SCORES``) the attention here is MLX's own unfused formula, written out: two matmuls and
a softmax, whose kernels are built once, whatever the shape. Larger chunks keep cuDNN, where
its fused kernel pays back the plan (the length buckets of ``prefill_shapes`` bound those).

A keyed request meets the same cost on every reused turn: its suffix over the prefix restored
from the prefix cache is a (queries, keys) shape of its own. On the single lane it is routed;
in the batch lane (mlx-vlm's model) it is not: routed there, 4 sessions' third turns took
6.1-8.2 s against 1.2-1.5 s on the H200 (``docs/benchmarks.md``), a cost not yet explained.

Where each applies (``fits``, ``fits_prefill``): mlx-lm's plain ``KVCache`` or ``BatchKVCache``
(no sliding window, no quantised cache; for prefill also mlx-vlm's ``KVCache``), no attention
sinks; for decode, one
query position, an array mask, a head size up to 256 and enough (row, KV head) pairs for the
cache's length (``MANY_BLOCKS``, ``LONG_CACHE``). Everything else goes to upstream's function
unchanged. Both are routed only on threads that ``enable`` them (the engine's worker), so
other users of the same model class in the process keep upstream's path.

Private upstream names relied on (mlx-lm >=0.31.3,<0.33, mlx-vlm >=0.7.10,<0.8.0,
``tests/test_backend_contract.py``): a model module's ``scaled_dot_product_attention`` (the name
its attention layers call) and mlx-lm's ``BatchKVCache.left_padding``.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx

__all__ = ["available", "decode_attention", "enable", "fits", "fits_prefill", "install", "prefill_attention"]

log = logging.getLogger(__name__)

# Measured on the H200 with the 4B shape (bench/decode_attention.py, docs/benchmarks.md): one
# block per (row, KV head), each warp taking every W-th key. Fewer than MANY_BLOCKS blocks read a
# cache longer than LONG_CACHE keys with too little parallelism: upstream's path was faster
# there (1 row x 4,000 keys: 5.4 ms against 1.9 over 36 layers), so those steps stay on it.
# 8 warps a block did best from 256 blocks up, 16 below; 32 exceed the registers a thread may
# use (at 1,024 threads a block).
MANY_BLOCKS = 128
LONG_CACHE = 1024
MAX_WARPS = 16


def warps_for(blocks: int) -> int:
    return 8 if blocks >= 2 * MANY_BLOCKS else 16


# One block of W warps per (row b, KV head): its G query heads share each key and value read.
# Lane l of each warp holds ceil(D/32) consecutive dims of every query head; a warp scores one key at a
# time (a warp-wide sum per head), keeps a running max, sum of exponentials and weighted values
# per head; the warps' partial results are merged through shared memory, one head at a time.
# Keys before the row's start (its left padding) are never read.
_SOURCE = r"""
    constexpr int PER = (D + 31) / 32;
    const int HQ = q_shape[1];
    const int HKV = k_shape[1];
    const int L = k_shape[2];
    const int b = blockIdx.x / HKV;
    const int kvh = blockIdx.x % HKV;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int first = start[b];
    const float s = scale[0];
    const bool unit = q_strides[3] == 1 && k_strides[3] == 1 && v_strides[3] == 1;

    __shared__ float warp_max[W][G];
    __shared__ float warp_sum[W][G];
    __shared__ float warp_out[W][D];

    float qv[G][PER];
    float acc[G][PER];
    float run_max[G];
    float run_sum[G];
    #pragma unroll
    for (int g = 0; g < G; g++) {
        const T* qp = q + b * q_strides[0] + (kvh * G + g) * q_strides[1];
        #pragma unroll
        for (int i = 0; i < PER; i++) {
            const int d = lane * PER + i;
            qv[g][i] = d < D ? static_cast<float>(qp[d * q_strides[3]]) * s : 0.f;
            acc[g][i] = 0.f;
        }
        run_max[g] = -3.0e38f;
        run_sum[g] = 0.f;
    }
    const T* kp = k + b * k_strides[0] + kvh * k_strides[1];
    const T* vp = v + b * v_strides[0] + kvh * v_strides[1];
    for (int j = first + warp; j < L; j += W) {
        const T* kj = kp + j * k_strides[2];
        const T* vj = vp + j * v_strides[2];
        float kr[PER];
        float vr[PER];
        #pragma unroll
        for (int i = 0; i < PER; i++) {
            const int d = lane * PER + i;
            kr[i] = d >= D ? 0.f : static_cast<float>(unit ? kj[d] : kj[d * k_strides[3]]);
            vr[i] = d >= D ? 0.f : static_cast<float>(unit ? vj[d] : vj[d * v_strides[3]]);
        }
        float score[G];
        #pragma unroll
        for (int g = 0; g < G; g++) {
            score[g] = 0.f;
            #pragma unroll
            for (int i = 0; i < PER; i++) {
                score[g] += qv[g][i] * kr[i];
            }
        }
        #pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) {
            #pragma unroll
            for (int g = 0; g < G; g++) {
                score[g] += __shfl_xor_sync(0xffffffff, score[g], offset);
            }
        }
        #pragma unroll
        for (int g = 0; g < G; g++) {
            const float new_max = fmaxf(run_max[g], score[g]);
            const float factor = __expf(run_max[g] - new_max);
            const float weight = __expf(score[g] - new_max);
            run_sum[g] = run_sum[g] * factor + weight;
            run_max[g] = new_max;
            #pragma unroll
            for (int i = 0; i < PER; i++) {
                acc[g][i] = acc[g][i] * factor + weight * vr[i];
            }
        }
    }
    if (lane == 0) {
        #pragma unroll
        for (int g = 0; g < G; g++) {
            warp_max[warp][g] = run_max[g];
            warp_sum[warp][g] = run_sum[g];
        }
    }
    #pragma unroll
    for (int g = 0; g < G; g++) {
        #pragma unroll
        for (int i = 0; i < PER; i++) {
            const int d = lane * PER + i;
            if (d < D) {
                warp_out[warp][d] = acc[g][i];
            }
        }
        __syncthreads();
        for (int d = threadIdx.x; d < D; d += W * 32) {
            float top = -3.0e38f;
            for (int w = 0; w < W; w++) {
                top = fmaxf(top, warp_max[w][g]);
            }
            float total = 0.f;
            float value = 0.f;
            for (int w = 0; w < W; w++) {
                const float f = warp_sum[w][g] > 0.f ? __expf(warp_max[w][g] - top) : 0.f;
                total += warp_sum[w][g] * f;
                value += warp_out[w][d] * f;
            }
            out[((b * HQ) + kvh * G + g) * D + d] = static_cast<T>(total > 0.f ? value / total : 0.f);
        }
        __syncthreads();
    }
"""

MAX_HEAD_SIZE = 256  # the shared memory holds a partial output of this many floats per warp
_DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def available() -> bool:
    """Whether this process runs MLX's CUDA backend (the kernel is CUDA source)."""
    return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu


@functools.cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="arm_decode_attention",
        input_names=["q", "k", "v", "start", "scale"],
        output_names=["out"],
        source=_SOURCE,
        ensure_row_contiguous=False,  # the cache's keys and values are read in place, by stride
    )


@functools.cache
def _scale_array(scale: float) -> mx.array:
    return mx.array([scale], dtype=mx.float32)


def decode_attention(
    queries: mx.array, keys: mx.array, values: mx.array, start: mx.array, scale: float, *, warps: int | None = None
) -> mx.array:
    """Attention of one query position per row over ``keys[b, :, start[b]:]``.

    ``queries``: (B, Hq, 1, D); ``keys``/``values``: (B, Hkv, L, D), any strides, Hq a multiple
    of Hkv; ``start``: (B,) int32, each row's first key. Returns (B, Hq, 1, D) in the queries'
    dtype, what ``mx.fast.scaled_dot_product_attention`` returns under the mask
    ``start[b] <= j``. ``warps``: per block, 1 to ``MAX_WARPS`` (default: ``warps_for``)."""
    batch, heads, _, dim = queries.shape
    if warps is None:
        warps = warps_for(batch * keys.shape[1])
    if not 1 <= warps <= MAX_WARPS:
        raise ValueError(f"warps must be in [1, {MAX_WARPS}], got {warps}")
    (out,) = _kernel()(
        inputs=[queries, keys, values, start.astype(mx.int32), _scale_array(float(scale))],
        template=[("T", queries.dtype), ("D", dim), ("G", heads // keys.shape[1]), ("W", warps)],
        grid=(batch * keys.shape[1] * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(batch, heads, 1, dim)],
        output_dtypes=[queries.dtype],
    )
    result: mx.array = out
    return result


# A prompt chunk's attention runs in plain ops up to this many scores (rows x query heads x
# queries x keys; 2**27 is 256 MiB of bf16 scores, the bound on the memory they take). Measured
# on the H200 over 36 layers (bench/prefill_attention.py, docs/benchmarks.md): warm, ops took
# 1.0-1.5x cuDNN's time below 2**25 scores (at most 3 ms more a forward) and 0.55-0.84x from
# there up to 2**27, the largest measured; a shape's first call took 1-88 ms against 41-1,065.
SMALL_SCORES = 1 << 27


def prefill_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """MLX's unfused attention, as ``mx.fast.scaled_dot_product_attention`` computes it where it
    has no kernel for the call: scale the queries, one matmul for the scores (the G query heads
    of a KV head share its keys), the mask (boolean: keep; otherwise added), a precise softmax,
    one matmul over the values. ``mask``: None, ``"causal"`` (aligned to the last key, as
    upstream aligns it) or an array broadcastable to (B, Hq, L, keys)."""
    batch, heads, length, dim = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = queries * mx.array(scale, dtype=queries.dtype)
    if group > 1:
        q = q.reshape(batch, kv_heads, group, length, dim)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    scores = q @ keys.swapaxes(-1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        offset = keys.shape[-2] - length
        mask = mx.arange(offset, offset + length)[:, None] >= mx.arange(keys.shape[-2])[None]
    if mask is not None:
        if group > 1 and mask.ndim >= 3:
            mask = (
                mx.expand_dims(mask, -3)
                if mask.shape[-3] == 1
                else mask.reshape(*mask.shape[:-3], kv_heads, group, *mask.shape[-2:])
            )
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, dtype=scores.dtype))
        else:
            scores = scores + mask
    out = mx.softmax(scores, axis=-1, precise=True) @ values
    result: mx.array = out.reshape(batch, heads, length, -1) if group > 1 else out
    return result


_local = threading.local()


def enable(*, decode: bool, prefill: bool) -> None:
    """Route this thread's fitting decode steps to the kernel and its fitting prompt chunks to
    ``prefill_attention`` (the engine's worker calls it once)."""
    _local.decode = decode
    _local.prefill = prefill


@functools.cache
def _cache_classes() -> tuple[type, type]:
    from mlx_lm.models.cache import BatchKVCache, KVCache

    return BatchKVCache, KVCache


@functools.cache
def _prefill_cache_classes() -> tuple[type, ...]:
    """mlx-lm's plain caches, and mlx-vlm's ``KVCache``: a keyed single-lane row runs the text
    lane's model on it (``text_model.upstream_kv_cache``)."""
    from mlx_vlm.models.cache import KVCache

    return (*_cache_classes(), KVCache)


def fits(queries: mx.array, keys: mx.array, cache: Any, mask: Any, sinks: Any) -> bool:
    """A decode step on mlx-lm's plain batch cache, in a shape and dtype the kernel takes."""
    return (
        type(cache) is _cache_classes()[0]
        and isinstance(mask, mx.array)
        and sinks is None
        and queries.ndim == 4
        and queries.shape[2] == 1
        and queries.shape[-1] <= MAX_HEAD_SIZE
        and queries.dtype in _DTYPES
        and keys.dtype == queries.dtype
        and queries.shape[1] % keys.shape[1] == 0
        and mask.shape[-1] == keys.shape[2]
        and (keys.shape[2] <= LONG_CACHE or queries.shape[0] * keys.shape[1] >= MANY_BLOCKS)
    )


def fits_prefill(queries: mx.array, keys: mx.array, cache: Any, mask: Any, sinks: Any) -> bool:
    """A prompt chunk on a plain (batch) cache whose scores are few (``SMALL_SCORES``): a cold
    chunk, or a keyed single-lane row's suffix over its restored prefix."""
    batch, heads, length, _ = queries.shape if queries.ndim == 4 else (0, 0, 0, 0)
    return (
        type(cache) in _prefill_cache_classes()
        and sinks is None
        and length > 1
        and (mask is None or isinstance(mask, mx.array) or (isinstance(mask, str) and mask == "causal"))
        and heads % keys.shape[1] == 0
        and batch * heads * length * keys.shape[2] <= SMALL_SCORES
    )


def _routed(upstream: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(
        queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any, sinks: Any = None
    ) -> mx.array:
        if getattr(_local, "decode", False) and fits(queries, keys, cache, mask, sinks):
            return decode_attention(queries, keys, values, cache.left_padding, scale)
        if getattr(_local, "prefill", False) and fits_prefill(queries, keys, cache, mask, sinks):
            return prefill_attention(queries, keys, values, scale, mask)
        return upstream(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.upstream = upstream  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def install(model: Any) -> bool:
    """Route the attention of ``model``'s mlx-lm module through this module (on enabled
    threads). Idempotent; False where the module does not call mlx-lm's shared
    attention function (the model then keeps upstream's path)."""
    from mlx_lm.models import base

    module = sys.modules.get(type(model).__module__)
    current = getattr(module, "scaled_dot_product_attention", None)
    if module is None or current is None:
        return False
    if getattr(current, "upstream", None) is base.scaled_dot_product_attention:
        return True
    if current is not base.scaled_dot_product_attention:
        return False
    setattr(module, "scaled_dot_product_attention", _routed(current))
    log.info("CUDA attention routed for %s", module.__name__)
    return True
