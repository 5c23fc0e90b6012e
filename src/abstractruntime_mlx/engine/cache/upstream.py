"""Where the prefix cache extends mlx-vlm's APC (``mlx_vlm.apc``): every private upstream name
the cache folder touches is read here, and only here (``tests/test_import_graph.py``). mlx-vlm is
pinned ``>=0.7.10,<0.8.0`` in pyproject.toml; ``tests/test_backend_contract.py``,
``tests/test_cache_priority.py`` and ``tests/test_prefix_cache_disk.py`` check what is read.

- The RAM tier's manager (``counted_manager_class``): ``APCManager`` with its resident bytes
  counted in blocks and eviction by steps-to-execution; the block hash chain upstream keys
  blocks by (``block_hashes``); the free RAM it measures (``free_ram_bytes``).
- The SSD tier (``VerifiedDiskStore``): mlx-vlm's ``DiskBlockStore``, reading only the files it
  can vouch for.

The SSD tier's files:

Every shard file the store writes gets a sidecar ``<file>.sha256`` holding the file's size
and SHA-256. A file is used only when it and its sidecar are private regular files
(``owned_files``: never a symlink, a hard link, a directory or a FIFO, always this process's
user's), and size and digest match. Anything else is a miss: the file and its sidecar are
deleted (a link itself, never what it points at), the index forgets them, ``corrupt`` counts
the file, one warning names it, and the load goes on without it. A file is hashed when written
and when first read; the verdict is kept per (device, inode,
size, mtime), so a file read again unchanged is not hashed again. Startup only checks that
each file has a sidecar of the right size.

Upstream methods this class overrides or wraps; mlx-vlm is pinned (``>=0.7.10,<0.8.0`` in
pyproject.toml) and a test in ``tests/test_prefix_cache_disk.py`` fails when one disappears or
changes its parameters (``UPSTREAM_HOOKS``):

- ``_write_payload``: the one write path of both shard kinds (the background writer and the
  producer under backpressure); the sidecar is written right after it.
- ``_open_shard_header``: every load path, and the exact-snapshot lookup, read a file's header
  through it before any tensor; the file is verified first.
- ``_rebuild_index``: the startup scan; symlinks and files without a sidecar of the right size
  are removed before upstream indexes the rest.
- ``_drop_index_for_path``: eviction and vanished files; the sidecar and the verdict go too.
- ``load_layer_major_prefix`` / ``load_exact_cache`` (public): a load touches the file's mtime
  (upstream's LRU clock); the verdict follows it.

Upstream state read: ``dir``, ``SUFFIX``, ``_shard_path``, ``_is_canonical_store_file``,
``_index``, ``_exact_index``, ``_index_lock``, ``_write_lock``, ``_disk_bytes`` and
``_clear_disk_state_after_external_delete``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import stat
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mlx_vlm.apc import DiskBlockStore

from ...owned_files import open_owned, owned_fault, read_owned
from .cache_priority import CachePriorities, eviction_order, warm_rank
from .resident import NOTHING, ResidentKV, Taken

log = logging.getLogger(__name__)

# mlx-vlm's APC block: a KV block holds this many tokens.
BLOCK_SIZE = 16

SIDECAR_SUFFIX = ".sha256"
_PARTIAL_SUFFIX = ".partial"
_SIDECAR_MAX_BYTES = 4096

# name -> parameter names of the upstream methods named in the module docstring.
UPSTREAM_HOOKS: dict[str, tuple[str, ...]] = {
    "_write_payload": ("self", "shard_id", "block_hashes", "payload"),
    "_open_shard_header": ("self", "shard_path"),
    "_rebuild_index": ("self",),
    "_drop_index_for_path": ("self", "path"),
    "load_layer_major_prefix": ("self", "block_hashes", "preserve_capacity"),
    "load_exact_cache": ("self", "cache_hash", "wait_in_flight_ms", "min_capacity_tokens", "prefix_len"),
    "_shard_path": ("self", "shard_id"),
    "_is_canonical_store_file": ("path",),
    "_clear_disk_state_after_external_delete": ("self",),
}
UPSTREAM_STATE = ("dir", "SUFFIX", "_index", "_exact_index", "_index_lock", "_write_lock", "_disk_bytes")

FileStamp = tuple[int, int, int, int]

NOT_REGULAR = "is not a private regular file"
NO_CHECKSUM = "has no readable checksum"
MISMATCH = "does not match its checksum"


def _stamp(info: os.stat_result) -> FileStamp:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def sidecar_of(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR_SUFFIX)


def _read_sidecar(path: Path) -> tuple[int, str] | None:
    """``(size, sha256)`` recorded for ``path``, or None when absent, not a private regular file
    (a directory, a FIFO, a link: ``owned_files``) or malformed."""
    try:
        raw = read_owned(sidecar_of(path), _SIDECAR_MAX_BYTES + 1)
    except OSError:
        return None
    try:
        body = json.loads(raw)
        size, digest = body["size"], body["sha256"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(size, int) or not isinstance(digest, str) or len(digest) != 64:
        return None
    return size, digest


def _write_sidecar(path: Path, size: int, digest: str) -> None:
    final = sidecar_of(path)
    partial = final.with_name(final.name + _PARTIAL_SUFFIX)
    # A new file every time (O_EXCL): whatever was left at the name, a link to another file
    # included, is removed, never opened and truncated.
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()
    fd = open_owned(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps({"size": size, "sha256": digest}))
    os.replace(partial, final)


def _hash_regular_file(path: Path) -> tuple[os.stat_result, str] | None:
    """The file's stat and SHA-256, read through one descriptor; None unless it is a private
    regular file (``owned_files.open_owned``)."""
    try:
        fd = open_owned(path)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        return info, hashlib.file_digest(handle, "sha256").hexdigest()


def remove_store_files(directory: Path) -> int:
    """Delete every shard file (and sidecar) in ``directory``; the number of shard files removed."""
    removed = 0
    for path in directory.glob(f"*{DiskBlockStore.SUFFIX}*"):
        with contextlib.suppress(OSError):
            path.unlink()
            removed += int(path.name.endswith(DiskBlockStore.SUFFIX))
    return removed


class VerifiedDiskStore(DiskBlockStore):
    """``DiskBlockStore`` with a checksum per shard file, verified before the file is used."""

    def __init__(self, root: Path, **kwargs: Any) -> None:
        # Upstream's constructor scans the directory through our ``_rebuild_index``.
        self.corrupt = 0  # shard files discarded unused: damaged, unverifiable or not a regular file
        self.write_failures = 0  # shard writes that did not reach the disk with their checksum
        self._verdicts: dict[Path, FileStamp] = {}
        self._refused: dict[Path, FileStamp] = {}  # discarded but still there (a directory): not counted again
        self._writing: set[Path] = set()
        self._verdict_lock = threading.Lock()
        self._disk_bytes = 0  # upstream sets it from its scan; a file removed before that counts nothing
        super().__init__(root, **kwargs)

    # --- write ------------------------------------------------------------------------
    def _write_payload(self, shard_id: str, block_hashes: Sequence[int], payload: Any) -> bool:
        path = self._shard_path(shard_id)
        with self._verdict_lock:
            self._writing.add(path)
        try:
            written = super()._write_payload(shard_id, block_hashes, payload)
            if written:
                written = self._seal(path)
            if not written:
                with self._verdict_lock:
                    self.write_failures += 1
            return written
        finally:
            with self._verdict_lock:
                self._writing.discard(path)

    def _seal(self, path: Path) -> bool:
        """Record the checksum of the file just written; a file that cannot be sealed is removed."""
        try:
            hashed = _hash_regular_file(path)
            if hashed is None:
                raise OSError(f"{path} is not a regular file")
            info, digest = hashed
            _write_sidecar(path, info.st_size, digest)
        except OSError as exc:
            log.warning("prompt cache: could not record the checksum of %s (%s); dropping it", path, exc)
            self._remove(path)
            return False
        with self._verdict_lock:
            self._verdicts[path] = _stamp(info)
        return True

    # --- read -------------------------------------------------------------------------
    def _open_shard_header(self, shard_path: Path) -> Any:
        if not self._verified(shard_path):
            return None
        return super()._open_shard_header(shard_path)

    def _verified(self, path: Path) -> bool:
        """Whether ``path`` may be read; a file that may not is discarded."""
        try:
            info = os.lstat(path)
        except OSError:
            return True  # gone: upstream forgets it and reports a miss
        with self._verdict_lock:
            if self._verdicts.get(path) == _stamp(info):
                return True
            if self._refused.get(path) == _stamp(info):
                return False
            if path in self._writing:
                return False  # a miss for now; sealed when the write ends
        fault = self._fault(path, info)
        if fault is not None:
            self._discard(path, fault)
        return fault is None

    def _fault(self, path: Path, info: os.stat_result) -> str | None:
        """Why ``path`` may not be read; None when it is a regular file whose size and digest
        match its sidecar (the verdict is then kept)."""
        fault = owned_fault(info)
        if fault is not None:
            return f"{NOT_REGULAR} ({fault})"
        recorded = _read_sidecar(path)
        if recorded is None:
            return NO_CHECKSUM
        hashed = _hash_regular_file(path)
        if hashed is None:
            return NOT_REGULAR
        info, digest = hashed
        if (info.st_size, digest) != recorded:
            return MISMATCH
        with self._verdict_lock:
            self._verdicts[path] = _stamp(info)
        return None

    def load_layer_major_prefix(self, block_hashes: Sequence[int], *, preserve_capacity: bool = True) -> Any:
        with self._index_lock:
            paths = {self._index[h][0] for h in block_hashes if h in self._index}
        try:
            return super().load_layer_major_prefix(block_hashes, preserve_capacity=preserve_capacity)
        finally:
            self._follow_touch(paths)

    def load_exact_cache(self, cache_hash: int, **kwargs: Any) -> Any:
        with self._index_lock:
            path = self._exact_index.get(cache_hash)
        try:
            return super().load_exact_cache(cache_hash, **kwargs)
        finally:
            self._follow_touch({path} if path is not None else set())

    def _follow_touch(self, paths: set[Path]) -> None:
        """Keep the verdicts of files a load just touched (``os.utime``: only the mtime moved)."""
        with self._verdict_lock:
            for path in paths:
                known = self._verdicts.get(path)
                try:
                    now = _stamp(os.lstat(path))
                except OSError:
                    continue
                if known is not None and known[:3] == now[:3]:
                    self._verdicts[path] = now

    # --- index and removal --------------------------------------------------------------
    def _rebuild_index(self) -> int:
        self._screen()
        return int(super()._rebuild_index())

    def _screen(self) -> None:
        """Before upstream indexes the directory: drop what can never be verified."""
        for path in self.dir.iterdir():
            name = path.name
            if name.endswith(SIDECAR_SUFFIX + _PARTIAL_SUFFIX):
                with contextlib.suppress(OSError):
                    path.unlink()
            elif name.endswith(self.SUFFIX + SIDECAR_SUFFIX):
                shard = path.with_name(name[: -len(SIDECAR_SUFFIX)])
                if not os.path.lexists(shard):
                    with contextlib.suppress(OSError):
                        path.unlink()
            elif name.endswith(self.SUFFIX) and self._is_canonical_store_file(path):
                try:
                    info = os.lstat(path)
                except OSError:
                    continue
                fault = owned_fault(info)
                recorded = _read_sidecar(path) if fault is None else None
                if fault is not None:
                    self._discard(path, f"{NOT_REGULAR} ({fault})")
                elif recorded is None:
                    self._discard(path, NO_CHECKSUM)
                elif recorded[0] != info.st_size:
                    self._discard(path, MISMATCH + " (size)")

    def _discard(self, path: Path, why: str) -> None:
        """A miss that stays one: the file goes, is counted, and is named once."""
        log.warning("prompt cache: SSD file %s %s; discarded, the prompt is prefilled instead", path, why)
        with self._verdict_lock:
            self.corrupt += 1
        self._remove(path)
        try:
            left = _stamp(os.lstat(path))  # not removable here (a directory): never counted twice
        except OSError:
            return
        with self._verdict_lock:
            self._refused[path] = left

    def _remove(self, path: Path) -> None:
        """Delete ``path`` (a symlink itself, never its target) and its sidecar, and forget both."""
        freed = 0
        try:
            info = os.lstat(path)
            path.unlink()
            freed = info.st_size if stat.S_ISREG(info.st_mode) else 0
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sidecar_of(path).unlink()
        self._drop_index_for_path(path)
        with self._write_lock:  # upstream's lock over its byte count
            self._disk_bytes = max(0, self._disk_bytes - freed)

    def _drop_index_for_path(self, path: Path) -> None:
        super()._drop_index_for_path(path)
        with self._verdict_lock:
            self._verdicts.pop(path, None)
        if not os.path.lexists(path):  # evicted or vanished: its checksum goes with it
            with contextlib.suppress(OSError):
                sidecar_of(path).unlink()

    def remove_all(self) -> int:
        """Delete every shard file and sidecar and forget them; the number of shard files removed."""
        removed = remove_store_files(self.dir)
        self._clear_disk_state_after_external_delete()
        with self._verdict_lock:
            self._verdicts.clear()
        return removed


# --- the RAM tier ------------------------------------------------------------------------


@functools.cache
def counted_manager_class() -> type:
    """mlx-vlm's ``APCManager`` with its resident bytes counted in blocks.

    Upstream sums every tensor of every pooled block (``_resident_bytes_locked``) before each
    store, each prefill's lookup and each stats read: O(blocks x layers), measured at ~56 ms a
    call on the worker thread for a 36-layer model holding ~1,000 blocks on an H200. The full
    KV blocks of one model all hold the same tensors, so the count of blocks holding tensors
    times one block's bytes is the same sum.

    ``restore_align``: a restored prefix is cut to a multiple of this many tokens. On CUDA it is
    the prefill step (``restore_alignment``): the prefill after a restore then runs on the
    (batch, length) shapes a full prefill runs on, which MLX's CUDA kernels have already been
    built for; a prefix of any 16-token length makes new shapes every turn, each paying the
    kernels' setup again (measured at hundreds of ms a turn for a 4B model on an H200).

    ``priorities`` (a ``cache_priority.CachePriorities``, set by ``PrefixCache``): while it has
    hints or live pins, ``_make_room`` and ``_evict_lru`` evict idle blocks in its order
    (steps-to-execution, then recency) instead of upstream's LRU; without them upstream's own
    methods run. ``_make_room`` is upstream 0.7.10's with the block choice replaced.

    Private upstream names read here (pinned with mlx-vlm>=0.7.10,<0.8; tests/test_cache_priority.py
    checks the eviction ones): ``APCManager._resident_bytes_locked``, ``_make_room``, ``_evict_lru``,
    ``_free_head``, ``_free_remove``, ``_free_push``, ``_memory_headroom``, ``_prefill_reserve_bytes``,
    ``memory_reserve_bytes``, ``lookup_prefix``, ``release``, ``pool``, ``hash_table``,
    ``_exact_cache``, ``APCBlock.next``, ``APCNode.components``, ``_cache_nbytes``; and that
    ``store_kv_blocks`` asks ``_make_room`` for its admission before any other call of it
    (``test_a_store_past_a_restored_prefix_makes_room_for_its_new_blocks_only``).
    """
    import mlx.core as mx
    from mlx_vlm.apc import APCManager, _cache_nbytes

    class CountedAPCManager(APCManager):
        _block_bytes = 0
        restore_align = BLOCK_SIZE
        priorities: CachePriorities | None = None
        resident: ResidentKV | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.reused: set[int] = set()  # hashes of blocks a lookup restored (``reused_bytes``)
            self.ahead_of: tuple[int, int] | None = None  # while a warm stores: its blocks' rank
            self._from_disk: dict[tuple[int, int, int], None] = {}  # prefixes restored from SSD, not stored yet
            self.promoted_from_disk = 0  # stores that kept an SSD-restored prefix in RAM
            self._store_adds: int | None = None  # while a store runs: the bytes of the blocks it may add

        @contextlib.contextmanager
        def storing_ahead(self, key: str) -> Iterator[None]:
            """A prefix warm's store: it makes room only from blocks ranked below its own
            (``cache_priority.warm_rank``), never from a pin or another key's resident KV, and
            stores nothing when that is not enough. Without hints or pins: as any store (LRU)."""
            priorities = self.priorities
            if priorities is None or not priorities.active:
                yield
                return
            self.ahead_of = warm_rank(key, priorities.hints)
            try:
                yield
            finally:
                self.ahead_of = None

        def lookup_prefix(self, token_ids: Any, extra_hash: int = 0) -> tuple[list[Any], int]:
            """Upstream's lookup, cut to a multiple of ``restore_align`` tokens."""
            matched, tokens = super().lookup_prefix(token_ids, extra_hash=extra_hash)
            keep = tokens - tokens % self.restore_align
            if keep < tokens:
                self.release(matched[keep // self.block_size :])
                matched, tokens = matched[: keep // self.block_size], keep
            if matched:
                with self.lock:
                    self.reused.update(b.block_hash for b in matched if b.block_hash is not None)
                    if len(self.reused) > 2 * len(self.hash_table) + 4096:  # forget evicted ones
                        self.reused &= self.hash_table.keys()
            return matched, tokens

        # --- a prefix restored from the SSD tier comes back to RAM ----------------------
        def lookup_prefix_disk_cache(
            self,
            token_ids: Sequence[int],
            extra_hash: int = 0,
            max_prefix_tokens: int | None = None,
            min_prefix_tokens: int = 0,
            allow_memory_overlap: bool = False,
        ) -> tuple[list[Any] | None, int]:
            """Upstream's SSD restore (one per-layer K/V set for the row, no RAM blocks), noted
            so that the row's store (``store_kv_blocks``) keeps the restored prefix in RAM too."""
            cache, tokens = super().lookup_prefix_disk_cache(
                token_ids, extra_hash, max_prefix_tokens, min_prefix_tokens, allow_memory_overlap
            )
            if cache is not None and tokens > 0:
                with self.lock:
                    self._from_disk[_prefix_key(token_ids, tokens, extra_hash)] = None
                    while len(self._from_disk) > 256:
                        self._from_disk.pop(next(iter(self._from_disk)))
            return cache, tokens

        def store_kv_blocks(
            self,
            token_ids: Sequence[int],
            layer_keys: list[Any],
            layer_values: list[Any],
            *,
            extra_hash: int = 0,
            skip_first_n_tokens: int = 0,
        ) -> Any:
            """Upstream's store, skipping only the leading blocks RAM holds: upstream skips the
            first ``skip_first_n_tokens`` whatever holds them, so a row that started from
            elsewhere left a gap no later lookup gets past. A prefix read from the SSD tier
            (one K/V set for the row, no RAM blocks) would be read from the disk again by every
            later request (``promoted_from_disk`` counts these stores); one taken from a key's
            resident KV holds the previous answer, which no store had made blocks of. The room
            it makes is for the blocks past the skip (``_store_adds``): upstream asks for the
            whole KV handed in, so a turn that adds a few blocks to a long restored transcript
            evicted a transcript's worth of others' blocks."""
            if skip_first_n_tokens and self._from_disk:
                key = _prefix_key(token_ids, skip_first_n_tokens, extra_hash)
                with self.lock:
                    if key in self._from_disk:
                        del self._from_disk[key]
                        self.promoted_from_disk += 1
            if skip_first_n_tokens:
                skip_first_n_tokens = held_prefix_tokens(self, token_ids[:skip_first_n_tokens], extra_hash)
            if layer_keys and skip_first_n_tokens:
                per_token = _cache_nbytes(list(layer_keys) + list(layer_values)) / max(1, layer_keys[0].shape[2])
                blocks = len(token_ids) // self.block_size - skip_first_n_tokens // self.block_size
                self._store_adds = int(per_token * self.block_size) * max(0, blocks)
            try:
                return super().store_kv_blocks(
                    token_ids, layer_keys, layer_values, extra_hash=extra_hash, skip_first_n_tokens=skip_first_n_tokens
                )
            finally:
                self._store_adds = None

        def reused_bytes(self) -> int:
            """RAM held by blocks a lookup restored at least once: the part of the cache that paid.
            A budget below it (after a workload on a roomy one) evicts what that workload reuses."""
            with self.lock:
                held = sum(1 for h in self.reused if h in self.hash_table)
                if held and not self._block_bytes:
                    self._resident_bytes_locked()  # learns one block's bytes
                return held * int(self._block_bytes)

        # --- eviction by steps-to-execution (``cache_priority``) ---------------------
        def _make_room(self, allocation_bytes: int = 0, *, retain_bytes: int = 0) -> bool:
            """Upstream's ``_make_room`` with blocks and resident KV (``resident``) evicted in
            the priorities' order (``eviction_order``); what a pin holds goes last: a live
            request's allocation or store takes a pinned key's resident KV, then the newest pin,
            when nothing else is left. Without hints or pins, resident KV goes before any block
            and the blocks go in upstream's LRU order."""
            if self._store_adds is not None:  # a store's room: what it adds (``store_kv_blocks``)
                allocation_bytes = min(allocation_bytes, self._store_adds)
                retain_bytes = min(retain_bytes, self._store_adds)
                self._store_adds = None
            priorities = self.priorities
            if priorities is None or not priorities.active:
                self._drop_resident(allocation_bytes, retain_bytes)
                return bool(super()._make_room(allocation_bytes, retain_bytes=retain_bytes))
            required = self._required_bytes(allocation_bytes, retain_bytes)
            with self.lock:
                resident = self._resident_bytes_locked()
                target = self._room_target(resident, required, retain_bytes)
                evicted = 0
                victims: list[Any] | None = None
                while resident > target:
                    if self._exact_cache:
                        resident -= _cache_nbytes(self._exact_cache[next(iter(self._exact_cache))].prompt_cache)
                        self._exact_cache.popitem(last=False)
                    else:
                        if not victims:
                            victims = self._victims()
                        if not victims:
                            if self.ahead_of is not None or priorities.drop_pin() is None:
                                break
                            continue
                        resident -= self._drop_victim(victims.pop())
                    self.stats.evictions += 1
                    self.stats.memory_evictions += 1
                    evicted += 1
            if evicted or self._memory_headroom() < required:
                mx.clear_cache()
            return bool(resident + retain_bytes <= self.memory_max_bytes and self._memory_headroom() >= required)

        def _required_bytes(self, allocation_bytes: int, retain_bytes: int) -> int:
            """The free memory upstream's ``_make_room`` asks for (its own sum)."""
            return int(
                self.memory_reserve_bytes
                + (
                    self._prefill_reserve_bytes + allocation_bytes
                    if retain_bytes
                    else max(self._prefill_reserve_bytes, allocation_bytes)
                )
            )

        def _room_target(self, resident: int, required: int, retain_bytes: int) -> int:
            """The resident bytes upstream's ``_make_room`` evicts down to."""
            return max(0, min(self.memory_max_bytes - retain_bytes, resident + self._memory_headroom() - required))

        # --- a key's KV between turns (``resident``) ----------------------------------
        def keep_resident(self, key: str, salt: int, tokens: list[int], cache: list[Any], prompt_len: int) -> bool:
            """Keep a finished row's KV for its key if it fits the budget and the free memory
            with everything else held. Without hints or pins older entries go first, blocks
            never; with them, the entries that rank below it in the priorities' order make the
            room, else it goes. A block never goes for an entry (the entry is the faster copy,
            the blocks the one that lasts), nor does a pin."""
            resident_kv = self.resident
            if resident_kv is None or not resident_kv.keep(key, salt, tokens, cache, prompt_len):
                return False
            with self.lock:
                held = self._resident_bytes_locked()
                limit = min(self.memory_max_bytes, held + self._memory_headroom() - self.memory_reserve_bytes)
                if self.priorities is None or not self.priorities.active:
                    resident_kv.fit(held, limit)
                    return (key, salt) in resident_kv.entries
                if held <= limit:
                    return True
                order = [v for v in reversed(self._victims()) if isinstance(v, tuple)]
                mine = (key, salt)
                below = order[: order.index(mine)] if mine in order else order
                if held - sum(map(self._victim_bytes, below)) > limit:
                    resident_kv.drop(mine)
                    return False
                for victim in below:
                    if held <= limit:
                        break
                    held -= self._drop_victim(victim)
            return True

        def take_resident(self, key: str, salt: int, prompt: list[int]) -> Taken:
            """The key's resident KV for ``prompt`` (``ResidentKV.take``), cut as
            ``lookup_prefix`` cuts a block restore where the alignment is not the block."""
            if self.resident is None:
                return NOTHING
            align = self.restore_align if self.restore_align != BLOCK_SIZE else 1
            return self.resident.take(key, salt, prompt, align=align)

        def resident_used(self, tokens: int) -> None:
            """A row starts from ``tokens`` of resident KV: a prefix hit, as a block lookup's."""
            with self.lock:
                self.stats.hits += 1
            if self.resident is not None:
                self.resident.tokens_taken += tokens

        def _drop_resident(self, allocation_bytes: int, retain_bytes: int) -> None:
            """Drop resident KV, least recently kept first, while the cache is over the target
            ``_make_room`` evicts down to (the same sum as upstream's)."""
            resident_kv = self.resident
            if resident_kv is None or not resident_kv.entries:
                return
            required = self._required_bytes(allocation_bytes, retain_bytes)
            with self.lock:
                resident = self._resident_bytes_locked()
                target = self._room_target(resident, required, retain_bytes)
                while resident > target and (freed := resident_kv.drop_oldest()) is not None:
                    resident -= freed

        def _victim_bytes(self, victim: Any) -> int:
            if isinstance(victim, tuple):
                assert self.resident is not None
                return self.resident.entries[victim].nbytes
            return int(self._block_bytes or victim.resident_bytes())

        def _drop_victim(self, victim: Any) -> int:
            """Evict one entry of ``_victims``: an idle block, or a key's resident KV."""
            if isinstance(victim, tuple):
                assert self.resident is not None
                return self.resident.drop(victim) or 0
            return self._drop_idle_block(victim)

        def _evict_lru(self, *, cached_only: bool = False) -> Any:
            """An empty pooled block, else the first idle cached block in the priorities' order."""
            priorities = self.priorities
            if priorities is None or not priorities.active:
                return super()._evict_lru(cached_only=cached_only)
            block: Any = self._free_head
            while not cached_only and block is not None and block.block_hash is not None:
                block = block.next
            if block is None or cached_only:
                victims = self._victims(blocks_only=True)
                while not victims and self.ahead_of is None and priorities.drop_pin() is not None:
                    victims = self._victims(blocks_only=True)  # a store takes pins too, the newest first
                if not victims:
                    return None
                block = victims[-1]
            self._free_remove(block)
            block_hash = block.block_hash
            if block_hash is not None and self.hash_table.get(block_hash) is block:
                del self.hash_table[block_hash]
                self.stats.evictions += 1
            block.block_hash = None
            block.token_ids = ()
            block.release_components()
            return block

        def _victims(self, *, blocks_only: bool = False) -> list[Any]:
            """The idle cached blocks a pin does not hold and the resident KV entries (their
            ``(key, salt)``; a pinned key's last), in ``eviction_order``, the next to evict last
            (pop order)."""
            assert self.priorities is not None
            idle: list[Any] = []
            block: Any = self._free_head  # upstream's free queue: least recently released first
            while block is not None:
                if block.block_hash is not None:
                    idle.append(block)
                block = block.next
            infos = [self.priorities.block(b.block_hash, i) for i, b in enumerate(idle)]
            pinned = [pin.key for pin in self.priorities.live_pins()]
            entries = list(self.resident.entries.items()) if self.resident is not None else []
            kept = [(key, entry.kept_at) for (key, _), entry in entries]
            order = eviction_order(infos, self.priorities.hints, pinned, below=self.ahead_of, resident=kept)
            victims = [idle[i] if i < len(idle) else entries[i - len(idle)][0] for i in reversed(order)]
            return [v for v in victims if not isinstance(v, tuple)] if blocks_only else victims

        def _drop_idle_block(self, block: Any) -> int:
            """Evict one idle cached block (it stays pooled, empty); returns the bytes freed."""
            self._free_remove(block)
            freed = int(self._block_bytes or block.resident_bytes())
            self.hash_table.pop(block.block_hash, None)
            block.block_hash = None
            block.token_ids = ()
            block.release_components()
            self._free_push(block)
            return freed

        def _resident_bytes_locked(self) -> int:
            held = [block for block in self.pool if block.components]
            if held and not self._block_bytes:
                self._block_bytes = int(held[0].resident_bytes())
            exact = sum(_cache_nbytes(entry.prompt_cache) for entry in self._exact_cache.values())
            kept = self.resident.nbytes if self.resident is not None else 0
            return len(held) * self._block_bytes + exact + kept

    return CountedAPCManager


def _prefix_key(token_ids: Sequence[int], tokens: int, extra_hash: int) -> tuple[int, int, int]:
    """A prefix of ``tokens`` tokens under ``extra_hash``, as a small key."""
    return (int(extra_hash), tokens, hash(tuple(int(t) for t in token_ids[:tokens])))


def block_hashes(prompt: Any, salt: int) -> list[int]:
    """The APC hash chain of ``prompt``'s full 16-token blocks under ``salt``, as upstream keys them."""
    from mlx_vlm.apc import SEED_PARENT_HASH, _hash_tokens

    parent, out = SEED_PARENT_HASH, []
    tokens = [int(t) for t in prompt]
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = _hash_tokens(parent, tuple(tokens[start : start + BLOCK_SIZE]), salt)
        out.append(parent)
    return out


def held_prefix_tokens(manager: Any, prompt: Sequence[int], salt: int, *, disk: Any = None) -> int:
    """How many leading tokens of ``prompt`` have their blocks held now, in ``manager``'s RAM
    or (``disk``) its SSD tier, under the manager's lock; a multiple of ``BLOCK_SIZE``."""
    matched = 0
    with manager.lock:
        for i, block_hash in enumerate(block_hashes(prompt, salt)):
            chunk = tuple(int(t) for t in prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            block = manager.hash_table.get(block_hash)
            in_ram = block is not None and block.token_ids == chunk
            if not in_ram and (disk is None or not disk.has(block_hash)):
                break
            matched += BLOCK_SIZE
    return matched


def free_ram_bytes() -> int | None:
    """The machine's free RAM as upstream measures it for its budget (None: unknown)."""
    from mlx_vlm.apc import _free_ram_bytes

    free = _free_ram_bytes()
    return None if free is None else int(free)


def exact_entries(manager: Any) -> int:
    """How many exact (whole prompt) snapshots ``manager`` holds besides its blocks."""
    return len(manager._exact_cache)
