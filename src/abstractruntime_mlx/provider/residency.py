"""Resident models: providers sharing a target (and head) share one engine and its weights."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.loop import Engine, EngineConfig
from ..engine.model import load_model
from ..engine.prefix_cache import CacheOptions
from ..errors import OwnerBusy, ResidencyConflict


@dataclass(slots=True)
class Resident:
    key: tuple[str, str | None, str]
    options: dict[str, Any]
    engine: Engine
    leases: set[int] = field(default_factory=set)


_LOCK = threading.Lock()
_RESIDENTS: dict[tuple[str, str | None, str], Resident] = {}


def acquire(
    path: Path,
    *,
    head: Path | None,
    lane: str,
    load_drafter: bool,
    options: dict[str, Any],
    config: EngineConfig,
    lease: int,
    cache_options: CacheOptions | None = None,
) -> Resident:
    """Attach ``lease`` to the resident engine for ``path``, loading it on first use."""
    key = (str(path.resolve()), str(head.resolve()) if head else None, lane)
    with _LOCK:
        resident = _RESIDENTS.get(key)
        if resident is not None and resident.engine.alive:
            if resident.options != options:
                raise ResidencyConflict(
                    f"{path} is already resident with different execution/cache settings "
                    f"({resident.options}); use the same options or unload it first"
                )
            resident.leases.add(lease)
            return resident
        engine = Engine(
            lambda: load_model(path, lane=lane, head=head, load_drafter=load_drafter),
            config,
            name=path.name,
            cache_options=cache_options,
        )
        engine.start()
        resident = Resident(key=key, options=dict(options), engine=engine, leases={lease})
        _RESIDENTS[key] = resident
        return resident


UNLOAD_SETTLE_S = 5.0
"""How long an unload waits for cancelled requests (streams just closed) to leave the engine."""


def release(resident: Resident, lease: int, *, force_check: bool = True) -> bool:
    """Drop ``lease``; the last lease stops the engine. Refused while this owner has live requests.

    Requests already cancelled (a stream closed just before) are waited for, up to
    ``UNLOAD_SETTLE_S``; open streams make it ``OwnerBusy`` at once.
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
        resident.leases.discard(lease)
        last = not resident.leases
        if last:
            _RESIDENTS.pop(resident.key, None)
    if last:
        resident.engine.stop()
    return last


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
        return sum(1 for r in _RESIDENTS.values() if r.engine.alive)
