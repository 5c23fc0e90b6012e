"""Eviction by steps-to-execution and pins with a TTL: the pure policy, the block manager that
applies it (real MLX arrays), and a resident tiny model under a tight budget."""

from __future__ import annotations

import pytest

from abstractruntime_mlx import errors
from abstractruntime_mlx.engine.cache import prefix_cache, upstream
from abstractruntime_mlx.engine.cache.cache_priority import (
    BlockInfo,
    CachePriorities,
    eviction_order,
    validate_hints,
    warm_rank,
)

# --- the policy on hand-built blocks ----------------------------------------------------------


def blocks(*specs: tuple[int, set[str]]) -> list[BlockInfo]:
    return [BlockInfo(last_used, frozenset(owners)) for last_used, owners in specs]


def test_unreachable_first_then_unhinted_then_farthest_with_lru_between_equals():
    idle = blocks(
        (0, {"near"}),  # 0: next step
        (1, {"far"}),  # 1: three steps away
        (2, {"gone"}),  # 2: no live run reaches it
        (3, {"stranger"}),  # 3: never hinted
        (4, {"gone"}),  # 4: unreachable, used later than 2
        (5, set()),  # 5: no known owner
        (6, {"far"}),  # 6: far, used later than 1
    )
    hints = {"near": 0, "far": 3, "gone": None}
    assert eviction_order(idle, hints) == [2, 4, 3, 5, 1, 6, 0]


def test_a_shared_block_counts_its_most_urgent_owner():
    idle = blocks((0, {"gone", "near"}), (1, {"gone"}), (2, {"gone", "stranger"}), (3, {"far", "near"}), (4, {"far"}))
    assert eviction_order(idle, {"gone": None, "near": 0, "far": 5}) == [1, 2, 4, 0, 3]


def test_pinned_owners_keep_their_blocks_out_of_the_order():
    idle = blocks((0, {"a"}), (1, {"b"}), (2, {"a", "c"}))
    assert eviction_order(idle, {}, pinned={"a"}) == [1]
    assert eviction_order(idle, {}) == [0, 1, 2]  # no hints: plain LRU


def test_resident_entries_rank_as_their_keys_blocks_and_pinned_ones_go_last_newest_first():
    idle = blocks((0, {"a"}), (1, {"b"}))
    resident = [("p1", 5), ("b", 6), ("p2", 7), ("gone", 8)]  # indexed 2.. after the blocks
    order = eviction_order(idle, {"b": 0, "gone": None}, pinned=["p1", "p2"], resident=resident)
    assert order == [5, 0, 1, 3, 4, 2]  # gone, a's block, b's block, b's entry, p2 (newer pin), p1
    assert eviction_order(idle, {"b": 0}, resident=resident, below=(2, 0)) == [0]  # a warm: no entry


def test_pins_expire_renew_and_the_newest_goes_first():
    now = [100.0]
    priorities = CachePriorities(clock=lambda: now[0])
    assert not priorities.active
    priorities.pin("a", 10)
    now[0] = 101
    priorities.pin("b", 1)
    now[0] = 101.5
    priorities.pin("a", 10)  # a renewal keeps its age
    assert [p.key for p in priorities.live_pins()] == ["a", "b"] and priorities.active
    now[0] = 102.5
    assert [p.key for p in priorities.live_pins()] == ["a"]
    assert priorities.pins_expired == 1
    priorities.pin("c", 10)
    assert priorities.drop_pin().key == "c"
    assert priorities.release("c") is False
    assert priorities.release("a") is True and priorities.release("a") is False
    assert not priorities.active and priorities.pins_dropped == 1


@pytest.mark.parametrize(
    "hints",
    [{"k": -1}, {"k": True}, {"k": 1.5}, {"": 1}, {1: 1}, ["k"], {"k": 1 << 30}],
)
def test_bad_hints_are_typed_errors(hints):
    with pytest.raises(errors.InvalidControls) as info:
        validate_hints(hints)
    assert info.value.code == "invalid_controls"


# --- the block manager (real MLX arrays, no model) ---------------------------------------------


