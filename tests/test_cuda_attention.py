"""The text lane's attention on CUDA (``engine/model/cuda_attention.py``). Fused decode: which calls it
takes, that a row's left padding as its start says what upstream's decode mask says, and on
MLX's CUDA backend that the kernel returns what upstream's masked attention returns. Prompt
chunks in plain ops: which calls they take, and that they compute what upstream computes."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache

from abstractruntime_mlx import errors
from abstractruntime_mlx.engine.model import cuda_attention
from abstractruntime_mlx.engine.model.cuda_attention import fits, fits_prefill, install, prefill_attention

cuda = pytest.mark.skipif(not cuda_attention.available(), reason="the kernel is CUDA source: MLX's CUDA backend only")


def _step(batch=3, heads=4, kv_heads=2, dim=16, length=7):
    q = mx.random.normal((batch, heads, 1, dim))
    k = mx.random.normal((batch, kv_heads, length, dim))
    mask = mx.ones((batch, 1, 1, length), dtype=mx.bool_)
    return q, k, mask


def test_fits_a_decode_step_on_the_plain_batch_cache_only():
    q, k, mask = _step()
    cache = BatchKVCache([0, 1, 2])
    assert fits(q, k, cache, mask, None)
    assert not fits(q, k, cache, None, None)  # no mask: upstream's fused path already
    assert not fits(q, k, cache, "causal", None)
    assert not fits(q, k, cache, mask, mx.zeros((4,)))  # attention sinks
    assert not fits(mx.concatenate([q, q], axis=2), k, cache, mask, None)  # a prefill chunk
    assert not fits(q, k, KVCache(), mask, None)
    assert not fits(q, k, BatchRotatingKVCache(16, [0, 1, 2]), mask, None)  # a sliding window
    assert not fits(q, k, cache, mask[..., :-1], None)  # a mask that is not over these keys
    # A long cache over few (row, KV head) pairs stays on upstream's path; over many, it fits.
    few, few_k, few_mask = _step(batch=4, kv_heads=2, length=2000)
    assert not fits(few, few_k, BatchKVCache([0] * 4), few_mask, None)
    many, many_k, many_mask = _step(batch=64, kv_heads=2, length=2000)
    assert fits(many, many_k, BatchKVCache([0] * 64), many_mask, None)
    wide, wide_k, wide_mask = _step(dim=288)
    assert not fits(wide, wide_k, cache, wide_mask, None)
    assert not fits(q.astype(mx.int32), k, cache, mask, None)


def _reference(queries, keys, values, start, scale):
    """Upstream's attention under the mask ``start[b] <= j``: what the kernel computes."""
    positions = mx.arange(keys.shape[2])
    mask = (positions[None, :] >= start[:, None])[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


@pytest.fixture
def routed(monkeypatch):
    """The routing with the kernel's arithmetic done by upstream's masked attention (the kernel
    itself needs CUDA): records each routed call's start."""
    starts: list[list[int]] = []

    def record(queries, keys, values, start, scale):
        starts.append(start.tolist())
        return _reference(queries, keys, values, start, scale)

    monkeypatch.setattr(cuda_attention, "decode_attention", record)
    yield starts
    cuda_attention.enable(decode=False, prefill=False)


def _greedy(model, prompts, steps):
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model, max_tokens=steps, stop_tokens=[], completion_batch_size=len(prompts), prefill_batch_size=len(prompts)
    )
    uids = gen.insert(prompts, max_tokens=[steps] * len(prompts))
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    while any(len(t) < steps for t in tokens.values()):
        _, responses = gen.next()
        for r in responses:
            tokens[r.uid].append(r.token)
    gen.close()
    return [tokens[u] for u in uids]


