"""Which prefix blocks to evict first: steps-to-execution before recency, and pins with a TTL.

Pure (no MLX, no threads): the prefix cache's block manager asks it for an eviction order over
its idle blocks and applies it. The runtime that runs a flow knows which LLM node runs next; it
tells the cache, per ``prompt_cache_key``, how many steps away that key's next call is
(``hints``: ``{key: steps}``, or ``None`` when no live run reaches the key again) and pins the
key of an agent that is between turns (``pin``). The order (after KVFlow, arXiv 2507.07400):

1. blocks only one key owns, hinted ``None``, least recently used first;
2. blocks of keys nobody hinted (or of no known key), and shared blocks whose owners are all
   hinted ``None``: a prefix several keys began with (a system prompt under ``mlx_cache_sharing=
   "scope"``) is what a key not seen yet begins with too, and ``None`` speaks for its own key only;
3. blocks of hinted keys, the farthest next call first (a block's steps: its nearest owner's);

recency breaks every tie. A prefix warm's store (``warm_rank``) evicts only blocks ranked below
its own and never takes a pin: a prefetch fills room, it never costs a live run a hit. Blocks of
a live pin are never in the order: they are evicted only
when a live request needs memory and nothing else is left, and then the newest pin goes first
(``drop_pin``: of agents waiting alike, the last to begin waiting comes back last). A key's
resident KV ranks as its key's blocks, after the blocks of that rank; a pinned key's goes
after every block and entry not pinned, the newest pin's first, before the pin itself. Without hints or pins the order is the manager's own LRU
(``active`` is False), so nothing changes for callers that never give any.

A block is owned by every key whose prompt covered it (``own``): with ``mlx_cache_sharing=
"scope"`` one system prompt's blocks are shared by many keys, and the most urgent owner counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from ...errors import InvalidControls

__all__ = ["BlockInfo", "CachePriorities", "Pin", "eviction_order", "validate_hints", "validate_pin", "warm_rank"]

MAX_STEPS: Final = 1 << 20
MAX_PIN_TTL_S: Final = 24 * 3600.0
# Owner records for blocks no longer resident are pruned once there are this many more of them.
_OWNER_SLACK: Final = 4096

UNREACHABLE: Final = 0
UNHINTED: Final = 1
HINTED: Final = 2
PINNED: Final = 3  # a pinned key's resident KV: after everything not pinned


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One idle cached block as the policy sees it: how recently it was used (larger: later)
    and the keys whose prompts covered it."""

    last_used: int
    owners: frozenset[str]


@dataclass(frozen=True, slots=True)
class Pin:
    key: str
    pinned_at: float
    expires_at: float


def block_rank(block: BlockInfo, hints: Mapping[str, int | None]) -> tuple[int, int, int]:
    """Sort key of an evictable block: lower goes first."""
    steps = [s for s in (hints.get(k) for k in block.owners if k in hints) if s is not None]
    if steps:
        return (HINTED, -min(steps), block.last_used)
    if len(block.owners) == 1 and all(k in hints for k in block.owners):
        return (UNREACHABLE, 0, block.last_used)
    return (UNHINTED, 0, block.last_used)


def eviction_order(
    blocks: Sequence[BlockInfo],
    hints: Mapping[str, int | None],
    pinned: Iterable[str] = (),
    *,
    below: tuple[int, int] | None = None,
    resident: Sequence[tuple[str, int]] = (),
) -> list[int]:
    """Indices into ``blocks`` in the order to evict them, and into ``resident`` (the keys and
    keep times of the resident KV entries, indexed from ``len(blocks)`` on): an entry ranks as a
    block only its key owns, after the blocks of its class and steps (losing it costs a gather
    from its blocks, theirs a prefill). A pinned key's blocks are left out, its entry comes after
    everything else, the newest pin's first (``pinned``: oldest first, as ``live_pins``). With
    ``below`` (a warm's ``warm_rank``): every block needed as soon as the warm's or sooner, and
    every entry, left out."""
    pin_age = {key: age for age, key in enumerate(pinned)}
    ranks: dict[int, tuple[int, int, int, int]] = {}
    for i, block in enumerate(blocks):
        if not any(key in pin_age for key in block.owners):
            cls, steps, last = block_rank(block, hints)
            ranks[i] = (cls, steps, 0, last)
    if below is None:
        for j, (key, kept_at) in enumerate(resident):
            if key in pin_age:
                ranks[len(blocks) + j] = (PINNED, -pin_age[key], 1, kept_at)
            else:
                cls, steps, _ = block_rank(BlockInfo(kept_at, frozenset((key,))), hints)
                ranks[len(blocks) + j] = (cls, steps, 1, kept_at)
    else:
        ranks = {i: r for i, r in ranks.items() if r[:2] < below}
    return sorted(ranks, key=ranks.__getitem__)


