"""Prefix reuse for one resident model: a RAM-budgeted snapshot tier and an optional SSD tier.

Reuse is explicit: only requests carrying a ``prompt_cache_key`` (with their complete
conversation) look up or store anything. KV blocks are content-addressed: a block's hash
chains the tokens before it with a salt of the ``mlx_cache_scope``, the MTP depth, the
execution layout and the image content. Keyed rows of one scope therefore share every
identical prefix (N sessions with one system prompt and tool schema prefill it once), and
rows of different scopes never share. ``mlx_cache_sharing="key"`` adds the key to the salt:
only rows with the same key share (no cross-key timing side channel within a scope).

Two backends, one report shape:

- the native lane (mlx-vlm) uses upstream's ``APCManager`` inside its ``BatchGenerator``:
  dense models keep 16-token KV blocks, hybrids keep whole-cache checkpoints. One manager per
  resident model is shared by every group (continuous, cohort, exclusive), so one runtime
  shares its budget across keys and depths. ``DiskBlockStore`` is the SSD tier.
- the serialized mlx-lm lane keeps one snapshot per key: the prompt cache a few tokens short
  of the prompt's end (so the next turn's re-rendered history still extends it), restored
  by copy.

Everything here runs on the engine's worker thread except ``stats`` readers, which only
read counters.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import InvalidControls, PromptCacheFlushFailed, PromptCacheLocked, PromptCachePathUnsafe
from .cache_priority import CachePriorities, validate_hints, validate_pin
from .prefix_break import find_break
from .report import ApcReport, PromptCacheReport
from .resident import ResidentKV, common_prefix
from .upstream import (
    BLOCK_SIZE,
    VerifiedDiskStore,
    block_hashes,
    counted_manager_class,
    exact_entries,
    free_ram_bytes,
    held_prefix_tokens,
)

log = logging.getLogger(__name__)

GIB = 1 << 30
MAX_BUDGET_BYTES = 8 * GIB
RESERVE_BYTES = 512 << 20
DEFAULT_DISK_MAX_GB = 4.0
NUM_BLOCKS = 8192
# A checkpoint this many tokens short of the prompt's end: the next turn re-renders the
# assistant header differently (the generation prompt), so the last few tokens diverge.
GUARD_TOKENS = 8
CHECKPOINTS_PER_SLOT = 2
IDENTITY_FILE = "abstractruntime-mlx-identity.json"
LOCK_FILE = "abstractruntime-mlx-owner.lock"
SCHEMA = "abstractruntime-mlx-prefix-cache/v1"
# Per-call counters reported under ``prompt_cache.apc`` (deltas over the call's lifetime).
CALL_COUNTERS = (
    "stores",
    "exact_stores",
    "hits",
    "exact_hits",
    "misses",
    "memory_skips",
    "rejects",
    "disk_hits",
    "disk_corrupt",
)
_MAX_TRACKED_KEYS = 4096


@dataclass(frozen=True, slots=True)
class CacheOptions:
    """The constructor options ``mlx_cache_memory_max_gb``, ``mlx_cache_disk_path``,
    ``mlx_cache_disk_max_gb`` and ``mlx_cache_scope``."""

    memory_max_gb: float | None = None
    disk_path: str | None = None
    disk_max_gb: float = DEFAULT_DISK_MAX_GB
    scope: str = "local"
    sharing: str = "scope"  # "scope": keys of one scope share prefixes; "key": only one key's rows do


SHARING_MODES = ("scope", "key")


def validate_options(options: dict[str, Any]) -> CacheOptions:
    """Build ``CacheOptions`` from provider options, with typed errors naming the field."""

    def number(name: str, value: Any, *, allow_zero: bool) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value != value
            or value in (float("inf"), float("-inf"))
        ):
            raise InvalidControls(f"{name} must be a finite number of GiB", field=name, value=value)
        if value < 0 or (value == 0 and not allow_zero):
            raise InvalidControls(f"{name} must be {'>= 0' if allow_zero else '> 0'}", field=name, value=value)
        return float(value)

    memory = options.get("mlx_cache_memory_max_gb")
    disk_path = options.get("mlx_cache_disk_path")
    disk_max = options.get("mlx_cache_disk_max_gb")
    scope = options.get("mlx_cache_scope", "local")
    sharing = options.get("mlx_cache_sharing", "scope")
    if sharing not in SHARING_MODES:
        raise InvalidControls(
            f"mlx_cache_sharing must be one of {', '.join(SHARING_MODES)}", field="mlx_cache_sharing", value=sharing
        )
    if memory is not None:
        memory = number("mlx_cache_memory_max_gb", memory, allow_zero=True)
    if disk_path is not None and (not isinstance(disk_path, (str, os.PathLike)) or not str(disk_path)):
        raise InvalidControls(
            "mlx_cache_disk_path must be a non-empty path", field="mlx_cache_disk_path", value=disk_path
        )
    if disk_max is None:
        disk_max = DEFAULT_DISK_MAX_GB
    else:
        disk_max = number("mlx_cache_disk_max_gb", disk_max, allow_zero=False)
    if not isinstance(scope, str) or not scope or len(scope) > 256:
        raise InvalidControls(
            "mlx_cache_scope must be a non-empty string (at most 256 characters)", field="mlx_cache_scope", value=scope
        )
    return CacheOptions(memory, str(disk_path) if disk_path is not None else None, disk_max, scope, sharing)


# --- the RAM budget ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Budget:
    max_bytes: int
    reserve_bytes: int
    working_set_bytes: int | None
    source: str  # "mlx_cache_memory_max_gb" | "metal_recommended_working_set" | "cuda_device_memory" | "system_memory"


def working_set() -> tuple[int | None, str]:
    """The accelerator's recommended working set, derived honestly per backend.

    Metal reports ``max_recommended_working_set_size``. CUDA reports the device's total
    memory (``total_memory``), used as is. On CPU the working set is the machine's physical
    memory: the model and its caches live there.
    """
    import mlx.core as mx

    info: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        info = dict(mx.device_info())
    if info.get("max_recommended_working_set_size"):
        return int(info["max_recommended_working_set_size"]), "metal_recommended_working_set"
    # mlx 0.32's CUDA backend names the device's memory total_memory (earlier: memory_size).
    device_memory = info.get("total_memory") or info.get("memory_size")
    if device_memory and mx.default_device() == mx.gpu:
        return int(device_memory), "cuda_device_memory"
    with contextlib.suppress(Exception):
        import psutil

        return int(psutil.virtual_memory().total), "system_memory"
    with contextlib.suppress(Exception):
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")), "system_memory"
    return None, "unknown"


def memory_budget(memory_max_gb: float | None) -> Budget:
    """min(8 GiB, working set / 4), or ``mlx_cache_memory_max_gb``; a 512 MiB reserve over free memory."""
    ws, source = working_set()
    if memory_max_gb is not None:
        return Budget(int(memory_max_gb * GIB), RESERVE_BYTES, ws, "mlx_cache_memory_max_gb")
    if ws is None:
        return Budget(MAX_BUDGET_BYTES, RESERVE_BYTES, None, "default_8gib")
    return Budget(min(MAX_BUDGET_BYTES, ws // 4), RESERVE_BYTES, ws, source)


# --- identity and salts ------------------------------------------------------------------


def image_hash(images: list[Any]) -> int:
    """Content hash of a request's images (index, size, mode and pixels), 0 without images."""
    if not images:
        return 0
    digest = hashlib.sha256()
    for i, image in enumerate(images):
        raw = image.tobytes()
        digest.update(i.to_bytes(8, "big"))
        digest.update(f"{image.mode}:{image.size[0]}x{image.size[1]}".encode())
        digest.update(len(raw).to_bytes(8, "big"))
        digest.update(raw)
    return int.from_bytes(digest.digest()[:8], "big", signed=True)