def test_start_per_row_is_the_decode_mask(dense_model, routed, monkeypatch):
    """mlx-lm's batch loop over rows of different lengths (left-padded): routing each decode
    step's attention by ``left_padding`` gives the tokens of upstream's mask, and only decode
    steps of enabled threads are routed."""
    import mlx_lm

    model, _ = mlx_lm.load(dense_model)
    module = type(model).__module__
    monkeypatch.setattr(f"{module}.scaled_dot_product_attention", base.scaled_dot_product_attention)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    upstream = _greedy(model, prompts, 6)

    assert install(model) and install(model)  # idempotent
    assert _greedy(model, prompts, 6) == upstream and routed == []  # not enabled on this thread

    forwards: list[int] = []  # each forward's positions per row
    call = type(model).__call__

    def spy(self, inputs, *args, **kwargs):
        forwards.append(inputs.shape[1])
        return call(self, inputs, *args, **kwargs)

    monkeypatch.setattr(type(model), "__call__", spy)
    cuda_attention.enable(decode=True, prefill=False)
    assert _greedy(model, prompts, 6) == upstream
    decode_steps = forwards.count(1)
    assert decode_steps >= 5 and len(forwards) > decode_steps  # prefill ran too, unrouted
    assert len(routed) == decode_steps * len(model.layers)  # every decode step, every layer
    assert routed[0] == [0, 5, 3]  # each row's left padding under the longest prompt

    routed.clear()
    other = threading.Thread(target=lambda: _greedy(model, prompts, 2))
    other.start()
    other.join()
    assert routed == []


def test_install_leaves_a_module_without_the_shared_function():
    class Elsewhere:
        pass

    assert install(Elsewhere()) is False


@pytest.mark.parametrize("option", ["mlx_fused_decode_attention", "mlx_prefill_attention_ops"])
def test_bad_option_is_a_typed_error(make_llm, dense_model, option):
    with pytest.raises(errors.InvalidControls) as caught:
        make_llm(dense_model, mlx_batching=True, **{option: "yes"})
    assert caught.value.field == option


def test_off_the_cuda_backend_nothing_is_installed(make_llm, dense_model):
    if cuda_attention.available():
        pytest.skip("this process runs MLX's CUDA backend")
    import importlib

    llm = make_llm(dense_model, mlx_batching=True, mlx_single_lane=False, speculation=False)
    llm.generate("Hello.", thinking=False, max_output_tokens=2)
    assert not llm._engine._lanes._fused_decode_attention() and not llm._engine._lanes._prefill_attention_ops()
    module = importlib.import_module(type(llm._engine._lanes._text_lm).__module__)
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention


# --- the kernel (MLX's CUDA backend) --------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    "batch,heads,kv_heads,dim,length",
    [
        (1, 4, 4, 16, 1),
        (3, 4, 2, 16, 9),
        (5, 32, 8, 128, 150),
        (64, 16, 8, 128, 257),
        (2, 8, 8, 64, 1030),
        (4, 6, 2, 80, 40),
    ],
)
def test_kernel_matches_upstream_masked_attention(dtype, batch, heads, kv_heads, dim, length):
    mx.random.seed(batch * 1000 + length)
    q = mx.random.normal((batch, heads, 1, dim)).astype(dtype)
    # The cache's keys and values are a slice of a longer buffer: read in place, by stride.
    buf_k = mx.random.normal((batch, kv_heads, length + 37, dim)).astype(dtype)
    buf_v = mx.random.normal((batch, kv_heads, length + 37, dim)).astype(dtype)
    k, v = buf_k[..., :length, :], buf_v[..., :length, :]
    start = mx.array([(b * 7) % length for b in range(batch)], dtype=mx.int32)
    scale = dim**-0.5
    got = cuda_attention.decode_attention(q, k, v, start, scale)
    want = _reference(q, k, v, start, scale)
    tolerance = 1e-4 if dtype == mx.float32 else 2e-2
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tolerance, rtol=tolerance).item()