def warm_rank(key: str, hints: Mapping[str, int | None]) -> tuple[int, int]:
    """The class and steps the blocks of ``key``'s warm will rank with: a warm makes room only
    from blocks below them, so a prefetch never pushes out what a run needs first."""
    steps = hints.get(key)
    return (HINTED, -steps) if steps is not None else (UNHINTED, 0)


def validate_hints(hints: object) -> dict[str, int | None]:
    """``{key: steps}`` with steps an int >= 0 or None; ``InvalidControls`` naming the key."""
    if not isinstance(hints, Mapping):
        raise InvalidControls(
            "prompt-cache hints must be an object of key -> steps (int >= 0) or null", field="hints", value=hints
        )
    out: dict[str, int | None] = {}
    for key, steps in hints.items():
        if not isinstance(key, str) or not key.strip():
            raise InvalidControls("a prompt-cache hint's key must be a non-empty string", field="hints", value=key)
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_STEPS):
            raise InvalidControls(
                f"the steps of prompt-cache key {key!r} must be an int in [0, {MAX_STEPS}] or null (no live run reaches it)",
                field=f"hints.{key}",
                value=steps,
            )
        out[key] = steps
    return out


def validate_pin(key: object, ttl_s: object) -> tuple[str, float]:
    if not isinstance(key, str) or not key.strip():
        raise InvalidControls("a pinned prompt-cache key must be a non-empty string", field="key", value=key)
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= MAX_PIN_TTL_S:
        raise InvalidControls(
            f"ttl_s must be a number of seconds in (0, {MAX_PIN_TTL_S:.0f}]", field="ttl_s", value=ttl_s
        )
    return key, float(ttl_s)


@dataclass(slots=True)
class CachePriorities:
    """The hints, pins and block owners of one prefix cache (worker thread only)."""

    clock: Callable[[], float] = time.monotonic
    hints: dict[str, int | None] = field(default_factory=dict)
    pins: dict[str, Pin] = field(default_factory=dict)
    owners: dict[int, set[str]] = field(default_factory=dict)
    pins_dropped: int = 0  # pins a live request's memory need took
    pins_expired: int = 0

    @property
    def active(self) -> bool:
        return bool(self.hints) or bool(self.live_pins())

    def set_hints(self, hints: Mapping[str, int | None], *, replace: bool = False) -> None:
        if replace:
            self.hints.clear()
        self.hints.update(hints)

    def pin(self, key: str, ttl_s: float) -> Pin:
        """Pin ``key`` for ``ttl_s`` from now (a pin again renews it, keeping its age)."""
        now = self.clock()
        old = self.pins.get(key)
        pin = Pin(key, old.pinned_at if old is not None else now, now + ttl_s)
        self.pins[key] = pin
        return pin

    def release(self, key: str) -> bool:
        return self.pins.pop(key, None) is not None

    def live_pins(self) -> list[Pin]:
        """The pins still alive, oldest first; expired ones are dropped here."""
        now = self.clock()
        for key in [k for k, p in self.pins.items() if p.expires_at <= now]:
            del self.pins[key]
            self.pins_expired += 1
        return sorted(self.pins.values(), key=lambda p: (p.pinned_at, p.key))

    def drop_pin(self) -> Pin | None:
        """Give up the newest live pin: of agents waiting alike (a tool call each), the one
        that began waiting last comes back last, so its prefix is the one to lose."""
        pins = self.live_pins()
        if not pins:
            return None
        del self.pins[pins[-1].key]
        self.pins_dropped += 1
        return pins[-1]

    def own(self, key: str, block_hashes: Iterable[int]) -> None:
        for block_hash in block_hashes:
            self.owners.setdefault(block_hash, set()).add(key)

    def prune(self, resident: Iterable[int], resident_count: int) -> None:
        """Forget owners of blocks no longer resident, once there are many of them."""
        if len(self.owners) > resident_count + _OWNER_SLACK:
            keep = set(resident)
            self.owners = {h: keys for h, keys in self.owners.items() if h in keep}

    def block(self, block_hash: int, last_used: int) -> BlockInfo:
        return BlockInfo(last_used, frozenset(self.owners.get(block_hash, ())))

    def clear(self) -> None:
        self.hints.clear()
        self.pins.clear()
        self.owners.clear()

    def stats(self) -> dict[str, object]:
        pins = self.live_pins()
        return {
            "hinted_keys": len(self.hints),
            "unreachable_keys": sum(1 for s in self.hints.values() if s is None),
            "pins": len(pins),
            "pins_dropped": self.pins_dropped,
            "pins_expired": self.pins_expired,
        }
