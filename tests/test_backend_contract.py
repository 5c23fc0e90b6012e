"""The private upstream fields the engine reads (``engine/backends/backend.py``, ``engine/model/upstream.py``,
``engine/cache/upstream.py``), pinned to the supported mlx-lm / mlx-vlm ranges."""

from __future__ import annotations

import inspect
from importlib.metadata import version

from packaging.version import Version


def test_supported_versions():
    assert Version("0.7.10") <= Version(version("mlx-vlm")) < Version("0.8.0")
    assert Version("0.31.3") <= Version(version("mlx-lm")) < Version("0.33")


def test_batch_generator_fields():
    from mlx_vlm.generate.ar import BatchGenerator, PromptProcessingBatch

    params = inspect.signature(BatchGenerator.__init__).parameters
    for name in (
        "completion_batch_size",
        "prefill_batch_size",
        "prefill_step_size",
        "greedy_sampling",
        "draft_model",
        "draft_kind",
        "draft_block_size",
        "stream",
        "compute_logprobs",
    ):
        assert name in params, name
    insert = inspect.signature(BatchGenerator.insert).parameters
    assert {"prompts", "max_tokens", "prompt_kwargs", "logits_processors"} <= set(insert)
    source = inspect.getsource(BatchGenerator)
    for attr in ("self._generation_batch", "self._prompt_batch", "self.prefill_batch_size"):
        assert attr in source, attr
    # the prefill admission gate that ``allow_partial_prefill`` works around
    assert "num_to_add >= self.prefill_batch_size" in source
    batch_source = inspect.getsource(PromptProcessingBatch)
    for attr in (
        "_processed_prompt_columns",
        "_suffix_lens",
        "_left_padding_per_row",
        "_cached_tokens_per_row",
        "_right_pad_per_row",
    ):
        assert f"self.{attr}" in batch_source, attr


def test_row_counters_on_a_live_batch(dense_model):
    import mlx_vlm

    from abstractruntime_mlx.engine.backends.backend import BatchBackend
    from abstractruntime_mlx.engine.backends.rows import RowInput

    model, processor = mlx_vlm.load(dense_model)
    backend = BatchBackend(model, processor, max_batch_size=2, prefill_step_size=16)
    tokenizer = processor.tokenizer if hasattr(processor, "tokenizer") else processor
    rows = [tokenizer.encode("a b c d " * 20), tokenizer.encode("x y " * 10)]
    uids = [backend.insert(RowInput(ids, 4)) for ids in rows]
    seen: dict[int, list[int]] = {uid: [] for uid in uids}
    finished = set()
    while backend.has_work:
        result = backend.step(observe_prefill=True)
        for uid, row in result.prefill.items():
            seen[uid].append(row.processed)
            assert row.total == len(rows[uids.index(uid)])
        for event in result.tokens:
            if event.finish_reason:
                finished.add(event.uid)
    backend.close()
    assert finished == set(uids)
    for processed in seen.values():
        assert processed == sorted(processed) and processed, processed


def test_prefix_cache_upstream_surface():
    """What ``engine/cache/prefix_cache.py`` and ``engine/cache/upstream.py`` use of mlx-vlm's APC (verified on 0.7.10)."""
    from mlx_vlm import apc
    from mlx_vlm.generate.ar import APC_PRIVATE_PROMPT_KEYS, BatchGenerator

    assert Version(version("mlx-vlm")) >= Version("0.7.10")
    assert "apc_manager" in inspect.signature(BatchGenerator.__init__).parameters
    assert "_apc_semantic_hash" in APC_PRIVATE_PROMPT_KEYS
    assert {"tenant", "image_hash"} <= set(inspect.signature(apc.semantic_extra_hash).parameters)
    manager_source = inspect.getsource(apc.APCManager)
    for key in (
        "memory_max_gb",
        "memory_reserve_gb",
        "checkpoint_interval_tokens",
        "checkpoint_entries",
        "checkpoint_guard_tokens",
    ):
        assert f'"{key}"' in manager_source, key
    for attr in ("self.hash_table", "self._exact_cache", "self.lock"):
        assert attr in manager_source, attr
    manager = apc.APCManager(num_blocks=4, block_size=16, overrides={"memory_max_gb": 0.001})
    snap = manager.stats_snapshot()
    for name in (
        "stores",
        "exact_stores",
        "lookups_hit",
        "exact_hits",
        "lookups_miss",
        "memory_skips",
        "rejects",
        "disk_hits",
    ):
        assert isinstance(snap[name], int), name
    assert manager.memory_max_bytes == int(0.001 * (1 << 30))
    store_params = inspect.signature(apc.DiskBlockStore.__init__).parameters
    assert {"root", "namespace", "max_bytes", "num_workers", "overrides"} <= set(store_params)
    for attr in (
        "flush",
        "close",
        "_clear_disk_state_after_external_delete",
        "disk_bytes",
        "pending_bytes",
        "num_blocks_indexed",
        "num_exact_indexed",
    ):
        assert hasattr(apc.DiskBlockStore, attr), attr
    assert callable(apc._free_ram_bytes)


