"""The models one ``serve`` process holds: loaded on first request, evicted when memory is needed.

Names. A model is known by its name (``serve --model NAME=PATH``, or the path/repo id itself),
its aliases (``--alias ALIAS=NAME``), the base name of its path, and its path. A request may
also name any model the server can load (a repo id in the Hugging Face cache, a directory
under a model root, ``model_roots.py``): it is loaded on demand and listed while resident.
A request that names no model (or ``default``) goes to the only resident model, else to the
first ``--model``. Whatever the spelling, a model has one name (``ResidentModel.name``,
``Lease.name``): its ``--model`` name, or for one loaded by name only its repo id or its
directory relative to its model root (``ModelRoots.name_of``). Answers, metrics, logs and the
ledger use that name, so they hold as many names as the models the server has held.

Memory. Before a load, the model's estimate (``memory.estimate_footprint``: weights + KV
reserve) must fit the budget together with the resident models' estimates. The budget is
``--memory-budget``, else what the machine has: the smaller of its working set and what the
resident models hold plus the memory available now. When it does not fit, idle models are
evicted one at a time, least recently used first; a pinned model (``--pin``, or a provider
handed to ``create_app``) and a model with requests in flight are never evicted. When only
models with requests in flight stand in the way, the load waits for them to go idle (up to
``load_wait_s``). When it still does not fit the load is refused with ``InsufficientMemory``
(507) saying why each resident model stayed; when no wait could have helped, nothing was
evicted for it.

Keep-alive. After its last request a model stays resident for its keep-alive (the request's
``keep_alive``, else the one it was loaded with, else ``serve --keep-alive``; ``None``: until
memory is needed), then the reaper unloads it.

Threads. Everything here runs on the event loop; loads, estimates and unloads run on threads.
One ``asyncio.Lock`` serialises loads and unloads (memory decisions see one state); a request
for a resident model never waits on it. A model is chosen for eviction and marked
``unloading`` in one step (no ``await`` between the check that it is idle and the mark), and a
lease is taken in one step too: either the request holds the model first (it is not chosen)
or the model is unloading (the request waits for it to load again).

Reading it (for metrics): ``models()`` / ``resident()`` return ``ResidentModel`` snapshots (the
provider included), ``counters()`` the per-model load/eviction counts, ``memory()`` the budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Final, Protocol

from ..errors import InsufficientMemory, MLXRuntimeError, ModelNotFound, OwnerBusy, PromptCacheFlushFailed
from ..json_values import JSONObject, JSONValue
from .keep_alive import format_keep_alive
from .memory import DEFAULT_KV_TOKENS_PER_ROW, Footprint, MachineMemory, estimate_footprint, machine_memory
from .model_roots import ModelRoots

log = logging.getLogger(__name__)

REAP_INTERVAL_S: Final = 0.5
"""How often the reaper looks for models whose keep-alive ran out."""
DEFAULT_LOAD_WAIT_S: Final = 30.0
"""How long a load waits for busy models to go idle before it is refused (507)."""


class PooledProvider(Protocol):
    """What the pool needs of a provider: its name and ``unload_model``."""

    @property
    def model(self) -> str: ...

    def unload_model(self, model_name: str | None = None) -> object: ...


Factory = Callable[..., PooledProvider]
"""``factory(source, **options)``: builds the provider of a model."""


class ModelState(StrEnum):
    UNLOADED = "unloaded"  # known (configured, or loadable by name), not resident
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"  # resident, but its engine failed: unload it and load it again
    UNLOADING = "unloading"


class Unset(StrEnum):
    UNSET = "unset"


UNSET: Final = Unset.UNSET
"""``keep_alive`` not given: the model's own keep-alive applies (``None`` means "no idle unload")."""