def request_salt(*, scope: str, key: str | None, draft_tokens: int, layout: str, media_hash: int) -> int:
    """The APC salt of one request: scope, MTP depth and layout partition the cache, and the
    key too when given (``None``: rows of every key share)."""
    from mlx_vlm.apc import semantic_extra_hash

    partition: list[object] = ["abstractruntime-mlx", scope, int(draft_tokens), layout]
    if key is not None:
        partition.append(key)
    tenant = json.dumps(partition)
    return int(semantic_extra_hash(tenant=tenant, image_hash=media_hash))


def cache_identity(loaded: Any, *, scope: str) -> dict[str, Any]:
    """What a snapshot on disk depends on. A change to any of it never reuses old files."""
    import importlib.metadata as md

    from ...artifacts import model_fingerprint

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    head = None
    head_source = loaded.head_source or loaded.drafter_source  # the head this target attaches, attached or not
    if head_source is not None:
        head = {"path": str(Path(head_source).resolve()), "fingerprint": model_fingerprint(head_source)}
    return {
        "schema": SCHEMA,
        "model": str(Path(loaded.path).resolve()),
        "weights_fingerprint": model_fingerprint(loaded.path),
        "head": head,
        "config": hashlib.sha256(json.dumps(loaded.config, sort_keys=True).encode()).hexdigest(),
        "engine_versions": {"mlx": version("mlx"), "mlx-vlm": version("mlx-vlm"), "mlx-lm": version("mlx-lm")},
        "lane": loaded.upstream,
        "block_size": BLOCK_SIZE,
        "scope": scope,
    }


