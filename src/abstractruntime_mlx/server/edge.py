"""What every generating route does at the HTTP edge: read the body (within its limit), build the
typed request of a chat body, take the model from the pool, wait for the first answer or the
client's leaving, render an error. Used by the one call path of the generating routes
(``calls.py``: chat, responses, completions) and by the other routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Final, Protocol, cast

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive

from ..controls import SAMPLING_FIELDS
from ..errors import RequestTooLarge
from ..json_values import parse_ascii_int
from ..request import GenerationRequest, output_cap
from ..results import GenerationChunk, GenerationResult
from ..structured import ResponseFormat
from .media import extract_images
from .pool import Lease, ModelPool, ResidentModel
from .schemas import ChatCompletionRequest
from .sse import ProviderPump, PumpItem
from .wire import error_payload

MAX_BODY_BYTES: Final = 64 * 1024 * 1024  # 16 images of 10 MiB in base64 fit


class ServedProvider(Protocol):
    """What the server calls on the provider it serves (an ``MLXProvider``, or a test's fake).

    Optional hooks are looked up with ``getattr``: ``health()``, ``execution_options``,
    ``speculation_default()``, ``supports_text_progress_events()``.
    """

    @property
    def model(self) -> str: ...

    def unload_model(self, model_name: str | None = None) -> object: ...

    def supports_concurrent_generation(self) -> bool: ...

    def get_prompt_cache_stats(self) -> Mapping[str, object]: ...

    def prompt_cache_clear(self, key: str | None = None) -> Mapping[str, object]: ...

    def agenerate_request(
        self, request: GenerationRequest, *, stream: bool = False
    ) -> Awaitable[GenerationResult | AsyncIterator[GenerationChunk]]: ...


def pool_of(request: Request) -> ModelPool:
    pool: ModelPool = request.app.state.pool
    return pool


def served_provider(lease_or_model: ResidentModel | Lease) -> ServedProvider:
    """The pool holds providers as ``PooledProvider``; this server put ``ServedProvider``s in it."""
    return cast(ServedProvider, lease_or_model.provider)


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_payload(exc)
    return JSONResponse(body, status_code=status)


async def read_body(request: Request) -> bytes:
    too_large = RequestTooLarge(
        f"the request body exceeds {MAX_BODY_BYTES // (1024 * 1024)} MiB", details={"limit_bytes": MAX_BODY_BYTES}
    )
    declared = request.headers.get("content-length")
    size_declared = None if declared is None else parse_ascii_int(declared)
    if size_declared is not None and size_declared > MAX_BODY_BYTES:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def first_item(request: Request, pump: ProviderPump) -> PumpItem | None:
    """The pump's first item, or ``None`` when the client went away first."""
    getter = asyncio.ensure_future(pump.next())
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if getter.done():
        return getter.result()
    getter.cancel()
    return None


def generation_request(body: ChatCompletionRequest, response_format: ResponseFormat | None) -> GenerationRequest:
    """The typed request of a chat body (the HTTP edge; controls validated here, once) and its
    already checked ``response_format``."""
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    native = extract_images(messages)
    return GenerationRequest.build(
        messages=native.messages,
        media=native.images,
        tools=body.tools,
        tool_choice=body.tool_choice,
        sampling={name: value for name in SAMPLING_FIELDS if (value := getattr(body, name)) is not None},
        max_output_tokens=output_cap(
            max_output_tokens=body.max_output_tokens,
            max_tokens=body.max_tokens,
            max_completion_tokens=body.max_completion_tokens,
        ),
        stop=body.stop,
        thinking=body.thinking_said(),
        speculation=body.speculation,
        response_format=response_format,
        logprobs=body.logprobs_asked(),
        n=body.n,
        prompt_cache_key=body.prompt_cache_key,
    )


def progress_supported(llm: ServedProvider) -> bool:
    probe = getattr(llm, "supports_text_progress_events", None)
    return callable(probe) and probe() is True
