"""Admission decisions: which waiting requests start, join, or wait. Plain logic, no MLX, no threads.

``Scheduler.schedule(state) -> StepPlan``: the loop on the worker thread gathers a
``SchedulerState`` (the waiting queue, the running group, the clock), asks for a plan and
executes it. Every lane policy lives here, and is tested on hand-built requests
(``tests/test_scheduler_plan.py``).

Policy (the fairness rule):
- Requests are considered in arrival order. The head of the waiting queue decides what the
  next group is: continuous (no speculation; greedy and sampled rows side by side, each with
  its own controls), cohort (greedy MTP of one depth) or exclusive (alone with its own
  controls, where a control cannot be applied per row; ``reason`` says which).
- Exclusive: sampling or penalties with MTP speculation (a speculative generator draws
  every row with one sampler), and every sampled request under ``sampled_exclusive`` (the
  seed's behaviour, kept as an option).
- A running continuous group admits later compatible requests into free slots, but only
  while the head of the queue is compatible: an incompatible request at the head is a
  barrier, so the group drains and that request runs next. A stream of batchable
  requests therefore cannot starve a sampled one; it waits at most one group's lifetime.
- Cohorts never admit late joiners (upstream cannot extend a speculative batch).
- Load-aware optional MTP: an optional MTP request (``require_acceleration`` false) runs
  target-only in the continuous batch, as if it had asked for no speculation, when
  target-only work is there to share it: a continuous group admits it as a late joiner
  (that group is the work running), and at the head of the queue it defers when target-only
  requests wait right behind it (``under_load``: the run of requests the target-only group
  would take holds one that asked for no MTP). Alone, or with only MTP requests of its depth
  behind it, it runs MTP (a cohort). Strict MTP requests are never deferred.
- Burst and batch waits: a cohort cannot be joined later, so it waits up to ``batch_wait_ms``
  for company (stopping early once target-only work arrives for its optional-MTP head to defer
  to, then running target-only with it). A continuous group waits only while a burst keeps
  arriving (``burst_gap_ms`` without a compatible arrival ends it, ``batch_wait_ms`` at most);
  later requests join its free slots.
- Which lane a new group runs on is the table's (``lanes.LANES``, ``lanes.choose_lane``): the
  one-at-a-time lanes (``mlx_batching=False``) run every request alone, as exclusive; a
  continuous group of one whose row can later move into a batch as is decodes on the single
  lane, and the first compatible arrival moves that row (once it decodes) into the batch lane
  of its key (``LaneSpec.adopts_from``); a continuous group of text rows (``lanes.text_lane_row``)
  on a model that has the text lane runs there; everything else on mlx-vlm's batch.
  A text key (``GroupKey.lane``) never admits rows that need mlx-vlm's loop, so such a row at the
  head of the queue is a barrier like any other.
- Requests with different prefix-cache groups never share a group: keyed requests (which
  look up and store in the resident model's prefix cache) never batch with keyless ones.
- Shared prefixes are prefilled once: a keyed request about to be admitted to a continuous
  batch whose prompt shares at least ``MIN_SHARED_PREFIX`` tokens not yet cached with a
  request already admitted and still prefilling (its prefix leader) waits at the head of
  the queue until that leader's prefill has stored the shared blocks, then joins and
  restores them (N sessions of one flow started together prefill its system prompt and
  tools once). A waiting follower is a barrier like any head of the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..backends.rows import LaneName
from .config import EngineConfig
from .lanes import LaneContext, choose_lane, one_at_a_time_lane, text_lane_row
from .request import EngineRequest, ExclusiveReason, ExecutionMode, RequestStatus


@dataclass(frozen=True, slots=True)
class GroupKey:
    mode: ExecutionMode
    draft_tokens: int
    cache_group: Hashable
    reason: ExclusiveReason | None = field(default=None, compare=False)
    sampled_exclusive: bool = field(default=False, compare=False)
    # The batch lane its continuous rows share: the text lane (``lanes.text_lane_row``) or mlx-vlm's.
    lane: LaneName = LaneName.BATCH
    text_lane: bool = field(default=False, compare=False)  # whether the text lane is open
    keyed_text: bool = field(default=False, compare=False)  # and takes keyed rows (``LaneContext.lanes_restore``)

    def admits(self, request: EngineRequest) -> bool:
        if self.mode == ExecutionMode.EXCLUSIVE:
            return False
        options = {
            "sampled_exclusive": self.sampled_exclusive,
            "text_lane": self.text_lane,
            "keyed_text": self.keyed_text,
        }
        if group_key(request, **options) == self:
            return True
        # A continuous group is target-only work running: optional MTP joins it target-only.
        return (
            self.mode == ExecutionMode.CONTINUOUS and request.deferrable and self == target_only_key(request, **options)
        )


def group_key(
    request: EngineRequest,
    *,
    sampled_exclusive: bool = False,
    target_only: bool = False,
    text_lane: bool = False,
    keyed_text: bool = False,
) -> GroupKey:
    """The group ``request`` runs in; ``target_only``: the group it runs in without its MTP;
    ``text_lane``: the text lane is open (the model has it and the engine enables it);
    ``keyed_text``: it runs keyed rows too (``lanes.text_lane_row``)."""
    cache_group = request.cache_group if request.prompt_cache_key is None else ("prefix", request.cache_group)
    draft_tokens = 0 if target_only else request.draft_tokens
    if not request.sampling.is_greedy_neutral():
        reason: ExclusiveReason | None = None
        if draft_tokens > 0:
            reason = ExclusiveReason.SAMPLED_SPECULATION
        elif sampled_exclusive:
            reason = ExclusiveReason.SAMPLED_EXCLUSIVE
        if reason is not None:
            return GroupKey(ExecutionMode.EXCLUSIVE, draft_tokens, (cache_group, request.request_id), reason)
    elif draft_tokens > 0:
        return GroupKey(ExecutionMode.COHORT, draft_tokens, cache_group)
    lane = LaneName.TEXT if text_lane and text_lane_row(request, keyed=keyed_text) else LaneName.BATCH
    return GroupKey(
        ExecutionMode.CONTINUOUS,
        0,
        cache_group,
        sampled_exclusive=sampled_exclusive,
        lane=lane,
        text_lane=text_lane,
        keyed_text=keyed_text,
    )


def target_only_key(
    request: EngineRequest, *, sampled_exclusive: bool = False, text_lane: bool = False, keyed_text: bool = False
) -> GroupKey:
    return group_key(
        request, sampled_exclusive=sampled_exclusive, target_only=True, text_lane=text_lane, keyed_text=keyed_text
    )


def under_load(
    waiting: Sequence[EngineRequest],
    *,
    sampled_exclusive: bool = False,
    text_lane: bool = False,
    keyed_text: bool = False,
) -> GroupKey | None:
    """The continuous key the head of ``waiting`` defers to, or None when it runs its MTP.

    The head defers when it is optional MTP and the run of requests its target-only group
    would take (from the head, up to the first it does not admit) holds a request that asked
    for no MTP: target-only work is waiting to share the batch.
    """
    if not waiting or not waiting[0].deferrable:
        return None
    key = target_only_key(waiting[0], sampled_exclusive=sampled_exclusive, text_lane=text_lane, keyed_text=keyed_text)
    if key.mode != ExecutionMode.CONTINUOUS:
        return None
    for request in list(waiting)[1:]:
        if not key.admits(request):
            return None
        if request.draft_tokens == 0:
            return key
    return None


def compatible_head(waiting: Sequence[EngineRequest], key: GroupKey, limit: int) -> list[EngineRequest]:
    """Up to ``limit`` requests from the head of ``waiting`` that ``key`` admits.

    Stops at the first request it does not admit (the fairness barrier), or that waits for
    its prefix leader's prefill.
    """
    taken: list[EngineRequest] = []
    for request in waiting:
        if len(taken) >= limit or not key.admits(request) or request.waits_for_prefix:
            break
        taken.append(request)
    return taken


def take_compatible(waiting: deque[EngineRequest], key: GroupKey, limit: int) -> list[EngineRequest]:
    """Pop ``compatible_head(waiting, key, limit)`` from ``waiting``."""
    taken = compatible_head(waiting, key, limit)
    for _ in taken:
        waiting.popleft()
    return taken


# Shorter shared prefixes are cheaper to prefill again than to wait for.
MIN_SHARED_PREFIX = 64


def prefix_leader(request: EngineRequest, prefilling: list[EngineRequest], *, resident: int) -> EngineRequest | None:
    """The request of ``prefilling`` (admitted to the same batch, prefill not done) whose prefix
    ``request`` should wait for: the one sharing the longest prompt prefix, when that prefix
    is at least ``MIN_SHARED_PREFIX`` tokens longer than the ``resident`` (already cached) one."""
    best, best_len = None, resident + MIN_SHARED_PREFIX - 1
    prompt = request.prompt_ids
    for leader in prefilling:
        other = leader.prompt_ids
        n = min(len(prompt) - 1, len(other))  # a row always feeds at least one token
        shared = 0
        while shared < n and prompt[shared] == other[shared]:
            shared += 1
        if shared > best_len:
            best, best_len = leader, shared
    return best


def count_compatible_head(waiting: Sequence[EngineRequest], key: GroupKey) -> int:
    n = 0
    for request in waiting:
        if not key.admits(request):
            break
        n += 1
    return n


# --- the plan --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewGroup:
    """Start a group for ``key`` on ``lane`` (``lanes.LANES``) with ``max_batch_size`` slots."""

    key: GroupKey
    lane: LaneName
    max_batch_size: int


@dataclass(frozen=True, slots=True)
class Admission:
    """Insert ``request`` into the group; ``target_only``: optional MTP deferred under load
    (it runs without its speculation, in the continuous batch)."""

    request: EngineRequest
    target_only: bool = False


@dataclass(frozen=True, slots=True)
class HeldForPrefix:
    """``request`` goes back to the head of the queue until ``leader``'s prefill has stored the
    prefix they share (it becomes ``request.prefix_leader``)."""

    request: EngineRequest
    leader: EngineRequest


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step does, in the order the loop executes it.

    The requests admitted and held come off the head of the waiting queue (``num_taken``);
    the held ones go back to its head, in order.
    """

    # Nothing starts yet: wait for arrivals until this time (on ``SchedulerState.now``'s clock).
    wait_until: float | None = None
    new_group: NewGroup | None = None
    # Move the single lane's decoding row into a new batch of this lane before admitting.
    hand_off: LaneName | None = None
    admit: tuple[Admission, ...] = ()
    held: tuple[HeldForPrefix, ...] = ()
    # Step the group (the one this plan starts, or the one running).
    step: bool = False

    @property
    def num_taken(self) -> int:
        """How many requests this plan takes off the head of the queue: admitted and held are
        one run from its head."""
        return len(self.admit) + len(self.held)