def namespace_for(identity: dict[str, Any]) -> str:
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return "armlx-apc-v1-" + hashlib.sha256(canonical.encode()).hexdigest()[:32]


# --- the SSD namespace -------------------------------------------------------------------


def _private_dir(path: Path, what: str) -> None:
    """Create ``path`` 0700, or check an existing one is a private directory (not a symlink)."""
    if path.is_symlink():
        raise PromptCachePathUnsafe(f"{what} {path} is a symlink; use a real private directory", path=str(path))
    if not path.exists():
        path.mkdir(mode=0o700, parents=True)
        path.chmod(0o700)
        return
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise PromptCachePathUnsafe(f"{what} {path} is not a directory", path=str(path))
    if info.st_mode & 0o077:
        raise PromptCachePathUnsafe(
            f"{what} {path} is readable by other users (mode {stat.S_IMODE(info.st_mode):o}); run chmod 700 on it",
            path=str(path),
        )
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise PromptCachePathUnsafe(f"{what} {path} belongs to another user", path=str(path))


class DiskNamespace:
    """The private, single-writer directory of one cache identity under ``mlx_cache_disk_path``."""

    def __init__(self, root: str, identity: dict[str, Any]) -> None:
        import fcntl

        self.root = Path(root).expanduser().absolute()
        _private_dir(self.root, "mlx_cache_disk_path")
        self.namespace = namespace_for(identity)
        self.dir = self.root / self.namespace
        _private_dir(self.dir, "the prompt-cache namespace")
        self._lock_fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise PromptCacheLocked(
                f"the prompt-cache namespace {self.dir} is already owned by another live runtime; "
                "choose a different mlx_cache_disk_path or close its owner",
                path=str(self.dir),
            ) from None
        self._write_identity(identity)

    def _write_identity(self, identity: dict[str, Any]) -> None:
        marker = self.dir / IDENTITY_FILE
        body = json.dumps(identity, sort_keys=True, indent=2)
        if marker.is_file() and not marker.is_symlink():
            try:
                if json.loads(marker.read_text()) == identity:
                    return
            except (OSError, ValueError):
                pass
            log.warning(
                "prompt cache %s: identity marker differs or is damaged; starting the namespace empty", self.dir
            )
            self.remove_snapshots()
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(body)

    def snapshot_files(self) -> list[Path]:
        return [p for p in self.dir.glob("*.safetensors") if p.is_file() and not p.is_symlink()]

    def remove_snapshots(self) -> int:
        removed = 0
        for path in self.snapshot_files():
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
        return removed

    def close(self) -> None:
        import fcntl

        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None  # type: ignore[assignment]


# --- the RAM tier's manager ---------------------------------------------------------------


def restore_alignment(prefill_step_size: int) -> int:
    """How many tokens a restored prefix is a multiple of: the prefill step on CUDA (see
    ``counted_manager_class``), one KV block elsewhere."""
    import mlx.core as mx

    on_cuda = mx.default_device() == mx.gpu and not mx.metal.is_available()
    return prefill_step_size if on_cuda else BLOCK_SIZE


