"""``RemoteClient`` and ``AsyncRemoteClient``: the provider's API over HTTP (httpx, pooled).

The twins differ only in ``def``/``async def``, ``close``/``aclose`` and ``with``/``async with``;
everything else lives in ``_ClientCore`` and ``_base``. ``generate`` takes the provider's
keyword arguments and returns the same ``GenerationResult`` (or a stream of
``GenerationChunk`` with exactly one final chunk), plus ``metadata["remote"]``
(``base_url``, ``retries``, ``streamed``, ``latency_s``, ``ttft_s`` for streams).

Retries: only ``QueueFull`` answers and failures to connect, before anything was generated,
``max_retries`` times with exponential backoff (``backoff_s``, doubled each time).

Structured output (``response_model`` / ``response_schema`` / ``response_format``) is sent as
OpenAI's ``response_format``; against a server that does not constrain decoding the answer is
checked and asked again up to ``structured_retries`` times (``_base.structured_step``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping
from typing import Literal, overload

import httpx

from ..errors import UpstreamError
from ..json_values import JSONObject, JSONValue, array_at, as_str, objects_in
from ..request import AFFINITY_HEADER, GenerationRequest
from ..results import GenerationChunk, GenerationResult
from ._base import (
    CHAT_PATH,
    DEFAULT_BACKOFF_S,
    DEFAULT_MAX_RETRIES,
    DEFAULT_STRUCTURED_RETRIES,
    DEFAULT_TIMEOUT,
    ChatCall,
    ClientState,
    SSEParser,
    StreamDecoder,
    affinity_header_value,
    auth_headers,
    backoff_s,
    build_chat_call,
    check_state,
    decode_completion,
    decode_error,
    is_retryable,
    normalize_base_url,
    remote_block,
    structured_step,
    transport_error,
)

DEFAULT_LIMITS = httpx.Limits(max_connections=128, max_keepalive_connections=64)


class _Prepared:
    __slots__ = ("call", "headers", "cancel_event", "started")

    def __init__(self, call: ChatCall, headers: dict[str, str], cancel_event: threading.Event | None) -> None:
        self.call = call
        self.headers = headers
        self.cancel_event = cancel_event
        self.started = time.perf_counter()


class _ClientCore:
    """Settings and the non-I/O half of every call."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        model: str | None,
        timeout: httpx.Timeout,
        max_retries: int,
        backoff_s: float,
        structured_retries: int = DEFAULT_STRUCTURED_RETRIES,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if structured_retries < 0:
            raise ValueError("structured_retries must be >= 0")
        self.structured_retries = structured_retries
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._api_key = api_key
        self._state = ClientState.UNOPENED

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r}, model={self.model!r})"

    # Remote calls are independent HTTP requests; the server's engine batches them.
    def supports_concurrent_generation(self) -> bool:
        return True

    def supports_text_progress_events(self) -> bool:
        return True

    def _use(self) -> None:
        self._state = check_state(self._state)

    def _prepare(self, request: GenerationRequest, stream: bool, model: str | None) -> _Prepared:
        call = build_chat_call(request, model=model, stream=stream, want_events=request.cancel is not None)
        headers = {"Accept": "text/event-stream" if call.sse else "application/json"}
        if request.affinity_key is not None:
            headers[AFFINITY_HEADER] = affinity_header_value(request.affinity_key)
        if request.trace_metadata:
            headers["X-AbstractCore-Trace-Metadata"] = json.dumps(
                dict(request.trace_metadata), separators=(",", ":"), default=str
            )
        return _Prepared(call, headers, request.cancel)

    def _remote(self, prepared: _Prepared, retries: int, **extra: JSONValue) -> JSONObject:
        return remote_block(
            base_url=self.base_url,
            retries=retries,
            streamed=prepared.call.sse,
            latency_s=round(time.perf_counter() - prepared.started, 6),
            **extra,
        )

    def _cancelled_result(self, prepared: _Prepared, retries: int, text: str) -> GenerationResult:
        return GenerationResult(
            content=text,
            finish_reason="cancelled",
            metadata={"remote": self._remote(prepared, retries, cancelled=True)},
            model=self.model,
        )

    def _cancelled_chunk(self, prepared: _Prepared, retries: int) -> GenerationChunk:
        return GenerationChunk(
            finish_reason="cancelled",
            usage={},
            metadata={"remote": self._remote(prepared, retries, cancelled=True)},
            model=self.model,
        )


