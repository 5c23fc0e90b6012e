"""Server-sent events: framing, and the pump that feeds one provider call into a response.

``ProviderPump`` runs one ``agenerate`` call as an asyncio task and merges what it produces
(stream chunks, or the one result) with the provider's phase events (``on_progress``, called
on any thread) into one queue of typed items, in arrival order. Chunks are bounded
(``max_pending``) so a slow HTTP client slows the pump, and the engine's own backpressure
(``StreamBackpressure``) still applies. An ``observer`` (``observe.CallObserver``: the metrics,
the serve ledger) sees the same call: phase events, chunks or the result, then how it ended.
``close()`` is synchronous and idempotent: it sets the request's ``cancel_event`` (the engine
frees the slot at its next step) and cancels the task, whose ``finally`` closes the provider
stream.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..errors import RequestCancelled, UpstreamError
from ..json_values import JSONObject, JSONValue
from ..request import ProgressSink
from ..results import GenerationChunk, GenerationResult
from .observe import CallObserver
from .wire import error_payload

DONE: Final = "data: [DONE]\n\n"
DEFAULT_MAX_PENDING: Final = 64
SSE_HEADERS: Final = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def data_event(payload: Mapping[str, JSONValue]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def named_event(name: str, payload: Mapping[str, JSONValue]) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


def error_records(error: BaseException) -> list[str]:
    """An error after the first byte of an OpenAI-style stream: ``data: {"error": ...}``, then ``[DONE]``."""
    return [data_event(error_payload(error)[1]), DONE]


# --------------------------------------------------------------------------- pump items


@dataclass(slots=True)
class ChunkItem:
    chunk: GenerationChunk


@dataclass(slots=True)
class ResultItem:
    result: GenerationResult


@dataclass(slots=True)
class ProgressItem:
    event: JSONObject


@dataclass(slots=True)
class FailureItem:
    error: BaseException


@dataclass(slots=True)
class EndItem:
    pass


PumpItem = ChunkItem | ResultItem | ProgressItem | FailureItem | EndItem
ProviderCall = Callable[[ProgressSink | None], Awaitable[GenerationResult | AsyncIterator[GenerationChunk]]]
"""Starts the provider call with this progress sink; awaited, it gives the result or the chunk stream."""


class ProviderPump:
    """One provider call, its outputs and its phase events, as one ordered queue.

    ``call(on_progress)`` must start the provider call (``llm.agenerate(...)``) with the given
    progress callback (``None`` when progress was not asked for).
    """

    def __init__(
        self,
        call: ProviderCall,
        *,
        stream: bool,
        cancel_event: threading.Event,
        with_progress: bool,
        max_pending: int = DEFAULT_MAX_PENDING,
        observer: CallObserver | None = None,
    ) -> None:
        self._call = call
        self._observer = observer
        self._observer_told_end = False
        self._stream = stream
        self.cancel_event = cancel_event
        self._with_progress = with_progress
        self._queue: asyncio.Queue[PumpItem] = asyncio.Queue()
        self._slots = asyncio.Semaphore(max_pending)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._admitted = asyncio.Event()

    def start(self) -> ProviderPump:
        if self._task is not None:
            raise RuntimeError("the pump was already started")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._task = asyncio.create_task(self._run())
        return self

    async def next(self) -> PumpItem:
        item = await self._queue.get()
        if isinstance(item, ChunkItem):
            self._slots.release()
        return item

    async def settled(self) -> PumpItem | None:
        """The first item if the call already produced one, once the call was admitted.

        Admitted means the provider finished preparing and submitting it (controls
        validation, chat-template rendering, tokenizing, queue admission): a streamed call
        returned its stream, the first phase event (the provider emits one on admission)
        arrived, or the call ended. Every early failure (``InvalidControls``,
        ``ContextTooLong``, ``QueueFull`` ...) is queued by then, and a stream can send its
        headers without waiting for the first token.
        """
        await self._admitted.wait()
        return self.next_nowait()

    def next_nowait(self) -> PumpItem | None:
        try:
            item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        if isinstance(item, ChunkItem):
            self._slots.release()
        return item

    def close(self) -> None:
        """Cancel the call if it is still running (never blocks, safe to repeat)."""
        if self._closed:
            return
        self._closed = True
        task = self._task
        if task is not None and not task.done():
            self.cancel_event.set()
            task.cancel()
            # A task cancelled before its first step never runs ``_run``'s ``finally``.
            task.add_done_callback(lambda _task: self._tell_end(RequestCancelled("the client closed the connection")))

    # --- internals -------------------------------------------------------------------------
    def _on_progress(self, event: Mapping[str, JSONValue]) -> None:
        """The provider's ``on_progress``: may run on the loop or on a worker thread."""
        item = ProgressItem(dict(event))
        if threading.get_ident() == self._loop_thread:
            self._put_progress(item)
        elif self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._put_progress, item)

    def _put_progress(self, item: ProgressItem) -> None:
        self._queue.put_nowait(item)
        self._admitted.set()

    def _progress_sink(self) -> ProgressSink | None:
        observer = self._observer
        watched = observer is not None and observer.wants_progress
        if not watched:
            return self._on_progress if self._with_progress else None
        assert observer is not None

        def both(event: JSONObject) -> None:
            observer.progress(dict(event))
            if self._with_progress:
                self._on_progress(event)

        return both

    def _tell_end(self, error: BaseException | None) -> None:
        if self._observer is not None and not self._observer_told_end:
            self._observer_told_end = True
            self._observer.ended(error)

    async def _run(self) -> None:
        callback = self._progress_sink()
        observer = self._observer
        error: BaseException | None = None
        try:
            if self._stream:
                iterator = await self._call(callback)
                if isinstance(iterator, GenerationResult):
                    raise UpstreamError("the provider returned a GenerationResult, not a stream of chunks")
                self._admitted.set()
                try:
                    async for chunk in iterator:
                        if observer is not None:
                            observer.chunk(chunk)
                        await self._slots.acquire()
                        self._queue.put_nowait(ChunkItem(chunk))
                finally:
                    aclose = getattr(iterator, "aclose", None)
                    if aclose is not None:
                        await aclose()
            else:
                result = await self._call(callback)
                if not isinstance(result, GenerationResult):
                    raise UpstreamError(f"the provider returned {type(result).__name__}, not a GenerationResult")
                if observer is not None:
                    observer.result(result)
                self._queue.put_nowait(ResultItem(result))
        except asyncio.CancelledError:
            self.cancel_event.set()
            error = RequestCancelled("the client closed the connection")
            raise
        except Exception as exc:  # noqa: BLE001 - every failure travels to the response as an item
            error = exc
            self._queue.put_nowait(FailureItem(exc))
        finally:
            self._tell_end(error)
            # Scheduled, so phase events already posted from other threads stay ahead of it.
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon(self._end)

    def _end(self) -> None:
        self._queue.put_nowait(EndItem())
        self._admitted.set()


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that runs ``on_close`` however the stream ends.

    Starlette cancels the body on client disconnect, possibly before the body iterator ever
    started, so cleanup cannot live only in the iterator's ``finally``.
    """

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
