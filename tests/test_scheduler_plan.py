"""``Scheduler.schedule(state) -> StepPlan`` on hand-built requests and state (no MLX, no threads).

The clock is ``SchedulerState.now``: every wait is asserted as the time the plan names, never
measured.
"""

from __future__ import annotations

from abstractruntime_mlx.engine.backends.rows import LaneName
from abstractruntime_mlx.engine.backends.text_plan import PrefillPlan, plan_prefill, should_compact
from abstractruntime_mlx.engine.core.config import EngineConfig
from abstractruntime_mlx.engine.core.request import (
    EngineRequest,
    ExclusiveReason,
    ExecutionMode,
    RequestStatus,
    Sampling,
)
from abstractruntime_mlx.engine.core.scheduler import (
    MIN_SHARED_PREFIX,
    Admission,
    GroupState,
    Scheduler,
    SchedulerState,
    StepPlan,
    group_key,
)

SINGLE_LANE_MODEL = frozenset({LaneName.BATCH, LaneName.SINGLE})


def req(name, *, temperature=0.0, draft=0, strict=False, key=None, prompt=(1, 2, 3), penalty=None):
    return EngineRequest(
        request_id=name,
        prompt_ids=list(prompt),
        max_tokens=4,
        sampling=Sampling(temperature=temperature, repetition_penalty=penalty),
        draft_tokens=draft,
        speculation_required=strict,
        prompt_cache_key=key,
    )


def state(waiting, *, now=0.0, group=None, **kw):
    return SchedulerState(now=now, waiting=tuple(waiting), group=group, **kw)


def scheduler(**config):
    return Scheduler(EngineConfig(**{"batch_wait_ms": 10.0, "burst_gap_ms": 2.0, **config}))


def ids(plan: StepPlan) -> list[str]:
    return [a.request.request_id for a in plan.admit]


def running(key_of, lane=LaneName.BATCH, *, free=3, decoding=False, prefilling=()):
    return GroupState(group_key(key_of), lane, free, row_decoding=decoding, prefilling=tuple(prefilling))


# --- starting a group ---------------------------------------------------------------------


def test_nothing_waiting_plans_nothing():
    assert scheduler().schedule(state([])) == StepPlan()


def test_a_continuous_group_starts_once_the_burst_goes_quiet():
    s = scheduler(single_lane=False)
    a, b = req("a"), req("b")
    assert s.schedule(state([a], now=1.0)) == StepPlan(wait_until=1.002)
    # an arrival inside the gap extends the window from its arrival
    assert s.schedule(state([a, b], now=1.0015)) == StepPlan(wait_until=1.0035)
    plan = s.schedule(state([a, b], now=1.0035))
    assert plan.new_group is not None and plan.new_group.lane == LaneName.BATCH
    assert (plan.new_group.key.mode, plan.new_group.max_batch_size) == (ExecutionMode.CONTINUOUS, 4)
    assert ids(plan) == ["a", "b"] and plan.step and plan.num_taken == 2


def test_a_burst_waits_at_most_batch_wait_ms():
    s = scheduler(single_lane=False)
    waiting = [req("a")]
    assert s.schedule(state(waiting, now=0.0)).wait_until == 0.002
    for i, now in enumerate((0.0015, 0.003, 0.0045, 0.006, 0.0075, 0.009)):
        waiting.append(req(f"r{i}"))
        plan = s.schedule(state(waiting, now=now))
        if plan.new_group is not None:
            break
        assert plan.wait_until == min(0.010, now + 0.002)
    # four slots: the window closes as soon as they are taken
    assert plan.new_group is not None and len(plan.admit) == 4


def test_a_full_window_or_a_stop_starts_at_once():
    full = [req(str(i)) for i in range(4)]
    assert scheduler().schedule(state(full)).new_group is not None
    assert scheduler().schedule(state([req("a")], stopping=True)).new_group is not None
    assert scheduler(burst_gap_ms=0).schedule(state([req("a")])).new_group is not None


