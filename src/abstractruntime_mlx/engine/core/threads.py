"""Worker threads that outlive their engine.

A Python thread that ran MLX work and then exits leaves MLX's per-thread state to be torn
down at interpreter exit, which aborts the process ("terminate called without an active
exception", exit code 134) when sampled or batched work ran on it. So a worker thread never
exits: when its engine stops, it parks and serves the next engine that starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class WorkerHandle:
    """One engine's turn on a worker thread."""

    name: str
    thread: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def is_alive(self) -> bool:
        return self.thread is not None and not self.done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self.done.wait(timeout)

    def is_current(self) -> bool:
        return self.thread is threading.current_thread() and not self.done.is_set()


class _Worker:
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.job: tuple[Callable[[], None], WorkerHandle] | None = None
        self.wake = threading.Condition()
        self.thread = threading.Thread(target=self._serve, name="abstractruntime-mlx-worker", daemon=True)

    def _serve(self) -> None:
        while True:
            with self.wake:
                while self.job is None:
                    self.wake.wait()
                fn, handle = self.job
            self.thread.name = handle.name
            try:
                fn()
            finally:
                with self.wake:
                    self.job = None
                self.thread.name = "abstractruntime-mlx-worker (parked)"
                handle.done.set()
                self.pool._park(self)


class WorkerPool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []

    def run(self, fn: Callable[[], None], name: str) -> WorkerHandle:
        handle = WorkerHandle(name)
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker(self)
            worker.thread.start()
        handle.thread = worker.thread
        with worker.wake:
            worker.job = (fn, handle)
            worker.wake.notify()
        return handle

    def _park(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)


POOL = WorkerPool()
