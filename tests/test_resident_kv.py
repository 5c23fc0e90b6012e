"""A key's KV resident between turns (``prefix_cache.ResidentKV``): real MLX, the tiny dense model.

A lone keyed request decodes on the single lane; when it ends, its whole KV stays resident for
its key and the key's next prompt starts from it, trimmed to the prefix they share. Blocks stay
the fallback.
"""

from __future__ import annotations

import pytest

SYSTEM = "You are a careful assistant who answers briefly and checks every step twice. " * 12


def turn(llm, messages, key):
    call = dict(messages=messages, max_output_tokens=8, thinking=False)
    if key is not None:
        call["prompt_cache_key"] = key
    return llm.generate("", **call)


def conversation(llm, key, questions):
    messages = [{"role": "system", "content": SYSTEM}]
    results = []
    for question in questions:
        messages = messages + [{"role": "user", "content": question}]
        result = turn(llm, messages, key)
        results.append(result)
        messages = messages + [{"role": "assistant", "content": result.content}]
    return results


QUESTIONS = ["What does a cache keep?", "And what does it drop?", "When does it drop it?"]


def plain_run(make_llm, model, questions):
    """The same questions without a key, on an engine of their own (unloaded after)."""
    llm = make_llm(model, mlx_batching=True)
    results = conversation(llm, None, questions)
    llm.unload_model()
    return results


def resident_stats(llm):
    return llm.get_prompt_cache_stats()["memory"]["resident_kv"]


def without_resident(llm):
    """The same engine with the resident tier off: every restore gathers blocks."""
    llm._engine.prefix_cache.manager.resident = None
    return llm


@pytest.mark.slow
def test_resident_reuse_gives_the_greedy_tokens_of_no_reuse_and_of_block_reuse(make_llm, dense_model):
    plain = plain_run(make_llm, dense_model, QUESTIONS)
    llm = make_llm(dense_model, mlx_batching=True)
    resident = conversation(llm, "k", QUESTIONS)
    stats = resident_stats(llm)
    llm.unload_model()
    block_llm = without_resident(make_llm(dense_model, mlx_batching=True))
    blocks = conversation(block_llm, "k", QUESTIONS)
    block_llm.unload_model()
    assert [r.token_ids for r in resident] == [r.token_ids for r in plain] == [r.token_ids for r in blocks]
    assert all(r.metadata["execution"]["path"] == "single" for r in resident)
    assert stats["entries"] == 1 and stats["bytes"] > 0
    cached = [r.usage["cached_input_tokens"] for r in resident[1:]]
    assert stats["tokens_taken"] == sum(cached) > 0
    # The resident KV holds the whole previous prompt, not only its full 16-token blocks.
    block_cached = [r.usage["cached_input_tokens"] for r in blocks[1:]]
    assert all(a >= b for a, b in zip(cached, block_cached)) and sum(cached) > sum(block_cached)
    for result in resident[1:]:
        cache = result.metadata["prompt_cache"]
        assert cache["outcome"] == "hit" and cache["apc"]["hits"] == 1
        assert cache["cached_tokens"] + cache["fed_tokens"] == result.usage["prompt_tokens"]


@pytest.mark.slow
def test_a_live_request_needing_room_drops_the_resident_kv_before_any_block(make_llm, dense_model, monkeypatch):
    plain = plain_run(make_llm, dense_model, QUESTIONS[:2])
    llm = make_llm(dense_model, mlx_batching=True)
    first = conversation(llm, "k", QUESTIONS[:1])
    manager = llm._engine.prefix_cache.manager
    kept = resident_stats(llm)["bytes"]
    assert kept > 0
    blocks = len(manager.hash_table)
    # The free memory is short of a live request's need by exactly the resident KV's bytes
    # (dropping it frees them).
    held = manager.resident_bytes()
    monkeypatch.setattr(
        manager, "_memory_headroom", lambda: manager.memory_reserve_bytes + kept - manager.resident.nbytes
    )
    monkeypatch.setattr(manager, "_prefill_reserve_bytes", 0)
    manager._make_room(kept)
    assert resident_stats(llm) == {**resident_stats(llm), "entries": 0, "bytes": 0, "dropped": 1}
    assert len(manager.hash_table) == blocks and manager.resident_bytes() == held - kept
    monkeypatch.undo()
    # The next turn falls back to the blocks, with the same greedy tokens.
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": first[0].content},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    again = turn(llm, messages, "k")
    assert first[0].token_ids == plain[0].token_ids and again.token_ids == plain[1].token_ids
    assert again.usage["cached_input_tokens"] > 0 and resident_stats(llm)["tokens_taken"] == 0


