"""A key's KV between turns: the whole cache of each key's last finished single-lane row.

The key's next prompt usually extends the previous one (the transcript plus an answer and an
observation): the row then starts from this KV trimmed to the prefix the two share and
prefills only its new tokens, with no block lookup or gather. Blocks stay the fallback (other
keys, a broken prefix, after eviction, the SSD tier). The bytes count in the prefix cache's RAM
budget (the manager's ``_resident_bytes_locked``); without hints or pins an entry goes before
any block when room is needed (its ``_make_room``), with them in the priorities' order
(``cache_priority.eviction_order``), and it is never kept at a block's expense
(``keep_resident``).

Worker thread only; the manager's lock guards the table for stats readers. No MLX import: the
caches are the single lane's plain per-layer KV caches, used through ``offset``, ``trim``,
``is_trimmable`` and ``nbytes``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(slots=True)
class _Entry:
    tokens: tuple[int, ...]  # the tokens whose KV ``cache`` holds, in order
    cache: list[Any]  # one plain KV cache per layer (the single lane's layout)
    nbytes: int
    prompt_len: int  # how many of ``tokens`` were the row's prompt (the rest: its answer)
    kept_at: int  # the table's event count when it was kept


class Taken(NamedTuple):
    """What ``ResidentKV.take`` gives a row: the cache (empty when nothing is taken), how many
    prompt tokens it holds, and whether the prompt extends the previous one (to its last
    ``guard`` tokens: the re-rendered generation prompt), so no block could hold more."""

    cache: list[Any]
    tokens: int
    extends: bool


NOTHING = Taken([], 0, False)


def common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ResidentKV:
    """One entry per (key, salt): the KV of the key's last finished row."""

    def __init__(self, lock: Any, *, min_tokens: int, guard: int) -> None:
        self.entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self.nbytes = 0
        self.tokens_taken = 0  # lifetime: prompt tokens rows started from resident KV
        self.dropped = 0  # lifetime: entries dropped to make room
        self._events = 0  # keeps and takes so far: the clock of ``_reads``
        self._reads: deque[tuple[int, int, int]] = deque(maxlen=4096)  # (kept_at, taken_at, bytes)
        self._lock = lock
        self._min_tokens = min_tokens  # less than this shared: take nothing (a block's worth)
        self._guard = guard

    def take(self, key: str, salt: int, prompt: list[int], *, align: int = 1) -> Taken:
        """The key's KV trimmed to the prefix it shares with ``prompt`` (at least one prompt
        token left to feed), cut to a multiple of ``align`` as a block restore is. The entry
        leaves the table either way: the row owns the cache now."""
        with self._lock:
            entry = self.entries.pop((key, salt), None)
            if entry is None:
                return NOTHING
            self.nbytes -= entry.nbytes
        shared = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
        shared -= shared % align
        if shared < self._min_tokens:
            return NOTHING
        with self._lock:
            self._events += 1
            self._reads.append((entry.kept_at, self._events, entry.nbytes))
        for layer in entry.cache:
            layer.trim(layer.offset - shared)
        return Taken(entry.cache, shared, shared + self._guard >= entry.prompt_len)

    def keep(self, key: str, salt: int, tokens: list[int], cache: list[Any], prompt_len: int) -> bool:
        """Keep ``cache`` (holding exactly ``tokens``, the first ``prompt_len`` of them the
        row's prompt) for ``key``; the manager then fits the table to its budget."""
        if not tokens or not all(getattr(layer, "is_trimmable", lambda: False)() for layer in cache):
            return False
        size = sum(int(layer.nbytes) for layer in cache)
        with self._lock:
            old = self.entries.pop((key, salt), None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._events += 1
            self.entries[(key, salt)] = _Entry(tuple(tokens), cache, size, prompt_len, self._events)
            self.nbytes += size
        return True

    def drop_oldest(self) -> int | None:
        """Drop the least recently kept entry (the caller holds the lock); its bytes, None when
        the table is empty."""
        first = next(iter(self.entries), None)
        return None if first is None else self.drop(first)

    def drop(self, key_salt: tuple[str, int]) -> int | None:
        """Drop one entry (the caller holds the lock); returns its bytes, None if not held."""
        entry = self.entries.pop(key_salt, None)
        if entry is None:
            return None
        self.nbytes -= entry.nbytes
        self.dropped += 1
        return entry.nbytes

    def fit(self, held_bytes: int, max_bytes: int) -> None:
        """Drop entries, least recently kept first, until everything held fits ``max_bytes``."""
        with self._lock:
            while held_bytes > max_bytes and (freed := self.drop_oldest()) is not None:
                held_bytes -= freed

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.nbytes = 0

    def reused_peak_bytes(self) -> int:
        """The most bytes of entries that were held at one time and later taken (of the last
        4,096 takes): the resident KV a workload reads back, at its peak. A budget below it (after
        the workload on a roomy one) drops some entry a later turn would have started from."""
        with self._lock:
            reads = list(self._reads)
        edges = sorted([(kept, size) for kept, _, size in reads] + [(taken, -size) for _, taken, size in reads])
        peak = held = 0
        for _, size in edges:
            held += size
            peak = max(peak, held)
        return peak

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self.entries),
            "bytes": self.nbytes,
            "tokens_taken": self.tokens_taken,
            "dropped": self.dropped,
            "reused_peak_bytes": self.reused_peak_bytes(),
        }
