"""Warming a prefix ahead of its request: what the runtime asks, and what the engine did.

A warm is a keyed request with one output token (discarded) that the engine runs only when no
live request waits, and cancels while it still waits or prefills as soon as a live request
arrives: a live request never queues behind it. Its lookup restores what the SSD tier holds of
the prefix and its prefill computes the rest; when it finishes, its blocks stay in RAM as any
request's do, and the prefix cache remembers which of them the warm put there, so the next
request that restores them reports them as ``prefetched_tokens`` (docs/prompt-cache.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from ..errors import InvalidPrefixWarm

__all__ = ["MAX_PENDING_WARMS", "MIN_WARM_TOKENS", "WarmReport", "check_warm"]

# Warms waiting for an idle engine; more are refused by name (``warm_queue_full``).
MAX_PENDING_WARMS: Final = 16
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

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "key": self.key,
            "prompt_tokens": self.prompt_tokens,
            "resident_tokens": self.resident_tokens,
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