@pytest.mark.slow
def test_a_resident_entry_that_does_not_fit_the_budget_is_not_kept(make_llm, dense_model):
    probe = make_llm(dense_model, mlx_batching=True)
    conversation(probe, "k", QUESTIONS[:1])
    stats = probe.get_prompt_cache_stats()["memory"]
    blocks_bytes = stats["resident_bytes"] - stats["resident_kv"]["bytes"]
    probe.unload_model()
    # Room for the blocks, not for the resident KV next to them.
    llm = make_llm(dense_model, mlx_batching=True, mlx_cache_memory_max_gb=1.2 * blocks_bytes / (1 << 30))
    conversation(llm, "k", QUESTIONS[:1])
    stats = llm.get_prompt_cache_stats()["memory"]
    assert stats["resident_kv"]["entries"] == 0 and stats["resident_bytes"] <= stats["max_bytes"]
    assert stats["entries"] > 0  # the blocks stayed


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["early", "late"])
def test_a_prompt_that_breaks_the_resident_prefix_falls_back_correctly(make_llm, dense_model, broken):
    """Early: another first question, whose transcript another key's blocks hold (more than the
    resident KV shares: blocks win); late: another last question (the resident KV is trimmed to
    the shared prefix)."""
    other = ["Which cache is this?", *QUESTIONS[1:2]] if broken == "early" else [QUESTIONS[0], "Why is it fast?"]
    expected = plain_run(make_llm, dense_model, other)
    llm = make_llm(dense_model, mlx_batching=True)
    if broken == "early":
        conversation(llm, "j", other)
    conversation(llm, "k", QUESTIONS[:2])
    messages = [{"role": "system", "content": SYSTEM}]
    # Rebuild the broken transcript from the plain run's answers, as the host would resend it.
    for question, answer in zip(other, expected):
        messages = messages + [{"role": "user", "content": question}]
        last = messages
        messages = messages + [{"role": "assistant", "content": answer.content}]
    before = resident_stats(llm)["tokens_taken"]
    result = turn(llm, last, "k")
    assert result.token_ids == expected[-1].token_ids
    cached = result.usage["cached_input_tokens"]
    taken = resident_stats(llm)["tokens_taken"] - before
    assert 0 < cached < result.usage["prompt_tokens"]
    if broken == "early":
        assert taken == 0  # j's blocks, not k's resident KV
        assert cached >= result.usage["prompt_tokens"] - 16 - 8  # j's whole prompt but its tail
    else:
        assert taken == cached
    assert result.metadata["prompt_cache"]["cached_tokens"] == cached


@pytest.mark.slow
def test_a_restarted_engine_reuses_at_least_90_percent_from_its_ssd_tier(make_llm, dense_model, tmp_path):
    disk = tmp_path / "cache"
    first = make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=str(disk))
    (answer,) = conversation(first, "k", QUESTIONS[:1])
    first.unload_model()  # flushes the SSD tier, releases its namespace
    restarted = make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=str(disk))
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": answer.content},
        {"role": "user", "content": "Why?"},
    ]
    result = turn(restarted, messages, "k")
    # The prefix read from the SSD tier was stored in RAM by that turn: the next one reads no disk.
    following = messages + [{"role": "assistant", "content": result.content}, {"role": "user", "content": "And?"}]
    after = turn(restarted, following, "k")
    restarted.unload_model()
    prompt, cached = result.usage["prompt_tokens"], result.usage["cached_input_tokens"]
    assert cached >= 0.9 * prompt, (cached, prompt)
    assert result.metadata["prompt_cache"]["apc"]["disk_hits"] >= 1
    assert after.metadata["prompt_cache"]["apc"]["disk_hits"] == 0
    assert after.usage["cached_input_tokens"] >= cached
    plain = turn(make_llm(dense_model, mlx_batching=True), messages, None)
    assert result.token_ids == plain.token_ids