def test_upstream_eviction_surface():
    """The private names of mlx-vlm 0.7.10's APCManager the override replaces or reads."""
    import inspect

    from mlx_vlm import apc

    assert list(inspect.signature(apc.APCManager._make_room).parameters) == ["self", "allocation_bytes", "retain_bytes"]
    assert "cached_only" in inspect.signature(apc.APCManager._evict_lru).parameters
    for name in ("_free_push", "_free_remove", "_memory_headroom"):
        assert callable(getattr(apc.APCManager, name)), name
    source = inspect.getsource(apc.APCManager._make_room)
    for text in ("self._prefill_reserve_bytes", "self.memory_reserve_bytes", "self._free_head", "retain_bytes"):
        assert text in source, text
    assert {"next", "prev", "block_hash", "ref_cnt"} <= set(apc.APCBlock.__dataclass_fields__)


LAYERS, HEADS, DIM = 2, 2, 8
PROMPT_BLOCKS = 4


def kv(tokens: int):
    import mlx.core as mx

    keys = [mx.random.normal((1, HEADS, tokens, DIM)) for _ in range(LAYERS)]
    values = [mx.random.normal((1, HEADS, tokens, DIM)) for _ in range(LAYERS)]
    mx.eval(keys + values)
    return keys, values


def block_bytes() -> int:
    return 2 * LAYERS * HEADS * prefix_cache.BLOCK_SIZE * DIM * 4


def make_manager(max_prompts: float, priorities: CachePriorities | None):
    budget = int(max_prompts * PROMPT_BLOCKS * block_bytes())
    manager = upstream.counted_manager_class()(
        num_blocks=64,
        block_size=prefix_cache.BLOCK_SIZE,
        overrides={"memory_max_gb": budget / prefix_cache.GIB, "memory_reserve_gb": 0, "checkpoint_entries": 0},
    )
    manager.priorities = priorities
    return manager


def prompt(key: str) -> list[int]:
    base = 1000 * (1 + "abcdefgh".index(key))
    return [base + i for i in range(PROMPT_BLOCKS * prefix_cache.BLOCK_SIZE)]


def store(manager, priorities: CachePriorities | None, key: str) -> None:
    tokens = prompt(key)
    if priorities is not None:
        priorities.own(key, upstream.block_hashes(tokens, 0))
    keys, values = kv(len(tokens))
    manager.release(manager.store_kv_blocks(tokens, keys, values))


def resident(manager, key: str) -> int:
    matched, tokens = manager.lookup_prefix(prompt(key))
    manager.release(matched)
    return tokens


FULL = PROMPT_BLOCKS * prefix_cache.BLOCK_SIZE


def test_lru_without_priorities_evicts_the_oldest():
    manager = make_manager(2, None)
    for key in "abc":
        store(manager, None, key)
    assert [resident(manager, k) for k in "abc"] == [0, FULL, FULL]


def test_a_hinted_key_survives_and_the_unreachable_one_goes():
    priorities = CachePriorities()
    manager = make_manager(2, priorities)
    store(manager, priorities, "a")
    store(manager, priorities, "b")
    priorities.set_hints({"a": 0, "b": None})
    store(manager, priorities, "c")
    assert [resident(manager, k) for k in "abc"] == [FULL, 0, FULL]
    assert manager.resident_bytes() <= manager.memory_max_bytes


def test_a_pinned_key_survives_a_store_until_its_pin_expires():
    now = [0.0]
    priorities = CachePriorities(clock=lambda: now[0])
    manager = make_manager(2, priorities)
    store(manager, priorities, "a")
    store(manager, priorities, "b")
    priorities.pin("a", 5)
    store(manager, priorities, "c")
    assert [resident(manager, k) for k in "abc"] == [FULL, 0, FULL]
    now[0] = 6.0  # expired: plain LRU again, a is the oldest
    store(manager, priorities, "d")
    assert resident(manager, "a") == 0 and resident(manager, "d") == FULL
    assert priorities.pins_expired == 1