@cuda
def test_engine_tokens_with_and_without_the_cuda_paths(make_llm, dense_model):
    from test_call_harness import together

    calls = [{"prompt": "word " * n + "end.", "thinking": False, "max_output_tokens": 8} for n in (3, 17, 40)]
    runs = []
    for on in (False, True):
        llm = make_llm(
            dense_model,
            mlx_batching=True,
            mlx_single_lane=False,
            speculation=False,
            mlx_fused_decode_attention=on,
            mlx_prefill_attention_ops=on,
        )
        runs.append([r.token_ids for r in together(llm, calls)])
        llm.unload_model()
    assert runs[0] == runs[1]


def test_block_sizes():
    assert cuda_attention.warps_for(64 * 8) == 8 and cuda_attention.warps_for(16 * 8) == 16
    q, k, _ = _step()
    with pytest.raises(ValueError, match="warps"):
        cuda_attention.decode_attention(q, k, k, mx.zeros((3,), dtype=mx.int32), 0.1, warps=32)


@cuda
@pytest.mark.parametrize("warps", [1, 8, 16])
def test_kernel_block_sizes_agree(warps):
    mx.random.seed(warps)
    q = mx.random.normal((6, 16, 1, 128)).astype(mx.bfloat16)
    k = mx.random.normal((6, 4, 300, 128)).astype(mx.bfloat16)
    v = mx.random.normal((6, 4, 300, 128)).astype(mx.bfloat16)
    start = mx.array([0, 299, 17, 150, 3, 64], dtype=mx.int32)
    got = cuda_attention.decode_attention(q, k, v, start, 0.1, warps=warps)
    want = _reference(q, k, v, start, 0.1)
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=2e-2, rtol=2e-2).item()


# --- prompt chunks in plain ops --------------------------------------------------------------


def _chunk(batch=3, heads=4, kv_heads=2, dim=16, length=5, keys=9, dtype=mx.float32):
    mx.random.seed(batch * 100 + heads * 10 + length)
    q = mx.random.normal((batch, heads, length, dim)).astype(dtype)
    k = mx.random.normal((batch, kv_heads, keys, dim)).astype(dtype)
    v = mx.random.normal((batch, kv_heads, keys, dim)).astype(dtype)
    return q, k, v


def test_fits_a_small_prompt_chunk_on_a_plain_cache_only():
    q, k, _ = _chunk()
    mask = mx.ones((3, 1, 5, 9), dtype=mx.bool_)
    for cache in (BatchKVCache([0, 1, 2]), KVCache()):
        assert fits_prefill(q, k, cache, mask, None)
        assert fits_prefill(q, k, cache, "causal", None)
        assert fits_prefill(q, k, cache, None, None)
    cache = BatchKVCache([0, 1, 2])
    assert not fits_prefill(q[:, :, :1], k, cache, mask[:, :, :1], None)  # a decode step
    assert not fits_prefill(q, k, cache, mask, mx.zeros((4,)))  # attention sinks
    assert not fits_prefill(q, k, BatchRotatingKVCache(16, [0, 1, 2]), mask, None)  # a sliding window
    assert not fits_prefill(q, k, None, mask, None)
    # Many scores stay on upstream's path (cuDNN's fused kernel on CUDA).
    big_q = mx.zeros((1, 32, 2048, 8))
    big_k = mx.zeros((1, 8, cuda_attention.SMALL_SCORES // (32 * 2048) + 1, 8))
    assert not fits_prefill(big_q, big_k, KVCache(), "causal", None)
    assert fits_prefill(big_q, big_k[:, :, :-1], KVCache(), "causal", None)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "bool_per_head", "additive"])
