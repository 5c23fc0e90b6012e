"""One generating call, for every route that generates (chat, responses, completions).

Every such route has a chat body (``schemas.ChatCompletionRequest``): the chat route reads it,
responses and completions turn theirs into one (``chat_body``). ``serve_call`` builds the
typed request (``edge.generation_request``: controls checked, schema compiled), takes the model
from the pool, runs the call through one ``ProviderPump`` with its observers (metrics, serve
ledger) and answers; only the rendering differs: the route's ``WireRenderer`` writes the
non-streamed body and the SSE records.

A streamed call (or one asking for phase events) answers SSE once the call was admitted, so
early failures keep their HTTP status; later ones travel in the stream. Text deltas that queued
up together go out as one. A non-streamed call asking for phase events answers SSE too: the
progress events, then one ``event: result`` holding the non-streamed body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import UpstreamError
from ..json_values import JSONObject
from ..request import GenerationRequest, ProgressSink
from ..results import GenerationChunk, GenerationResult, TokenLogprob
from ..structured import ResponseFormat, run_schema_work
from .edge import (
    ServedProvider,
    error_response,
    first_item,
    generation_request,
    pool_of,
    progress_supported,
    served_provider,
)
from .keep_alive import parse_keep_alive
from .observe import begin_call
from .pool import UNSET, KeepAlive
from .schemas import ChatCompletionRequest, parse_body
from .sse import (
    ChunkItem,
    EndItem,
    FailureItem,
    ProgressItem,
    ProviderPump,
    PumpItem,
    ResultItem,
    SSEResponse,
    named_event,
)


class WireRenderer(Protocol):
    """How one route writes an answer (``model`` is the served model's name)."""

    ends_at_final: bool
    """Whether the stream ends with the terminal chunk's records; otherwise it goes on to the
    end of the provider's call (a later phase event or failure still reaches the client)."""

    def body(self, result: GenerationResult, *, model: str, reasoning_open: bool) -> JSONObject:
        """The non-streamed response body (``reasoning_open`` as for ``opening``)."""
        ...

    def opening(self, *, model: str, reasoning_open: bool) -> list[str]:
        """The SSE records that open a stream (called first, on a streamed call only);
        ``reasoning_open``: the prompt left a think block open, the answer starts inside it."""
        ...

    def text(self, delta: str, logprobs: list[TokenLogprob] | None = None, *, index: int = 0) -> str:
        """The SSE record of a text delta of answer ``index`` (and its tokens' logprobs, when asked)."""
        ...

    def closing(
        self, final: GenerationChunk, *, tail: str, text: str, logprobs: list[TokenLogprob] | None = None
    ) -> list[str]:
        """The SSE records of the terminal chunk: ``tail`` is the text not written yet (the
        terminal chunk's own included), ``logprobs`` its tokens' (when asked), ``text`` the whole answer.
        Also those of an answer that ends while others go on (``final.choice_finish_reason``
        set, ``final.index`` the answer; a call with several answers)."""
        ...

    def ending(self) -> list[str]:
        """The SSE records after a call that ended well."""
        ...

    def failure(self, error: BaseException) -> list[str]:
        """The SSE records of an error after the first byte (the stream's last)."""
        ...


async def serve_call(
    request: Request,
    body: ChatCompletionRequest,
    *,
    route: str,
    renderer: WireRenderer,
    continuation: str | None = None,
) -> Response:
    """Run ``body`` on the model it names (loaded first when it is not resident, held until the
    answer ends); answer as ``renderer`` writes it. ``route`` names the call to the observers;
    ``continuation``: a plain prompt the model continues without the chat template (its body's
    one user turn holds it, for the record)."""
    keep_alive: KeepAlive = UNSET if body.keep_alive is None else parse_keep_alive(body.keep_alive)
    # A schema within the limits still takes up to about half a second to check: on the
    # schema threads, so that the loop and the other requests go on meanwhile.
    response_format = (
        None
        if body.response_format is None
        else await run_schema_work(ResponseFormat.from_openai, body.response_format)
    )
    typed = generation_request(body, response_format)
    if continuation is not None:
        typed = dataclasses.replace(typed, continuation=continuation)
    # The model is resident (loaded now if it was not) and held until the response ends.
    lease = await pool_of(request).acquire(body.model, keep_alive=keep_alive)
    streaming = False
    try:
        response = await _call_with(
            request,
            body,
            typed,
            served_provider(lease),
            model=lease.name,
            route=route,
            renderer=renderer,
            release=lease.release,
        )
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
    model: str,
    route: str,
    renderer: WireRenderer,
    release: Callable[[], None],
) -> Response:
    """The call on ``llm``, the model the pool names ``model`` (what the answer, the metrics and the
    ledger call it, however the request spelled it); an SSE response calls ``release`` when it ends."""
    # A provider without phase events: the request's progress is consumed here and dropped,
    # never passed on and no phase invented (the seed's rule); the event stream has no progress records.
    supported = progress_supported(llm)
    with_progress = body.include_progress and supported
    observer = await begin_call(
        request, route=route, model=model, call=typed, stream=body.stream, asked_model=body.model
    )
    cancel_event = threading.Event()

    def call(on_progress: ProgressSink | None) -> Awaitable[GenerationResult | AsyncIterator[GenerationChunk]]:
        progress = on_progress if supported else None
        return llm.agenerate_request(typed.with_sinks(cancel=cancel_event, progress=progress), stream=body.stream)

    pump = ProviderPump(
        call, stream=body.stream, cancel_event=cancel_event, with_progress=with_progress, observer=observer
    ).start()
    sse = body.stream or body.include_progress
    try:
        if sse:
            # Early failures keep their HTTP status; the headers then go out at once and
            # later failures travel in the stream.
            first = await pump.settled()
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
    if not sse:
        if not isinstance(first, ResultItem):  # pragma: no cover - the pump's contract
            pump.close()
            return error_response(UpstreamError(f"unexpected first item {type(first).__name__}"))
        return JSONResponse(renderer.body(first.result, model=model, reasoning_open=_reasoning_opens(llm, typed)))

    def close() -> None:
        pump.close()
        release()

    records = _records(
        first,
        pump,
        renderer,
        model=model,
        stream=body.stream,
        interval_s=request.app.state.stream_interval_s,
        reasoning_open=_reasoning_opens(llm, typed),
    )
    return SSEResponse(records, on_close=close)