KeepAlive = float | None | Unset


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model ``serve`` was told about: ``name`` (what clients send), ``source`` (the directory or
    repo id the factory loads), ``options`` (its ``create_llm`` options), ``pinned`` (never evicted)."""

    name: str
    source: str
    options: Mapping[str, object] = field(default_factory=dict)
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """``memory_budget_bytes``: the budget (None: what the machine has); ``keep_alive_s``: the default
    keep-alive (None: no idle unload); ``default_options``: ``create_llm`` options of models loaded
    by name only; ``kv_tokens_per_row``: tokens per batch row the KV reserve counts;
    ``load_wait_s``: how long a load that fits once running requests end waits for them."""

    memory_budget_bytes: int | None = None
    keep_alive_s: float | None = None
    default_options: Mapping[str, object] = field(default_factory=dict)
    kv_tokens_per_row: int = DEFAULT_KV_TOKENS_PER_ROW
    load_wait_s: float = DEFAULT_LOAD_WAIT_S


@dataclass(slots=True)
class ModelCounters:
    """Counts since start, per model name; they only go up."""

    loads: int = 0
    load_failures: int = 0
    evictions: int = 0  # unloaded to make room for another model
    expirations: int = 0  # unloaded when its keep-alive ran out
    unloads: int = 0  # unloaded on request (``/acore/models/unload``) or at shutdown
    refusals: int = 0  # loads refused with ``InsufficientMemory``


@dataclass(frozen=True, slots=True)
class ResidentModel:
    """A snapshot of one model of the pool. ``provider`` is set while it is resident."""

    name: str
    source: str
    state: ModelState
    aliases: tuple[str, ...]
    pinned: bool
    configured: bool
    in_flight: int
    footprint: Footprint | None
    keep_alive_s: float | None
    expires_in_s: float | None
    idle_s: float | None
    provider: PooledProvider | None

    def to_dict(self) -> JSONObject:
        out: JSONObject = {
            "state": self.state.value,
            "aliases": list(self.aliases),
            "pinned": self.pinned,
            "in_flight": self.in_flight,
            "keep_alive": format_keep_alive(self.keep_alive_s),
        }
        if self.footprint is not None:
            out["estimated_bytes"] = dict(self.footprint.to_dict())
        if self.expires_in_s is not None:
            out["expires_in_s"] = round(self.expires_in_s, 3)
        if self.idle_s is not None:
            out["idle_s"] = round(self.idle_s, 3)
        return out


@dataclass(slots=True)
class _Entry:
    name: str
    source: str
    options: dict[str, object]  # the options it is (or was last) loaded with
    pinned: bool
    configured: bool
    keep_alive_s: float | None
    base_options: dict[str, object] = field(default_factory=dict)  # the operator's (serve's) options
    state: ModelState = ModelState.UNLOADED
    provider: PooledProvider | None = None
    owned: bool = False  # the pool made the provider (it unloads it at shutdown)
    footprint: Footprint | None = None
    in_flight: int = 0
    last_used: float | None = None
    expires_at: float | None = None


@dataclass(frozen=True, slots=True)
class Loaded:
    """What ``ModelPool.load`` did: ``loaded_new`` (False: it was resident), the model's ``name``
    (its one name on this server) and its provider."""

    loaded_new: bool
    name: str
    provider: PooledProvider


@dataclass(slots=True)
class Lease:
    """A request's hold on a resident model: while held, the model is not evicted or expired.

    ``release()`` (idempotent) starts the keep-alive clock once the last lease is gone."""

    provider: PooledProvider
    name: str
    _pool: ModelPool
    _entry: _Entry
    _keep_alive: KeepAlive
    _released: bool = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._pool._release(self._entry, self._keep_alive)


class ModelPool:
    """The resident models of one server and the rules that load, keep and evict them."""

    def __init__(
        self,
        *,
        factory: Factory,
        roots: ModelRoots,
        settings: PoolSettings | None = None,
        specs: Sequence[ModelSpec] = (),
        aliases: Mapping[str, str] | None = None,
        instance: PooledProvider | None = None,
        health: Callable[[PooledProvider], Mapping[str, JSONValue] | None] | None = None,
    ) -> None:
        self.roots = roots
        self.settings = settings or PoolSettings()
        self._factory = factory
        self._health = health or provider_health
        self._lock = asyncio.Lock()
        self._went_idle = asyncio.Event()  # set when a model's last request ends (``_make_room`` waits on it)
        self._entries: dict[str, _Entry] = {}
        self._counters: dict[str, ModelCounters] = {}
        self._default: str | None = None  # the first configured model
        for spec in specs:
            if _clean(spec.name) in self._entries:
                raise ValueError(f"model name {spec.name!r} is given twice")
            name = _clean(spec.name)
            self._entries[name] = _Entry(
                name, spec.source, dict(spec.options), spec.pinned, True, self.settings.keep_alive_s, dict(spec.options)
            )
            self._default = self._default or name
        if instance is not None:
            # The caller's provider: served, never evicted or expired, left to the caller at shutdown;
            # once unloaded it is forgotten (the factory never rebuilds it).
            name = str(instance.model)
            entry = self._entries.get(name) or _Entry(name, name, {}, True, False, None)
            entry.provider, entry.state, entry.pinned, entry.last_used = (
                instance,
                ModelState.LOADED,
                True,
                time.monotonic(),
            )
            entry.footprint = self._estimate(entry.source, entry.options)
            self._entries[name] = entry
            self._default = self._default or name
        self.aliases: dict[str, str] = {}
        for alias, target in (aliases or {}).items():
            if _clean(target) not in self._entries:
                raise ValueError(f"alias {alias!r} names {target!r}, which is not a --model of this server")
            if _clean(alias) in self._entries:
                raise ValueError(f"alias {alias!r} is already the name of a model")
            if _clean(alias) in self.aliases:
                raise ValueError(f"alias {alias!r} is given twice")
            self.aliases[_clean(alias)] = _clean(target)

    # --- reading -------------------------------------------------------------------------
    def models(self) -> tuple[ResidentModel, ...]:
        """Every model the pool knows (resident or not); the default model first."""
        now = time.monotonic()
        default = self._default_entry()
        ordered = sorted(self._entries.values(), key=lambda e: e is not default)
        return tuple(self._snapshot(e, now) for e in ordered)

    def resident(self) -> tuple[ResidentModel, ...]:
        """The models that hold memory now (loading, loaded, failed or unloading)."""
        return tuple(m for m in self.models() if m.state is not ModelState.UNLOADED)

    def counters(self) -> dict[str, ModelCounters]:
        """Per-model counts since start (copies)."""
        return {name: replace(c) for name, c in self._counters.items()}

    def memory(self, machine: MachineMemory | None = None) -> JSONObject:
        """The budget, what the resident models' estimates add up to, and the machine's memory
        (``machine``: a reading taken off the event loop, ``memory.machine_memory()``)."""
        machine = machine or machine_memory()
        return {
            "budget_bytes": self._budget(machine),
            "budget_source": "--memory-budget" if self.settings.memory_budget_bytes is not None else machine.source,
            "resident_bytes": self._resident_bytes(None),
            "machine": dict(machine.to_dict()),
        }

    def default_name(self) -> str | None:
        entry = self._default_entry()
        return None if entry is None else entry.name

    def find(self, requested: str | None) -> ResidentModel | None:
        """The model ``requested`` names (``None``/``""``/``default``: the default model), or None.
        Looks at known models only; ``acquire`` and ``load`` also load models by name."""
        entry = self._find(requested)
        return None if entry is None else self._snapshot(entry, time.monotonic())

    # --- using -------------------------------------------------------------------------
    async def acquire(self, requested: str | None, *, keep_alive: KeepAlive = UNSET) -> Lease:
        """A lease on the model ``requested`` names, loaded first when it is not resident.

        ``ModelNotFound`` (404) for a name the server cannot serve; ``InsufficientMemory`` (507)
        when it does not fit. The caller must ``release()`` the lease when its request ends.
        """
        entry = self._find(requested)
        if entry is not None and entry.state is ModelState.LOADED and entry.provider is not None:
            return self._lease(entry, keep_alive)
        async with self._lock:
            entry = await self._entry_for(requested)
            if entry.provider is None or entry.state is not ModelState.LOADED:
                try:
                    await self._load_locked(entry, entry.options)
                except BaseException:
                    self._discard_if_unused(entry)
                    raise
            return self._lease(entry, keep_alive)

    def operator_options(self, requested: str | None) -> Mapping[str, object]:
        """The options the operator gave the model ``requested`` names (``serve``'s flags; for a
        model loaded by name only, the ones every such model gets)."""
        entry = self._find(requested)
        return dict(self.settings.default_options if entry is None else entry.base_options)

    async def load(
        self, requested: str, options: Mapping[str, object] | None, *, keep_alive: KeepAlive = UNSET
    ) -> Loaded:
        """``/acore/models/load``. A resident model is returned as is when ``options`` agree with it
        (the caller's check); a failed one is unloaded and loaded afresh. ``options`` are a client's
        (``load_policy.client_load_options`` checked them): they go over the operator's."""
        async with self._lock:
            entry = await self._entry_for(requested)
            if entry.provider is not None and self._failed(entry):
                await self._unload_locked(entry, reason="unload")
                entry = await self._entry_for(requested)  # a model known by name only was forgotten
            if not isinstance(keep_alive, Unset):
                entry.keep_alive_s = keep_alive
            if entry.provider is not None and entry.state is ModelState.LOADED:
                return Loaded(False, entry.name, entry.provider)
            try:
                if options is None:
                    chosen = entry.options
                else:
                    chosen = {**entry.base_options, **await asyncio.to_thread(self._head_inside_roots, options)}
                await self._load_locked(entry, chosen)
            except BaseException:
                self._discard_if_unused(entry)
                raise
            assert entry.provider is not None
            entry.last_used = time.monotonic()
            self._schedule_expiry(entry)
            return Loaded(True, entry.name, entry.provider)

    async def unload(self, requested: str | None) -> list[str]:
        """Unload the model ``requested`` names (``None``: every resident one); the names unloaded.

        ``ModelNotFound`` for a name that is not resident; ``OwnerBusy`` (409) while it has
        requests in flight; ``PromptCacheFlushFailed`` after unloading when the SSD flush failed."""
        async with self._lock:
            if requested is None:
                targets = [e for e in self._entries.values() if e.provider is not None]
            else:
                entry = self._find(requested)
                if entry is None or entry.provider is None:
                    resident = [e.name for e in self._entries.values() if e.provider is not None]
                    raise ModelNotFound(f"{requested!r} is not loaded here; resident: {resident or 'none'}")
                targets = [entry]
            for entry in targets:
                if entry.in_flight:
                    raise OwnerBusy(
                        f"cannot unload {entry.name}: {entry.in_flight} request(s) "
                        "are still running; close their streams first"
                    )
            done: list[str] = []
            for entry in targets:
                if entry.in_flight:  # leased while an earlier one unloaded: it keeps its model
                    raise OwnerBusy(f"cannot unload {entry.name}: a request started on it; unloaded so far: {done}")
                await self._unload_locked(entry, reason="unload")
                done.append(entry.name)
            return done

    def preload(self, names: Iterable[str]) -> None:
        """Load ``names`` now, before the event loop runs (``serve`` at start): errors are raised
        here, and a model that does not fit is ``InsufficientMemory`` (nothing is evicted)."""
        for requested in names:
            entry = self._find(requested)
            if entry is None:
                raise ModelNotFound(f"{requested!r} is not a --model of this server")
            if entry.provider is not None:
                continue
            footprint = self._estimate(entry.source, entry.options)
            self._check_fits(entry, footprint, machine_memory())
            self._counter(entry.name).loads += 1
            entry.provider = self._factory(entry.source, **entry.options)
            entry.state, entry.owned, entry.footprint, entry.last_used = (
                ModelState.LOADED,
                True,
                footprint,
                time.monotonic(),
            )
            self._schedule_expiry(entry)

    async def reap(self, now: float | None = None) -> list[str]:
        """Unload every idle, unpinned model whose keep-alive ran out by ``now`` (default: now)."""
        moment = time.monotonic() if now is None else now
        if not any(self._expired(e, moment) for e in self._entries.values()):
            return []
        async with self._lock:
            done: list[str] = []
            for entry in list(self._entries.values()):
                if self._expired(entry, moment):
                    with contextlib.suppress(MLXRuntimeError):
                        await self._unload_locked(entry, reason="expired")
                        done.append(entry.name)
            return done

    async def run_reaper(self, interval_s: float = REAP_INTERVAL_S) -> None:
        """Reap forever (the app's lifespan runs it as a task and cancels it at shutdown)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.reap()
            except Exception:  # noqa: BLE001 - a failed reap is logged; the next one retries
                log.exception("keep-alive reaper")

    async def shutdown(self) -> None:
        """Unload every model the pool loaded (a provider handed in stays the caller's)."""
        async with self._lock:
            for entry in list(self._entries.values()):
                if entry.provider is not None and entry.owned:
                    with contextlib.suppress(MLXRuntimeError):
                        await self._unload_locked(entry, reason="unload")

    def unload_all_now(self) -> None:
        """Unload what the pool loaded, synchronously (no event loop runs any more: ``serve``'s exit)."""
        for entry in list(self._entries.values()):
            provider = entry.provider
            if provider is not None and entry.owned:
                with contextlib.suppress(MLXRuntimeError):
                    provider.unload_model(provider.model)
                self._forget(entry, "unload")

    # --- internals ---------------------------------------------------------------------
    def _find(self, requested: str | None) -> _Entry | None:
        name = _clean(requested or "")
        if name in ("", "default"):
            return self._default_entry()
        name = self.aliases.get(name, name)
        entry = self._entries.get(name)
        if entry is not None:
            return entry
        for entry in self._entries.values():
            for known in {
                entry.name,
                entry.source,
                str(entry.provider.model) if entry.provider is not None else entry.name,
            }:
                if name == known or name == Path(known).name or _same_path(name, known):
                    return entry
        return None

    def _default_entry(self) -> _Entry | None:
        resident = [e for e in self._entries.values() if e.provider is not None]
        if len(resident) == 1:
            return resident[0]
        if self._default is not None and self._default in self._entries:
            return self._entries[self._default]
        return resident[0] if resident else None

    async def _entry_for(self, requested: str | None) -> _Entry:
        """The entry ``requested`` names, made for a loadable name (inside the model roots)."""
        entry = self._find(requested)
        if entry is not None:
            return entry
        if not _clean(requested or "") or _clean(requested or "") == "default":
            raise ModelNotFound("no model is loaded on this server; POST /acore/models/load first")
        name = _clean(requested or "")
        source = await asyncio.to_thread(self.roots.resolve, name)
        entry = self._find(source)
        if entry is not None:
            return entry
        name = self._canonical_name(source)
        options = dict(self.settings.default_options)
        entry = _Entry(name, source, options, False, False, self.settings.keep_alive_s, dict(options))
        self._entries[name] = entry
        return entry

    def _canonical_name(self, source: str) -> str:
        """The one name of a model loaded by name only, however the request spelled it: its repo id,
        or its directory relative to the model root holding it (the source when that name is taken)."""
        name = self.roots.name_of(source)
        return name if name not in self._entries and name not in self.aliases else source

    def _discard_if_unused(self, entry: _Entry) -> None:
        """Forget a model known only by the request that failed to load it."""
        if not entry.configured and entry.provider is None and self._entries.get(entry.name) is entry:
            del self._entries[entry.name]

    def _head_inside_roots(self, options: Mapping[str, object]) -> dict[str, object]:
        """A client's ``options`` with an ``mtp_head`` directory resolved inside the model roots."""
        head = options.get("mtp_head")
        if isinstance(head, str):
            return {**options, "mtp_head": self.roots.resolve(head, field="options.mtp_head")}
        return dict(options)

    def _lease(self, entry: _Entry, keep_alive: KeepAlive) -> Lease:
        assert entry.provider is not None
        entry.in_flight += 1
        entry.expires_at = None
        return Lease(entry.provider, entry.name, self, entry, keep_alive)

    def _release(self, entry: _Entry, keep_alive: KeepAlive) -> None:
        entry.in_flight = max(0, entry.in_flight - 1)
        entry.last_used = time.monotonic()
        if not isinstance(keep_alive, Unset):
            entry.keep_alive_s = keep_alive
        if entry.in_flight == 0:
            self._schedule_expiry(entry)
            self._went_idle.set()  # a load waiting for room looks again

    def _schedule_expiry(self, entry: _Entry) -> None:
        if entry.pinned or not entry.owned or entry.keep_alive_s is None or entry.last_used is None:
            entry.expires_at = None
        else:
            entry.expires_at = entry.last_used + entry.keep_alive_s

    def _expired(self, entry: _Entry, now: float) -> bool:
        return (
            entry.state is ModelState.LOADED
            and entry.in_flight == 0
            and entry.expires_at is not None
            and entry.expires_at <= now
        )

    async def _load_locked(self, entry: _Entry, options: Mapping[str, object]) -> None:
        footprint = await asyncio.to_thread(self._estimate, entry.source, options)
        await self._make_room(entry, footprint)
        entry.state = ModelState.LOADING
        counter = self._counter(entry.name)
        try:
            provider = await asyncio.to_thread(self._factory, entry.source, **options)
        except BaseException:
            counter.load_failures += 1
            entry.state = ModelState.UNLOADED
            raise
        counter.loads += 1
        entry.provider, entry.owned, entry.footprint, entry.options = provider, True, footprint, dict(options)
        entry.state = ModelState.LOADED
        entry.last_used = time.monotonic()
        log.info("loaded %s (estimated %d bytes)", entry.name, footprint.total_bytes)

    async def _make_room(self, entry: _Entry, footprint: Footprint) -> None:
        """Evict idle, unpinned models (least recently used first) until ``footprint`` fits.

        Each victim is chosen and marked ``unloading`` in one step of the event loop, with no
        ``await`` between: a request that leased a model before that step keeps it (it is no longer
        idle, another victim is chosen), and one that comes after it does not join it. When only
        models with requests in flight stand in the way, the load waits (``load_wait_s``) for them
        to go idle. A load that cannot fit even then is refused before anything is evicted."""
        machine = await asyncio.to_thread(machine_memory)
        budget = self._budget(machine)
        need = footprint.total_bytes
        deadline = time.monotonic() + self.settings.load_wait_s
        refused: set[str] = set()  # models whose provider would not unload (owner_busy)
        while need + self._resident_bytes(entry) > budget:
            if need + self._kept_bytes(entry, refused) > budget:
                raise self._refusal(entry, footprint, budget, refused)
            victim = self._next_victim(entry, refused)
            if victim is None:
                if not await self._wait_for_idle(deadline):
                    raise self._refusal(entry, footprint, budget, refused)
                continue
            try:
                await self._unload_locked(victim, reason="evicted")
            except PromptCacheFlushFailed as exc:
                log.warning("evicted %s; its prompt-cache flush failed: %s", victim.name, exc)
            except MLXRuntimeError as exc:  # owner_busy: a request outside the pool holds the engine
                log.warning("could not evict %s: %s", victim.name, exc)
                refused.add(victim.name)

    def _next_victim(self, entry: _Entry, refused: set[str]) -> _Entry | None:
        """The idle model to evict first: a failed one, else the least recently used."""
        idle = [e for e in self._entries.values() if e is not entry and e.name not in refused and self._evictable(e)]
        return min(idle, key=lambda e: (not self._failed(e), e.last_used or 0.0), default=None)

    def _kept_bytes(self, entry: _Entry, refused: set[str]) -> int:
        """What stays resident however long the load waits: pinned models, the caller's provider,
        and the models that refused to unload."""
        return sum(
            e.footprint.total_bytes
            for e in self._entries.values()
            if e is not entry
            and e.provider is not None
            and e.footprint is not None
            and (e.pinned or not e.owned or e.name in refused)
        )

    async def _wait_for_idle(self, deadline: float) -> bool:
        """Wait until a model's last request ends (True), or ``deadline`` (False)."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        self._went_idle.clear()  # no await since the caller looked: no release is missed
        try:
            await asyncio.wait_for(self._went_idle.wait(), left)
        except TimeoutError:
            return False
        return True

    def _check_fits(self, entry: _Entry, footprint: Footprint, machine: MachineMemory) -> None:
        budget = self._budget(machine)
        if footprint.total_bytes + self._resident_bytes(entry) > budget:
            raise self._refusal(entry, footprint, budget, set())

    def _refusal(self, entry: _Entry, footprint: Footprint, budget: int, refused: set[str]) -> InsufficientMemory:
        """The 507 of a load that does not fit, naming each resident model and why it stays."""
        self._counter(entry.name).refusals += 1
        resident = self._resident_bytes(entry)
        larger = footprint.total_bytes > budget
        kept: list[JSONValue] = [
            {
                "model": e.name,
                "bytes": e.footprint.total_bytes if e.footprint else 0,
                "reason": self._kept_reason(e, refused),
            }
            for e in self._entries.values()
            if e is not entry and e.provider is not None
        ]
        needs = (
            f"{entry.name} needs about {_mib(footprint.total_bytes)} (weights "
            f"{_mib(footprint.weights_bytes)} + KV reserve {_mib(footprint.kv_bytes)})"
        )
        if larger:
            message = (
                f"{needs}, more than the whole {_mib(budget)} budget; raise "
                "--memory-budget or lower --kv-reserve-tokens"
            )
        else:
            message = (
                f"{needs}, but {_mib(budget - resident)} of the {_mib(budget)} budget is free "
                "and the other models stay (pinned or still running requests); unload a "
                "model, wait for running requests, or raise --memory-budget"
            )
        return InsufficientMemory(
            message,
            details={
                "model": entry.name,
                "reason": "larger_than_budget" if larger else "models_in_use",
                "needed_bytes": footprint.total_bytes,
                "budget_bytes": budget,
                "resident_bytes": resident,
                "kept": kept,
            },
        )

    @staticmethod
    def _kept_reason(entry: _Entry, refused: set[str]) -> str:
        """Why a resident model was not evicted: ``pinned``, ``in_flight``, ``loading`` / ``unloading``,
        ``busy`` (its engine refused to unload), else ``idle`` (evicting it would not have been enough)."""
        if entry.pinned or not entry.owned:
            return "pinned"
        if entry.in_flight:
            return "in_flight"
        if entry.state in (ModelState.LOADING, ModelState.UNLOADING):
            return entry.state.value
        return "busy" if entry.name in refused else "idle"

    def _failed(self, entry: _Entry) -> bool:
        """Whether the resident model's engine failed (it serves nothing until loaded again)."""
        if entry.provider is None:
            return False
        health = self._health(entry.provider)
        return health is not None and health.get("state") == "failed"

    def _evictable(self, entry: _Entry) -> bool:
        return (
            entry.provider is not None
            and entry.owned
            and not entry.pinned
            and entry.in_flight == 0
            and entry.state is ModelState.LOADED
        )

    async def _unload_locked(self, entry: _Entry, *, reason: str) -> None:
        """Unload ``entry``'s provider; it stays resident when the provider refuses (``owner_busy``)."""
        provider = entry.provider
        if provider is None:
            return
        before = entry.state
        entry.state = ModelState.UNLOADING
        try:
            await asyncio.to_thread(provider.unload_model, provider.model)
        except PromptCacheFlushFailed:
            self._forget(entry, reason)
            raise
        except BaseException:
            entry.state = before
            raise
        self._forget(entry, reason)

    def _forget(self, entry: _Entry, reason: str) -> None:
        counter = self._counter(entry.name)
        if reason == "evicted":
            counter.evictions += 1
        elif reason == "expired":
            counter.expirations += 1
        else:
            counter.unloads += 1
        log.info("unloaded %s (%s)", entry.name, reason)
        entry.provider, entry.owned, entry.state, entry.expires_at = None, False, ModelState.UNLOADED, None
        entry.in_flight = 0
        if not entry.configured:
            self._entries.pop(entry.name, None)

    def _estimate(self, source: str, options: Mapping[str, object]) -> Footprint:
        from ..artifacts import resolve_model_path
        from ..engine.api import EngineConfig

        try:
            path = resolve_model_path(source)
        except MLXRuntimeError:
            path = Path(source)
        width = (
            options.get("mlx_max_batch_size", EngineConfig().max_batch_size)
            if options.get("mlx_batching", False)
            else 1
        )
        rows = width if isinstance(width, int) and not isinstance(width, bool) and width > 0 else 1
        return estimate_footprint(path, max_batch_size=rows, kv_tokens_per_row=self.settings.kv_tokens_per_row)

    def _budget(self, machine: MachineMemory) -> int:
        if self.settings.memory_budget_bytes is not None:
            return self.settings.memory_budget_bytes
        held = self._resident_bytes(None)
        limits = [
            v
            for v in (
                machine.working_set_bytes,
                None if machine.available_bytes is None else held + machine.available_bytes,
            )
            if v is not None
        ]
        return min(limits) if limits else 1 << 62

    def _resident_bytes(self, excluding: _Entry | None) -> int:
        return sum(
            e.footprint.total_bytes
            for e in self._entries.values()
            if e is not excluding and e.provider is not None and e.footprint is not None
        )

    def _counter(self, name: str) -> ModelCounters:
        return self._counters.setdefault(name, ModelCounters())

    def _snapshot(self, entry: _Entry, now: float) -> ResidentModel:
        state = ModelState.FAILED if entry.state is ModelState.LOADED and self._failed(entry) else entry.state
        return ResidentModel(
            name=entry.name,
            source=entry.source,
            state=state,
            aliases=tuple(a for a, t in self.aliases.items() if t == entry.name),
            pinned=entry.pinned,
            configured=entry.configured,
            in_flight=entry.in_flight,
            footprint=entry.footprint,
            keep_alive_s=entry.keep_alive_s,
            expires_in_s=None if entry.expires_at is None else max(0.0, entry.expires_at - now),
            idle_s=None if entry.last_used is None or entry.in_flight else now - entry.last_used,
            provider=entry.provider,
        )


def provider_health(provider: object) -> Mapping[str, JSONValue] | None:
    """The provider's ``health()`` (``{"state", "error"?}``), or None when it has none."""
    probe = getattr(provider, "health", None)
    if not callable(probe):
        return None
    answer = probe()
    return answer if isinstance(answer, Mapping) else None


def _clean(name: str) -> str:
    text = name.strip()
    return text[4:] if text.lower().startswith("mlx/") else text


def _same_path(a: str, b: str) -> bool:
    try:
        pa, pb = Path(a), Path(b)
        return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
    except (OSError, ValueError):
        return False


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
