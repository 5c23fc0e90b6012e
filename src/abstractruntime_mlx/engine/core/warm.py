"""Warming a prefix ahead of its request: what the runtime asks, and what the engine did.

A warm is a keyed request with one output token (discarded) and one prefill chunk of new
tokens, chained chunk after chunk until the prefix is in RAM. The engine admits one only while
it is idle (nothing queued, nothing running), cancels one still waiting when a live request
arrives, and drops a held one after ``WARM_TTL_S``: a live request never queues behind a warm,
and an admitted one holds it back one step at most. Its lookup restores what the SSD tier holds of
the prefix and its prefill computes the rest; when it finishes, its blocks stay in RAM as any
request's do, and the prefix cache remembers which of them the warm put there, so the next
request that restores them reports them as ``prefetched_tokens`` (docs/prompt-cache.md).
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from ...errors import InvalidPrefixWarm
from ..cache.prefix_cache import PrefixCache
from ..cache.upstream import BLOCK_SIZE
from .request import EngineRequest, RequestStatus

__all__ = ["MAX_PENDING_WARMS", "MIN_WARM_TOKENS", "WARM_TTL_S", "WarmQueue", "WarmReport", "check_warm"]

# Warms waiting for an idle engine; more are refused by name (``warm_queue_full``).
MAX_PENDING_WARMS: Final = 16
# A held warm the engine never got idle for is dropped after this long (its call came and went).
WARM_TTL_S: Final = 30.0
# A warm costs a batch step of its own; one that would compute fewer tokens than this saves the
# request less than that step costs the rows beside it (the request prefills them in its own).
MIN_WARM_TOKENS: Final = 64


@dataclass(frozen=True, slots=True)
class WarmReport:
    """What ``Engine.warm_prefix`` did: ``queued`` (a warm will run when the engine is idle), or
    not and ``reason`` (``already_resident``: RAM holds all but ``MIN_WARM_TOKENS`` at most, ``prefix_cache_not_loaded``, ``lane_without_blocks``,
    ``speculation``, ``prompt_too_short``, ``request_live``, ``warm_in_flight``, ``warm_queue_full``)."""

    key: str
    prompt_tokens: int
    resident_tokens: int
    queued: bool
    reason: str | None = None
    # Tokens past ``resident_tokens`` the SSD tier holds: the warm's first step restores them all.
    ssd_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "key": self.key,
            "prompt_tokens": self.prompt_tokens,
            "resident_tokens": self.resident_tokens,
            "ssd_tokens": self.ssd_tokens,
            "queued": self.queued,
        }
        if self.reason is not None:
            out["reason"] = self.reason
        return out


def check_warm(key: object, prompt_ids: object) -> tuple[str, list[int]]:
    """The key and token ids of a warm call, or ``InvalidPrefixWarm`` naming the bad field."""
    if not isinstance(key, str) or not key.strip():
        raise InvalidPrefixWarm(
            "a warmed prefix needs a non-empty prompt_cache_key", field="prompt_cache_key", value=key
        )
    if (
        not isinstance(prompt_ids, list)
        or not prompt_ids
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt_ids)
    ):
        raise InvalidPrefixWarm(
            "a warmed prefix is a non-empty list of token ids (non-negative integers)",
            field="prompt_ids",
            value=prompt_ids if not isinstance(prompt_ids, list) else f"list of {len(prompt_ids)}",
        )
    return key, prompt_ids


def warm_goal(prompt_ids: list[int]) -> int:
    """The RAM coverage at which a prefix counts as warm: every full block but the last (a
    request always feeds its prompt's last tokens itself)."""
    return len(prompt_ids) - len(prompt_ids) % BLOCK_SIZE - BLOCK_SIZE


class WarmQueue:
    """The warms held until the engine is idle, and the decisions about them. The engine calls
    it under its lock (``hold``, ``take``, ``give_way``, ``plan``) or on its worker
    (``next_chunk``); it owns no thread."""

    def __init__(self, prefill_step_size: int) -> None:
        self.held: deque[EngineRequest] = deque()
        self._step = prefill_step_size

    def __len__(self) -> int:
        return len(self.held)

    def clear(self) -> None:
        self.held.clear()

    def hold(self, request: EngineRequest) -> None:
        self.held.append(request)

    def take(self, *, idle: bool, cache: PrefixCache | None) -> tuple[list[EngineRequest], EngineRequest | None]:
        """The held warms to finish now (cancelled, or held past ``WARM_TTL_S``: the engine
        stayed busy, their call came and went), and the one to admit: one at a time, only onto
        an idle engine, so a live request never waits behind it and no running row's steps get
        longer for it. One that RAM meanwhile covers is admitted cancelled."""
        now = time.perf_counter()
        for warm in self.held:
            if now - warm.submitted_at > WARM_TTL_S:
                warm.cancel_event.set()
        done = [w for w in self.held if w.cancelled]
        if done:
            self.held = deque(w for w in self.held if not w.cancelled)
        if not self.held or not idle:
            return done, None
        warm = self.held.popleft()
        if cache is not None:
            target = list(warm.warm_target)
            if cache.resident_prefix_tokens(target, cache.salt(warm, "batch"), ssd=False) + MIN_WARM_TOKENS > warm_goal(
                target
            ):
                warm.cancel_event.set()  # another warm or request stored it meanwhile
        return done, warm

    def give_way(self, live: EngineRequest, waiting: Iterable[EngineRequest]) -> None:
        """A live request arrived: a warm still waiting in the queue is cancelled, and so is a
        held warm of the same key (its request is here). An admitted warm goes on: it feeds one
        prefill chunk at most, so it holds a live request back one step at most."""
        for warm in self.held:
            if warm.prompt_cache_key == live.prompt_cache_key:
                warm.cancel_event.set()
        for request in waiting:
            if request.warm:
                request.cancel_event.set()

    def plan(
        self, request: EngineRequest, cache: PrefixCache, live: list[EngineRequest], resident: int, restorable: int
    ) -> WarmReport:
        """Whether keyed ``request`` becomes a warm (``Engine.warm_prefix`` has checked the call
        (``check_warm``) and the model, and read that RAM holds ``resident`` tokens of its
        prompt, RAM and SSD ``restorable``): refused by name, or turned into its first chunk
        (``queued``): what the SSD holds and one prefill chunk past it, so a prefix the SSD tier
        holds comes back to RAM in one step (a lookup restores it, nothing is computed)."""
        key, prompt_ids = str(request.prompt_cache_key), request.prompt_ids
        salt = cache.salt(request, "batch")
        ssd = max(0, restorable - resident)

        def refused(reason: str) -> WarmReport:
            return WarmReport(key, len(prompt_ids), resident, queued=False, reason=reason, ssd_tokens=ssd)

        if warm_goal(prompt_ids) < MIN_WARM_TOKENS:
            return refused("prompt_too_short")
        if resident + MIN_WARM_TOKENS > warm_goal(prompt_ids):
            return refused("already_resident")
        if any(r.prompt_cache_key == key and not r.warm for r in live):
            return refused("request_live")  # it stores the prefix itself
        held = [r for r in live if r.warm and not r.is_finished()]
        if len(held) >= MAX_PENDING_WARMS:
            return refused("warm_queue_full")
        target = tuple(prompt_ids)
        if any(r.warm_target == target and cache.salt(r, "batch") == salt for r in held):
            return refused("warm_in_flight")  # the same blocks: another key's warm stores them
        for older in held:
            if older.prompt_cache_key == key and older.status == RequestStatus.WAITING:
                older.cancel_event.set()  # the newer prefix of the same key replaces it
        request.warm = True
        request.warm_target = target
        request.prompt_ids = prompt_ids[: resident + ssd + self._step]  # one chunk past what the SSD holds
        request.max_tokens = 1
        request.submitted_at = time.perf_counter()
        return WarmReport(key, len(prompt_ids), resident, queued=True, ssd_tokens=ssd)

    def next_chunk(self, done: EngineRequest, cache: PrefixCache) -> EngineRequest | None:
        """The warm of the next chunk of ``done``'s prefix, where RAM does not hold it all yet;
        None when it does, or when ``done`` made no progress (not stored: the budget)."""
        target = list(done.warm_target)
        salt = cache.salt(done, done.cache_layout or "batch")
        covered = cache.resident_prefix_tokens(target, salt, ssd=False)
        if covered <= done.warm_ram_tokens or covered + MIN_WARM_TOKENS > warm_goal(target):
            return None
        restorable = cache.resident_prefix_tokens(target, salt) if cache.disk is not None else covered
        return EngineRequest(
            request_id=uuid.uuid4().hex,
            prompt_ids=target[: max(covered, restorable) + self._step],
            max_tokens=1,
            sampling=done.sampling,
            prompt_cache_key=done.prompt_cache_key,
            media_hash=done.media_hash,
            warm=True,
            warm_target=done.warm_target,
        )
