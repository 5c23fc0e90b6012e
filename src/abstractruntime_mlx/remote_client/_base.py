"""Everything the remote clients do that is not I/O: request bodies, response decoding, errors.

Pure functions and small stateful decoders; ``client.py`` only moves bytes. Works against
this package's server and AbstractCore's servers (``abstractcore.endpoint.app`` and
``abstractcore.server.app``), which share the wire:

- the chat body is OpenAI's plus ``speculation`` (``false`` or an MTP object),
  ``thinking``, ``prompt_cache_key``; the output cap travels as ``max_tokens`` (AbstractCore
  reads no other name); a thinking control also travels as ``chat_template_kwargs``
  (``enable_thinking``), the form mlx_lm.server reads;
- a call with an affinity key sends it as ``X-Session-Affinity`` (a load balancer's hash key);
- diagnostics come back under the additive ``abstractcore`` field (non-stream body, and
  the terminal chunk of a stream);
- errors are ``{"error": {"message", "type", "code"}}`` (AbstractCore's FastAPI
  ``HTTPException`` wraps it in ``{"detail": ...}``); ``code`` rebuilds the typed class.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, cast

import httpx

from ..conversation import final_user_message
from ..errors import (
    AuthenticationError,
    CapacityError,
    ConflictError,
    EngineError,
    InvalidControls,
    InvalidMedia,
    InvalidRequest,
    MLXRuntimeError,
    ModelNotFound,
    QueueFull,
    QueueTimeout,
    RequestCancelled,
    SpeculationUnavailable,
    StreamBackpressure,
    StructuredOutputInvalid,
    UpstreamError,
    error_class_for_code,
)
from ..image_types import MIME_BY_TYPE, sniff_image_type
from ..json_values import JSONObject, JSONValue, array_at, as_str, object_at, objects_in, to_int
from ..request import GenerationRequest, ProgressSink
from ..results import WIRE_METADATA_KEYS, FinishReason, GenerationChunk, GenerationResult, stop_reason
from ..structured import PROMPTED_PREFIX, answer_error, parse_answer, prompted_instruction
from ..tools import AUTO

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT: Final = httpx.Timeout(600.0, connect=5.0)
DEFAULT_MAX_RETRIES: Final = 2
DEFAULT_BACKOFF_S: Final = 0.25
MAX_BACKOFF_S: Final = 8.0
CHAT_PATH: Final = "/v1/chat/completions"
RETRYABLE_CODES: Final = frozenset({QueueFull.code})
_STRICT_SPECULATION_SUFFIX: Final = "(speculation.require_acceleration=True)"
_STATUS_FALLBACK: Final[dict[int, type[MLXRuntimeError]]] = {
    400: InvalidRequest,
    401: AuthenticationError,
    403: AuthenticationError,
    404: ModelNotFound,
    409: ConflictError,
    422: InvalidRequest,
    429: StreamBackpressure,
    499: RequestCancelled,
    502: UpstreamError,
    503: CapacityError,
    504: QueueTimeout,
}


class ClientState(enum.Enum):
    UNOPENED = 1
    OPENED = 2
    CLOSED = 3


def check_state(state: ClientState, *, entering: bool = False) -> ClientState:
    """The state after a use (or ``with`` entry); misuse raises ``RuntimeError`` (httpx-style)."""
    if state is ClientState.CLOSED:
        raise RuntimeError("cannot use a remote client after it was closed; create a new one")
    if entering and state is ClientState.OPENED:
        raise RuntimeError("cannot open a remote client more than once (it is already in use or in a 'with' block)")
    return ClientState.OPENED


def normalize_base_url(base_url: str) -> str:
    url = str(base_url).strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
    return url


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


_AFFINITY_HEADER_CHARS: Final = 128


def affinity_header_value(key: str) -> str:
    """The ``X-Session-Affinity`` value of ``key``: the key itself when it is at most 128
    visible ASCII characters, else ``sha256:`` and its digest's first 32 hex digits (a header
    carries no other text, and a balancer only needs equal keys to give equal values)."""
    if len(key) <= _AFFINITY_HEADER_CHARS and key.isascii() and key.isprintable() and " " not in key:
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


# --------------------------------------------------------------------------- request


@dataclass(frozen=True, slots=True)
class ChatCall:
    """One prepared chat call: the JSON body and how to read the answer."""

    body: JSONObject
    stream: bool  # the caller wants chunks
    sse: bool  # the answer is read as SSE (streams, and non-streams with progress)
    on_progress: ProgressSink | None


def build_chat_call(
    request: GenerationRequest, *, model: str | None, stream: bool = False, want_events: bool = False
) -> ChatCall:
    """The JSON body of ``request`` (already validated at its edge).

    Unsaid controls are omitted (the server's provider/policy decides); speculation off is
    sent as ``false``. ``want_events`` asks for SSE even without a progress sink (used for
    cancellation checkpoints).
    """
    body: JSONObject = {}
    if model:
        body["model"] = model
    body["messages"] = wire_messages(request.messages, request.media)
    body.update(request.sampling.to_dict())
    if request.max_output_tokens is not None:
        body["max_tokens"] = request.max_output_tokens
    if request.stop:
        body["stop"] = list(request.stop)
    body.update(request.call.to_dict())
    if request.thinking is not None:
        body["chat_template_kwargs"] = thinking_template_kwargs(request.thinking)
    if request.tools:
        body["tools"] = [dict(tool) for tool in request.tools]
        if request.tool_choice != AUTO:
            body["tool_choice"] = request.tool_choice.to_openai()
    if request.prompt_cache_key is not None:
        body["prompt_cache_key"] = request.prompt_cache_key
    if request.response_format is not None:
        body["response_format"] = request.response_format.to_openai()
    progress = request.progress is not None
    body["stream"] = bool(stream)
    sse = bool(stream) or progress or want_events
    if sse:
        options: JSONObject = {"include_progress": progress or want_events}
        if stream:
            options["include_usage"] = True
        body["stream_options"] = options
    return ChatCall(body=body, stream=bool(stream), sse=sse, on_progress=request.progress)


def thinking_template_kwargs(thinking: bool | str) -> JSONObject:
    """The chat template's arguments for a thinking control, as ``engine.chat.render_prompt``
    passes them (``enable_thinking``; a level also as ``reasoning_effort``). mlx_lm.server (also
    under ``mlx.launch``) reads only ``chat_template_kwargs``; this package's server and
    AbstractCore's read ``thinking`` and take this as the same value."""
    out: JSONObject = {"enable_thinking": thinking is not False}
    if isinstance(thinking, str):
        out["reasoning_effort"] = thinking
    return out


def wire_messages(messages: Iterable[Mapping[str, JSONValue]], media: tuple[object, ...]) -> list[JSONObject]:
    """Copies of the conversation with ``media`` as inline base64 ``image_url`` parts of the
    final user message."""
    out = [dict(message) for message in messages]
    if media:
        urls = [image_data_url(item, index) for index, item in enumerate(media)]
        message = final_user_message(out)
        content = message.get("content")
        parts: list[JSONObject] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        if isinstance(content, list):
            parts.extend(p for p in content if p.get("type") != "image_url")
        elif content:
            parts.append({"type": "text", "text": str(content)})
        message["content"] = parts
    return out


def image_data_url(item: object, index: int = 0) -> str:
    """A ``data:image/...;base64,`` URL for a file path, raw bytes or a PIL image."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
    elif isinstance(item, (str, os.PathLike)):
        path = Path(item)
        if not path.is_file():
            raise InvalidMedia(f"media[{index}]: no file at {path}")
        data = path.read_bytes()
    elif hasattr(item, "save") and hasattr(item, "mode"):  # a PIL image
        import io

        buffer = io.BytesIO()
        item.save(buffer, format="PNG")
        data = buffer.getvalue()
    else:
        raise InvalidMedia(
            f"media[{index}]: expected a file path, image bytes or a PIL image, got {type(item).__name__}"
        )
    kind = sniff_image_type(data)
    if kind is None:
        raise InvalidMedia(f"media[{index}]: not a PNG, JPEG, WebP or GIF image")
    return f"data:{MIME_BY_TYPE[kind]};base64,{base64.b64encode(data).decode('ascii')}"


# --------------------------------------------------------------------------- responses


def decode_usage(wire: JSONValue) -> dict[str, int]:
    """The provider's usage shape from OpenAI's (``prompt_tokens_details.cached_tokens`` included)."""
    if not isinstance(wire, Mapping) or not wire:
        return {}
    prompt = wire.get("prompt_tokens", wire.get("input_tokens"))
    completion = wire.get("completion_tokens", wire.get("output_tokens"))
    out: dict[str, int] = {}
    if prompt is not None:
        out["prompt_tokens"] = out["input_tokens"] = _token_count(prompt)
    if completion is not None:
        out["completion_tokens"] = out["output_tokens"] = _token_count(completion)
    total = wire.get("total_tokens")
    if total is not None:
        out["total_tokens"] = _token_count(total)
    elif prompt is not None and completion is not None:
        out["total_tokens"] = _token_count(prompt) + _token_count(completion)
    cached = wire.get("cached_input_tokens")
    details = wire.get("prompt_tokens_details")
    if cached is None and isinstance(details, Mapping):
        cached = details.get("cached_tokens")
    if cached is not None:
        out["cached_input_tokens"] = _token_count(cached)
    return out


# --------------------------------------------------------------------------- structured output

DEFAULT_STRUCTURED_RETRIES: Final = 2


def structured_step(
    request: GenerationRequest, result: GenerationResult, *, attempts: int, max_retries: int
) -> GenerationResult | GenerationRequest:
    """After attempt ``attempts`` of a structured call: the finished result (``parsed`` set,
    ``metadata["structured"]`` saying how) or the request of the next attempt.

    A server that constrained decoding says so (``abstractcore.structured.mode ==
    "constrained"``) and its answer is parsed as is. Every other server (AbstractCore's, plain
    OpenAI-compatible ones) gets the prompted form: the answer is checked against the schema
    and, while invalid, asked again with the schema and the error in a system message, at most
    ``max_retries`` times; then ``StructuredOutputInvalid`` (mode ``prompted``, ``attempts``).
    """
    fmt = request.response_format
    assert fmt is not None
    reported = result.metadata.get("structured")
    if isinstance(reported, Mapping) and reported.get("mode") == "constrained":
        result.parsed = parse_answer(result.content, fmt, mode="constrained", finish_reason=result.finish_reason)
        return result
    error = answer_error(result.content, fmt)
    if error is None:
        result.parsed = parse_answer(result.content, fmt, mode="prompted", attempts=attempts)
        result.metadata["structured"] = {
            "mode": "prompted",
            "schema_hash": fmt.schema_hash,
            "name": fmt.name,
            "attempts": attempts,
        }
        return result
    if attempts > max_retries:
        raise StructuredOutputInvalid(
            f"no valid {fmt.name} JSON after {attempts} attempts: {error}",
            details={"mode": "prompted", "attempts": attempts, "error": error},
        )
    instruction = f"{prompted_instruction(fmt)}\nYour previous answer was invalid: {error}"
    messages = [m for m in request.messages if not _is_prompted_instruction(m)]
    return dataclasses.replace(request, messages=({"role": "system", "content": instruction}, *messages))


def _is_prompted_instruction(message: Mapping[str, object]) -> bool:
    content = message.get("content")
    return message.get("role") == "system" and isinstance(content, str) and content.startswith(PROMPTED_PREFIX)


def _token_count(value: JSONValue) -> int:
    """A count as the server sent it, read as ``int()`` reads it (servers send integers; a float
    or a numeric string is accepted the same way). Anything else is the server's fault."""
    if isinstance(value, (int, float, str)):
        try:
            return to_int(value)
        except (ValueError, OverflowError):
            pass
    raise UpstreamError(f"the server sent a token count that is not a number: {str(value)[:50]!r}")


def metadata_from(block: JSONValue) -> JSONObject:
    if not isinstance(block, Mapping):
        return {}
    return {k: block[k] for k in WIRE_METADATA_KEYS if isinstance(block.get(k), Mapping)}


def decode_completion(body: Mapping[str, JSONValue], *, remote: Mapping[str, JSONValue]) -> GenerationResult:
    """A ``GenerationResult`` from a ``chat.completion`` body; ``remote`` becomes ``metadata["remote"]``."""
    choices = objects_in(array_at(body, "choices"))
    message = choices[0].get("message") if choices else None
    if not isinstance(message, Mapping):
        raise UpstreamError(f"the server answered without choices[0].message: {str(body)[:200]}")
    choice = choices[0]
    reasoning = None
    for key in ("reasoning", "reasoning_content", "thinking", "thinking_content"):
        value = message.get(key)
        if isinstance(value, str) and value:
            reasoning = value
            break
    metadata = metadata_from(body.get("abstractcore"))
    metadata.update(stop_reason_from(choice))
    metadata["remote"] = dict(remote)
    calls = [dict(call) for call in objects_in(array_at(message, "tool_calls"))]
    return GenerationResult(
        content=as_str(message.get("content")) or "",
        finish_reason=finish_reason_of(choice.get("finish_reason")),
        usage=decode_usage(body.get("usage")),
        metadata=metadata,
        model=model if isinstance(model := body.get("model"), str) else None,
        reasoning=reasoning,
        tool_calls=calls or None,
    )


def stop_reason_from(choice: Mapping[str, JSONValue]) -> JSONObject:
    """``{"stop_reason": ...}`` of a finished choice that names its stop (vLLM's field), else ``{}``."""
    value = stop_reason({"stop_reason": choice.get("stop_reason")})
    return {} if value is None else {"stop_reason": value}


def finish_reason_of(value: JSONValue) -> FinishReason | None:
    """A server's finish reason, passed on as it was sent: servers send OpenAI's reasons and
    ours (``stop``, ``length``, ``tool_calls``, ``cancelled``, ``error``); a non-string is none."""
    return cast(FinishReason, value) if isinstance(value, str) else None


def decode_error(status: int, content: bytes) -> MLXRuntimeError:
    """The typed error for an error response: ``code`` picks the class, else the status does."""
    payload: JSONValue = None
    try:
        payload = json.loads(content) if content else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        payload = None
    error = _error_object(payload)
    if error is None:
        text = content.decode("utf-8", "replace").strip()[:500] if content else ""
        return rebuild_error({"message": f"HTTP {status}: {text or 'no body'}"}, status=status)
    return rebuild_error(error, status=status)


def _error_object(payload: JSONValue) -> JSONObject | None:
    if not isinstance(payload, Mapping):
        return None
    error = payload.get("error")
    if isinstance(error, Mapping):
        return dict(error)
    if isinstance(error, str):
        return {"message": error, "code": payload.get("code")}
    detail = payload.get("detail")
    if isinstance(detail, Mapping):
        return _error_object(detail) or {"message": json.dumps(detail)[:500]}
    if isinstance(detail, list):  # FastAPI validation errors
        return {"message": "invalid request: " + json.dumps(detail)[:500], "code": "invalid_request"}
    if isinstance(detail, str):
        return {"message": detail}
    return None


def rebuild_error(error: Mapping[str, JSONValue], *, status: int | None) -> MLXRuntimeError:
    """The same class the server raised (by stable ``code``), with its message and details."""
    code = error.get("code")
    message = str(error.get("message") or f"HTTP {status}")
    details: JSONObject = dict(object_at(error, "details"))
    cls = error_class_for_code(code) if isinstance(code, str) else MLXRuntimeError
    if cls is MLXRuntimeError and message.endswith(_STRICT_SPECULATION_SUFFIX):
        # AbstractCore sends strict-MTP refusals as untyped native_runtime_error with this suffix.
        cls = SpeculationUnavailable
    if cls is MLXRuntimeError and status is not None:
        cls = _STATUS_FALLBACK.get(status) or (EngineError if status >= 500 else InvalidRequest)
    if code and cls.code != code:
        details.setdefault("server_code", code)
    if status is not None and status != cls.http_status:
        details.setdefault("http_status", status)
    exc = cls.__new__(cls)
    MLXRuntimeError.__init__(exc, message, details=details)
    if isinstance(exc, InvalidControls):
        exc.field = named if isinstance(named := details.get("field"), str) else None
        exc.value = details.get("value")
    if isinstance(exc, SpeculationUnavailable):
        exc.reason = str(details.get("reason") or "unknown")
        details.setdefault("reason", exc.reason)
    return exc


def is_retryable(exc: BaseException) -> bool:
    """QueueFull and failures to connect; never errors after the server accepted the call."""
    if isinstance(exc, MLXRuntimeError):
        return exc.code in RETRYABLE_CODES
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


def backoff_s(attempt: int, base_s: float) -> float:
    return min(MAX_BACKOFF_S, base_s * 2.0**attempt)


def transport_error(exc: httpx.HTTPError, url: str) -> MLXRuntimeError:
    """The one place httpx failures become typed errors (chained by the caller with ``from``)."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return UpstreamError(
            f"cannot reach the model server at {url}: {exc}", details={"transport": type(exc).__name__}
        )
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError(
            f"the model server at {url} did not answer in time ({type(exc).__name__}); raise the client's timeout",
            details={"transport": type(exc).__name__},
        )
    return UpstreamError(
        f"the connection to {url} failed: {type(exc).__name__}: {exc}", details={"transport": type(exc).__name__}
    )


# --------------------------------------------------------------------------- SSE


@dataclass(slots=True)
class ServerEvent:
    event: str | None
    data: str


@dataclass(slots=True)
class SSEParser:
    """Incremental ``text/event-stream`` parser: ``feed_bytes`` takes raw network chunks
    (``feed`` takes one decoded line without its newline)."""

    _event: str | None = None
    _data: list[str] = field(default_factory=list)
    _buffer: bytes = b""

    def feed_bytes(self, chunk: bytes) -> list[ServerEvent]:
        data = self._buffer + chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        events: list[ServerEvent] = []
        start = 0
        while True:
            end = data.find(b"\n\n", start)
            if end < 0:
                break
            block = data[start:end]
            start = end + 2
            if block.startswith(b"data: ") and b"\n" not in block and self._event is None and not self._data:
                events.append(ServerEvent(None, block[6:].decode("utf-8")))  # the common one-line record
                continue
            for line in block.decode("utf-8").split("\n"):
                self.feed(line)
            event = self.feed("")
            if event is not None:
                events.append(event)
        self._buffer = data[start:]
        return events

    def feed(self, line: str) -> ServerEvent | None:
        if not line:
            if not self._data and self._event is None:
                return None
            out = ServerEvent(self._event, "\n".join(self._data))
            self._event, self._data = None, []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None


@dataclass(slots=True)
class ToolCallParts:
    """One streamed call as its ``delta.tool_calls`` pieces arrive."""

    call_id: str = ""
    name: str = ""
    arguments: str = ""
    sent: bool = False

    def add(self, piece: Mapping[str, JSONValue]) -> None:
        self.call_id = as_str(piece.get("id")) or self.call_id
        function = object_at(piece, "function")
        self.name = as_str(function.get("name")) or self.name
        self.arguments += as_str(function.get("arguments")) or ""

    def complete(self) -> bool:
        if not self.name:
            return False
        try:
            return isinstance(json.loads(self.arguments), dict)
        except json.JSONDecodeError:
            return False

    def to_openai(self) -> JSONObject:
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class StreamDecoder:
    """Turns server events into chunks, progress callbacks, and exactly one final chunk.

    The terminal record is held back until ``[DONE]`` so that a later usage-only chunk
    (OpenAI's ``include_usage`` shape) or ``abstractcore`` block is merged into it. A
    non-stream call read as SSE ends with ``event: result`` (a whole ``chat.completion``).

    ``delta.tool_calls`` pieces are gathered per ``index`` (``id`` and ``function.name`` once,
    ``function.arguments`` appended); a call goes out on the chunk where its arguments became a
    whole JSON object (nothing can follow one), or on the terminal chunk.
    """

    def __init__(self, *, on_progress: ProgressSink | None) -> None:
        self._on_progress = on_progress
        self.done = False
        self.model: str | None = None
        # The server's reason as sent: ours and AbstractCore's are FinishReason values; another
        # server's own reason (OpenAI's "content_filter") is passed through unchanged.
        self.finish_reason: FinishReason | None = None
        self.final_content = ""
        self.usage: dict[str, int] = {}
        self.abstractcore: JSONObject = {}
        self.result_body: JSONObject | None = None
        self.num_progress_events = 0
        self._calls: dict[int, ToolCallParts] = {}

    def feed(self, event: ServerEvent) -> list[GenerationChunk]:
        if self.done:
            return []
        if event.data == "[DONE]":
            self.done = True
            return []
        try:
            payload: JSONValue = json.loads(event.data)
        except json.JSONDecodeError as exc:
            raise UpstreamError(f"the server sent an undecodable SSE record: {event.data[:200]!r}") from exc
        if isinstance(payload, Mapping) and "error" in payload and (event.event in (None, "error")):
            error = _error_object(payload) or {"message": str(payload)[:500]}
            raise rebuild_error(error, status=None)
        if event.event == "progress":
            self._progress(payload)
            return []
        if event.event == "result":
            if not isinstance(payload, Mapping):
                raise UpstreamError(f"the server sent a result record that is not an object: {event.data[:200]!r}")
            self.result_body = dict(payload)
            return []
        if event.event not in (None, "message"):
            return []  # an event kind this client does not know; documented as ignorable
        return self._chunk(payload)

    def _progress(self, payload: JSONValue) -> None:
        self.num_progress_events += 1
        callback = self._on_progress
        if callback is None or not isinstance(payload, dict):
            return
        try:
            callback(payload)
        except Exception as exc:  # noqa: BLE001 - a host's callback must not break generation
            self._on_progress = None
            log.warning(
                "progress callback raised %s: %s; it is disabled for the rest of this call", type(exc).__name__, exc
            )

    def _chunk(self, payload: JSONValue) -> list[GenerationChunk]:
        if not isinstance(payload, Mapping):
            return []
        self.model = model if isinstance(model := payload.get("model"), str) and model else self.model
        if isinstance(payload.get("usage"), Mapping):
            self.usage = decode_usage(payload["usage"])
        block = payload.get("abstractcore")
        if isinstance(block, Mapping):
            self.abstractcore.update(metadata_from(block))
        choices = objects_in(array_at(payload, "choices"))
        if not choices:
            return []
        choice = choices[0]
        delta = object_at(choice, "delta")
        text = as_str(delta.get("content")) or ""
        reasoning = as_str(delta.get("reasoning_content")) or None
        self._gather_calls(delta)
        if choice.get("finish_reason") is not None:
            self.finish_reason = finish_reason_of(choice["finish_reason"])
            self.abstractcore.update(stop_reason_from(choice))
            self.final_content += text
            return []
        if self.finish_reason is not None:  # text after the terminal record joins it
            self.final_content += text
            return []
        calls = self._take_calls(final=False)
        if not (text or reasoning or calls):
            return []
        return [GenerationChunk(content=text, model=self.model, reasoning=reasoning, tool_calls=calls or None)]

    def _gather_calls(self, delta: Mapping[str, JSONValue]) -> None:
        for piece in objects_in(array_at(delta, "tool_calls")):
            index = piece.get("index", 0)
            if not isinstance(index, int) or isinstance(index, bool):
                raise UpstreamError(f"the server sent a tool call piece without an integer index: {piece!r:.200}")
            parts = self._calls.setdefault(index, ToolCallParts())
            parts.add(piece)

    def _take_calls(self, *, final: bool) -> list[JSONObject]:
        """The gathered calls that are complete (at the end: all of them), in index order, once each."""
        out: list[JSONObject] = []
        for index in sorted(self._calls):
            parts = self._calls[index]
            if not parts.sent and (final or parts.complete()):
                parts.sent = True
                out.append(parts.to_openai())
        return out

    def final_chunk(self, *, remote: Mapping[str, JSONValue]) -> GenerationChunk:
        if self.finish_reason is None:
            raise UpstreamError("the server's stream ended without a terminal chunk (no finish_reason)")
        metadata = dict(self.abstractcore)
        metadata["remote"] = dict(remote)
        return GenerationChunk(
            content=self.final_content,
            finish_reason=self.finish_reason,
            usage=dict(self.usage),
            metadata=metadata,
            model=self.model,
            tool_calls=self._take_calls(final=True) or None,
        )

    def result(self, *, remote: Mapping[str, JSONValue]) -> GenerationResult:
        if self.result_body is None:
            raise UpstreamError("the server's event stream ended without a result record")
        return decode_completion(self.result_body, remote=remote)


def remote_block(*, base_url: str, retries: int, streamed: bool, **extra: JSONValue) -> JSONObject:
    out: JSONObject = {"base_url": base_url, "retries": retries, "streamed": streamed}
    out.update({k: v for k, v in extra.items() if v is not None})
    return out