def test_prefill_attention_computes_what_upstream_does(heads, kv_heads, mask_kind):
    """On the CPU upstream runs this same unfused formula, so the results are equal bit for bit;
    on CUDA upstream runs cuDNN's kernel, equal within rounding."""
    q, k, v = _chunk(heads=heads, kv_heads=kv_heads)
    positions = mx.arange(9)[None, :] >= mx.array([0, 3, 6])[:, None]  # each row's left padding
    masks = {
        "none": None,
        "causal": "causal",  # 5 queries after 4 cached keys: aligned to the last key
        "bool": (positions[:, None, :] & (mx.arange(5)[:, None] + 4 >= mx.arange(9)[None]))[:, None],
        "bool_per_head": mx.random.uniform(shape=(3, heads, 5, 9)) > 0.3,
        "additive": mx.random.normal((3, 1, 5, 9)),
    }
    mask = masks[mask_kind]
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_:
        mask[..., -1] = True  # every query keeps a key
    got = prefill_attention(q, k, v, 0.25, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert got.shape == want.shape and got.dtype == want.dtype
    if cuda_attention.available():
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    else:
        assert mx.array_equal(got, want).item()


def test_prefill_attention_refuses_an_unknown_mask_name():
    q, k, v = _chunk()
    with pytest.raises(ValueError, match="mask"):
        prefill_attention(q, k, v, 0.25, "sliding")


def test_prompt_chunks_route_to_plain_ops(dense_model, monkeypatch):
    """mlx-lm's batch loop over left-padded rows: with prompt chunks routed to
    ``prefill_attention`` the tokens are upstream's, every prefill forward's layers went through
    it, and no decode step did."""
    import mlx_lm

    model, _ = mlx_lm.load(dense_model)
    module = type(model).__module__
    monkeypatch.setattr(f"{module}.scaled_dot_product_attention", base.scaled_dot_product_attention)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    upstream = _greedy(model, prompts, 6)

    lengths: list[int] = []

    def record(queries, keys, values, scale, mask):
        lengths.append(queries.shape[2])
        return prefill_attention(queries, keys, values, scale, mask)

    monkeypatch.setattr(cuda_attention, "prefill_attention", record)
    assert install(model)
    try:
        cuda_attention.enable(decode=False, prefill=True)
        assert _greedy(model, prompts, 6) == upstream
    finally:
        cuda_attention.enable(decode=False, prefill=False)
    assert lengths and all(n > 1 for n in lengths)
    assert len(lengths) % len(model.layers) == 0  # whole forwards, every layer


def test_a_keyed_rows_suffix_over_its_restored_prefix_routes_to_plain_ops(make_llm, dense_model, monkeypatch):
    """The single lane (the text lane's model on mlx-vlm's cache, keyed rows): with prompt
    chunks routed, a reused turn's suffix runs ``prefill_attention`` over more keys than
    queries (its restored prefix), and the conversation's tokens are those of upstream's
    attention. Off the CUDA backend the routing is forced on (the plain ops are MLX's, so the
    CPU runs them); the fused decode kernel, CUDA source, stays off."""
    from test_prefix_cache import conversation

    runs, shapes = [], []

    def record(queries, keys, values, scale, mask):
        shapes.append((queries.shape[2], keys.shape[2]))
        return prefill_attention(queries, keys, values, scale, mask)

    for routed in (False, True):
        if routed:
            monkeypatch.setattr(cuda_attention, "available", lambda: True)
            monkeypatch.setattr(cuda_attention, "prefill_attention", record)
        llm = make_llm(
            dense_model,
            mlx_batching=True,
            speculation=False,
            mlx_fused_decode_attention=False,
            mlx_prefill_attention_ops=routed,
        )
        module = type(llm._engine._lanes._text_lm).__module__
        # routing installs on the model's module: put upstream's function back afterwards
        monkeypatch.setattr(f"{module}.scaled_dot_product_attention", base.scaled_dot_product_attention)
        try:
            results = conversation(llm, "session-1", turns=3, max_output_tokens=6)
        finally:
            llm.unload_model()
            cuda_attention.enable(decode=False, prefill=False)
        assert [r.metadata["execution"]["path"] for r in results] == ["single"] * 3
        assert results[-1].usage["cached_input_tokens"] > 0
        runs.append([r.token_ids for r in results])
    assert runs[0] == runs[1]
    assert any(keys > queries > 1 for queries, keys in shapes)  # a suffix over its cached prefix
