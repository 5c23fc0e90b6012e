"""Keyed rows on the text lane (``text_loop.TextLoopBackend`` with the prefix cache's manager):
real MLX, the tiny dense model, the engine stepped by hand (``test_single_lane.Stepper``) so
that every turn's rows arrive together and share one batch.

Concurrent keyed sessions (N runs of one flow, each agent's transcript under its own key) batch
on the text lane's own loop, as keyless rows do: each row restores its prefix (its key's
resident KV or the blocks), prefills the rest alone, decodes with the others, stores its new
blocks once its first token is out and leaves its KV resident when it ends.
"""

from __future__ import annotations

import itertools

from abstractruntime_mlx.engine.backends.text_plan import PrefillPlan, plan_prefill
from abstractruntime_mlx.engine.cache.prefix_cache import CacheOptions, PrefixCache, restore_alignment
from abstractruntime_mlx.engine.core.request import EngineRequest, execution_report
from test_single_lane import Stepper

SYSTEM = "You are a careful assistant who answers briefly and checks every step twice. " * 12
QUESTIONS = ["What does a cache keep?", "And what does it drop?", "When does it drop it?"]
SESSIONS = 3
_ids = itertools.count()


class KeyedStepper(Stepper):
    """A hand-stepped engine with a prefix cache in RAM (as the worker builds it at load)."""

    def __init__(self, path: str, **config: object) -> None:
        super().__init__(path, **config)
        engine = self.engine
        assert engine.loaded is not None
        engine.prefix_cache = PrefixCache(
            engine.loaded,
            CacheOptions(),
            max_batch_size=engine.config.max_batch_size,
            restore_align=restore_alignment(engine.config.prefill_step_size),
        )
        engine._make_lanes()

    def request_ids(self, prompt_ids: list[int], **kwargs: object) -> EngineRequest:
        req = EngineRequest(request_id=f"k{next(_ids)}", prompt_ids=prompt_ids, **kwargs)  # type: ignore[arg-type]
        self.engine.submit(req)
        return req

    def close(self) -> None:
        self.engine._close_group()
        assert self.engine.prefix_cache is not None
        self.engine.prefix_cache.close()


def sessions(s: KeyedStepper, *, keyed: bool, max_tokens: int = 6) -> list[list[EngineRequest]]:
    """Each session's turns as token ids (the prompt grows by the answer and the next
    question), the sessions' turn k submitted together and stepped to the end."""
    loaded = s.engine.loaded
    assert loaded is not None
    prompts = [loaded.encode(SYSTEM) for _ in range(SESSIONS)]
    turns: list[list[EngineRequest]] = [[] for _ in range(SESSIONS)]
    for question in QUESTIONS:
        for i in range(SESSIONS):
            prompts[i] = prompts[i] + loaded.encode(f" Session {i}: {question}")
            key = f"run{i}/agent" if keyed else None
            turns[i].append(s.request_ids(prompts[i], max_tokens=max_tokens, prompt_cache_key=key))
        s.drain()
        for i in range(SESSIONS):
            prompts[i] = prompts[i] + list(turns[i][-1].token_ids)
    return turns


def blocks_leased(s: Stepper) -> int:
    assert s.engine.prefix_cache is not None
    return sum(block.ref_cnt for block in s.engine.prefix_cache.manager.hash_table.values())


def test_concurrent_keyed_sessions_batch_on_the_text_lane_with_the_tokens_of_no_reuse(dense_model):
    plain_engine = KeyedStepper(dense_model, max_batch_size=SESSIONS)
    plain = sessions(plain_engine, keyed=False)
    plain_engine.close()
    s = KeyedStepper(dense_model, max_batch_size=SESSIONS)
    try:
        keyed = sessions(s, keyed=True)
        assert [[r.token_ids for r in t] for t in keyed] == [[r.token_ids for r in t] for t in plain]
        # Every keyed row ran on the text lane's loop (before: mlx-vlm's batch generator, "batch").
        assert {execution_report(r).to_wire()["path"] for t in keyed for r in t} == {"text_batch"}
        # Turn 1: one session prefills the shared system prompt, the others wait for it and
        # restore its blocks.
        first = sorted(t[0].cached_tokens for t in keyed)
        assert first[0] == 0 and all(c >= 16 for c in first[1:])
        # Later turns start from each key's resident KV: the whole previous prompt and answer
        # (each delivered token is fed with the batch's next step, the last one too).
        for t in keyed:
            for previous, row in zip(t, t[1:]):
                assert row.cached_tokens >= previous.num_prompt_tokens + len(previous.token_ids) - 1
        assert s.engine.prefix_cache is not None
        resident = s.engine.prefix_cache.stats()["memory"]["resident_kv"]
        assert resident["entries"] == SESSIONS
        assert resident["tokens_taken"] == sum(r.cached_tokens for t in keyed for r in t[1:])
        assert blocks_leased(s) == 0  # every restored block went back once its row stored
    finally:
        s.close()


def test_a_keyed_row_cancelled_mid_prefill_or_mid_decode_lets_go_of_its_blocks(dense_model):
    s = KeyedStepper(dense_model, max_batch_size=2, prefill_step_size=64)
    try:
        loaded = s.engine.loaded
        assert loaded is not None
        prompt = loaded.encode(SYSTEM + QUESTIONS[0])
        first = s.request_ids(prompt, max_tokens=4, prompt_cache_key="a")
        s.drain()  # stores the prompt's blocks
        # Two rows restore them; each has a long rest to prefill, one chunked group at a time.
        decoding = s.request_ids(prompt + loaded.encode(" And then? " * 20), max_tokens=200, prompt_cache_key="b")
        prefilling = s.request_ids(prompt + loaded.encode(" Or else? " * 60), max_tokens=200, prompt_cache_key="c")
        s.until(lambda: len(decoding.token_ids) >= 2)
        assert prefilling.status.name == "PREFILLING"
        assert blocks_leased(s) > 0  # the row still prefilling holds what it restored
        s.engine.cancel(decoding)
        s.engine.cancel(prefilling)
        s.drain()
        assert blocks_leased(s) == 0
        assert execution_report(decoding).to_wire()["path"] == "text_batch"
        again = s.request_ids(prompt, max_tokens=4, prompt_cache_key="d")
        s.drain()
        assert again.cached_tokens >= 16 and again.token_ids == first.token_ids
    finally:
        s.close()


def test_plan_prefill_gives_a_keyed_row_a_group_of_its_own():
    alone = [True, False, True]
    # Short keyed rows are admitted (each prefills alone, in the same step).
    assert plan_prefill([3, 3, 3], free=3, step_size=8, chunking=False, alone=alone) == PrefillPlan(short=(0, 1, 2))
    # A long keyed row is the chunked group by itself; the long rows after it wait.
    assert plan_prefill([20, 30, 3], free=3, step_size=8, chunking=False, alone=alone) == PrefillPlan(
        short=(2,), long=(0,)
    )
    # Long keyless rows form the group; a long keyed row behind them waits.
    assert plan_prefill([30, 20, 20], free=3, step_size=8, chunking=False, alone=[False, False, True]) == PrefillPlan(
        long=(0, 1)
    )
    # While a group is chunking, only short rows are admitted, keyed or not.
    assert plan_prefill([20, 3], free=2, step_size=8, chunking=True, alone=[True, True]) == PrefillPlan(short=(1,))