def test_a_store_takes_pins_only_when_nothing_else_is_left_newest_first():
    """Pinned blocks go last but lose to a live request, a store included: with every
    resident block pinned, the store takes the newest pin's blocks, not none of its own."""
    now = [0.0]
    priorities = CachePriorities(clock=lambda: now[0])
    manager = make_manager(2, priorities)
    store(manager, priorities, "a")
    store(manager, priorities, "b")
    priorities.pin("b", 60)
    now[0] = 1.0
    priorities.pin("a", 60)
    store(manager, priorities, "c")
    assert [resident(manager, k) for k in "abc"] == [0, FULL, FULL]
    assert list(priorities.pins) == ["b"] and priorities.pins_dropped == 1


def test_a_warm_stores_only_over_blocks_needed_later_and_never_takes_a_pin():
    """A prefetch fills room: the next node's warm (steps 1) may push out a block needed in three
    steps, not the current node's (steps 0) nor a pin; where only those are left it stores nothing."""
    now = [0.0]
    priorities = CachePriorities(clock=lambda: now[0])
    manager = make_manager(2, priorities)
    store(manager, priorities, "a")
    store(manager, priorities, "b")
    priorities.set_hints({"a": 0, "b": 3, "c": 1, "d": 1})
    with manager.storing_ahead("c"):
        store(manager, priorities, "c")
    assert [resident(manager, k) for k in "abc"] == [FULL, 0, FULL]
    priorities.pin("a", 60)
    with manager.storing_ahead("d"):
        store(manager, priorities, "d")  # a: pinned, c: as soon as d
    assert [resident(manager, k) for k in "acd"] == [FULL, FULL, 0] and priorities.pins_dropped == 0
    store(manager, priorities, "d")  # d's own request: it may push out c (as soon as d)
    assert [resident(manager, k) for k in "acd"] == [FULL, 0, FULL]