def _is_sse(response: httpx.Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.startswith("text/event-stream")


def _json_body(content: bytes) -> JSONObject:
    try:
        body: JSONValue = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UpstreamError(f"the server answered with a body that is not JSON: {content[:200]!r}") from exc
    if not isinstance(body, dict):
        raise UpstreamError(f"the server answered with JSON that is not an object: {content[:200]!r}")
    return body


def _unwrap(body: JSONObject, key: str) -> JSONObject:
    """``body[key]`` when it is an object (the server wraps some answers in one key), else ``body``."""
    value = body.get(key, body)
    return value if isinstance(value, dict) else body


def _final_from_result(result: GenerationResult) -> GenerationChunk:
    return GenerationChunk(
        content=result.content,
        finish_reason=result.finish_reason,
        usage=result.usage,
        metadata=result.metadata,
        model=result.model,
    )


# =========================================================================== sync


class RemoteClient(_ClientCore):
    """Blocking client for an ``abstractruntime-mlx serve`` (or AbstractCore) server.

    ``RemoteClient("http://127.0.0.1:8080", api_key=None, model=None)``; ``model=None`` asks
    the server (``GET /v1/models``) on first use. Use it as a context manager or call ``close()``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        limits: httpx.Limits = DEFAULT_LIMITS,
        structured_retries: int = DEFAULT_STRUCTURED_RETRIES,
    ) -> None:
        super().__init__(
            base_url,
            api_key=api_key,
            model=model,
            timeout=timeout,
            max_retries=max_retries,
            backoff_s=backoff_s,
            structured_retries=structured_retries,
        )
        self._http = httpx.Client(
            base_url=self.base_url, timeout=timeout, transport=transport, headers=auth_headers(api_key), limits=limits
        )

    def __enter__(self) -> RemoteClient:
        self._state = check_state(self._state, entering=True)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._state is not ClientState.CLOSED:
            self._state = ClientState.CLOSED
            self._http.close()

    # --- generation -----------------------------------------------------------------------
    @overload
    def generate(self, prompt: str = "", *, stream: Literal[False] = False, **kwargs: object) -> GenerationResult: ...

    @overload
    def generate(self, prompt: str = "", *, stream: Literal[True], **kwargs: object) -> Iterator[GenerationChunk]: ...

    @overload
    def generate(
        self, prompt: str = "", *, stream: bool, **kwargs: object
    ) -> GenerationResult | Iterator[GenerationChunk]: ...

    def generate(
        self, prompt: str = "", *, stream: bool = False, **kwargs: object
    ) -> GenerationResult | Iterator[GenerationChunk]:
        """The provider's ``generate`` over HTTP (same keywords, same result types)."""
        return self.generate_request(GenerationRequest.from_kwargs(prompt, **kwargs), stream=stream)

    @overload
    def generate_request(self, request: GenerationRequest, *, stream: Literal[False] = False) -> GenerationResult: ...

    @overload
    def generate_request(self, request: GenerationRequest, *, stream: Literal[True]) -> Iterator[GenerationChunk]: ...

    @overload
    def generate_request(
        self, request: GenerationRequest, *, stream: bool
    ) -> GenerationResult | Iterator[GenerationChunk]: ...

    def generate_request(
        self, request: GenerationRequest, *, stream: bool = False
    ) -> GenerationResult | Iterator[GenerationChunk]:
        """Send one validated request (the typed twin of ``generate``). A structured request
        (not streamed) comes back parsed; see ``_base.structured_step``."""
        if request.response_format is None or stream:
            return self._generate_once(request, stream=stream)
        attempts, attempt = 1, request
        while True:
            result = self._generate_once(attempt, stream=False)
            assert isinstance(result, GenerationResult)
            step = structured_step(request, result, attempts=attempts, max_retries=self.structured_retries)
            if isinstance(step, GenerationResult):
                return step
            attempts, attempt = attempts + 1, step

    def _generate_once(
        self, request: GenerationRequest, *, stream: bool
    ) -> GenerationResult | Iterator[GenerationChunk]:
        self._use()
        prepared = self._prepare(request, stream, self._model_name())
        if prepared.cancel_event is not None and prepared.cancel_event.is_set():
            return iter([self._cancelled_chunk(prepared, 0)]) if stream else self._cancelled_result(prepared, 0, "")
        response, retries = self._open(prepared)
        if stream:
            return SyncChunkStream(self, prepared, response, retries)
        try:
            return self._read_result(prepared, response, retries)
        finally:
            response.close()

    def stream(self, prompt: str = "", **kwargs: object) -> Iterator[GenerationChunk]:
        return self.generate(prompt, stream=True, **kwargs)

    def _open(self, prepared: _Prepared) -> tuple[httpx.Response, int]:
        attempt = 0
        while True:
            try:
                request = self._http.build_request("POST", CHAT_PATH, json=prepared.call.body, headers=prepared.headers)
                response = self._http.send(request, stream=True)
            except httpx.HTTPError as exc:
                if is_retryable(exc) and attempt < self.max_retries:
                    time.sleep(backoff_s(attempt, self.backoff_s))
                    attempt += 1
                    continue
                raise transport_error(exc, self.base_url) from exc
            if response.status_code < 400:
                return response, attempt
            try:
                content = response.read()
            finally:
                response.close()
            error = decode_error(response.status_code, content)
            if is_retryable(error) and attempt < self.max_retries:
                time.sleep(backoff_s(attempt, self.backoff_s))
                attempt += 1
                continue
            raise error

    def _read_result(self, prepared: _Prepared, response: httpx.Response, retries: int) -> GenerationResult:
        try:
            if not _is_sse(response):
                body = _json_body(response.read())
                return decode_completion(body, remote=self._remote(prepared, retries))
            decoder = StreamDecoder(on_progress=prepared.call.on_progress)
            parser = SSEParser()
            for data in response.iter_bytes():
                if prepared.cancel_event is not None and prepared.cancel_event.is_set():
                    return self._cancelled_result(prepared, retries, "")
                for event in parser.feed_bytes(data):
                    decoder.feed(event)
                # After [DONE] keep reading to the end of the body: a response read to its end
                # returns its connection to the pool, one closed early costs a new connection.
            return decoder.result(remote=self._remote(prepared, retries))
        except httpx.HTTPError as exc:
            raise transport_error(exc, self.base_url) from exc

    # --- control plane --------------------------------------------------------------------
    def _request(
        self, method: str, path: str, *, json: JSONValue = None, params: Mapping[str, str | None] | None = None
    ) -> JSONObject:
        self._use()
        try:
            response = self._http.request(method, path, json=json, params=params)
        except httpx.HTTPError as exc:
            raise transport_error(exc, self.base_url) from exc
        if response.status_code >= 400:
            raise decode_error(response.status_code, response.content)
        return _json_body(response.content)

    def _model_name(self) -> str | None:
        if self.model is None:
            models = objects_in(array_at(self._request("GET", "/v1/models"), "data"))
            self.model = as_str(models[0].get("id")) if models else None
        return self.model

    def health(self) -> JSONObject:
        return self._request("GET", "/health")

    def list_models(self) -> list[JSONObject]:
        return [model for model in array_at(self._request("GET", "/v1/models"), "data") if isinstance(model, dict)]

    def load_model(self, model: str, options: Mapping[str, JSONValue] | None = None) -> JSONObject:
        body = self._request(
            "POST", "/acore/models/load", json={"provider": "mlx", "model": model, "options": options or {}}
        )
        self.model = model
        return body

    def unload_model(self, model: str | None = None) -> JSONObject:
        return self._request("POST", "/acore/models/unload", json={"model": model or self.model})

    def get_execution_capabilities(self, model_name: str | None = None, provider: str = "mlx") -> JSONObject:
        params = {
            "provider": provider,
            **({"model_name": model_name or self.model} if (model_name or self.model) else {}),
        }
        return self._request("GET", "/v1/models/execution-capabilities", params=params)

    def get_prompt_cache_stats(self) -> JSONObject:
        body = self._request("GET", "/acore/prompt_cache/stats")
        return _unwrap(body, "stats")

    def prompt_cache_clear(self, key: str | None = None) -> JSONObject:
        body = self._request("POST", "/acore/prompt_cache/clear", json={"key": key} if key is not None else {})
        return _unwrap(body, "result")


class SyncChunkStream:
    """The chunks of one streamed call; ``close()`` (or leaving a ``with``) drops the connection,
    which cancels the request on the server."""

    def __init__(self, client: RemoteClient, prepared: _Prepared, response: httpx.Response, retries: int) -> None:
        self._client = client
        self._prepared = prepared
        self._response = response
        self._retries = retries
        self._iterator = self._run()

    def __iter__(self) -> SyncChunkStream:
        return self

    def __next__(self) -> GenerationChunk:
        return next(self._iterator)

    def __enter__(self) -> SyncChunkStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._iterator.close()
        self._response.close()

    def __del__(self) -> None:  # an abandoned stream must not hold its server slot
        try:
            self._response.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _run(self) -> Generator[GenerationChunk, None, None]:
        client, prepared, response = self._client, self._prepared, self._response
        first_at: float | None = None
        try:
            if not _is_sse(response):
                result = decode_completion(_json_body(response.read()), remote=client._remote(prepared, self._retries))
                yield _final_from_result(result)
                return
            decoder = StreamDecoder(on_progress=prepared.call.on_progress)
            parser = SSEParser()
            for data in response.iter_bytes():
                if prepared.cancel_event is not None and prepared.cancel_event.is_set():
                    yield client._cancelled_chunk(prepared, self._retries)
                    return
                for event in parser.feed_bytes(data):
                    for chunk in decoder.feed(event):
                        if first_at is None:
                            first_at = time.perf_counter()
                        yield chunk
                # After [DONE] keep reading to the end of the body: a response read to its end
                # returns its connection to the pool, one closed early costs a new connection.
            ttft = None if first_at is None else round(first_at - prepared.started, 6)
            yield decoder.final_chunk(remote=client._remote(prepared, self._retries, ttft_s=ttft))
        except httpx.HTTPError as exc:
            raise transport_error(exc, client.base_url) from exc
        finally:
            response.close()


# =========================================================================== async


class AsyncRemoteClient(_ClientCore):
    """The asyncio twin of ``RemoteClient`` (``await generate(...)``, ``async with``, ``aclose()``)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        limits: httpx.Limits = DEFAULT_LIMITS,
        structured_retries: int = DEFAULT_STRUCTURED_RETRIES,
    ) -> None:
        super().__init__(
            base_url,
            api_key=api_key,
            model=model,
            timeout=timeout,
            max_retries=max_retries,
            backoff_s=backoff_s,
            structured_retries=structured_retries,
        )
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout, transport=transport, headers=auth_headers(api_key), limits=limits
        )

    async def __aenter__(self) -> AsyncRemoteClient:
        self._state = check_state(self._state, entering=True)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._state is not ClientState.CLOSED:
            self._state = ClientState.CLOSED
            await self._http.aclose()

    # --- generation -----------------------------------------------------------------------
    @overload
    async def generate(
        self, prompt: str = "", *, stream: Literal[False] = False, **kwargs: object
    ) -> GenerationResult: ...

    @overload
    async def generate(
        self, prompt: str = "", *, stream: Literal[True], **kwargs: object
    ) -> AsyncIterator[GenerationChunk]: ...

    @overload
    async def generate(
        self, prompt: str = "", *, stream: bool, **kwargs: object
    ) -> GenerationResult | AsyncIterator[GenerationChunk]: ...

    async def generate(
        self, prompt: str = "", *, stream: bool = False, **kwargs: object
    ) -> GenerationResult | AsyncIterator[GenerationChunk]:
        return await self.generate_request(GenerationRequest.from_kwargs(prompt, **kwargs), stream=stream)

    @overload
    async def generate_request(
        self, request: GenerationRequest, *, stream: Literal[False] = False
    ) -> GenerationResult: ...

    @overload
    async def generate_request(
        self, request: GenerationRequest, *, stream: Literal[True]
    ) -> AsyncIterator[GenerationChunk]: ...

    @overload
    async def generate_request(
        self, request: GenerationRequest, *, stream: bool
    ) -> GenerationResult | AsyncIterator[GenerationChunk]: ...

    async def generate_request(
        self, request: GenerationRequest, *, stream: bool = False
    ) -> GenerationResult | AsyncIterator[GenerationChunk]:
        """Send one validated request (the typed twin of ``generate``). A structured request
        (not streamed) comes back parsed; see ``_base.structured_step``."""
        if request.response_format is None or stream:
            return await self._generate_once(request, stream=stream)
        attempts, attempt = 1, request
        while True:
            result = await self._generate_once(attempt, stream=False)
            assert isinstance(result, GenerationResult)
            step = structured_step(request, result, attempts=attempts, max_retries=self.structured_retries)
            if isinstance(step, GenerationResult):
                return step
            attempts, attempt = attempts + 1, step

    async def _generate_once(
        self, request: GenerationRequest, *, stream: bool
    ) -> GenerationResult | AsyncIterator[GenerationChunk]:
        self._use()
        prepared = self._prepare(request, stream, await self._model_name())
        if prepared.cancel_event is not None and prepared.cancel_event.is_set():
            if stream:
                return _single(self._cancelled_chunk(prepared, 0))
            return self._cancelled_result(prepared, 0, "")
        response, retries = await self._open(prepared)
        if stream:
            return AsyncChunkStream(self, prepared, response, retries)
        try:
            return await self._read_result(prepared, response, retries)
        finally:
            await response.aclose()

    # The provider's names for the same calls.
    agenerate = generate
    agenerate_request = generate_request

    async def stream(self, prompt: str = "", **kwargs: object) -> AsyncIterator[GenerationChunk]:
        return await self.generate(prompt, stream=True, **kwargs)

    async def _open(self, prepared: _Prepared) -> tuple[httpx.Response, int]:
        attempt = 0
        while True:
            try:
                request = self._http.build_request("POST", CHAT_PATH, json=prepared.call.body, headers=prepared.headers)
                response = await self._http.send(request, stream=True)
            except httpx.HTTPError as exc:
                if is_retryable(exc) and attempt < self.max_retries:
                    await asyncio.sleep(backoff_s(attempt, self.backoff_s))
                    attempt += 1
                    continue
                raise transport_error(exc, self.base_url) from exc
            if response.status_code < 400:
                return response, attempt
            try:
                content = await response.aread()
            finally:
                await response.aclose()
            error = decode_error(response.status_code, content)
            if is_retryable(error) and attempt < self.max_retries:
                await asyncio.sleep(backoff_s(attempt, self.backoff_s))
                attempt += 1
                continue
            raise error

    async def _read_result(self, prepared: _Prepared, response: httpx.Response, retries: int) -> GenerationResult:
        try:
            if not _is_sse(response):
                body = _json_body(await response.aread())
                return decode_completion(body, remote=self._remote(prepared, retries))
            decoder = StreamDecoder(on_progress=prepared.call.on_progress)
            parser = SSEParser()
            async for data in response.aiter_bytes():
                if prepared.cancel_event is not None and prepared.cancel_event.is_set():
                    return self._cancelled_result(prepared, retries, "")
                for event in parser.feed_bytes(data):
                    decoder.feed(event)
                # After [DONE] keep reading to the end of the body: a response read to its end
                # returns its connection to the pool, one closed early costs a new connection.
            return decoder.result(remote=self._remote(prepared, retries))
        except httpx.HTTPError as exc:
            raise transport_error(exc, self.base_url) from exc

    # --- control plane --------------------------------------------------------------------
    async def _request(
        self, method: str, path: str, *, json: JSONValue = None, params: Mapping[str, str | None] | None = None
    ) -> JSONObject:
        self._use()
        try:
            response = await self._http.request(method, path, json=json, params=params)
        except httpx.HTTPError as exc:
            raise transport_error(exc, self.base_url) from exc
        if response.status_code >= 400:
            raise decode_error(response.status_code, response.content)
        return _json_body(response.content)

    async def _model_name(self) -> str | None:
        if self.model is None:
            models = objects_in(array_at(await self._request("GET", "/v1/models"), "data"))
            self.model = as_str(models[0].get("id")) if models else None
        return self.model

    async def health(self) -> JSONObject:
        return await self._request("GET", "/health")

    async def list_models(self) -> list[JSONObject]:
        return [
            model for model in array_at(await self._request("GET", "/v1/models"), "data") if isinstance(model, dict)
        ]

    async def load_model(self, model: str, options: Mapping[str, JSONValue] | None = None) -> JSONObject:
        body = await self._request(
            "POST", "/acore/models/load", json={"provider": "mlx", "model": model, "options": options or {}}
        )
        self.model = model
        return body

    async def unload_model(self, model: str | None = None) -> JSONObject:
        return await self._request("POST", "/acore/models/unload", json={"model": model or self.model})

    async def get_execution_capabilities(self, model_name: str | None = None, provider: str = "mlx") -> JSONObject:
        params = {
            "provider": provider,
            **({"model_name": model_name or self.model} if (model_name or self.model) else {}),
        }
        return await self._request("GET", "/v1/models/execution-capabilities", params=params)

    async def get_prompt_cache_stats(self) -> JSONObject:
        body = await self._request("GET", "/acore/prompt_cache/stats")
        return _unwrap(body, "stats")

    async def prompt_cache_clear(self, key: str | None = None) -> JSONObject:
        body = await self._request("POST", "/acore/prompt_cache/clear", json={"key": key} if key is not None else {})
        return _unwrap(body, "result")


class AsyncChunkStream:
    """Async chunks of one streamed call; ``await aclose()`` drops the connection (the server cancels)."""

    def __init__(self, client: AsyncRemoteClient, prepared: _Prepared, response: httpx.Response, retries: int) -> None:
        self._client = client
        self._prepared = prepared
        self._response = response
        self._retries = retries
        self._iterator = self._run()

    def __aiter__(self) -> AsyncChunkStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        return await self._iterator.__anext__()

    async def __aenter__(self) -> AsyncChunkStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._iterator.aclose()
        await self._response.aclose()

    async def _run(self) -> AsyncGenerator[GenerationChunk, None]:
        client, prepared, response = self._client, self._prepared, self._response
        first_at: float | None = None
        try:
            if not _is_sse(response):
                result = decode_completion(
                    _json_body(await response.aread()), remote=client._remote(prepared, self._retries)
                )
                yield _final_from_result(result)
                return
            decoder = StreamDecoder(on_progress=prepared.call.on_progress)
            parser = SSEParser()
            async for data in response.aiter_bytes():
                if prepared.cancel_event is not None and prepared.cancel_event.is_set():
                    yield client._cancelled_chunk(prepared, self._retries)
                    return
                for event in parser.feed_bytes(data):
                    for chunk in decoder.feed(event):
                        if first_at is None:
                            first_at = time.perf_counter()
                        yield chunk
                # After [DONE] keep reading to the end of the body: a response read to its end
                # returns its connection to the pool, one closed early costs a new connection.
            ttft = None if first_at is None else round(first_at - prepared.started, 6)
            yield decoder.final_chunk(remote=client._remote(prepared, self._retries, ttft_s=ttft))
        except httpx.HTTPError as exc:
            raise transport_error(exc, client.base_url) from exc
        finally:
            await response.aclose()


async def _single(chunk: GenerationChunk) -> AsyncIterator[GenerationChunk]:
    yield chunk


__all__ = ["AsyncChunkStream", "AsyncRemoteClient", "RemoteClient", "SyncChunkStream"]