def test_per_row_sampling_seams():
    """``_RowSampler`` tells prefill rows (position 0) from decode rows (position >= 1) and reads
    the rows' uids from the batch being sampled; ``step`` toggles the decode batch's greedy flag."""
    from mlx_vlm.generate.ar import GenerationBatch, PromptProcessingBatch, _sample_with_positions

    assert "sample_target" in inspect.getsource(_sample_with_positions)
    prefill = inspect.getsource(PromptProcessingBatch.generate)
    assert "positions=[0] * len(self.uids)" in prefill
    decode = inspect.getsource(GenerationBatch._step)
    assert "positions=[n + 1 for n in self._num_tokens]" in decode
    assert "self.greedy_sampling" in inspect.getsource(GenerationBatch._fused_greedy_step)


def test_adopting_a_decoding_row():
    """What ``BatchBackend.adopt`` builds a decoding row from (the single lane's hand-off)."""
    from mlx_vlm.generate.ar import BatchGenerator, GenerationBatch, cache
    from mlx_vlm.models.cache import BatchKVCache, KVCache

    params = inspect.signature(GenerationBatch.__init__).parameters
    for name in (
        "model",
        "uids",
        "inputs",
        "prompt_cache",
        "sampler",
        "stop_criteria",
        "max_tokens",
        "greedy_sampling",
        "thinking_budget_criteria",
    ):
        assert name in params, name
    assert "self._num_tokens" in inspect.getsource(GenerationBatch)
    source = inspect.getsource(BatchGenerator)
    for attr in (
        "self.uid_count",
        "self.sampler",
        "self.tokenizer",
        "self.greedy_sampling",
        "self.compute_logprobs",
        "def _extend_generation_batch",
    ):
        assert attr in source, attr
    assert KVCache.merge([KVCache()]).__class__ is BatchKVCache
    assert cache.BatchKVCache is BatchKVCache  # the class the generator builds for a prefill


def test_mlx_lm_batch_cache_fields():
    """What ``engine/backends/text_loop.py`` reads and writes of mlx-lm's ``BatchKVCache``: built from a
    left padding, extended in place (right-justified), its rows and leading columns dropped by
    hand through its fields; a plain cache merged into one."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache, TokenBuffer

    cache = BatchKVCache([2, 0])
    keys = mx.ones((2, 1, 3, 4))
    cache.update_and_fetch(keys, keys)
    assert cache._idx == 3 and cache.left_padding.tolist() == [2, 0] and cache.offset.tolist() == [1, 3]
    other = BatchKVCache([0])
    other.update_and_fetch(mx.ones((1, 1, 1, 4)), mx.ones((1, 1, 1, 4)))
    cache.extend(other)
    assert cache._idx == 3 and cache.left_padding.tolist() == [2, 0, 2] and cache.keys.shape[0] == 3
    for attr in ("keys", "values", "offset", "left_padding", "_idx"):
        assert hasattr(cache, attr), attr
    assert KVCache.merge([KVCache()]).__class__ is BatchKVCache
    assert TokenBuffer([1, 2]).update_and_fetch(mx.array([3])).tolist() == [1, 2, 3]


def test_mlx_lm_prompt_batch_padding():
    """What ``engine/model/prefill_shapes.py`` (through ``engine/model/upstream.py``) relies on: the prompt batch the generator keeps and
    copies with its own class, and the batch cache's right padding turned into left padding."""
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import BatchKVCache

    assert "self.__class__" in inspect.getsource(PromptProcessingBatch._copy)
    assert {"model", "uids", "caches", "prefill_step_size"} <= set(
        inspect.signature(PromptProcessingBatch.__init__).parameters
    )
    assert {"fallback_sampler", "prefill_step_size"} <= set(inspect.signature(PromptProcessingBatch.empty).parameters)
    assert "right_padding" in inspect.signature(BatchKVCache.prepare).parameters
    assert callable(getattr(BatchKVCache, "finalize", None))


def test_mlx_lm_attention_surface():
    """What ``engine/model/cuda_attention.py`` relies on: model modules call mlx-lm's shared attention
    function by a module-level name, with the cache and mask as keywords, and a batch cache's
    decode mask hides exactly its rows' left padding."""
    import mlx.core as mx
    from mlx_lm.models import base, llama, qwen3
    from mlx_lm.models.cache import BatchKVCache

    for module in (qwen3, llama):
        assert module.scaled_dot_product_attention is base.scaled_dot_product_attention
        assert "scaled_dot_product_attention(" in inspect.getsource(module.Attention.__call__)
    assert list(inspect.signature(base.scaled_dot_product_attention).parameters)[:6] == [
        "queries",
        "keys",
        "values",
        "cache",
        "scale",
        "mask",
    ]
    cache = BatchKVCache([2, 0, 1])
    cache.update_and_fetch(mx.zeros((3, 1, 4, 8)), mx.zeros((3, 1, 4, 8)))
    mask = cache.make_mask(1)
    assert cache.left_padding.tolist() == [2, 0, 1]
    assert mask.shape == (3, 1, 1, 5)
    assert mask.reshape(3, 5).tolist() == [[j >= p for j in range(5)] for p in (2, 0, 1)]


def test_mlx_lm_tokenizer_wrapper_parts():
    """What ``engine/model/upstream.py``'s ``tokenizer_parts`` reads of mlx-lm's ``TokenizerWrapper``."""
    import inspect

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    source = inspect.getsource(TokenizerWrapper.__init__)
    assert "self._tokenizer = tokenizer" in source and "self._detokenizer = " in source