def test_a_lone_text_request_starts_on_the_single_lane():
    def kind(request, **kw):
        plan = scheduler(burst_gap_ms=0).schedule(state([request], **{"model_lanes": SINGLE_LANE_MODEL, **kw}))
        assert plan.new_group is not None
        return plan.new_group.lane

    assert kind(req("a")) == LaneName.SINGLE
    assert kind(req("a"), model_lanes=frozenset({LaneName.BATCH})) == LaneName.BATCH  # the model has no single lane
    assert kind(req("p", penalty=1.2)) == LaneName.BATCH  # logits processors run in the batch
    assert kind(req("k", key="s")) == LaneName.SINGLE
    assert kind(req("k", key="s"), prefix_cache=True) == LaneName.BATCH  # keyed rows use the prefix cache
    plan = scheduler(burst_gap_ms=0, single_lane=False).schedule(state([req("a")], model_lanes=SINGLE_LANE_MODEL))
    assert plan.new_group is not None and plan.new_group.lane == LaneName.BATCH
    two = scheduler(burst_gap_ms=0).schedule(state([req("a"), req("b")], model_lanes=SINGLE_LANE_MODEL))
    assert two.new_group is not None and two.new_group.lane == LaneName.BATCH


def test_exclusive_and_serial_start_alone_without_waiting():
    sampled_mtp, other = req("x", temperature=0.7, draft=2), req("y", temperature=0.7, draft=2)
    plan = scheduler().schedule(state([sampled_mtp, other]))
    assert plan.new_group is not None
    key = plan.new_group.key
    assert (key.mode, key.reason, plan.new_group.max_batch_size) == (
        ExecutionMode.EXCLUSIVE,
        ExclusiveReason.SAMPLED_SPECULATION,
        1,
    )
    assert ids(plan) == ["x"]
    plan = scheduler().schedule(state([req("a"), req("b")], model_lanes=frozenset({LaneName.SERIAL})))
    assert plan.new_group is not None and plan.new_group.lane == LaneName.SERIAL
    assert (plan.new_group.key.reason, ids(plan)) == (ExclusiveReason.SERIALIZED_LANE, ["a"])


def test_a_cohort_waits_the_whole_window_for_company():
    s = scheduler()
    a, b = req("a", draft=2), req("b", draft=2)
    assert s.schedule(state([a], now=0.0)).wait_until == 0.010  # no burst gap: it cannot be joined later
    assert s.schedule(state([a, b], now=0.009)).wait_until == 0.010
    plan = s.schedule(state([a, b], now=0.010))
    assert plan.new_group is not None and plan.new_group.key.mode == ExecutionMode.COHORT
    assert [(x.request.request_id, x.target_only) for x in plan.admit] == [("a", False), ("b", False)]


def test_optional_mtp_defers_when_target_only_work_arrives_while_its_cohort_waits():
    s = scheduler()
    head = req("o", draft=2)
    assert s.schedule(state([head], now=0.0)).wait_until == 0.010
    plan = s.schedule(state([head, req("t")], now=0.001))  # target-only work: stop waiting
    assert plan.new_group is not None and plan.new_group.key.mode == ExecutionMode.CONTINUOUS
    assert [(x.request.request_id, x.target_only) for x in plan.admit] == [("o", True), ("t", False)]


def test_strict_mtp_keeps_its_cohort():
    s = scheduler()
    head = req("m", draft=2, strict=True)
    s.schedule(state([head], now=0.0))
    plan = s.schedule(state([head, req("t")], now=0.010))
    assert plan.new_group is not None and plan.new_group.key.mode == ExecutionMode.COHORT
    assert ids(plan) == ["m"]  # the target-only request is a barrier: it runs next


# --- a running group ----------------------------------------------------------------------


def test_late_joiners_take_free_slots_up_to_the_first_incompatible_request():
    group = running(req("g"), free=2)
    waiting = [req("a"), req("o", draft=2), req("b"), req("c")]
    plan = scheduler().schedule(state(waiting, group=group))
    assert plan.new_group is None and plan.step
    assert [(x.request.request_id, x.target_only) for x in plan.admit] == [("a", False), ("o", True)]
    barrier = [req("a"), req("m", draft=2, strict=True), req("b")]
    assert ids(scheduler().schedule(state(barrier, group=group))) == ["a"]


