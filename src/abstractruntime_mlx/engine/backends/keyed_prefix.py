"""A keyed row's prefix on the lanes that restore it themselves (the single and the text lane).

A keyed row (``RowInput.prefix`` with the prefix cache's manager) starts from the KV the cache
holds for its prompt: its key's resident KV when the prompt extends the key's last one
(``cache/resident.py``), else the longer of the SSD tier's prefix (one K/V set per layer) and
the RAM blocks copied into a plain cache. Once its first
token is out its new full blocks are stored, as a batch row's are, so every lane finds the
others'; a row that ends on its own leaves its whole KV resident for its key's next turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

__all__ = ["KeyedPrefix"]


def _same_type(a: object, b: object) -> bool:
    return type(a) is type(b)


def _plain_kv(read: object, mine: object) -> bool:
    """An SSD-restored layer (mlx-vlm's ``KVCache``) that fits a plain cache layer of ours
    (mlx-lm's): both unquantized K/V caches."""
    return type(read).__name__ == type(mine).__name__ == "KVCache" and getattr(read, "keys", None) is not None


@dataclass(slots=True, eq=False)
class KeyedPrefix:
    """One keyed row's prefix-cache work; ``apc``: the resident model's prefix-cache manager
    (``cache/upstream.py``), ``prompt``: the row's whole prompt."""

    apc: Any
    salt: int
    key: str | None
    prompt: list[int]
    cached: int = 0  # prompt tokens the row's cache started with
    restored: list[Any] = field(default_factory=list)  # blocks held until the row's own are stored
    store_pending: bool = False  # its first token is out: its new blocks are stored next

    def restore(self, cache: list[Any]) -> list[Any]:
        """The cache the row starts from: ``cache`` (a fresh plain cache per layer) with the
        prefix's blocks copied in, or the key's resident KV in its place (``cached`` says how
        many prompt tokens it holds)."""
        take = getattr(self.apc, "take_resident", None)
        resident: list[Any] = []
        kept = 0
        if self.key is not None and take is not None:
            resident, kept, extends = take(self.key, self.salt, self.prompt)
            if not (len(resident) == len(cache) and all(map(_same_type, resident, cache))):
                kept = 0
            # Extending the previous prompt (the usual next turn; its generation prompt is
            # re-rendered, so its last few tokens differ): no block lookup. Broken earlier,
            # blocks (another key's, an earlier turn's) may hold more.
            if kept and extends:
                return self._use_resident(resident, kept)
        blocks, tokens = self.apc.lookup_prefix(self.prompt[:-1], extra_hash=self.salt)
        disk, on_disk = self._lookup_disk(max(tokens, kept), overlap=tokens > 0)
        if on_disk and len(disk) == len(cache) and all(map(_plain_kv, disk, cache)):
            # The SSD tier holds more than RAM: read as one K/V set per layer (upstream's order,
            # disk before blocks; mlx-vlm's cache class, its arrays taken into the row's). Its
            # store puts the prefix back in RAM (``cache/upstream.py``).
            self.apc.release(blocks)
            for mine, read in zip(cache, disk):
                mine.keys, mine.values, mine.offset = read.keys, read.values, on_disk
            self.cached = on_disk
            return cache
        if kept and kept >= tokens:
            self.apc.release(blocks)
            return self._use_resident(resident, kept)
        if tokens == 0:
            return cache
        for layer, c in enumerate(cache):
            c.keys = mx.concatenate([block.keys[layer] for block in blocks], axis=2)
            c.values = mx.concatenate([block.values[layer] for block in blocks], axis=2)
            c.offset = tokens
        self.restored, self.cached = blocks, tokens
        return cache

    def _lookup_disk(self, at_least: int, *, overlap: bool) -> tuple[list[Any], int]:
        """The SSD tier's prefix of the prompt (but its last token) when it is longer than
        ``at_least`` tokens (upstream reads nothing otherwise); ``overlap``: RAM holds the
        leading blocks (upstream then still reads the disk, for more)."""
        if getattr(self.apc, "disk", None) is None:
            return [], 0
        block = int(getattr(self.apc, "block_size", 1))
        if at_least >= (len(self.prompt) - 1) // block * block:
            return [], 0  # RAM holds every full block the disk could: no walk of its hash chain
        disk, tokens = self.apc.lookup_prefix_disk_cache(
            self.prompt[:-1], extra_hash=self.salt, min_prefix_tokens=at_least, allow_memory_overlap=overlap
        )
        return (list(disk), tokens) if disk is not None else ([], 0)

    def _use_resident(self, cache: list[Any], tokens: int) -> list[Any]:
        self.apc.resident_used(tokens)
        self.cached = tokens
        return cache

    def store(self, cache: list[Any]) -> None:
        """Once the first token is out (``store_pending``): store the new full blocks of
        ``cache`` (its first columns hold the prompt but its last token) and let go of the
        restored ones."""
        if not self.store_pending or not cache:  # (upstream would store blocks of no layer)
            return
        from mlx_vlm.apc import commit_prefix_blocks

        self.store_pending = False
        blocks, self.restored = self.restored, []
        commit_prefix_blocks(
            self.apc,
            cache,
            self.prompt[:-1],
            extra_hash=self.salt,
            skip_first_n_tokens=self.cached,
            blocks_in_use=blocks,
        )

    def release(self) -> None:
        """The row left without storing (cancelled before its first token): the restored
        blocks go back."""
        if self.restored:
            self.apc.release(self.restored)
            self.restored = []

    def keep(self, cache: list[Any], tokens: list[int]) -> None:
        """The row ended on its own: ``cache`` (a plain cache per layer, holding exactly
        ``tokens``: the prompt, then each token it was fed) stays resident for its key."""
        self.store(cache)  # the blocks first: the fallback when the resident KV goes
        keep = getattr(self.apc, "keep_resident", None)
        if self.key is not None and keep is not None and cache:
            keep(self.key, self.salt, tokens, cache, len(self.prompt))
