"""Prefix reuse keyed by ``prompt_cache_key``: every lane, real MLX, tiny offline models."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from abstractruntime_mlx import errors
from abstractruntime_mlx.engine.cache import prefix_cache

SYSTEM = "You are a careful assistant who answers briefly. " * 12


def conversation(llm, key, *, turns=3, max_output_tokens=8, **kwargs):
    """Run a growing conversation; return each turn's result."""
    messages = [{"role": "system", "content": SYSTEM}]
    results = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what does a cache keep?"})
        call = dict(messages=messages, max_output_tokens=max_output_tokens, thinking=False, **kwargs)
        if key is not None:
            call["prompt_cache_key"] = key
        result = llm.generate("", **call)
        results.append(result)
        messages = messages + [{"role": "assistant", "content": result.content}]
    return results


def assert_reused(results, key):
    first, *later = results
    assert first.metadata["prompt_cache"]["outcome"] == "miss"
    assert first.usage["cached_input_tokens"] == 0
    for result in later:
        cache = result.metadata["prompt_cache"]
        assert cache["mode"] == "key" and cache["key"] == key
        assert cache["outcome"] == "hit", cache
        assert cache["cached_tokens"] == result.usage["cached_input_tokens"] > 0
        assert cache["cached_tokens"] + cache["fed_tokens"] == result.usage["prompt_tokens"]
        # the whole previous prompt but its last few tokens was restored
        assert (
            cache["cached_tokens"]
            >= results[0].usage["prompt_tokens"] - prefix_cache.BLOCK_SIZE - prefix_cache.GUARD_TOKENS
        )
        assert cache["apc"]["memory_max_bytes"] >= cache["apc"]["resident_bytes"] > 0
        assert cache["apc"]["hits"] + cache["apc"]["exact_hits"] >= 1
        assert "degraded_reason" not in cache