def test_no_late_joiners_when_full_paused_or_not_continuous():
    waiting = [req("a")]
    assert scheduler().schedule(state(waiting, group=running(req("g"), free=0))) == StepPlan(step=True)
    paused = state(waiting, group=running(req("g")), admission_paused=True)
    assert scheduler().schedule(paused) == StepPlan(step=True)
    cohort = running(req("c", draft=2))
    assert scheduler().schedule(state([req("d", draft=2)], group=cohort)) == StepPlan(step=True)


def test_the_single_lane_hands_its_row_off_when_a_compatible_request_arrives():
    s = scheduler(max_batch_size=3)
    waiting = [req("a"), req("b"), req("c")]
    prefilling = running(req("g"), LaneName.SINGLE, free=0, decoding=False)
    assert s.schedule(state(waiting, group=prefilling)) == StepPlan(step=True)  # the row moves once it decodes
    decoding = running(req("g"), LaneName.SINGLE, free=0, decoding=True)
    plan = s.schedule(state(waiting, group=decoding))
    assert plan.hand_off == LaneName.BATCH and ids(plan) == ["a", "b"]  # the moved row holds the third slot
    assert s.schedule(state([req("m", draft=2, strict=True)], group=decoding)) == StepPlan(step=True)
    assert scheduler(max_batch_size=1).schedule(state(waiting, group=decoding)) == StepPlan(step=True)


# --- shared prefixes ----------------------------------------------------------------------


class FakePrefixIndex:
    """Salts by cache key; ``resident`` tokens are already cached for every prompt."""

    def __init__(self, resident: int = 0) -> None:
        self.resident = resident

    def salt(self, request):
        return request.prompt_cache_key

    def resident_tokens(self, prompt_ids, salt):
        return self.resident


SYSTEM = tuple(range(100, 100 + MIN_SHARED_PREFIX + 8))


def test_a_request_sharing_a_prefix_still_prefilling_waits_for_its_leader():
    leader = req("lead", key="s", prompt=SYSTEM + (1, 2))
    leader.transition(RequestStatus.PREFILLING)
    follower, other_scope, keyless = (
        req("f", key="s", prompt=SYSTEM + (3,)),
        req("o", key="t", prompt=SYSTEM + (4,)),
        req("k", prompt=SYSTEM),
    )
    group = running(req("g", key="s"), free=3, prefilling=[leader])
    plan = scheduler().schedule(state([follower, other_scope, keyless], group=group, shared_prefixes=FakePrefixIndex()))
    assert [(h.request.request_id, h.leader.request_id) for h in plan.held] == [("f", "lead")]
    assert ids(plan) == ["o"]  # a keyless request is another group: a barrier
    assert plan.num_taken == 2


def test_followers_in_one_burst_wait_for_the_first_to_prefill():
    burst = [req(f"r{i}", key="s", prompt=SYSTEM + (i,)) for i in range(3)]
    plan = scheduler(burst_gap_ms=0).schedule(state(burst, shared_prefixes=FakePrefixIndex()))
    assert ids(plan) == ["r0"]
    assert [(h.request.request_id, h.leader.request_id) for h in plan.held] == [("r1", "r0"), ("r2", "r0")]


def test_a_prefix_already_cached_or_too_short_is_not_waited_for():
    leader = req("lead", key="s", prompt=SYSTEM + (1,))
    leader.transition(RequestStatus.PREFILLING)
    follower = req("f", key="s", prompt=SYSTEM + (3,))
    group = running(req("g", key="s"), prefilling=[leader])
    cached = FakePrefixIndex(resident=len(SYSTEM) - MIN_SHARED_PREFIX + 1)
    assert ids(scheduler().schedule(state([follower], group=group, shared_prefixes=cached))) == ["f"]
    short = req("x", key="s", prompt=SYSTEM[: MIN_SHARED_PREFIX - 1] + (9, 9))
    assert ids(scheduler().schedule(state([short], group=group, shared_prefixes=FakePrefixIndex()))) == ["x"]
    # without block sharing (no index) nothing is held
    assert ids(scheduler().schedule(state([follower], group=group))) == ["f"]


