"""Sibling-branch batching: run predictable later ``llm_call`` branches ahead of the runtime.

AbstractRuntime's ``parallel``/``sequence`` node runs its branches one after another on the
tick thread. When the handler runs the first ``llm_call`` branch of such a node, it also
submits the later ``llm_call`` branches whose requests are fully known from the flow
(``prediction``) on background threads, so all of them meet in one engine batch. When the
runtime reaches a sibling, its real request is prepared and compared with the prefetched one
by fingerprint (the whole typed request, the resolved controls and the client); only an
identical request takes the precomputed result (and its buffered progress rows, written then
under the sibling's own step with their original timestamps). Anything else is cancelled and
called again. See docs/runtime-plugin.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from ...nodes import LLMNode, NodeResult, PreparedCall, ProgressRoute

__all__ = ["PrefetchStats", "SiblingPrefetcher"]

log = logging.getLogger(__name__)

DEFAULT_PREFETCH_WORKERS: Final = 32
DEFAULT_PREFETCH_TTL_S: Final = 600.0
DEFAULT_MAX_PREFETCHES: Final = 256


@dataclass(slots=True)
class _Prefetch:
    run_id: str
    node_id: str
    trigger_node: str
    prepared: PreparedCall
    route: ProgressRoute
    cancel_event: threading.Event
    launched_at: float
    future: Future[NodeResult] | None = None

    def wait(self, cancel_event: threading.Event | None) -> NodeResult:
        assert self.future is not None
        while True:
            try:
                return self.future.result(timeout=0.25)
            except FutureTimeout:
                if cancel_event is not None and cancel_event.is_set():
                    self.cancel_event.set()  # the result comes back as cancelled soon after


@dataclass(slots=True)
class PrefetchStats:
    launched: int = 0
    used: int = 0
    mismatched: int = 0
    failed: int = 0
    unstarted: int = 0
    throttled: int = 0
    discarded: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "launched": self.launched,
            "used": self.used,
            "mismatched": self.mismatched,
            "failed": self.failed,
            "unstarted": self.unstarted,
            "throttled": self.throttled,
            "discarded": self.discarded,
        }


class SiblingPrefetcher:
    """Runs predicted sibling calls ahead of the runtime and hands them over by fingerprint.

    Owns one thread pool (``max_workers`` calls in flight); ``close()`` cancels what is left
    and joins it. Entries of a run that never claims them are dropped by ``discard_run``
    (``run_flow`` calls it when a run comes to rest) or after ``ttl_s``.
    """

    def __init__(
        self,
        node: LLMNode,
        *,
        max_workers: int = DEFAULT_PREFETCH_WORKERS,
        max_pending: int = DEFAULT_MAX_PREFETCHES,
        ttl_s: float = DEFAULT_PREFETCH_TTL_S,
    ) -> None:
        self._node = node
        self._max_workers = max_workers
        self._max_pending = max_pending
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], _Prefetch] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._active_runs = 0
        self._active_calls = 0
        self.stats = PrefetchStats()

    @contextmanager
    def run_in_progress(self) -> Iterator[None]:
        """Mark a run as ticking (``run_flow`` does), so prefetches leave it room in the engine."""
        with self._lock:
            self._active_runs += 1
        try:
            yield
        finally:
            with self._lock:
                self._active_runs -= 1

    @contextmanager
    def call_in_progress(self) -> Iterator[None]:
        """Mark a handler call in progress (the handler does)."""
        with self._lock:
            self._active_calls += 1
        try:
            yield
        finally:
            with self._lock:
                self._active_calls -= 1

    def note(self, outcome: str) -> None:
        """Count a claim outcome: ``used``, ``mismatched``, ``failed`` or ``unstarted``."""
        with self._lock:
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)

    def has(self, run_id: str, node_id: str) -> bool:
        with self._lock:
            return (run_id, node_id) in self._pending

    def launch(
        self, run_id: str, trigger_node: str, calls: list[tuple[str, PreparedCall]], *, buffer: bool
    ) -> list[str]:
        """Start ``calls`` (``(node_id, prepared)``) for ``run_id``; returns the node ids started.

        Prefetches only take what the engine can spare: its free batch slots and queue places,
        minus the prefetches already in flight, minus one place per run or call in progress
        (each may submit one request of its own at any moment), halved (the rest stays for
        other users of the engine). So a burst of prefetches does not make a real call fail
        with ``QueueFull``. Engines that do not report their load (remote) get at most
        ``max_workers`` prefetches in flight.
        """
        started: list[str] = []
        budgets: dict[str, int] = {}
        with self._lock:
            if self._closed:
                return started
            self._expire_locked()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="abstractruntime-mlx-sibling")
            in_flight = sum(1 for e in self._pending.values() if e.future is not None and not e.future.done())
            for node_id, prepared in calls:
                key = (run_id, node_id)
                if key in self._pending or len(self._pending) >= self._max_pending or in_flight >= self._max_workers:
                    continue
                if prepared.client_id not in budgets:
                    headroom = self._node.headroom(prepared)
                    # In-flight prefetches may not have reached the engine yet: count them as
                    # taken. Each run/call in progress may submit a request of its own.
                    reserve = max(self._active_runs, self._active_calls)
                    budgets[prepared.client_id] = (
                        self._max_workers if headroom is None else max(0, headroom - in_flight - reserve) // 2
                    )
                if budgets[prepared.client_id] <= 0:
                    self.stats.throttled += 1
                    continue
                budgets[prepared.client_id] -= 1
                in_flight += 1
                entry = _Prefetch(
                    run_id=run_id,
                    node_id=node_id,
                    trigger_node=trigger_node,
                    prepared=prepared,
                    route=ProgressRoute(buffer=buffer),
                    cancel_event=threading.Event(),
                    launched_at=time.perf_counter(),
                )
                entry.future = self._pool.submit(
                    self._node.execute, prepared, route=entry.route, cancel_event=entry.cancel_event
                )
                self._pending[key] = entry
                self.stats.launched += 1
                started.append(node_id)
        return started

    def take(self, run_id: str, node_id: str) -> _Prefetch | None:
        with self._lock:
            return self._pending.pop((run_id, node_id), None)

    def discard_run(self, run_id: str) -> int:
        """Cancel and forget every unclaimed prefetch of ``run_id``."""
        with self._lock:
            keys = [k for k in self._pending if k[0] == run_id]
            entries = [self._pending.pop(k) for k in keys]
            self.stats.discarded += len(entries)
        for entry in entries:
            entry.cancel_event.set()
        return len(entries)

    def _expire_locked(self) -> None:
        now = time.perf_counter()
        for key in [k for k, e in self._pending.items() if now - e.launched_at > self._ttl_s]:
            entry = self._pending.pop(key)
            entry.cancel_event.set()
            self.stats.discarded += 1

    def close(self) -> None:
        """Cancel every unclaimed prefetch and join the pool (cancelled calls end quickly)."""
        with self._lock:
            self._closed = True
            entries = list(self._pending.values())
            self._pending.clear()
            pool, self._pool = self._pool, None
        for entry in entries:
            entry.cancel_event.set()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
