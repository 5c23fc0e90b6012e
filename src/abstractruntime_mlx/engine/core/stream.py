"""Reading one request back on the caller's thread (sync) or event loop (async)."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Protocol

from ...errors import EngineCrashed
from .request import END_OF_STREAM, EngineRequest, Outcome, PrefillObservation, TokenDelta

PrefillCallback = Callable[[PrefillObservation], object]


class Owner(Protocol):
    """What a stream needs of the engine that runs its request."""

    def cancel(self, request: EngineRequest) -> None: ...

    def _worker_alive(self) -> bool: ...


_POLL_S = 0.05
_IDLE_WAIT_S = 0.5


class RequestStream:
    """Iterate a request's ``TokenDelta`` outputs on the caller's thread.

    Prefill observations go to ``on_prefill_progress`` on the iterating thread (the seed's
    ``NativeRuntime.stream(request, on_prefill_progress=...)``) and are never yielded; without
    a callback they are dropped. ``outcome`` is set once iteration ends. Closing the stream
    cancels the request.
    """

    def __init__(
        self, engine: Owner, request: EngineRequest, *, on_prefill_progress: PrefillCallback | None = None
    ) -> None:
        self.engine = engine
        self.request = request
        self.on_prefill_progress = on_prefill_progress
        self.outcome: Outcome | None = None

    def _observed(self, item: object) -> bool:
        """True when ``item`` is a prefill observation (handed to the callback, not yielded)."""
        if not isinstance(item, PrefillObservation):
            return False
        if self.on_prefill_progress is not None:
            self.on_prefill_progress(item)
        return True

    def __iter__(self) -> Iterator[TokenDelta]:
        request = self.request
        try:
            while True:
                try:
                    item = request.outputs.get(timeout=_POLL_S)
                except queue.Empty:
                    if not self.engine._worker_alive() and not request.done.is_set():
                        raise EngineCrashed("the MLX worker stopped while the request was live") from None
                    continue
                if item is END_OF_STREAM:
                    break
                if self._observed(item):
                    continue
                yield item
            self._finish()
        finally:
            if not request.done.is_set():
                self.engine.cancel(request)

    def _finish(self) -> None:
        outcome = self.request.outcome
        assert outcome is not None
        self.outcome = outcome
        if outcome.error is not None:
            raise outcome.error

    def close(self) -> None:
        if not self.request.done.is_set():
            self.engine.cancel(self.request)

    async def aiter(self) -> AsyncGenerator[TokenDelta, None]:
        """Async twin of ``__iter__``: wakes on the worker's notification, never blocks the loop."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        request = self.request

        def wake_up() -> None:
            loop.call_soon_threadsafe(wake.set)

        request.waker = wake_up
        try:
            while True:
                try:
                    item = request.outputs.get_nowait()
                except queue.Empty:
                    if not self.engine._worker_alive() and not request.done.is_set():
                        raise EngineCrashed("the MLX worker stopped while the request was live") from None
                    wake.clear()
                    if request.outputs.empty():
                        try:
                            await asyncio.wait_for(wake.wait(), timeout=_IDLE_WAIT_S)
                        except TimeoutError:
                            pass
                    continue
                if item is END_OF_STREAM:
                    break
                if self._observed(item):
                    continue
                yield item
            self._finish()
        finally:
            request.waker = None
            if not request.done.is_set():
                self.engine.cancel(request)