def test_a_held_request_is_a_barrier_until_its_leader_prefilled():
    leader = req("lead", key="s")
    leader.transition(RequestStatus.PREFILLING)
    follower = req("f", key="s")
    follower.prefix_leader = leader
    group = running(req("g", key="s"))
    waiting = [follower, req("b", key="s")]
    assert scheduler().schedule(state(waiting, group=group)) == StepPlan(step=True)
    leader.transition(RequestStatus.DECODING)
    assert ids(scheduler().schedule(state(waiting, group=group))) == ["f", "b"]


def test_admissions_are_typed_data():
    plan = scheduler(burst_gap_ms=0).schedule(state([req("a")]))
    assert plan.admit == (Admission(plan.admit[0].request, target_only=False),)


# --- lanes --------------------------------------------------------------------------------

TEXT_MODEL = frozenset({LaneName.BATCH, LaneName.SINGLE, LaneName.TEXT})


def test_text_rows_start_in_the_text_lane_and_hand_off_into_it():
    s = scheduler(burst_gap_ms=0)
    plan = s.schedule(state([req("a"), req("b")], model_lanes=TEXT_MODEL))
    assert plan.new_group is not None and plan.new_group.lane == LaneName.TEXT
    assert plan.new_group.key.lane == LaneName.TEXT
    keyed = s.schedule(state([req("k", key="s"), req("l", key="s")], model_lanes=TEXT_MODEL, prefix_cache=True))
    assert keyed.new_group is not None and keyed.new_group.lane == LaneName.BATCH  # prefix blocks: mlx-vlm's batch
    off = scheduler(burst_gap_ms=0, text_lane=False).schedule(state([req("a"), req("b")], model_lanes=TEXT_MODEL))
    assert off.new_group is not None and off.new_group.lane == LaneName.BATCH
    lone = s.schedule(state([req("a")], model_lanes=TEXT_MODEL))
    assert lone.new_group is not None and lone.new_group.lane == LaneName.SINGLE
    text_key = group_key(req("g"), text_lane=True)
    decoding = GroupState(text_key, LaneName.SINGLE, 0, row_decoding=True)
    moved = scheduler(max_batch_size=3).schedule(state([req("a")], group=decoding, model_lanes=TEXT_MODEL))
    assert moved.hand_off == LaneName.TEXT and ids(moved) == ["a"]


def test_the_in_process_lane_runs_every_request_alone():
    plan = scheduler().schedule(state([req("a", draft=2), req("b")], model_lanes=frozenset({LaneName.IN_PROCESS})))
    assert plan.new_group is not None and plan.new_group.lane == LaneName.IN_PROCESS
    assert (plan.new_group.key.reason, plan.new_group.max_batch_size, ids(plan)) == (
        ExclusiveReason.SERIALIZED_LANE,
        1,
        ["a"],
    )


# --- the text lane's step: prefill and compaction ------------------------------------------


def test_plan_prefill_admits_short_prompts_and_one_chunked_group():
    # step size 8: a prompt of 9 tokens (8 to prefill, its last rides in the decode step) is short
    assert plan_prefill([9, 10, 3], free=4, step_size=8, chunking=False) == PrefillPlan(short=(0, 2), long=(1,))
    # several long prompts start one chunked group together
    assert plan_prefill([20, 30], free=4, step_size=8, chunking=False) == PrefillPlan(long=(0, 1))
    # while a group chunks, long prompts wait and short ones behind them still join
    assert plan_prefill([20, 3], free=4, step_size=8, chunking=True) == PrefillPlan(short=(1,))
    # free slots bound it, in arrival order
    assert plan_prefill([3, 3, 3], free=2, step_size=8, chunking=False) == PrefillPlan(short=(0, 1))
    assert plan_prefill([3], free=0, step_size=8, chunking=False) == PrefillPlan()


def test_should_compact_idles_finished_rows_only_where_allowed():
    assert not should_compact(8, 0, joining=True, idle_allowed=False)  # nothing finished: nothing to drop
    assert should_compact(8, 1, joining=False, idle_allowed=False)  # dropped at once
    assert not should_compact(8, 3, joining=False, idle_allowed=True)  # idle until half the batch finished
    assert should_compact(8, 4, joining=False, idle_allowed=True)
    assert should_compact(8, 1, joining=True, idle_allowed=True)  # rows joining compact first
