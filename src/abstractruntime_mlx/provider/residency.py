"""Resident models: providers sharing a target (and head) share one engine and its weights.

The registry lock guards the table only, never a load: the first provider of a model puts
a loading entry in the table and loads outside the lock; providers of the same model wait
on that entry, and every other model (loads, releases, garbage-collection retires) goes on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.api import CacheOptions, Engine, EngineConfig, Upstream, load_model
from ..errors import OwnerBusy, ResidencyConflict

ResidentKey = tuple[str, str | None, str]


@dataclass(slots=True)
class Resident:
    key: ResidentKey
    options: dict[str, Any]
    engine: Engine
    leases: set[int] = field(default_factory=set)
    loaded: threading.Event = field(default_factory=threading.Event)
    load_error: BaseException | None = None


_LOCK = threading.Lock()
_RESIDENTS: dict[ResidentKey, Resident] = {}


def acquire(
    path: Path,
    *,
    head: Path | None,
    upstream: Upstream,
    head_source: Path | None,
    load_head: bool,
    options: dict[str, Any],
    config: EngineConfig,
    lease: int,
    cache_options: CacheOptions | None = None,
) -> Resident:
    """Attach ``lease`` to the resident engine for ``path``, loading it on first use.

    ``head`` is the head that identifies the residency (part of its key: a target pairs with
    one head, whether it was named with ``mtp_head=`` or found by the companion lookup);
    ``head_source`` is the local MTP head the target attaches (None: no head), loaded with the target when
    ``load_head``, else attached on first use. Whether the head was loaded up front is not
    part of the residency: providers with different speculation defaults share one engine.
    """
    key = (str(path.resolve()), str(head.resolve()) if head else None, upstream)
    while True:
        with _LOCK:
            resident = _RESIDENTS.get(key)
            if resident is None or (resident.loaded.is_set() and not resident.engine.alive):
                resident = _new_resident(
                    key, path, upstream, head_source, load_head, options, config, lease, cache_options
                )
                _RESIDENTS[key] = resident
                break
            _check_options(resident, path, options)
            if resident.loaded.is_set():
                resident.leases.add(lease)
                return resident
        # Another provider is loading this model: wait for it outside the lock.
        resident.loaded.wait()
        if resident.load_error is not None:
            raise resident.load_error
    try:
        resident.engine.start()
    except BaseException as exc:
        resident.load_error = exc
        with _LOCK:
            if _RESIDENTS.get(key) is resident:
                _RESIDENTS.pop(key, None)
        raise
    finally:
        resident.loaded.set()
    return resident


def _new_resident(
    key: ResidentKey,
    path: Path,
    upstream: Upstream,
    head_source: Path | None,
    load_head: bool,
    options: dict[str, Any],
    config: EngineConfig,
    lease: int,
    cache_options: CacheOptions | None,
) -> Resident:
    engine = Engine(
        lambda: load_model(path, upstream=upstream, head_source=head_source, load_head=load_head),
        config,
        name=path.name,
        cache_options=cache_options,
    )
    return Resident(key=key, options=dict(options), engine=engine, leases={lease})


def _check_options(resident: Resident, path: Path, options: dict[str, Any]) -> None:
    if resident.options != options:
        raise ResidencyConflict(
            f"{path} is already resident with different execution/cache settings "
            f"({resident.options}); use the same options or unload it first"
        )


UNLOAD_SETTLE_S = 5.0
"""How long an unload waits for cancelled requests (streams just closed) to leave the engine."""

UNLOAD_STOP_S = 10.0
"""How long the last unload waits for the worker to stop (finish its step, flush the SSD tier)."""


def release(resident: Resident, lease: int, *, force_check: bool = True) -> bool:
    """Drop ``lease``; the last lease stops the engine. Refused while this owner has live requests.

    Requests already cancelled (a stream closed just before) are waited for, up to
    ``UNLOAD_SETTLE_S``; open streams make it ``OwnerBusy`` at once. The last lease is given
    up only once the worker has stopped: a worker still running after ``UNLOAD_STOP_S`` is
    ``OwnerBusy`` with the lease kept, so a later call retries. A prompt-cache flush that
    failed as the worker stopped is raised after the lease is gone (``PromptCacheFlushFailed``).
    """
    if force_check:
        resident.engine.settle(UNLOAD_SETTLE_S)
    with _LOCK:
        if lease not in resident.leases:
            return False
        if force_check and resident.engine.active_count:
            raise OwnerBusy(
                f"cannot unload {Path(resident.key[0]).name}: {resident.engine.active_count} request(s) are "
                "still queued or running; close their streams first"
            )
        if resident.leases != {lease}:
            resident.leases.discard(lease)
            return False
        # The last holder: no new provider may join an engine about to stop.
        if _RESIDENTS.get(resident.key) is resident:
            _RESIDENTS.pop(resident.key, None)
    if not resident.engine.stop(UNLOAD_STOP_S):
        raise OwnerBusy(
            f"cannot unload {Path(resident.key[0]).name} yet: its worker did not stop within {UNLOAD_STOP_S:g} s "
            "(it is finishing a step or flushing the prompt cache); the model stays owned by this provider, "
            "call unload_model again",
            details={"reason": "worker_stop_timeout", "timeout_s": UNLOAD_STOP_S},
        )
    with _LOCK:
        resident.leases.discard(lease)
    if resident.engine.close_error is not None:
        raise resident.engine.close_error
    return True


def holds(resident: Resident, lease: int) -> bool:
    """Whether ``lease`` still holds ``resident`` (an unload that raised may have released it)."""
    with _LOCK:
        return lease in resident.leases


def retire(resident: Resident, lease: int) -> None:
    """Garbage-collection path: never blocks on an in-flight request."""
    with _LOCK:
        resident.leases.discard(lease)
        last = not resident.leases
        if last and _RESIDENTS.get(resident.key) is resident:
            _RESIDENTS.pop(resident.key, None)
    if last:
        resident.engine.retire()


def resident_count() -> int:
    with _LOCK:
        return sum(1 for r in _RESIDENTS.values() if r.loaded.is_set() and r.engine.alive)