# --- per-key bookkeeping -----------------------------------------------------------------


@dataclass(slots=True)
class _KeyState:
    prompt_ids: tuple[int, ...]
    retained: bool
    reason: str | None = None


class PrefixCache:
    """The prefix cache of one resident model (worker thread only)."""

    def __init__(
        self, loaded: Any, options: CacheOptions, *, max_batch_size: int, restore_align: int = BLOCK_SIZE
    ) -> None:
        self.options = options
        self.lane = loaded.upstream
        self.budget = memory_budget(options.memory_max_gb)
        self.disk: DiskNamespace | None = None
        self._keys: OrderedDict[tuple[str, int], _KeyState] = OrderedDict()
        # (key, salt) -> the key's latest prompt, its block owners not recorded yet (``_own``)
        self._unowned: OrderedDict[tuple[str, int], list[int]] = OrderedDict()
        self.totals = {"requests": 0, "hits": 0, "partial": 0, "misses": 0, "not_retained": 0}
        self.manager: Any = None
        self.serial: SerialStore | None = None
        self._block_strategy: bool | None = None
        if options.disk_path is not None:
            if loaded.upstream != "native":
                raise InvalidControls(
                    "mlx_cache_disk_path needs the mlx_batching=True lane (mlx-vlm's SSD tier)",
                    field="mlx_cache_disk_path",
                    value=options.disk_path,
                )
            self.disk = DiskNamespace(options.disk_path, cache_identity(loaded, scope=options.scope))
        self.restore_align = restore_align
        self.priorities = CachePriorities()
        # Blocks a prefix warm put in RAM that no request restored yet (``note_warm``).
        self._warmed: OrderedDict[int, None] = OrderedDict()
        self.warms = {"finished": 0, "blocks": 0, "restored_blocks": 0}
        if loaded.upstream == "native":
            self.manager = self._native_manager(max_batch_size)
            self.manager.restore_align = restore_align
            self.manager.priorities = self.priorities
            self.manager.resident = ResidentKV(self.manager.lock, min_tokens=BLOCK_SIZE, guard=GUARD_TOKENS)
            self.backend = "mlx_vlm_apc"
        else:
            self.serial = SerialStore(self.budget.max_bytes)
            self.backend = "mlx_lm_prompt_cache"

    def _native_manager(self, max_batch_size: int) -> Any:
        store = None
        if self.disk is not None:
            max_bytes = int(self.options.disk_max_gb * GIB)
            store = VerifiedDiskStore(
                self.disk.root,
                namespace=self.disk.namespace,
                max_bytes=max_bytes,
                num_workers=1,
                overrides={"disk_queue_max_gb": min(0.25, self.options.disk_max_gb / 4), "disk_shard_max_blocks": 32},
            )
        return counted_manager_class()(
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            disk=store,
            overrides={
                "memory_max_gb": self.budget.max_bytes / GIB,
                "memory_reserve_gb": self.budget.reserve_bytes / GIB,
                # One checkpoint at the end of each prompt (minus the guard), none in between.
                "checkpoint_interval_tokens": 1 << 20,
                "checkpoint_entries": CHECKPOINTS_PER_SLOT * max_batch_size,
                "checkpoint_guard_tokens": GUARD_TOKENS,
            },
        )

    # --- per request --------------------------------------------------------------------
    def salt(self, request: Any, layout: str) -> int:
        # One snapshot per salt on the serialized lane: there the key always partitions.
        per_key = self.options.sharing == "key" or layout == "serial"
        return request_salt(
            scope=self.options.scope,
            key=request.prompt_cache_key if per_key else None,
            draft_tokens=request.running_draft_tokens,  # a deferred request's prefix is target-only
            layout=layout,
            media_hash=request.media_hash,
        )

    def admit(self, request: Any, layout: str) -> int:
        """The salt of a keyed request being admitted; records its key as an owner of its
        prompt's blocks (what ``cache_priority`` ranks them by)."""
        salt = self.salt(request, layout)
        self._own(request, salt)
        return salt

    def _own(self, request: Any, salt: int) -> None:
        """Ownership is only read while hints or pins order eviction: until then a key's latest
        prompt is noted and hashed when the first hint or pin arrives (``_own_noted``), so a
        keyed turn without them hashes nothing."""
        if request.prompt_cache_key is not None:
            self.own(request.prompt_cache_key, request.prompt_ids, salt)

    def storing_ahead(self, key: str) -> contextlib.AbstractContextManager[None]:
        """While a warm of ``key`` stores its blocks (worker thread): they make room only from
        blocks ranked below their own, take no pin (``cache_priority.warm_rank``)."""
        manager = self.manager
        return manager.storing_ahead(key) if manager is not None else contextlib.nullcontext()

    def own(self, key: str, prompt: list[int], salt: int) -> None:
        """Record ``key`` as an owner of ``prompt``'s blocks (worker thread): as a keyed request is
        admitted, and as a warm names the prefix its node's request will begin with, cached or not,
        so that the key's hints rank those blocks before the request comes."""
        if self.manager is None:
            return
        if not self.priorities.active:
            self._unowned[(key, salt)] = prompt
            self._unowned.move_to_end((key, salt))
            while len(self._unowned) > _MAX_TRACKED_KEYS:
                self._unowned.popitem(last=False)
            return
        self._own_noted()
        self.priorities.own(key, block_hashes(prompt, salt))

    def _own_noted(self) -> None:
        """Record the owners of the prompts noted while no hint or pin was set."""
        manager = self.manager
        if manager is None:
            return
        with manager.lock:
            self.priorities.prune(manager.hash_table, len(manager.hash_table))
        while self._unowned:
            (key, salt), prompt = self._unowned.popitem(last=False)
            self.priorities.own(key, block_hashes(prompt, salt))

    # --- eviction hints and pins (``cache_priority``) --------------------------------------
    @property
    def eviction(self) -> str:
        """``steps_to_execution`` where hints and pins order eviction (the native lane's KV
        blocks), ``lru`` on the serialized lane, whose snapshot store stays LRU."""
        return "steps_to_execution" if self.manager is not None else "lru"

    def set_hints(self, hints: object, *, replace: bool = False) -> dict[str, Any]:
        """Steps-to-execution per key (None: no live run reaches it); merged unless ``replace``."""
        valid = validate_hints(hints)
        self._own_noted()
        self.priorities.set_hints(valid, replace=replace)
        return {"eviction": self.eviction, "hinted_keys": len(self.priorities.hints), "updated": len(valid)}

    def pin(self, key: object, ttl_s: object) -> dict[str, Any]:
        """Keep ``key``'s blocks resident for ``ttl_s`` (a live request's need still wins)."""
        name, ttl = validate_pin(key, ttl_s)
        self._own_noted()
        pin = self.priorities.pin(name, ttl)
        return {
            "eviction": self.eviction,
            "key": name,
            "ttl_s": ttl,
            "pins": len(self.priorities.pins),
            "expires_in_s": round(pin.expires_at - pin.pinned_at, 3),
        }

    def release(self, key: object) -> dict[str, Any]:
        if not isinstance(key, str) or not key.strip():
            raise InvalidControls("a released prompt-cache key must be a non-empty string", field="key", value=key)
        return {"eviction": self.eviction, "key": key, "released": self.priorities.release(key)}

    def shares_blocks(self, model: Any) -> bool:
        """True when this model's prefixes are stored as KV blocks a later row can extend
        (dense caches); hybrids keep whole-prompt checkpoints instead."""
        if self._block_strategy is None:
            self._block_strategy = self.manager is not None and not self.manager.coordinator(model).is_checkpoint
        return self._block_strategy

    def resident_prefix_tokens(self, prompt: list[int], salt: int, *, ssd: bool = True) -> int:
        """How many leading tokens of ``prompt`` a lookup would restore now (RAM or, with
        ``ssd``, SSD blocks), without taking the blocks; read under the manager's lock, so a
        caller thread may ask (``Engine.warm_prefix``)."""
        manager = self.manager
        if manager is None:
            return 0
        return held_prefix_tokens(manager, prompt, salt, disk=manager.disk if ssd else None)

    def counters(self) -> dict[str, int]:
        if self.manager is not None:
            # The counters alone: upstream's stats_snapshot also sums every cached tensor.
            with self.manager.lock:
                stats = self.manager.stats
                return {
                    "stores": stats.stores,
                    "exact_stores": stats.exact_stores,
                    "hits": stats.hits,
                    "exact_hits": stats.exact_hits,
                    "misses": stats.misses,
                    "memory_skips": stats.memory_skips,
                    "rejects": stats.rejects,
                    "disk_hits": stats.disk_hits,
                    "disk_corrupt": self.manager.disk.corrupt if self.manager.disk is not None else 0,
                }
        assert self.serial is not None
        return self.serial.counters()

    def resident_bytes(self) -> int:
        if self.manager is not None:
            return int(self.manager.resident_bytes())
        assert self.serial is not None
        return self.serial.resident_bytes

    def report(self, request: Any, before: dict[str, int], *, shared: bool, layout: str) -> PromptCacheReport:
        """What the cache did for a finished keyed request (``metadata["prompt_cache"]``);
        updates the key's record.

        Sets ``request.prefix_break`` when the prompt broke the key's previous prompt (see
        ``prefix_break``): the caller locates it, off this thread."""
        after = self.counters()
        delta = {name: after[name] - before.get(name, 0) for name in CALL_COUNTERS}
        prompt = list(request.prompt_ids)
        cached = int(request.cached_tokens or 0)
        key = (request.prompt_cache_key, self.salt(request, layout))
        self._own(request, key[1])  # again: owners of blocks stored since admission may have been pruned
        previous = self._keys.get(key)
        outcome, degraded = "miss", None
        request.prefix_break = None
        if previous is not None:
            num_shared = common_prefix(previous.prompt_ids, prompt)
            request.prefix_break = find_break(previous.prompt_ids, shared=num_shared, reused=cached, guard=GUARD_TOKENS)
            common = min(num_shared, len(prompt) - 1)
            tolerance = max(BLOCK_SIZE, self.restore_align) + GUARD_TOKENS
            if cached > 0 and cached >= common - tolerance:
                outcome = "hit"
            elif common > tolerance:
                outcome = "partial" if cached > 0 else "not_retained"
                degraded = previous.reason or (
                    f"the previous turn's snapshot was not retained in full: only {cached} of the {common} prompt "
                    "tokens this turn shares with it were restored; the rest was evicted to stay within the "
                    f"prefix-cache memory budget ({self.budget.max_bytes / (1 << 20):.1f} MiB) or the free memory; "
                    "raise mlx_cache_memory_max_gb above the conversation's snapshot size"
                )
        elif cached > 0:
            outcome = "hit"
        stored = delta["stores"] + delta["exact_stores"] > 0
        # Prompts too short for one block or checkpoint store nothing, and lose nothing.
        retained = delta["memory_skips"] == 0 and (stored or len(prompt) < 2 * BLOCK_SIZE)
        reason = None
        if not retained:
            reason = (
                f"the previous turn's {len(prompt)}-token prefix snapshot was not retained: it did not fit the "
                f"prefix-cache memory budget ({self.budget.max_bytes / (1 << 20):.1f} MiB) or the free memory "
                f"(memory_skips={delta['memory_skips']}, stores={delta['stores'] + delta['exact_stores']}); "
                "raise mlx_cache_memory_max_gb above the conversation's snapshot size"
            )
        self._keys[key] = _KeyState(tuple(prompt), retained, reason)
        self._keys.move_to_end(key)
        while len(self._keys) > _MAX_TRACKED_KEYS:
            self._keys.popitem(last=False)
        self.totals["requests"] += 1
        self.totals[
            {"hit": "hits", "partial": "partial", "miss": "misses", "not_retained": "not_retained"}[outcome]
        ] += 1
        return PromptCacheReport(
            request.prompt_cache_key,
            outcome,
            backend=self.backend,
            cached_tokens=cached,
            fed_tokens=len(prompt) - cached,
            apc=ApcReport(
                **delta, shared=shared, memory_max_bytes=self.budget.max_bytes, resident_bytes=self.resident_bytes()
            ),
            degraded_reason=degraded,
            prefetched_tokens=self._take_warmed(prompt[:cached], key[1]) if self.warms["finished"] else None,
        )

    # --- prefix warms (``warm``) -------------------------------------------------------------
    def note_warm(self, request: Any) -> int:
        """A warm finished: remember the blocks of its prompt it put in RAM (those past what RAM
        held when it was admitted, now resident), for the next report that restores them."""
        manager = self.manager
        if manager is None or request.cache_layout is None:
            return 0
        salt = self.salt(request, request.cache_layout)
        first = request.warm_ram_tokens // BLOCK_SIZE
        hashes = block_hashes(request.prompt_ids, salt)
        with manager.lock:
            added = [h for h in hashes[first:] if h in manager.hash_table]
        for block_hash in added:
            self._warmed[block_hash] = None
            self._warmed.move_to_end(block_hash)
        while len(self._warmed) > NUM_BLOCKS:
            self._warmed.popitem(last=False)
        self.warms["finished"] += 1
        self.warms["blocks"] += len(added)
        return len(added) * BLOCK_SIZE

    def _take_warmed(self, restored: list[int], salt: int) -> int:
        """The tokens of a restored prefix a warm put in RAM; each warmed block is counted once."""
        taken = [h for h in block_hashes(restored, salt) if h in self._warmed]
        for block_hash in taken:
            del self._warmed[block_hash]
        self.warms["restored_blocks"] += len(taken)
        return len(taken) * BLOCK_SIZE

    # --- control ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        counters = self.counters()
        out: dict[str, Any] = {
            "enabled": True,
            "backend": self.backend,
            "full_history_required": True,
            "scope": self.options.scope,
            "memory": {
                "max_bytes": self.budget.max_bytes,
                "reserve_bytes": self.budget.reserve_bytes,
                "working_set_bytes": self.budget.working_set_bytes,
                "budget_source": self.budget.source,
                "resident_bytes": self.resident_bytes(),
                **({"reused_bytes": self.manager.reused_bytes()} if self.manager is not None else {}),
                "entries": self._ram_entries(),
                **({"resident_kv": self.manager.resident.stats()} if self.manager is not None else {}),
            },
            "disk": self._disk_stats(),
            "counters": counters,
            "requests": dict(self.totals),
            "keys_tracked": len(self._keys),
            "eviction": {"order": self.eviction, **self.priorities.stats()},
            "warms": {**self.warms, "pending_blocks": len(self._warmed)},
        }
        return out

    def _ram_entries(self) -> int:
        if self.manager is not None:
            with self.manager.lock:
                return len(self.manager.hash_table) + exact_entries(self.manager)
        assert self.serial is not None
        return len(self.serial.entries)

    def _disk_stats(self) -> dict[str, Any]:
        if self.disk is None or self.manager is None:
            return {"enabled": False}
        store = self.manager.disk
        return {
            "enabled": True,
            "path": str(self.disk.dir),
            "namespace": self.disk.namespace,
            "max_bytes": store.max_bytes,
            "bytes": int(store.disk_bytes),
            "pending_bytes": int(store.pending_bytes),
            "files": len(self.disk.snapshot_files()),
            "blocks_indexed": int(store.num_blocks_indexed),
            "snapshots_indexed": int(store.num_exact_indexed),
            "corrupt_files": int(store.corrupt),
            "write_failures": int(store.write_failures),
            "promoted_to_ram": int(self.manager.promoted_from_disk),
        }

    def clear(self) -> dict[str, Any]:
        """Drop every owned RAM and SSD entry (the whole namespace: keys share it)."""
        ram = self._ram_entries()
        disk_removed = 0
        if self.manager is not None:
            store = self.manager.disk
            if store is not None:
                store.flush()
            if self.manager.resident is not None:
                self.manager.resident.clear()
            self.manager.clear()
            if store is not None:
                disk_removed = store.remove_all()
        else:
            assert self.serial is not None
            self.serial.clear()
        self._keys.clear()
        self._unowned.clear()
        self.priorities.owners.clear()  # hints and pins are the runtime's: they stay
        return {"scope": "all_keys", "ram_entries_removed": ram, "disk_files_removed": disk_removed}

    def flush(self) -> None:
        if self.manager is not None and self.manager.disk is not None:
            self.manager.disk.flush()

    def close(self) -> None:
        """Flush the SSD tier, stop its writer and release the namespace lock.

        ``PromptCacheFlushFailed`` when the flush raised or a snapshot write since load did not
        reach the disk; everything is closed and released either way.
        """
        store = self.manager.disk if self.manager is not None else None
        try:
            if self.manager is not None:
                self.flush()
                self.manager.close()
        except Exception as exc:
            raise PromptCacheFlushFailed(
                f"flushing the prompt-cache SSD tier failed: {exc}", details=self._flush_details(store)
            ) from exc
        finally:
            if self.disk is not None:
                self.disk.close()
        if store is not None and store.write_failures:
            raise PromptCacheFlushFailed(
                f"{store.write_failures} prompt-cache snapshot write(s) since load did not reach the SSD tier "
                f"at {store.dir} (see the mlx_vlm.apc warnings: a full disk, a removed or unwritable "
                "directory); later processes will prefill what they miss",
                details=self._flush_details(store),
            )

    def _flush_details(self, store: Any) -> dict[str, Any]:
        return {
            "path": str(self.disk.dir) if self.disk is not None else None,
            "write_failures": int(store.write_failures) if store is not None else 0,
        }