def test_pins_lose_to_a_live_request_newest_first(monkeypatch):
    now = [0.0]
    priorities = CachePriorities(clock=lambda: now[0])
    manager = make_manager(3, priorities)
    for key in "abc":
        store(manager, priorities, key)
    for key in "abc":
        now[0] += 1
        priorities.pin(key, 60)
    # The machine's free memory is short of what a live request needs by two prompts' worth.
    held = manager.resident_bytes()
    monkeypatch.setattr(manager, "_memory_headroom", lambda: -(held * 2 // 3) + block_bytes() // 2)
    manager._make_room(0)
    assert [resident(manager, k) for k in "abc"] == [FULL, 0, 0]
    assert [p.key for p in priorities.live_pins()] == ["a"] and priorities.pins_dropped == 2


def keep_resident(manager, key: str) -> bool:
    """``key``'s whole KV kept between turns (mlx-lm's plain cache per layer, as the lanes keep it)."""
    from mlx_lm.models.cache import KVCache

    tokens = prompt(key)
    layers = []
    for k, v in zip(*kv(len(tokens))):
        layer = KVCache()
        layer.keys, layer.values, layer.offset = k, v, len(tokens)
        layers.append(layer)
    return bool(manager.keep_resident(key, 0, tokens, layers, len(tokens)))


def test_blocks_and_resident_kv_go_in_one_order_and_a_pin_holds_its_entry_longest(monkeypatch):
    """With hints and pins, blocks and resident KV are evicted in one order: an entry ranks as
    its key's blocks (after blocks of its rank), a pinned key's entry after everything not
    pinned, then the pin with its blocks."""
    priorities = CachePriorities(clock=lambda: 0.0)
    manager = make_manager(8, priorities)
    manager.resident = upstream.ResidentKV(manager.lock, min_tokens=prefix_cache.BLOCK_SIZE, guard=0)
    store(manager, priorities, "a")
    store(manager, priorities, "c")
    for key in "dba":
        assert keep_resident(manager, key)
    priorities.set_hints({"a": 0, "b": 0, "c": 3, "d": None})
    priorities.pin("a", 60)
    size = PROMPT_BLOCKS * block_bytes()
    total = manager.resident_bytes()  # the machine's free memory: what the cache does not hold
    monkeypatch.setattr(manager, "_memory_headroom", lambda: total - manager.resident_bytes())
    monkeypatch.setattr(manager, "_prefill_reserve_bytes", 0)

    def held() -> tuple[list[str], list[int], list[str]]:
        kept = [key for key, _ in manager.resident.entries]
        return kept, [resident(manager, k) for k in "ac"], [p.key for p in priorities.live_pins()]

    assert held() == (["d", "b", "a"], [FULL, FULL], ["a"])
    steps = []
    for need in range(1, 6):
        manager._make_room(need * size)  # a live request needs one prompt's worth more each time
        steps.append(held())
    assert steps == [
        (["b", "a"], [FULL, FULL], ["a"]),  # d: hinted None
        (["b", "a"], [FULL, 0], ["a"]),  # c's blocks: three steps away
        (["a"], [FULL, 0], ["a"]),  # b: next, but not pinned
        ([], [FULL, 0], ["a"]),  # a's resident KV: its blocks stay pinned
        ([], [0, 0], []),  # a's pin, then its blocks
    ]


def test_a_kept_entry_takes_room_from_entries_ranked_below_it_never_from_blocks():
    """With hints, keeping a key's resident KV over budget drops the entries that rank below
    it; where that is not enough the entry goes and every block stays."""
    priorities = CachePriorities(clock=lambda: 0.0)
    manager = make_manager(3.5, priorities)
    manager.resident = upstream.ResidentKV(manager.lock, min_tokens=prefix_cache.BLOCK_SIZE, guard=0)
    store(manager, priorities, "a")
    store(manager, priorities, "b")
    priorities.set_hints({"a": 0, "b": 2, "c": None})
    assert keep_resident(manager, "b")
    assert keep_resident(manager, "a")  # b's entry is needed later than a's: it goes
    assert [key for key, _ in manager.resident.entries] == ["a"]
    # c is reached by no live run: nothing held ranks below its entry, so it is not kept.
    assert not keep_resident(manager, "c")
    assert [key for key, _ in manager.resident.entries] == ["a"]
    assert [resident(manager, k) for k in "ab"] == [FULL, FULL]


def test_without_priorities_resident_kv_goes_least_recently_kept_first(monkeypatch):
    manager = make_manager(8, None)
    manager.resident = upstream.ResidentKV(manager.lock, min_tokens=prefix_cache.BLOCK_SIZE, guard=0)
    for key in "dba":
        assert keep_resident(manager, key)
    total = manager.resident_bytes()
    monkeypatch.setattr(manager, "_memory_headroom", lambda: total - manager.resident_bytes())
    monkeypatch.setattr(manager, "_prefill_reserve_bytes", 0)
    manager._make_room(PROMPT_BLOCKS * block_bytes())
    assert [key for key, _ in manager.resident.entries] == ["b", "a"]


@pytest.mark.parametrize("priorities", [None, CachePriorities()], ids=["lru", "priorities"])
def test_a_store_past_a_restored_prefix_makes_room_for_its_new_blocks_only(priorities):
    """A turn that restored its transcript and adds one block evicts one block's worth, not
    room for its whole KV (upstream's admission: five blocks here, and b's and c's would go)."""
    manager = make_manager(3, priorities)
    for key in "abc":
        store(manager, priorities, key)
    assert len(manager.hash_table) == 3 * PROMPT_BLOCKS
    tokens = prompt("a") + [9000 + i for i in range(prefix_cache.BLOCK_SIZE)]
    keys, values = kv(len(tokens))
    manager.release(manager.store_kv_blocks(tokens, keys, values, skip_first_n_tokens=FULL))
    assert len(manager.hash_table) == 3 * PROMPT_BLOCKS
    assert [resident(manager, k) for k in "bc"] == [FULL, FULL]
    assert manager._store_adds is None


def test_a_store_skips_only_the_leading_blocks_ram_holds():
    """A row that started from its key's resident KV holds the previous answer, which no store
    made blocks of; skipping it as cached (upstream) leaves a gap no lookup gets past, and the
    blocks stored after it are never found. Here the gap is stored too."""
    manager = make_manager(8, None)
    store(manager, None, "a")
    answer = [9000 + i for i in range(2 * prefix_cache.BLOCK_SIZE)]
    turn = [9500 + i for i in range(2 * prefix_cache.BLOCK_SIZE)]
    tokens = prompt("a") + answer + turn
    keys, values = kv(len(tokens))
    held = manager.stats.stores
    manager.release(manager.store_kv_blocks(tokens, keys, values, skip_first_n_tokens=FULL + len(answer)))
    assert manager.stats.stores - held == 4  # the answer's two blocks and the turn's two
    matched, restored = manager.lookup_prefix(tokens)
    manager.release(matched)
    assert restored == len(tokens)


def test_the_resident_kv_read_back_counts_at_its_peak():
    """``reused_peak_bytes``: the most bytes of entries held at once that a later turn took."""
    manager = make_manager(8, None)
    manager.resident = upstream.ResidentKV(manager.lock, min_tokens=prefix_cache.BLOCK_SIZE, guard=0)
    size = PROMPT_BLOCKS * block_bytes()
    assert keep_resident(manager, "a") and keep_resident(manager, "b")
    assert manager.resident.reused_peak_bytes() == 0  # nothing read back yet
    assert manager.take_resident("a", 0, prompt("a") + [1]).tokens == FULL
    assert manager.take_resident("b", 0, prompt("b") + [1]).tokens == FULL
    assert keep_resident(manager, "c")  # kept after both were taken, never read back
    assert manager.take_resident("c", 0, [7] * 80).tokens == 0  # shares nothing: no read
    assert manager.resident.reused_peak_bytes() == 2 * size  # a and b were held together


# --- a resident tiny model under a tight budget -------------------------------------------------


def ask(llm, key: str, question: str = "What does a cache keep?"):
    system = f"You are agent {key}. " + "You answer briefly and carefully. " * 10
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return llm.generate("", messages=messages, max_output_tokens=4, thinking=False, prompt_cache_key=key)


def three_agents(llm, *, hints=None, pin=None):
    """a, b, c each once (a budget of about two), then a again: what a's second call finds."""
    first = [ask(llm, key) for key in ("agent-a", "agent-b")]
    if hints is not None:
        assert llm.prompt_cache_hints(hints)["applied"] is True
    if pin is not None:
        assert llm.prompt_cache_pin(pin, 60)["applied"] is True
    first.append(ask(llm, "agent-c"))
    return first, ask(llm, "agent-a", "And what does it drop?")


@pytest.fixture()
def tight_llm(make_llm, dense_model):
    probe = make_llm(dense_model, mlx_batching=True)
    result = ask(probe, "agent-a")
    # One prompt's blocks: the key's resident KV between turns is dropped before any block.
    kept = probe.get_prompt_cache_stats()["memory"]["resident_kv"]["bytes"]
    per_prompt = result.metadata["prompt_cache"]["apc"]["resident_bytes"] - kept
    probe.unload_model()

    def build():
        return make_llm(dense_model, mlx_batching=True, mlx_cache_memory_max_gb=2.5 * per_prompt / prefix_cache.GIB)

    return build


def test_lru_drops_the_next_agent_and_hints_keep_it(tight_llm):
    lru_first, lru_again = three_agents(tight_llm())
    assert lru_again.metadata["prompt_cache"]["cached_tokens"] == 0
    llm = tight_llm()
    hinted_first, hinted_again = three_agents(llm, hints={"agent-a": 1, "agent-b": None, "agent-c": 0})
    assert hinted_again.metadata["prompt_cache"]["cached_tokens"] > 0
    # greedy answers are the same with and without hints
    assert [r.token_ids for r in lru_first + [lru_again]] == [r.token_ids for r in hinted_first + [hinted_again]]
    stats = llm.get_prompt_cache_stats()
    assert stats["eviction"]["order"] == "steps_to_execution" and stats["eviction"]["hinted_keys"] == 3


def test_a_pinned_agent_keeps_its_prefix(tight_llm):
    _, again = three_agents(tight_llm(), pin="agent-a")
    assert again.metadata["prompt_cache"]["cached_tokens"] > 0


def test_provider_commands_validate_and_release(tight_llm):
    llm = tight_llm()
    with pytest.raises(errors.InvalidControls):
        llm.prompt_cache_hints({"k": -2})
    with pytest.raises(errors.InvalidControls):
        llm.prompt_cache_pin("k", 0)
    ask(llm, "agent-a")
    assert llm.prompt_cache_pin("agent-a", 30)["pins"] == 1
    assert llm.prompt_cache_release("agent-a")["released"] is True
    assert llm.prompt_cache_release("agent-a")["released"] is False


SHARED_SYSTEM = "You are the planner of every run. " + "You answer briefly and carefully. " * 10


def planner(llm, key: str, question: str = "What does a cache keep?"):
    messages = [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": question}]
    return llm.generate("", messages=messages, max_output_tokens=4, thinking=False, prompt_cache_key=key)


def test_a_warm_of_a_prefix_in_ram_makes_its_key_an_owner(tight_llm):
    """Run 1's planner stored the system prompt every run's planner shares, and is done (hinted None); run 2's
    planner is next. Its warm finds the prefix in RAM (nothing to prefill) yet names run 2's key an owner of its
    blocks, so run 2's hint keeps them; without the warm only run 1 owns them and they go first."""
    cached = {}
    for warm in (False, True):
        llm = tight_llm()
        first = planner(llm, "run1/planner")
        if warm:
            report = llm.prompt_cache_warm(
                messages=[{"role": "system", "content": SHARED_SYSTEM}], thinking=False, prompt_cache_key="run2/planner"
            )
            assert (report["queued"], report["reason"]) == (False, "already_resident")
        llm.prompt_cache_hints({"run1/planner": None, "run2/planner": 0, "agent-b": None, "agent-c": None})
        ask(llm, "agent-b")
        ask(llm, "agent-c")
        second = planner(llm, "run2/planner")
        cached[warm] = second.metadata["prompt_cache"]["cached_tokens"]
        assert second.token_ids == first.token_ids  # eviction never changes an answer
        llm.unload_model()
    assert cached[False] == 0 and cached[True] > 0


def test_a_shared_block_of_keys_that_are_done_ranks_with_the_unhinted():
    """None speaks for its own key: a prefix several keys began with is what a key not seen yet begins with too."""
    idle = blocks((0, {"stranger"}), (1, {"gone", "left"}), (2, {"gone"}), (3, {"near"}))
    assert eviction_order(idle, {"gone": None, "left": None, "near": 0}) == [2, 0, 1, 3]


def test_a_warm_ranks_its_victims_below_its_own_blocks():
    idle = blocks((0, {"near"}), (1, {"far"}), (2, {"gone"}), (3, {"stranger"}), (4, {"next"}))
    hints = {"near": 0, "far": 3, "gone": None, "next": 1, "warmed": 1}
    assert eviction_order(idle, hints, below=warm_rank("warmed", hints)) == [2, 3, 1]
    assert eviction_order(idle, hints, below=warm_rank("unhinted", hints)) == [2]  # only what no run reaches


def test_the_reused_bytes_count_the_blocks_a_lookup_restored(make_llm, dense_model):
    """``memory.reused_bytes``: of what the cache holds, the blocks some lookup restored (what a budget must keep)."""
    llm = make_llm(dense_model, mlx_batching=True)
    planner(llm, "run1/planner")
    memory = llm.get_prompt_cache_stats()["memory"]
    assert memory["reused_bytes"] == 0 < memory["resident_bytes"]
    cached = planner(llm, "run2/planner", "And what does it drop?").metadata["prompt_cache"]["cached_tokens"]
    memory = llm.get_prompt_cache_stats()["memory"]
    block_bytes = (memory["resident_bytes"] - memory["resident_kv"]["bytes"]) // memory["entries"]
    assert cached > 0 and memory["reused_bytes"] == cached // prefix_cache.BLOCK_SIZE * block_bytes