# --- what the scheduler reads ----------------------------------------------------------


class PrefixIndex(Protocol):
    """The resident prefix cache as the scheduler sees it, where prefixes are shared as
    blocks a later row extends (a batch's layout)."""

    def salt(self, request: EngineRequest) -> int:
        """The salt ``request``'s blocks are stored under in a batch."""
        ...

    def resident_tokens(self, prompt_ids: list[int], salt: int) -> int:
        """How many leading tokens of ``prompt_ids`` a lookup would restore now."""
        ...


@dataclass(frozen=True, slots=True)
class GroupState:
    """The running group, as admission needs it."""

    key: GroupKey
    lane: LaneName
    free_slots: int  # cancelled rows upstream could not drop yet still hold theirs
    row_decoding: bool = False  # the single lane's row has its next token in flight: it can move
    prefilling: tuple[EngineRequest, ...] = ()  # keyed rows whose prefill is not done

    @property
    def mode(self) -> ExecutionMode:
        return self.key.mode


@dataclass(frozen=True, slots=True)
class SchedulerState:
    """What the worker knows between two steps (gathered under the engine's lock)."""

    now: float  # seconds, monotonic
    waiting: Sequence[EngineRequest]  # in arrival order
    group: GroupState | None = None
    stopping: bool = False
    # The lanes the loaded model has (``LaneFactory.model_lanes``); the engine's options close some.
    model_lanes: frozenset[LaneName] = frozenset({LaneName.BATCH})
    prefix_cache: bool = False  # a prefix cache is resident (keyed requests use it)
    lanes_restore: bool = False  # the single and text lanes restore keyed rows' prefixes (``LaneContext``)
    shared_prefixes: PrefixIndex | None = None  # set where prefixes are shared as blocks
    admission_paused: bool = False  # a control waits for a step with no prompt mid-prefill


