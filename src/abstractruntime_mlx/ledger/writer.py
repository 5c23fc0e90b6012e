"""``ProgressWriter``: record phase events without slowing the caller, and know when they are durable.

``put()`` copies the event and appends it to an in-memory FIFO (no I/O, a few microseconds).
One writer thread, owned by the ``ProgressWriter``, takes everything queued (up to
``max_batch``) and writes it with ``Ledger.append_progress``: one transaction, one
executemany. While a batch is being committed the next one accumulates, and after a first
row the writer lingers up to ``linger_s`` (a full batch, a flush or a stop cuts it short), so
the batch size follows the load and a steady trickle of events costs no thread wake-ups.

Durability contract: when ``flush()`` returns, every event ``put()`` before the call (for the
given run or node, or all of them) is committed. A failed write is never dropped quietly: the
writer stops, keeps the error, and the next ``put()``/``flush()``/``stop()`` raises
``LedgerWriteFailed`` (chained to the cause) with the number of rows that were not written.
Events whose idempotency key is already stored are skipped, not errors.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping
from enum import IntEnum
from typing import Protocol

from .errors import LedgerError, LedgerTimeout, LedgerWriteFailed
from .keys import NodeKey, ProgressEvent, progress_idempotency_key

__all__ = ["DEFAULT_FLUSH_TIMEOUT_S", "ProgressWriter", "WriterState"]

logger = logging.getLogger(__name__)


class ProgressStore(Protocol):
    """What the writer needs of a ledger (``Ledger`` is one)."""

    def append_progress(self, items: Iterable[ProgressEvent]) -> int: ...


DEFAULT_MAX_BATCH = 1000
DEFAULT_IDLE_WAIT_S = 0.25
DEFAULT_LINGER_S = 0.02
DEFAULT_FLUSH_TIMEOUT_S = 30.0
_LIVENESS_POLL_S = 0.5


class WriterState(IntEnum):
    UNSTARTED = 0
    RUNNING = 1
    STOPPING = 2
    STOPPED = 3
    FAILED = 4


def _stop_at_exit(ref: weakref.ReferenceType[ProgressWriter]) -> None:
    writer = ref()
    if writer is None:
        return
    try:
        writer.stop(timeout_s=DEFAULT_FLUSH_TIMEOUT_S)
    except LedgerError:
        logger.error("ledger progress writer could not drain at interpreter exit", exc_info=True)


class ProgressWriter:
    """Batches progress rows into a ``Ledger`` on its own thread.

    Lifecycle: ``start()`` → ``put()``/``flush()`` → ``stop()`` (drains, then joins); also a
    context manager. The thread is a daemon so a forgotten writer cannot hang interpreter
    exit, but it is never ownerless: ``stop()`` is registered with ``atexit`` while it runs,
    which drains the queue at a normal exit.
    """

    def __init__(
        self,
        ledger: ProgressStore,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        linger_s: float = DEFAULT_LINGER_S,
        idle_wait_s: float = DEFAULT_IDLE_WAIT_S,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {max_batch})")
        if linger_s < 0:
            raise ValueError(f"linger_s must be >= 0 (got {linger_s})")
        if idle_wait_s <= 0:
            raise ValueError(f"idle_wait_s must be > 0 (got {idle_wait_s})")
        self._ledger = ledger
        self._max_batch = max_batch
        self._linger_s = linger_s
        self._idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the writer waits here for rows
        self._done = threading.Condition(self._lock)  # flushers wait here for commits
        self._queue: deque[ProgressEvent] = deque()
        self._state = WriterState.UNSTARTED
        self._writer_idle = False  # waiting for a first row: the next put() wakes the writer
        self._lingering = False  # gathering a batch: only a full batch or a flush wakes it
        self._flush_waiters = 0
        self._enqueued = 0  # tickets handed out: the n-th put() is ticket n
        self._dequeued = 0  # tickets taken by the writer (FIFO, so a batch ends at this ticket)
        self._committed = 0  # every ticket <= this is committed
        self._batches = 0
        self._last_by_run: dict[str, int] = {}
        self._last_by_node: dict[tuple[str, str], int] = {}
        self._error: BaseException | None = None
        self._unwritten = 0
        self._thread: threading.Thread | None = None
        self._atexit_hook = functools.partial(_stop_at_exit, weakref.ref(self))

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> ProgressWriter:
        with self._lock:
            if self._state is not WriterState.UNSTARTED:
                raise RuntimeError(f"ProgressWriter cannot start: it is {self._state.name}")
            self._thread = threading.Thread(target=self._run, name="abstractruntime-mlx-ledger-writer", daemon=True)
            self._state = WriterState.RUNNING
        atexit.register(self._atexit_hook)
        self._thread.start()
        return self

    def stop(self, *, timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S) -> None:
        """Write everything queued, then end the thread. Idempotent.

        Raises ``LedgerTimeout`` if the thread is still writing after ``timeout_s`` (call
        ``stop()`` again to keep waiting) and ``LedgerWriteFailed`` if a write failed.
        """
        with self._lock:
            if self._state is WriterState.UNSTARTED:
                self._state = WriterState.STOPPED
                return
            if self._state is WriterState.RUNNING:
                self._state = WriterState.STOPPING
                self._work.notify()
        if not self.join(timeout_s):
            raise LedgerTimeout(
                f"progress writer did not finish within {timeout_s}s; {self.pending} rows not yet committed",
                details={"pending_rows": self.pending},
            )
        atexit.unregister(self._atexit_hook)
        with self._lock:
            if self._state is WriterState.FAILED:
                raise self._failure()
            self._state = WriterState.STOPPED

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the writer thread to end (after ``stop()`` or a failure); True if it has."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def __enter__(self) -> ProgressWriter:
        if self._state is WriterState.UNSTARTED:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- state ----------------------------------------------------------------------

    @property
    def state(self) -> WriterState:
        return self._state

    @property
    def healthy(self) -> bool:
        """Running, its thread alive, and no write has failed."""
        thread = self._thread
        return self._state is WriterState.RUNNING and thread is not None and thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the writer, if one did."""
        return self._error

    @property
    def pending(self) -> int:
        """Rows put but not yet committed."""
        return self._enqueued - self._committed

    @property
    def committed(self) -> int:
        """Rows committed (or found already stored) since start."""
        return self._committed

    @property
    def batches(self) -> int:
        """Transactions committed since start (``committed / batches`` is the mean batch size)."""
        return self._batches

    def _failure(self) -> LedgerWriteFailed:
        failure = LedgerWriteFailed(
            f"ledger progress writer failed ({self._error}); {self._unwritten} rows were not written",
            details={"unwritten_rows": self._unwritten, "committed_rows": self._committed},
        )
        failure.__cause__ = self._error
        return failure

    # -- producer side --------------------------------------------------------------

    def put(self, event: Mapping[str, object], key: NodeKey, *, idempotency_key: str | None = None) -> str:
        """Queue one phase event of node ``key``; returns its idempotency key. Never blocks on I/O.

        ``event`` is copied (shallowly), so the caller may reuse its dict. Keys the event does
        not carry become NULL columns. Without ``idempotency_key`` the default is
        ``progress_idempotency_key(key, event)``.
        """
        item = ProgressEvent(key, dict(event), idempotency_key or progress_idempotency_key(key, event), time.time())
        with self._lock:
            if self._state is not WriterState.RUNNING:
                raise self._not_running()
            self._enqueued += 1
            ticket = self._enqueued
            self._queue.append(item)
            self._last_by_run[key.run_id] = ticket
            self._last_by_node[(key.run_id, key.node_id)] = ticket
            if self._writer_idle or (self._lingering and len(self._queue) >= self._max_batch):
                self._work.notify()
        return item.idempotency_key

    def _not_running(self) -> Exception:
        if self._state is WriterState.FAILED:
            return self._failure()
        return RuntimeError(f"ProgressWriter.put() needs a running writer; it is {self._state.name}")

    def flush(self, target: NodeKey | str | None = None, *, timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S) -> None:
        """Block until every event put so far is committed.

        ``target`` narrows what is waited for: a run id (``str``) or a ``NodeKey`` (its
        ``run_id`` and ``node_id``); None waits for everything. Raises ``LedgerWriteFailed``
        once a write has failed, ``LedgerTimeout`` after ``timeout_s``, and ``LedgerError`` if
        the writer thread is gone.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if target is None:
                wanted = self._enqueued
            elif isinstance(target, NodeKey):
                wanted = self._last_by_node.get((target.run_id, target.node_id), 0)
            else:
                wanted = self._last_by_run.get(target, 0)
            self._flush_waiters += 1
            try:
                self._wait_committed(wanted, deadline, timeout_s)
            finally:
                self._flush_waiters -= 1
            if self._state is WriterState.FAILED:
                raise self._failure()

    def _wait_committed(self, wanted: int, deadline: float, timeout_s: float) -> None:
        # called with the lock held
        if self._committed < wanted and (self._lingering or self._writer_idle):
            self._work.notify()  # no more gathering: a flush is waiting
        while self._committed < wanted and self._state is not WriterState.FAILED:
            thread = self._thread
            if thread is None or not thread.is_alive():
                raise LedgerError(
                    f"ledger progress writer thread is not running ({self._state.name}); "
                    f"{wanted - self._committed} rows cannot be flushed"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LedgerTimeout(
                    f"flush timed out after {timeout_s}s; {wanted - self._committed} rows not yet committed",
                    details={"pending_rows": wanted - self._committed},
                )
            self._done.wait(min(remaining, _LIVENESS_POLL_S))

    # -- writer thread --------------------------------------------------------------

    def _should_linger(self) -> bool:
        return (
            self._linger_s > 0
            and self._state is WriterState.RUNNING
            and self._flush_waiters == 0
            and 0 < len(self._queue) < self._max_batch
        )

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and self._state is WriterState.RUNNING:
                    self._writer_idle = True
                    self._work.wait(self._idle_wait_s)
                    self._writer_idle = False
                if self._should_linger():
                    # Gather a batch: the producers' put() stays a plain append (no wake-up)
                    # until the batch is full; a flush or stop cuts the wait short.
                    self._lingering = True
                    self._work.wait(self._linger_s)
                    self._lingering = False
                if not self._queue:
                    return  # stopping, and everything is written
                count = min(len(self._queue), self._max_batch)
                batch = [self._queue.popleft() for _ in range(count)]
                self._dequeued += count
                last_ticket = self._dequeued
            try:
                self._ledger.append_progress(batch)
            except BaseException as exc:  # noqa: BLE001 - stored and re-raised to the owner
                with self._lock:
                    self._error = exc
                    self._unwritten = len(batch) + len(self._queue)
                    self._state = WriterState.FAILED
                    self._done.notify_all()
                logger.error("ledger progress writer failed; %d rows not written", self._unwritten, exc_info=exc)
                return
            with self._lock:
                self._committed = last_ticket
                self._batches += 1
                if self._committed == self._enqueued:
                    self._last_by_run.clear()
                    self._last_by_node.clear()
                self._done.notify_all()
