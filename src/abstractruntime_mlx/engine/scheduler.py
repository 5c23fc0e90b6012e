"""Admission decisions: which waiting requests start, join, or wait. Plain logic, no MLX.

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
from dataclasses import dataclass, field
from typing import Hashable

from .request import EngineRequest, ExclusiveReason, ExecutionMode


@dataclass(frozen=True, slots=True)
class GroupKey:
    mode: ExecutionMode
    draft_tokens: int
    cache_group: Hashable
    reason: ExclusiveReason | None = field(default=None, compare=False)
    sampled_exclusive: bool = field(default=False, compare=False)

    def admits(self, request: EngineRequest) -> bool:
        if self.mode == ExecutionMode.EXCLUSIVE:
            return False
        if group_key(request, sampled_exclusive=self.sampled_exclusive) == self:
            return True
        # A continuous group is target-only work running: optional MTP joins it target-only.
        return self.mode == ExecutionMode.CONTINUOUS and request.deferrable and self == target_only_key(request, sampled_exclusive=self.sampled_exclusive)


def group_key(request: EngineRequest, *, sampled_exclusive: bool = False, target_only: bool = False) -> GroupKey:
    """The group ``request`` runs in; ``target_only``: the group it runs in without its MTP."""
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
    return GroupKey(ExecutionMode.CONTINUOUS, 0, cache_group, sampled_exclusive=sampled_exclusive)


def target_only_key(request: EngineRequest, *, sampled_exclusive: bool = False) -> GroupKey:
    return group_key(request, sampled_exclusive=sampled_exclusive, target_only=True)


def under_load(waiting: deque[EngineRequest], *, sampled_exclusive: bool = False) -> GroupKey | None:
    """The continuous key the head of ``waiting`` defers to, or None when it runs its MTP.

    The head defers when it is optional MTP and the run of requests its target-only group
    would take (from the head, up to the first it does not admit) holds a request that asked
    for no MTP: target-only work is waiting to share the batch.
    """
    if not waiting or not waiting[0].deferrable:
        return None
    key = target_only_key(waiting[0], sampled_exclusive=sampled_exclusive)
    if key.mode != ExecutionMode.CONTINUOUS:
        return None
    for request in list(waiting)[1:]:
        if not key.admits(request):
            return None
        if request.draft_tokens == 0:
            return key
    return None


def take_compatible(waiting: deque[EngineRequest], key: GroupKey, limit: int) -> list[EngineRequest]:
    """Pop up to ``limit`` requests from the head of ``waiting`` that ``key`` admits.

    Stops at the first request it does not admit (the fairness barrier), or that waits for
    its prefix leader's prefill.
    """
    taken: list[EngineRequest] = []
    while waiting and len(taken) < limit and key.admits(waiting[0]) and not waiting[0].waits_for_prefix:
        taken.append(waiting.popleft())
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


def count_compatible_head(waiting: deque[EngineRequest], key: GroupKey) -> int:
    n = 0
    for request in waiting:
        if not key.admits(request):
            break
        n += 1
    return n