LANES = [
    pytest.param("dense_model", {"mlx_batching": True, "speculation": False}, "continuous", id="dense-continuous"),
    # The hybrid model on the lanes the dense one covers too: in the whole suite only.
    pytest.param(
        "hybrid_model",
        {"mlx_batching": True, "speculation": False},
        "continuous",
        id="hybrid-continuous",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "hybrid_model",
        {"mlx_batching": True, "speculation": {"mode": "native_mtp", "num_draft_tokens": 2}},
        "cohort",
        id="hybrid-mtp-cohort",
    ),
    pytest.param("dense_model", {"mlx_batching": False}, "exclusive", id="dense-serial-mlx-lm"),
    # speculation=False: the mlx-lm lane (with MTP on, a non-batched hybrid runs mlx-vlm's in-process lane)
    pytest.param(
        "hybrid_model",
        {"mlx_batching": False, "speculation": False},
        "exclusive",
        id="hybrid-serial-mlx-lm",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("model_name, options, mode", LANES)
def test_greedy_identity_and_reuse_on_every_lane(request, make_llm, model_name, options, mode):
    llm = make_llm(request.getfixturevalue(model_name), **options)
    plain = conversation(llm, None)
    cached = conversation(llm, "conversation-1")
    for a, b in zip(plain, cached):
        assert a.token_ids == b.token_ids
        assert "prompt_cache" not in a.metadata
        assert a.usage.get("cached_input_tokens", 0) == 0
        assert b.metadata["execution"]["mode"] == mode
    assert_reused(cached, "conversation-1")
    if mode == "cohort":
        assert all(r.metadata["speculation"]["used"] for r in cached)
    assert {r.metadata["prompt_cache"]["apc"]["accounting"] for r in cached} == {"request"}  # alone in its batch
    stats = llm.get_prompt_cache_stats()
    assert stats["enabled"] is True
    assert stats["requests"] == {"requests": 3, "hits": 2, "partial": 0, "misses": 1, "not_retained": 0}
    assert stats["memory"]["entries"] > 0
    assert 0 < stats["memory"]["resident_bytes"] <= stats["memory"]["max_bytes"]
    assert stats["disk"] == {"enabled": False}


def test_exclusive_sampled_lane_reuses(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    results = conversation(llm, "sampled", temperature=0.8, seed=3)
    assert_reused(results, "sampled")
    assert {r.metadata["execution"]["mode"] for r in results} <= {"exclusive", "continuous"}


def test_key_needs_the_complete_conversation(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    with pytest.raises(errors.InvalidRequest) as info:
        llm.generate("hello", prompt_cache_key="k", max_output_tokens=2)
    assert info.value.code == "invalid_request"
    assert "messages" in str(info.value) and "complete conversation" in str(info.value)
    with pytest.raises(errors.InvalidControls):
        llm.generate("hello", messages=[], prompt_cache_key="", max_output_tokens=2)
    # messages=[] is a standalone prompt: accepted
    result = llm.generate("hello", messages=[], prompt_cache_key="k", max_output_tokens=2)
    assert result.metadata["prompt_cache"]["outcome"] == "miss"


@pytest.mark.parametrize(
    "option, value",
    [
        ("mlx_cache_memory_max_gb", -1),
        ("mlx_cache_memory_max_gb", float("nan")),
        ("mlx_cache_memory_max_gb", "8"),
        ("mlx_cache_disk_max_gb", 0),
        ("mlx_cache_disk_path", ""),
        ("mlx_cache_scope", ""),
    ],
)
def test_bad_cache_options_are_typed(make_llm, dense_model, option, value):
    with pytest.raises(errors.InvalidControls) as info:
        make_llm(dense_model, mlx_batching=True, **{option: value})
    assert info.value.field == option


@pytest.mark.slow
@pytest.mark.parametrize("batching", [True, False], ids=["native", "serial"])
def test_budget_too_small_for_one_snapshot(make_llm, hybrid_model, batching):
    # A hybrid snapshot of ~200 prompt tokens is several hundred KB; 64 KiB holds none.
    llm = make_llm(hybrid_model, mlx_batching=batching, speculation=False, mlx_cache_memory_max_gb=64 / (1 << 20))
    first, second = conversation(llm, "tight", turns=2)
    assert first.metadata["prompt_cache"]["apc"]["memory_skips"] >= 1
    assert first.metadata["prompt_cache"]["apc"]["memory_max_bytes"] == 64 << 10
    cache = second.metadata["prompt_cache"]
    assert cache["outcome"] == "not_retained"
    assert cache["cached_tokens"] == 0
    assert "not retained" in cache["degraded_reason"] and "mlx_cache_memory_max_gb" in cache["degraded_reason"]
    for result in (first, second):
        apc = result.metadata["prompt_cache"]["apc"]
        assert apc["resident_bytes"] <= apc["memory_max_bytes"]
    stats = llm.get_prompt_cache_stats()
    assert stats["memory"]["budget_source"] == "mlx_cache_memory_max_gb"
    assert stats["requests"]["not_retained"] == 1


def test_dense_snapshot_larger_than_the_budget_is_kept_in_part_and_said_so(make_llm, dense_model):
    # ~270 prompt tokens of tiny-model KV are ~140 KB; 64 KiB holds only the first blocks.
    llm = make_llm(dense_model, mlx_batching=True, mlx_cache_memory_max_gb=64 / (1 << 20))
    first, second = conversation(llm, "tight", turns=2)
    cache = second.metadata["prompt_cache"]
    assert cache["outcome"] == "partial"
    assert (
        0 < cache["cached_tokens"] < first.usage["prompt_tokens"] - prefix_cache.BLOCK_SIZE - prefix_cache.GUARD_TOKENS
    )
    assert "not retained in full" in cache["degraded_reason"] and "mlx_cache_memory_max_gb" in cache["degraded_reason"]
    for result in (first, second):
        apc = result.metadata["prompt_cache"]["apc"]
        assert 0 < apc["resident_bytes"] <= apc["memory_max_bytes"] == 64 << 10
    assert llm.get_prompt_cache_stats()["requests"]["partial"] == 1


def test_machine_budget_rule(monkeypatch):
    monkeypatch.setattr(prefix_cache, "working_set", lambda: (24 << 30, "system_memory"))
    budget = prefix_cache.memory_budget(None)
    assert budget.max_bytes == 6 << 30 and budget.reserve_bytes == 512 << 20
    monkeypatch.setattr(prefix_cache, "working_set", lambda: (128 << 30, "metal_recommended_working_set"))
    assert prefix_cache.memory_budget(None).max_bytes == 8 << 30
    assert prefix_cache.memory_budget(0.5).max_bytes == 512 << 20
    assert prefix_cache.memory_budget(0.5).source == "mlx_cache_memory_max_gb"


def test_real_working_set_on_this_machine():
    ws, source = prefix_cache.working_set()
    assert source in {"metal_recommended_working_set", "cuda_device_memory", "system_memory"}
    assert ws is not None and ws > 1 << 30


def test_stats_and_clear_tell_the_truth(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    conversation(llm, "a", turns=2)
    stats = llm.get_prompt_cache_stats()
    assert stats["enabled"] and stats["backend"] == "mlx_vlm_apc" and stats["full_history_required"]
    assert stats["memory"]["entries"] > 0 and stats["counters"]["stores"] > 0
    assert stats["execution"]["completed"] == 2
    cleared = llm.prompt_cache_clear("a")
    assert cleared["cleared"] is True and cleared["scope"] == "all_keys"
    assert cleared["ram_entries_removed"] == stats["memory"]["entries"]
    assert "whole prompt-cache namespace" in cleared["warning"]
    after = llm.get_prompt_cache_stats()
    assert after["memory"]["entries"] == 0 and after["memory"]["resident_bytes"] == 0
    # the conversation starts over: its next turn misses
    again = conversation(llm, "a", turns=1)[0]
    assert again.metadata["prompt_cache"]["outcome"] == "miss"
    assert again.usage["cached_input_tokens"] == 0


def test_keyless_requests_store_nothing(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    conversation(llm, None, turns=2)
    stats = llm.get_prompt_cache_stats()
    assert stats["memory"]["entries"] == 0 and stats["counters"]["stores"] == 0


@pytest.mark.slow
def test_concurrent_conversations_on_different_keys_kept_apart(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=4, mlx_batch_wait_ms=50, mlx_cache_sharing="key")
    keys = ["k0", "k1", "k2"]
    start = threading.Barrier(len(keys))

    def run(key):
        start.wait()
        return conversation(llm, key, turns=3)

    with ThreadPoolExecutor(len(keys)) as pool:
        runs = list(pool.map(run, keys))
    plain = conversation(llm, None, turns=3)
    for key, results in zip(keys, runs):
        assert [r.token_ids for r in results] == [p.token_ids for p in plain]
        assert_reused(results, key)
    assert max(r.metadata["execution"]["peak_batch_size"] for rs in runs for r in rs) >= 2
    shared = [r.metadata["prompt_cache"]["apc"]["accounting"] for rs in runs for r in rs]
    assert "shared" in shared


def test_sessions_sharing_a_prompt_prefill_it_once(make_llm, dense_model):
    """Keys of one scope share identical prefixes: three sessions started together with one
    system prompt prefill it once (the first is the leader, the others wait for its blocks),
    and every answer is the one an uncached run gives."""
    llm = make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=4, mlx_batch_wait_ms=50)
    keys = ["s0", "s1", "s2"]
    start = threading.Barrier(len(keys))

    def first_turn(key):
        start.wait()
        return conversation(llm, key, turns=1)[0]

    with ThreadPoolExecutor(len(keys)) as pool:
        firsts = list(pool.map(first_turn, keys))
    plain = conversation(llm, None, turns=1)[0]
    assert all(r.token_ids == plain.token_ids for r in firsts)
    cached = sorted(r.usage["cached_input_tokens"] for r in firsts)
    prompt = plain.usage["prompt_tokens"]
    assert cached[0] == 0  # the leader prefilled it
    assert all(c >= prompt - prefix_cache.BLOCK_SIZE - 1 for c in cached[1:]), (cached, prompt)
    assert [r.metadata["prompt_cache"]["outcome"] for r in firsts].count("hit") == 2
    # later turns of each session still reuse their own history
    second = conversation(llm, "s1", turns=2)
    assert second[1].metadata["prompt_cache"]["outcome"] == "hit"


def test_scopes_never_share(make_llm, dense_model, tmp_path):
    """One scope's snapshots, kept on disk, are never found by a runtime of another scope."""
    disk = str(tmp_path / "ssd")
    one = make_llm(dense_model, mlx_batching=True, mlx_cache_scope="tenant-a", mlx_cache_disk_path=disk)
    conversation(one, "a", turns=1)
    one.unload_model(one.model)  # flushes tenant a's snapshots to disk
    other = make_llm(dense_model, mlx_batching=True, mlx_cache_scope="tenant-b", mlx_cache_disk_path=disk)
    assert conversation(other, "b", turns=1)[0].usage["cached_input_tokens"] == 0
    other.unload_model(other.model)
    same = make_llm(dense_model, mlx_batching=True, mlx_cache_scope="tenant-a", mlx_cache_disk_path=disk)
    assert conversation(same, "another-key", turns=1)[0].usage["cached_input_tokens"] > 0


def test_sharing_mode_is_validated(make_llm, dense_model):
    with pytest.raises(errors.InvalidControls) as info:
        make_llm(dense_model, mlx_batching=True, mlx_cache_sharing="everyone")
    assert info.value.code == "invalid_controls" and info.value.details["field"] == "mlx_cache_sharing"


@pytest.mark.slow
def test_clear_during_traffic(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=4)
    plain = conversation(llm, None, turns=2, max_output_tokens=40)
    conversation(llm, "busy", turns=1)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Question 0: what does a cache keep?"},
    ]
    stream = llm.generate(
        "", messages=messages, prompt_cache_key="busy", max_output_tokens=40, thinking=False, stream=True
    )
    next(stream)  # decoding now
    cleared = llm.prompt_cache_clear()
    rest = list(stream)
    assert cleared["cleared"] is True and cleared["ram_entries_removed"] > 0
    assert rest[-1].finish_reason == "length"
    assert rest[-1].token_ids == plain[0].token_ids  # the request running through the clear is intact
    # requests after the clear still give the uncached tokens
    again = conversation(llm, "busy", turns=2, max_output_tokens=40)
    assert [r.token_ids for r in again] == [p.token_ids for p in plain]


def test_phase_events_carry_the_cached_fed_split(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Question 0"}]
    first = llm.generate("", messages=messages, prompt_cache_key="p", max_output_tokens=4, thinking=False)
    messages = messages + [{"role": "assistant", "content": first.content}, {"role": "user", "content": "Question 1"}]
    events = []
    second = llm.generate(
        "", messages=messages, prompt_cache_key="p", max_output_tokens=4, thinking=False, on_progress=events.append
    )
    cached = second.usage["cached_input_tokens"]
    assert cached > 0
    final = events[-1]
    assert final["phase"] == "complete"
    assert final["cached_tokens"] == cached and final["fed_tokens"] == second.usage["prompt_tokens"] - cached
    # The rest of the prompt fits one chunk: no mid-prefill position, so the split first shows
    # on the first-token event (the seed's rule for a prompt too short to observe).
    assert "cached_tokens" not in events[0]
    first_token = next(e for e in events if e.get("first_token"))
    assert first_token["cached_tokens"] == cached
    assert all(e.get("cached_tokens", cached) == cached for e in events)


@pytest.mark.slow
def test_image_bytes_change_the_identity(make_llm, vision_model, tmp_path):
    from abstractruntime_mlx.testing import tiny_image

    red_blue = tiny_image(tmp_path / "rb.png", (255, 0, 0), (0, 0, 255))
    blue_red = tiny_image(tmp_path / "br.png", (0, 0, 255), (255, 0, 0))
    llm = make_llm(vision_model, mlx_batching=True, speculation=False)

    def ask(image):
        return llm.generate(
            "Describe the two halves of this image in detail, please, left then right.",
            messages=[{"role": "system", "content": SYSTEM}],
            media=[str(image)],
            prompt_cache_key="img",
            max_output_tokens=4,
        )

    first = ask(red_blue)
    other = ask(blue_red)
    same = ask(red_blue)
    assert first.usage["cached_input_tokens"] == 0
    assert other.usage["cached_input_tokens"] == 0  # different pixels: nothing shared
    assert same.usage["cached_input_tokens"] > 0
    assert same.token_ids == first.token_ids


def test_image_hash_is_content_based(tmp_path):
    from PIL import Image

    a = Image.new("RGB", (8, 8), (255, 0, 0))
    b = Image.new("RGB", (8, 8), (255, 0, 1))
    assert prefix_cache.image_hash([]) == 0
    assert prefix_cache.image_hash([a]) == prefix_cache.image_hash([a.copy()])
    assert prefix_cache.image_hash([a]) != prefix_cache.image_hash([b])
    assert prefix_cache.image_hash([a, b]) != prefix_cache.image_hash([b, a])


def test_http_routes_and_remote_client_report_the_same(make_llm, dense_model):
    from abstractruntime_mlx.remote_client import RemoteClient
    from abstractruntime_mlx.server import create_app
    from test_server_harness import serve_in_thread

    llm = make_llm(dense_model, mlx_batching=True)
    with serve_in_thread(create_app(llm)) as url, RemoteClient(url) as client:
        remote = conversation(client, "http", turns=2)
        local_stats = llm.get_prompt_cache_stats()
        remote_stats = client.get_prompt_cache_stats()
        assert {k: v for k, v in remote_stats.items() if k != "execution"} == {
            k: v for k, v in local_stats.items() if k != "execution"
        }
        cleared = client.prompt_cache_clear("http")
    cache = remote[1].metadata["prompt_cache"]
    assert cache["outcome"] == "hit" and remote[1].usage["cached_input_tokens"] == cache["cached_tokens"] > 0
    assert cleared["cleared"] is True and cleared["ram_entries_removed"] == local_stats["memory"]["entries"] > 0
    assert "warning" in cleared


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense_model", "hybrid_model"])
def test_resident_bytes_counted_in_blocks_equal_upstreams_sum(make_llm, kind, request):
    """The manager counts resident bytes per block; the figure is upstream's tensor-by-tensor sum
    (plus the keys' resident KV between turns, which upstream does not know of)."""
    from mlx_vlm.apc import APCManager

    llm = make_llm(request.getfixturevalue(kind), mlx_batching=True)
    for key in ("a", "b"):
        conversation(llm, key, turns=2)
    manager = llm._engine.prefix_cache.manager
    with manager.lock:
        counted = manager._resident_bytes_locked()
        summed = APCManager._resident_bytes_locked(manager)
        kept = manager.resident.nbytes
    assert counted - kept == summed > 0
    assert llm.get_prompt_cache_stats()["memory"]["resident_bytes"] == counted


@pytest.mark.slow
def test_a_restored_prefix_cut_to_an_alignment_keeps_greedy_output(make_llm, dense_model):
    """On CUDA restored prefixes are cut to the prefill step; the cut changes what is fed, not
    what is generated."""
    plain = conversation(make_llm(dense_model, mlx_batching=True), None, turns=3)
    llm = make_llm(dense_model, mlx_batching=True)
    llm._engine.prefix_cache.manager.restore_align = llm._engine.prefix_cache.restore_align = 64
    keyed = conversation(llm, "aligned", turns=3)
    assert [r.metadata["prompt_cache"]["outcome"] for r in keyed] == ["miss", "hit", "hit"]
    assert [r.token_ids for r in keyed] == [p.token_ids for p in plain]
    cached = [r.usage["cached_input_tokens"] for r in keyed[1:]]
    assert all(c > 0 and c % 64 == 0 for c in cached), cached


@pytest.mark.slow
def test_a_lone_keyed_request_restores_and_stores_on_the_single_lane(make_llm, dense_model, tmp_path):
    """Alone, a keyed request decodes on the single lane: it restores the prefix the batch or
    an earlier turn stored, stores its own for the next, and gives the uncached tokens."""
    llm = make_llm(dense_model, mlx_batching=True)
    plain = conversation(llm, None, turns=3)
    keyed = conversation(llm, "alone", turns=3)
    assert [r.token_ids for r in keyed] == [p.token_ids for p in plain]
    assert [str(r.metadata["execution"]["path"]) for r in keyed] == ["single"] * 3
    assert_reused(keyed, "alone")
    llm.unload_model(llm.model)
    # With the SSD tier too: a new engine over the same directory restores the first turn's
    # prefix from the disk, on the single lane, with the same tokens.
    disk = make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=str(tmp_path / "ssd"))
    written = conversation(disk, "alone", turns=2)
    assert [str(r.metadata["execution"]["path"]) for r in written] == ["single"] * 2
    disk.unload_model(disk.model)
    again = make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=str(tmp_path / "ssd"))
    read = conversation(again, "alone", turns=2)
    assert [r.token_ids for r in read] == [p.token_ids for p in plain[:2]]
    assert str(read[0].metadata["execution"]["path"]) == "single"
    first = read[0].metadata["prompt_cache"]
    assert first["apc"]["disk_hits"] > 0 and read[0].usage["cached_input_tokens"] >= 16


@pytest.mark.parametrize("max_output_tokens", [1, 6])
def test_the_single_lane_stores_a_prefix_after_the_first_token(make_llm, dense_model, monkeypatch, max_output_tokens):
    """A keyed row's new blocks are stored once its first token is out, not on its way: the
    first token event comes before the store, and a row ending at its first token stores as it
    ends (the next turn restores it)."""
    from abstractruntime_mlx.engine.backends.single import SingleBackend

    order: list[str] = []
    store, step = SingleBackend._store_if_pending, SingleBackend.step

    def recorded_store(self):
        if self._keyed is not None and self._keyed.store_pending:
            order.append("store")
        return store(self)

    def recorded_step(self, **kwargs):
        result = step(self, **kwargs)
        order.extend("token" for _ in result.tokens)
        return result

    monkeypatch.setattr(SingleBackend, "_store_if_pending", recorded_store)
    monkeypatch.setattr(SingleBackend, "step", recorded_step)
    llm = make_llm(dense_model, mlx_batching=True)
    results = conversation(llm, "after-first", turns=2, max_output_tokens=max_output_tokens)
    assert [str(r.metadata["execution"]["path"]) for r in results] == ["single"] * 2
    assert results[1].metadata["prompt_cache"]["outcome"] == "hit"
    assert order.count("store") == 2
    if max_output_tokens > 1:  # a row ending at its first token stores as it ends, in that step
        assert order[:2] == ["token", "store"]


def test_a_lone_keyed_request_runs_the_text_lanes_model(make_llm, dense_model, monkeypatch):
    """On the single lane a keyed row's forward is the text lane's model (fused, and routed on
    CUDA), on a cache of mlx-lm's classes (those the text lane merges, where a keyed row moves
    when company arrives): the tokens are the text lane's and mlx-vlm's batch's, and the
    restored turns ran through that model."""
    from mlx_lm.models.cache import KVCache

    from abstractruntime_mlx.engine.backends.single import SingleBackend

    llm = make_llm(dense_model, mlx_batching=True)
    text_lm = llm._engine._lanes.text_language_model()
    caches: list[type] = []
    insert = SingleBackend.insert

    def recorded(self, row):
        uid = insert(self, row)
        assert self._lm is text_lm
        caches.append(type(self._cache[0]))
        return uid

    monkeypatch.setattr(SingleBackend, "insert", recorded)
    keyed = conversation(llm, "text-model", turns=3)
    assert [str(r.metadata["execution"]["path"]) for r in keyed] == ["single"] * 3
    assert_reused(keyed, "text-model")
    assert caches == [KVCache] * 3
    llm.unload_model(llm.model)
    text = make_llm(dense_model, mlx_batching=True, mlx_single_lane=False)
    on_text = conversation(text, "text-model", turns=3)
    assert [str(r.metadata["execution"]["path"]) for r in on_text] == ["text_batch"] * 3
    text.unload_model(text.model)
    batch = make_llm(dense_model, mlx_batching=True, mlx_single_lane=False, mlx_text_lane=False)
    on_batch = conversation(batch, "text-model", turns=3)
    assert [str(r.metadata["execution"]["path"]) for r in on_batch] == ["batch"] * 3
    assert [r.token_ids for r in on_batch] == [r.token_ids for r in on_text] == [r.token_ids for r in keyed]