def _reasoning_opens(llm: ServedProvider, typed: GenerationRequest) -> bool:
    """Whether ``llm`` starts the answer to ``typed`` inside a think block (a provider without the
    hook: its answers say so themselves, with ``<think>``; a plain continuation has no template)."""
    if typed.continuation is not None:
        return False
    probe = getattr(llm, "reasoning_opens_in_prompt", None)
    return callable(probe) and probe(typed) is True


async def _records(
    first: PumpItem | None,
    pump: ProviderPump,
    renderer: WireRenderer,
    *,
    model: str,
    stream: bool,
    interval_s: float,
    reasoning_open: bool = False,
) -> AsyncIterator[str]:
    """The SSE records of one call; text deltas that queued up together go out as one delta.

    With ``interval_s`` a text delta that arrives sooner than that after the previous write
    waits out the rest of the interval, gathering what else arrives (the first token, phase
    events, the terminal chunk and errors never wait). Only streams faster than
    ``1 / interval_s`` tokens per second are affected.
    """
    loop = asyncio.get_running_loop()
    last_write = float("-inf")  # so the first text never waits, however recent the clock's origin
    pending: list[PumpItem] = [] if first is None else [first]
    answer: list[str] = []
    index = 0  # the answer the text gathered belongs to (a call may have several)
    finished = False
    opening = renderer.opening(model=model, reasoning_open=reasoning_open) if stream else []
    if opening:
        yield "".join(opening)
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
        logprobs: list[TokenLogprob] | None = None  # of the text gathered (None: not asked)

        def flush_text() -> None:
            nonlocal logprobs
            if text or logprobs:
                joined = "".join(text)
                answer.append(joined)
                out.append(renderer.text(joined, logprobs, index=index))
                text.clear()
                logprobs = None

        for item in pending:
            if isinstance(item, ChunkItem) and item.chunk.index != index:
                flush_text()  # deltas gather per answer
                index = item.chunk.index
            match item:
                case ChunkItem(chunk=piece) if piece.finish_reason is None:
                    if piece.content:
                        text.append(piece.content)
                    if piece.logprobs is not None:
                        logprobs = [*(logprobs or ()), *piece.logprobs]
                    if piece.choice_finish_reason is not None:  # this answer ended, others go on
                        tail = "".join(text)
                        text.clear()
                        answer.append(tail)
                        out.extend(renderer.closing(piece, tail=tail, text="".join(answer), logprobs=logprobs))
                        logprobs = None
                case ChunkItem(chunk=piece):
                    text.append(piece.content)
                    if piece.logprobs is not None:
                        logprobs = [*(logprobs or ()), *piece.logprobs]
                    tail = "".join(text)
                    text.clear()
                    answer.append(tail)
                    out.extend(renderer.closing(piece, tail=tail, text="".join(answer), logprobs=logprobs))
                    logprobs = None
                    finished = True
                    if renderer.ends_at_final:
                        out.extend(renderer.ending())
                        yield "".join(out)
                        return
                case ProgressItem(event=event):
                    flush_text()
                    out.append(named_event("progress", event))
                case ResultItem(result=result):
                    out.append(named_event("result", renderer.body(result, model=model, reasoning_open=reasoning_open)))
                    finished = True
                case FailureItem(error=error):
                    flush_text()
                    out.extend(renderer.failure(error))
                    yield "".join(out)
                    return
                case EndItem():
                    flush_text()
                    if finished:
                        out.extend(renderer.ending())
                    else:
                        out.extend(
                            renderer.failure(UpstreamError("the provider stream ended without a terminal chunk"))
                        )
                    yield "".join(out)
                    return
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