# --- the serialized mlx-lm lane ----------------------------------------------------------


@dataclass(slots=True)
class _SerialEntry:
    tokens: tuple[int, ...]
    cache: list[Any]
    nbytes: int


def clone_cache(cache: list[Any]) -> list[Any]:
    """A private copy of an mlx-lm prompt cache (generation mutates the one it is given);
    mlx-lm's own ``LRUPromptCache`` copies the same way."""
    import copy

    return copy.deepcopy(cache)


def cache_bytes(cache: list[Any]) -> int:
    return sum(int(layer.nbytes) for layer in cache)


class SerialStore:
    """One snapshot per salt for the serialized lanes, LRU within the RAM budget.

    The worker looks up and stores; ``peek`` is read on callers' threads (the split a start
    event reports), so the table changes under ``_lock``.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, _SerialEntry] = OrderedDict()
        self.resident_bytes = 0
        self._counters = {name: 0 for name in CALL_COUNTERS}
        self._lock = threading.Lock()

    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def _match(self, salt: int, prompt: list[int]) -> _SerialEntry | None:
        entry = self.entries.get(salt)
        if entry is None or len(entry.tokens) >= len(prompt) or tuple(prompt[: len(entry.tokens)]) != entry.tokens:
            return None
        return entry

    def peek(self, salt: int, prompt: list[int]) -> int:
        """How many leading tokens of ``prompt`` a lookup would restore now (no copy, no counters)."""
        with self._lock:
            entry = self._match(salt, prompt)
            return 0 if entry is None else len(entry.tokens)

    def lookup(self, salt: int, prompt: list[int]) -> tuple[list[Any] | None, int]:
        """A copy of the key's snapshot when it is a prefix of ``prompt`` (leaving a token to feed)."""
        with self._lock:
            entry = self._match(salt, prompt)
            if entry is None:
                self._counters["misses"] += 1
                return None, 0
            self.entries.move_to_end(salt)
            self._counters["hits"] += 1
            self._counters["exact_hits"] += 1
        return clone_cache(entry.cache), len(entry.tokens)

    def store(self, salt: int, tokens: list[int], cache: list[Any]) -> bool:
        """Keep a copy of ``cache`` (holding exactly ``tokens``); False when it does not fit."""
        size = cache_bytes(cache)
        copy = clone_cache(cache) if size <= self.max_bytes else None
        with self._lock:
            old = self.entries.pop(salt, None)
            if old is not None:
                self.resident_bytes -= old.nbytes
            if copy is None or not self._make_room(size):
                self._counters["memory_skips"] += 1
                return False
            self.entries[salt] = _SerialEntry(tuple(tokens), copy, size)
            self.resident_bytes += size
            self._counters["exact_stores"] += 1
        return True

    def _make_room(self, size: int) -> bool:
        while self.entries and self.resident_bytes + size > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.resident_bytes -= old.nbytes
        free = free_ram_bytes()
        return free is None or free - RESERVE_BYTES >= size

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.resident_bytes = 0
