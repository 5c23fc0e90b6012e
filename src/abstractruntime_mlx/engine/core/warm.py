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

from dataclasses import dataclass
from typing import Any, Final

from ...errors import InvalidPrefixWarm

__all__ = ["MAX_PENDING_WARMS", "MIN_WARM_TOKENS", "WARM_TTL_S", "WarmReport", "check_warm"]

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
