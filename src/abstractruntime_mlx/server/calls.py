"""One generating call for the routes that speak another wire than chat (responses, completions).

Such a route turns its body into the chat body (``schemas.ChatCompletionRequest``), so the
request is built, its controls checked and its schema compiled exactly as for
``/v1/chat/completions`` (``app.generation_request``); ``serve_call`` then runs it through
the same ``ProviderPump`` and observers, and only the rendering differs: a ``WireRenderer``
writes the non-streamed body and the SSE records.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import InvalidRequest, UpstreamError
from ..json_values import JSONObject
from ..request import GenerationRequest, ProgressSink
from ..results import GenerationChunk, GenerationResult
from ..structured import ResponseFormat, run_schema_work
from .edge import ServedProvider, error_response, first_item, generation_request, pool_of, progress_supported, served_provider
from .keep_alive import parse_keep_alive
from .observe import begin_call
from .pool import UNSET, KeepAlive
from .schemas import ChatCompletionRequest, parse_body
from .sse import ChunkItem, EndItem, FailureItem, ProgressItem, ProviderPump, PumpItem, ResultItem, SSEResponse, named_event


class WireRenderer(Protocol):
    """How one route writes an answer (``model`` is the served model's name)."""

    def body(self, result: GenerationResult, *, model: str) -> JSONObject:
        """The non-streamed response body."""
        ...

    def opening(self, *, model: str) -> list[str]:
        """SSE records before the first text."""
        ...

    def text(self, delta: str) -> str:
        """The SSE record of a text delta."""
        ...

    def closing(self, final: GenerationChunk, text: str) -> list[str]:
        """The SSE records after the terminal chunk (``text``: the whole answer)."""
        ...

    def failure(self, error: BaseException) -> list[str]:
        """The SSE records of an error after the first byte."""
        ...


async def serve_call(request: Request, body: ChatCompletionRequest, *, route: str, renderer: WireRenderer) -> Response:
    """Run ``body`` on the model it names (loaded first when it is not resident, held until the
    answer ends, as for chat); answer as ``renderer`` writes it."""
    keep_alive: KeepAlive = UNSET if body.keep_alive is None else parse_keep_alive(body.keep_alive)
    response_format = (
        None if body.response_format is None else await run_schema_work(ResponseFormat.from_openai, body.response_format)
    )
    typed = generation_request(body, response_format)
    lease = await pool_of(request).acquire(body.model, keep_alive=keep_alive)
    streaming = False
    try:
        response = await _call_with(request, body, typed, served_provider(lease), route=route, renderer=renderer, release=lease.release)
        streaming = isinstance(response, SSEResponse)
        return response
    finally:
        if not streaming:
            lease.release()


async def _call_with(
    request: Request,
    body: ChatCompletionRequest,
    typed: GenerationRequest,
    llm: ServedProvider,
    *,
    route: str,
    renderer: WireRenderer,
    release: Callable[[], None],
) -> Response:
    if body.include_progress and not progress_supported(llm):
        raise InvalidRequest("this provider emits no phase events; drop stream_options.include_progress")
    model = str(llm.model)
    observer = await begin_call(request, route=route, model=model, call=typed, stream=body.stream)
    cancel_event = threading.Event()

    def call(on_progress: ProgressSink | None) -> Awaitable[GenerationResult | AsyncIterator[GenerationChunk]]:
        return llm.agenerate_request(typed.with_sinks(cancel=cancel_event, progress=on_progress), stream=body.stream)

    pump = ProviderPump(
        call, stream=body.stream, cancel_event=cancel_event, with_progress=body.include_progress, observer=observer
    ).start()
    try:
        if body.stream:
            first = await pump.settled()  # early failures keep their HTTP status
        else:
            first = await first_item(request, pump)
            if first is None:  # the client left before the answer was ready
                pump.close()
                return Response(status_code=499)
    except BaseException:
        pump.close()
        raise
    if isinstance(first, FailureItem):
        pump.close()
        return error_response(first.error)
    if not body.stream:
        if not isinstance(first, ResultItem):  # pragma: no cover - the pump's contract
            pump.close()
            return error_response(UpstreamError(f"unexpected first item {type(first).__name__}"))
        return JSONResponse(renderer.body(first.result, model=model))

    def close() -> None:
        pump.close()
        release()

    records = _records(first, pump, renderer, model=model, interval_s=request.app.state.stream_interval_s)
    return SSEResponse(records, on_close=close)


async def _records(
    first: PumpItem | None, pump: ProviderPump, renderer: WireRenderer, *, model: str, interval_s: float
) -> AsyncIterator[str]:
    """The SSE records of one streamed call; text deltas that queued up together go out as one
    (a delta arriving sooner than ``interval_s`` after the last write waits out the rest)."""
    loop = asyncio.get_running_loop()
    last_write = float("-inf")
    pending: list[PumpItem] = [] if first is None else [first]
    answer: list[str] = []
    yield "".join(renderer.opening(model=model))
    while True:
        if not pending:
            pending.append(await pump.next())
            wait_s = interval_s - (loop.time() - last_write)
            if wait_s > 0 and isinstance(pending[0], ChunkItem) and pending[0].chunk.finish_reason is None:
                await asyncio.sleep(wait_s)
            while (more := pump.next_nowait()) is not None:
                pending.append(more)
        out: list[str] = []
        text: list[str] = []

        def flush_text() -> None:
            if text:
                joined = "".join(text)
                answer.append(joined)
                out.append(renderer.text(joined))
                text.clear()

        for item in pending:
            match item:
                case ChunkItem(chunk=piece):
                    if piece.content:
                        text.append(piece.content)
                    if piece.finish_reason is not None:
                        flush_text()
                        out.extend(renderer.closing(piece, "".join(answer)))
                        yield "".join(out)
                        return
                case ProgressItem(event=event):
                    flush_text()
                    out.append(named_event("progress", event))
                case FailureItem(error=error):
                    flush_text()
                    out.extend(renderer.failure(error))
                    yield "".join(out)
                    return
                case EndItem():
                    flush_text()
                    out.extend(renderer.failure(UpstreamError("the provider stream ended without a terminal chunk")))
                    yield "".join(out)
                    return
                case ResultItem():  # pragma: no cover - a streamed call yields chunks
                    pass
        flush_text()
        pending = []
        if out:
            yield "".join(out)
            last_write = loop.time()


async def chat_body(fields: Mapping[str, object]) -> ChatCompletionRequest:
    """The chat body of another route's fields (``None`` values left out), checked by the chat
    edge itself (``schemas.parse_body``), on a thread: a body may be large."""
    raw = json.dumps({k: v for k, v in fields.items() if v is not None}).encode("utf-8")
    return await asyncio.to_thread(parse_body, ChatCompletionRequest, raw)
