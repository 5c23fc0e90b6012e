"""Admission rules, on hand-built requests (no MLX)."""

from __future__ import annotations

from collections import deque

import pytest

from abstractruntime_mlx.engine.core.request import EngineRequest, ExecutionMode, RequestStatus, Sampling
from abstractruntime_mlx.engine.core.scheduler import group_key, take_compatible
from abstractruntime_mlx.engine.core.stops import StopMatcher


def req(name, *, temperature=0.0, draft=0, cache=None, penalty=None, strict=False):
    return EngineRequest(
        request_id=name,
        prompt_ids=[1, 2, 3],
        max_tokens=4,
        sampling=Sampling(temperature=temperature, repetition_penalty=penalty),
        draft_tokens=draft,
        speculation_required=strict,
        cache_group=cache,
    )


def test_lanes():
    assert group_key(req("a")).mode == ExecutionMode.CONTINUOUS
    assert group_key(req("b", draft=2)).mode == ExecutionMode.COHORT
    # sampled rows and penalties are per-row controls: they share the continuous batch
    assert group_key(req("c", temperature=0.7)) == group_key(req("a"))
    assert group_key(req("d", penalty=1.2)) == group_key(req("a"))
    # except with speculation (one sampler per speculative generator), or by option
    spec = group_key(req("e", temperature=0.7, draft=2))
    assert (spec.mode, spec.reason) == (ExecutionMode.EXCLUSIVE, "sampled_speculation")
    for r in (req("f", temperature=0.7), req("g", penalty=1.2)):
        key = group_key(r, sampled_exclusive=True)
        assert (key.mode, key.reason) == (ExecutionMode.EXCLUSIVE, "sampled_exclusive")
    assert group_key(req("h"), sampled_exclusive=True).mode == ExecutionMode.CONTINUOUS


def test_continuous_admits_sampled_rows_until_the_first_incompatible_request():
    waiting = deque([req("a"), req("s", temperature=0.9), req("m", draft=2, strict=True), req("c")])
    taken = take_compatible(waiting, group_key(waiting[0]), limit=8)
    assert [r.request_id for r in taken] == ["a", "s"]
    assert [r.request_id for r in waiting] == ["m", "c"]  # the cohort is next: no starvation
    # Optional MTP is no barrier: under load it joins the batch target-only.
    waiting = deque([req("a"), req("o", draft=2), req("c")])
    assert [r.request_id for r in take_compatible(waiting, group_key(waiting[0]), limit=8)] == ["a", "o", "c"]
    waiting = deque([req("a"), req("s", temperature=0.9), req("c")])
    key = group_key(waiting[0], sampled_exclusive=True)
    assert [r.request_id for r in take_compatible(waiting, key, limit=8)] == ["a"]
    assert [r.request_id for r in waiting] == ["s", "c"]


def test_limit_and_depths_and_cache_groups_are_separate_groups():
    waiting = deque([req("a", draft=2), req("b", draft=2), req("c", draft=3), req("d", draft=2)])
    taken = take_compatible(waiting, group_key(waiting[0]), limit=8)
    assert [r.request_id for r in taken] == ["a", "b"]
    waiting = deque([req("a", cache="k1"), req("b", cache="k2")])
    assert [r.request_id for r in take_compatible(waiting, group_key(waiting[0]), limit=8)] == ["a"]
    waiting = deque([req(str(i)) for i in range(5)])
    assert len(take_compatible(waiting, group_key(waiting[0]), limit=3)) == 3


def test_keyed_and_keyless_requests_need_different_cache_managers():
    def keyed(name, key, **kw):
        r = req(name, **kw)
        r.prompt_cache_key = key
        return r

    # keyed rows use the prefix cache's manager, keyless rows none: never one group
    waiting = deque([keyed("a", "k1"), keyed("b", "k2"), req("c"), keyed("d", "k1")])
    assert [r.request_id for r in take_compatible(waiting, group_key(waiting[0]), limit=8)] == ["a", "b"]
    assert [r.request_id for r in take_compatible(waiting, group_key(waiting[0]), limit=8)] == ["c"]
    assert group_key(keyed("x", "k", draft=2)).mode == ExecutionMode.COHORT
    assert group_key(keyed("x", "k", draft=2)) != group_key(req("y", draft=2))


def test_exclusive_never_admits_another():
    first, second = req("x", temperature=0.5, draft=2), req("y", temperature=0.5, draft=2)
    assert not group_key(first).admits(second)
    assert not group_key(first).admits(first)
    first, second = req("x", temperature=0.5), req("y", temperature=0.5)
    assert not group_key(first, sampled_exclusive=True).admits(second)


def test_status_only_moves_forward():
    r = req("a")
    r.transition(RequestStatus.PREFILLING)
    r.transition(RequestStatus.DECODING)
    r.transition(RequestStatus.FINISHED_LENGTH)
    assert r.is_finished() and r.finish_reason() == "length"
    with pytest.raises(RuntimeError, match="illegal transition"):
        r.transition(RequestStatus.DECODING)
    w = req("w")
    with pytest.raises(RuntimeError):
        w.transition(RequestStatus.DECODING)  # waiting cannot skip prefill


@pytest.mark.parametrize(
    "pieces, stops, emitted, stopped",
    [
        (["Hel", "lo wor", "ld"], ("lo w",), "Hel", True),
        (["ab", "c"], ("x",), "abc", False),
        (["a<", "/s", "> tail"], ("</s>",), "a", True),
        (["a<", "b"], ("</s>",), "a<b", False),  # a held prefix turns out to be text
    ],
)
def test_stop_strings_across_pieces(pieces, stops, emitted, stopped):
    matcher = StopMatcher(stops)
    out, hit = "", False
    for piece in pieces:
        text, hit = matcher.feed(piece)
        out += text
        if hit:
            break
    if not hit:
        out += matcher.flush()
    assert (out, hit) == (emitted, stopped)