@dataclass(frozen=True, slots=True)
class _Window:
    """A group waiting for company before it starts."""

    head: EngineRequest
    key: GroupKey
    started: float
    seen: int  # compatible requests at the head of the queue
    last_arrival: float


# --- the scheduler ---------------------------------------------------------------------


class Scheduler:
    """Decides each step from a ``SchedulerState``. Its only state is the collection window
    of a group about to start."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._window: _Window | None = None

    def schedule(self, state: SchedulerState) -> StepPlan:
        group = state.group
        if group is None:
            return self._start(state)
        self._window = None
        if group.mode != ExecutionMode.CONTINUOUS:
            return StepPlan(step=True)  # cohorts and exclusive requests admit no one later
        return self._admit_late(state, group)

    # --- a new group -------------------------------------------------------------------
    def _start(self, state: SchedulerState) -> StepPlan:
        waiting = state.waiting
        if not waiting:
            self._window = None
            return StepPlan()
        cfg = self.config
        head = waiting[0]
        lanes = self._lane_context(state)
        alone = one_at_a_time_lane(lanes)
        if alone is not None:
            key = GroupKey(
                ExecutionMode.EXCLUSIVE,
                self._head_key(state).draft_tokens,
                (head.cache_group, head.request_id),
                ExclusiveReason.SERIALIZED_LANE,
            )
            return self._started(state, NewGroup(key, alone, 1), [head])
        window = self._window
        if window is None or window.head is not head:
            key = self._head_key(state)
            if key.mode == ExecutionMode.EXCLUSIVE:
                key = GroupKey(
                    ExecutionMode.EXCLUSIVE, key.draft_tokens, (head.cache_group, head.request_id), key.reason
                )
                return self._started(state, NewGroup(key, choose_lane(key.mode, [head], lanes), 1), [head])
            window = _Window(head, key, state.now, count_compatible_head(waiting, key), state.now)
        else:
            seen = count_compatible_head(waiting, window.key)
            if seen > window.seen:
                window = _Window(head, window.key, window.started, seen, state.now)
        self._window = window
        key = window.key
        limit = cfg.max_batch_size
        wait_until = self._wait_until(state, window)
        if wait_until is not None:
            return StepPlan(wait_until=wait_until)
        self._window = None
        if key.mode == ExecutionMode.COHORT:
            # Target-only work arrived while the cohort waited: its optional-MTP head defers to it.
            key = under_load(waiting, **self._key_options(state)) or key
        requests = compatible_head(waiting, key, limit)
        if not requests:
            return StepPlan()  # the head waits for its prefix leader
        return self._started(state, NewGroup(key, choose_lane(key.mode, requests, lanes), limit), requests)

    def _lane_context(self, state: SchedulerState) -> LaneContext:
        """The lanes open: the loaded model's, less those the engine's options turn off."""
        closed = set()
        if not self.config.single_lane:
            closed.add(LaneName.SINGLE)
        if not self.config.text_lane:
            closed.add(LaneName.TEXT)
        return LaneContext(state.model_lanes - closed, state.prefix_cache, state.lanes_restore)

    def _key_options(self, state: SchedulerState) -> dict[str, bool]:
        """What ``group_key`` reads of the engine's state: which rows the text lane takes."""
        ctx = self._lane_context(state)
        return {
            "sampled_exclusive": self.config.sampled_exclusive,
            "text_lane": LaneName.TEXT in ctx.open,
            "keyed_text": ctx.lanes_restore,
        }

    def _head_key(self, state: SchedulerState) -> GroupKey:
        """The head's group; optional MTP with target-only work right behind it runs
        target-only, with that work."""
        options = self._key_options(state)
        return under_load(state.waiting, **options) or group_key(state.waiting[0], **options)

    def _wait_until(self, state: SchedulerState, window: _Window) -> float | None:
        """When to look again for company, or None: start now.

        A cohort cannot be joined later, so it waits the whole window (stopping once
        target-only work arrives for its optional-MTP head to defer to). The continuous lane
        waits only while a burst keeps arriving; later requests join its free slots.
        """
        cfg = self.config
        cohort = window.key.mode == ExecutionMode.COHORT
        quiet_ms = None if cohort else cfg.burst_gap_ms
        if quiet_ms is not None and quiet_ms <= 0:
            return None
        if window.seen >= cfg.max_batch_size or state.stopping:
            return None
        if cohort and under_load(state.waiting, **self._key_options(state)) is not None:
            return None
        until = window.started + cfg.batch_wait_ms / 1000.0
        if quiet_ms is not None:
            until = min(until, window.last_arrival + quiet_ms / 1000.0)
        return until if until > state.now else None

    def _started(self, state: SchedulerState, new: NewGroup, requests: list[EngineRequest]) -> StepPlan:
        group = GroupState(new.key, new.lane, new.max_batch_size)
        admit, held = self._hold_shared_prefixes(state, group, requests)
        return StepPlan(new_group=new, admit=admit, held=held, step=True)

    # --- a running continuous group ---------------------------------------------------------
    def _admit_late(self, state: SchedulerState, group: GroupState) -> StepPlan:
        hand_off: LaneName | None = None
        free = group.free_slots
        if group.lane == LaneName.SINGLE:
            # A compatible arrival moves the row into a batch, once the row decodes.
            if not group.row_decoding or self.config.max_batch_size < 2:
                return StepPlan(step=True)
            if count_compatible_head(state.waiting, group.key) == 0:
                return StepPlan(step=True)
            hand_off = group.key.lane  # the lane of its key adopts the row (``LaneSpec.adopts_from``)
            free = self.config.max_batch_size - 1  # the batch holds the moved row
            group = GroupState(group.key, hand_off, free, prefilling=group.prefilling)
        if free <= 0 or state.admission_paused:
            return StepPlan(hand_off=hand_off, step=True)
        requests = compatible_head(state.waiting, group.key, free)
        admit, held = self._hold_shared_prefixes(state, group, requests)
        return StepPlan(hand_off=hand_off, admit=admit, held=held, step=True)

    def _hold_shared_prefixes(
        self, state: SchedulerState, group: GroupState, requests: list[EngineRequest]
    ) -> tuple[tuple[Admission, ...], tuple[HeldForPrefix, ...]]:
        """Which of ``requests`` to admit now, and which wait because they share a prefix that
        a request of the batch is still prefilling (see ``prefix_leader``)."""
        target_only = group.mode == ExecutionMode.CONTINUOUS
        index = state.shared_prefixes
        if index is None or group.mode != ExecutionMode.CONTINUOUS or group.lane == LaneName.SINGLE:
            return tuple(Admission(r, target_only and r.draft_tokens > 0) for r in requests), ()
        prefilling = list(group.prefilling)
        admit: list[Admission] = []
        held: list[HeldForPrefix] = []
        for request in requests:
            leader = None
            if request.prompt_cache_key is not None and request.image_prompt is None:
                salt = index.salt(request)
                same_salt = [r for r in prefilling if index.salt(r) == salt]
                if same_salt:
                    resident = index.resident_tokens(request.prompt_ids, salt)
                    leader = prefix_leader(request, same_salt, resident=resident)
            if leader is None:
                admit.append(Admission(request, request.draft_tokens > 0))
                if request.prompt_cache_key is not None:
                    prefilling.append(request)
            else:
                held.append(HeldForPrefix(request, leader))
        return tuple(admit), tuple(held)


def prefilling_rows(requests: Sequence[EngineRequest]) -> tuple[EngineRequest, ...]:
    """The keyed rows of a group whose prefill is not done (prefix leaders for late joiners)."""
    return tuple(r for r in requests if r.status == RequestStatus.PREFILLING and r.prompt_cache_key is not None)
