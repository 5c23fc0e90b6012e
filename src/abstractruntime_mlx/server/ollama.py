"""Ollama's API (``/api/*``), a thin translation onto the chat call path and the model pool.

- ``POST /api/chat`` and ``POST /api/generate`` become chat bodies (``calls.chat_body``) and run
  through ``calls.serve_call``; they stream NDJSON by default (``"stream": false``: one object).
  ``options`` map onto the chat body's fields (``num_predict`` is the output cap, ``stop``,
  ``seed``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repeat_penalty``,
  ``presence_penalty``, ``frequency_penalty``); ``num_ctx`` and the runner's own options
  (``num_gpu``, ``num_thread`` ...) change nothing and are logged. ``keep_alive`` is the pool's
  keep-alive, ``format`` (``"json"`` or a JSON schema) the structured-output path, ``think`` the
  thinking control, ``images`` (base64 strings) the chat route's images (``media.py`` rules).
- A stream is read as it comes (``model_output.OutputSplitter``): thinking goes out as
  ``message.thinking`` (``/api/generate``: ``thinking``) deltas, the answer as ``content``
  (``response``) deltas, and with ``tools`` each call as ``message.tool_calls`` on the line
  where it completes (its text never reaches ``content``); the last line (``done: true``)
  carries the counts. A whole answer whose think block the prompt opened and that never closed
  it is all ``thinking``, as a stream sends it.
- ``/api/generate`` with no prompt loads the model (``done_reason: "load"``), and with
  ``keep_alive: 0`` too unloads it (``"unload"``), as Ollama does.
- ``GET /api/tags`` lists the pool's models, ``GET /api/ps`` the resident ones, ``POST /api/show``
  describes one, ``GET /api/version`` is the package version.

Durations are nanoseconds: ``total_duration`` (the whole request), ``load_duration`` (loading the
model, 0 when it was resident), ``prompt_eval_duration`` (the prefill, from the engine's
``execution`` block) and ``eval_duration`` (the decode); one with no known value is absent.
Errors are Ollama's ``{"error": "<message>"}`` plus this server's ``code`` (``dialects.py``);
after the first line, a stream's last line is that object.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .. import __version__
from ..errors import InvalidMedia, InvalidRequest, ModelNotFound
from ..image_types import sniff_image_type
from ..json_values import JSONObject, JSONValue
from ..model_output import ContentPiece, OutputSplitter, ReasoningPiece, StreamPiece, ToolCallPiece, cut_off_reasoning
from ..results import GenerationChunk, GenerationResult, TokenLogprob
from .calls import chat_body, serve_call
from .dialects import dialect_route, ollama_error_body
from .edge import pool_of, read_body
from .keep_alive import parse_keep_alive
from .pool import UNSET, KeepAlive, ResidentModel
from .schemas import MAX_MESSAGES, ModelName, parse_body
from .sse import SSEResponse
from .wire import error_payload, format_tool_calls

log = logging.getLogger(__name__)

NDJSON: Final = "application/x-ndjson"
NS: Final = 1_000_000_000
# Ollama's option -> the chat body's field
_OPTION_FIELDS: Final = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
_NO_EFFECT_OPTIONS: Final = frozenset(
    {"num_ctx", "num_gpu", "num_thread", "num_batch", "main_gpu", "use_mmap", "numa", "num_keep"}
)
TOLERATED_FIELDS: Final = frozenset({"truncate", "shift", "logprobs", "top_logprobs"})


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr = ""
    images: list[StrictStr] | None = None
    thinking: StrictStr | None = None
    tool_calls: list[dict[str, object]] | None = None
    tool_name: StrictStr | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: ModelName
    stream: StrictBool = True
    options: dict[str, object] | None = None
    format: StrictStr | dict[str, object] | None = None
    keep_alive: object = None
    think: StrictBool | StrictStr | None = None

    def unknown_fields(self) -> list[str]:
        return sorted(k for k in (self.model_extra or {}) if k not in TOLERATED_FIELDS)


class ChatRequest(_Common):
    messages: list[OllamaMessage] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: list[dict[str, object]] | None = None


class GenerateRequest(_Common):
    prompt: StrictStr = ""
    system: StrictStr | None = None
    images: list[StrictStr] | None = None
    raw: StrictBool = False
    suffix: StrictStr | None = None
    context: list[StrictInt] | None = None


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: ModelName | None = None
    name: ModelName | None = None  # older clients' field


# --------------------------------------------------------------------------- request


def options_fields(options: Mapping[str, object] | None) -> dict[str, object]:
    """The chat body's fields of ``options`` (unknown and no-effect options are logged, by name)."""
    out: dict[str, object] = {}
    ignored = []
    for name, value in (options or {}).items():
        if name == "num_predict":
            # Ollama's -1 (no limit) and -2 (fill the context): no cap beyond the model's context
            if not (isinstance(value, int) and not isinstance(value, bool) and value in (-1, -2)):
                out["max_tokens"] = value
        elif name in _OPTION_FIELDS:
            out[_OPTION_FIELDS[name]] = value
        else:
            ignored.append(name)
    if ignored:
        log.warning("ollama request: options %s change nothing here", ", ".join(sorted(ignored)))
    return out


def response_format_of(fmt: str | Mapping[str, object] | None) -> JSONObject | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, str):
        raise InvalidRequest(
            f"format must be 'json' or a JSON schema object (got {fmt!r})", details={"field": "format"}
        )
    schema: JSONObject = json.loads(json.dumps(fmt))
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


def image_parts(images: list[str] | None, where: str) -> list[JSONValue]:
    """The chat route's image parts of Ollama's base64 images (the type read from the bytes)."""
    parts: list[JSONValue] = []
    for index, data in enumerate(images or []):
        at = f"{where}.{index}"
        try:
            head = base64.b64decode(data[:64], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidMedia(f"{at}: the image is not valid base64: {exc}") from exc
        kind = sniff_image_type(head)
        if kind is None:
            raise InvalidMedia(f"{at}: the decoded bytes are not a known image format (PNG, JPEG, WebP, GIF)")
        parts.append({"type": "image_url", "image_url": {"url": f"data:image/{kind};base64,{data}"}})
    return parts


def _content(text: str, images: list[str] | None, where: str) -> JSONValue:
    if not images:
        return text
    return [*image_parts(images, where), {"type": "text", "text": text}]


def chat_messages(body: ChatRequest) -> list[JSONObject]:
    out: list[JSONObject] = []
    for index, message in enumerate(body.messages):
        turn: JSONObject = {
            "role": message.role,
            "content": _content(message.content, message.images, f"messages.{index}.images"),
        }
        if message.tool_calls:
            turn["tool_calls"] = json.loads(json.dumps(message.tool_calls))
        if message.thinking:
            turn["reasoning"] = message.thinking
        if message.tool_name is not None:
            turn["name"] = message.tool_name
        out.append(turn)
    if not out:
        raise InvalidRequest("messages must hold at least one message", details={"field": "messages"})
    return out


def generate_messages(body: GenerateRequest) -> list[JSONObject]:
    for field, refused in (
        ("raw", body.raw),
        ("suffix", body.suffix is not None),
        ("context", body.context is not None),
    ):
        if refused:
            raise InvalidRequest(
                f"{field} is not supported: every prompt is rendered with the "
                "model's chat template; send the whole conversation",
                details={"field": field},
            )
    messages: list[JSONObject] = []
    if body.system:
        messages.append({"role": "system", "content": body.system})
    messages.append({"role": "user", "content": _content(body.prompt, body.images, "images")})
    return messages


def _keep_alive(value: object) -> KeepAlive:
    return UNSET if value is None else parse_keep_alive(value)


def _call_fields(body: _Common, messages: list[JSONObject]) -> dict[str, object]:
    return {
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        "response_format": response_format_of(body.format),
        "thinking": body.think,
        "keep_alive": body.keep_alive,
        **options_fields(body.options),
    }


# --------------------------------------------------------------------------- routes


async def _serve(
    request: Request, body: _Common, fields: dict[str, object], *, kind: Literal["chat", "generate"]
) -> Response:
    started = time.perf_counter()
    unknown = body.unknown_fields()
    if unknown:
        log.warning("ollama %s request: ignoring unknown field(s) %s", kind, ", ".join(unknown))
    chat = await chat_body(fields)
    # The load is timed on its own (load_duration); the call then finds the model resident.
    lease = await pool_of(request).acquire(body.model, keep_alive=_keep_alive(body.keep_alive))
    try:
        renderer = OllamaRenderer(
            kind, started=started, load_s=time.perf_counter() - started, reads_calls=chat.reads_tool_calls()
        )
        response = await serve_call(request, chat, route=f"ollama_{kind}", renderer=renderer)
    finally:
        lease.release()
    if isinstance(response, SSEResponse):
        response.headers["content-type"] = NDJSON
    return response


@dialect_route
async def ollama_chat(request: Request) -> Response:
    body = await asyncio.to_thread(parse_body, ChatRequest, await read_body(request))
    fields = {**_call_fields(body, chat_messages(body)), "tools": body.tools}
    return await _serve(request, body, fields, kind="chat")


@dialect_route
async def ollama_generate(request: Request) -> Response:
    body = await asyncio.to_thread(parse_body, GenerateRequest, await read_body(request))
    if not body.prompt and not body.images:
        return await _load_or_unload(request, body)
    return await _serve(request, body, _call_fields(body, generate_messages(body)), kind="generate")


async def _load_or_unload(request: Request, body: GenerateRequest) -> Response:
    """Ollama's ``generate`` without a prompt: load the model; with ``keep_alive: 0``, unload it."""
    pool = pool_of(request)
    keep_alive = _keep_alive(body.keep_alive)
    if keep_alive == 0:
        known = pool.find(body.model)
        if known is None:
            raise ModelNotFound(f"{body.model!r} is not a model of this server")
        await pool.unload(body.model)
        return JSONResponse(
            {"model": known.name, "created_at": created_at(), "response": "", "done": True, "done_reason": "unload"}
        )
    started = time.perf_counter()
    lease = await pool.acquire(body.model, keep_alive=keep_alive)
    lease.release()
    ns = int((time.perf_counter() - started) * NS)
    return JSONResponse(
        {
            "model": lease.name,
            "created_at": created_at(),
            "response": "",
            "done": True,
            "done_reason": "load",
            "total_duration": ns,
            "load_duration": ns,
        }
    )


def _details() -> JSONObject:
    return {"format": "mlx", "family": "", "families": None, "parameter_size": "", "quantization_level": ""}


def _model_entry(model: ResidentModel) -> JSONObject:
    entry: JSONObject = {"name": model.name, "model": model.name, "details": _details()}
    if model.footprint is not None:
        entry["size"] = model.footprint.weights_bytes
    return entry


@dialect_route
async def ollama_tags(request: Request) -> Response:
    return JSONResponse({"models": [_model_entry(m) for m in pool_of(request).models()]})


@dialect_route
async def ollama_ps(request: Request) -> Response:
    now = datetime.now(UTC)
    models: list[JSONValue] = []
    for model in pool_of(request).resident():
        entry = _model_entry(model)
        if model.footprint is not None:
            # resident: the weights and the KV reserve; unified memory, so all of it is the GPU's
            entry["size"] = entry["size_vram"] = model.footprint.total_bytes
        if model.expires_in_s is not None:
            entry["expires_at"] = _rfc3339(now + timedelta(seconds=model.expires_in_s))
        models.append(entry)
    return JSONResponse({"models": models})


@dialect_route
async def ollama_show(request: Request) -> Response:
    body = await asyncio.to_thread(parse_body, ShowRequest, await read_body(request))
    name = body.model or body.name
    if name is None:
        raise InvalidRequest("model is required", details={"field": "model"})
    known = pool_of(request).find(name)
    if known is None:
        raise ModelNotFound(f"{name!r} is not a model of this server")
    info: JSONObject = {"source": known.source, "state": known.state.value, "aliases": list(known.aliases)}
    return JSONResponse(
        {"details": _details(), "model_info": info, "capabilities": ["completion"], "parameters": "", "template": ""}
    )


@dialect_route
async def ollama_version(request: Request) -> Response:
    return JSONResponse({"version": __version__})


# --------------------------------------------------------------------------- wire


def _rfc3339(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def created_at() -> str:
    return _rfc3339(datetime.now(UTC))


def ollama_tool_calls(calls: list[JSONObject] | None) -> list[JSONValue]:
    """Ollama's ``[{"function": {"name", "arguments": {...}}}]`` of the provider's tool calls."""
    out: list[JSONValue] = []
    for call in format_tool_calls(calls or []):
        function = call["function"]
        assert isinstance(function, dict)  # format_tool_calls' shape
        out.append(_ollama_call(str(function["name"]), str(function["arguments"] or "{}")))
    return out


def _ollama_call(name: str, arguments: str) -> JSONObject:
    return {"function": {"name": name, "arguments": json.loads(arguments)}}


def _line(payload: Mapping[str, JSONValue]) -> str:
    return json.dumps(payload, separators=(",", ":")) + "\n"


class OllamaRenderer:
    """Writes one call's answer as Ollama's objects, streamed as NDJSON lines (``calls.WireRenderer``)."""

    ends_at_final = True

    def __init__(
        self, kind: Literal["chat", "generate"], *, started: float, load_s: float, reads_calls: bool = False
    ) -> None:
        self.kind = kind
        self._started = started
        self._load_s = load_s
        self._model = ""
        self._reads_calls = reads_calls
        self._splitter = OutputSplitter(tools=reads_calls)

    def _object(
        self, text: str, *, done: bool, thinking: str | None = None, tool_calls: list[JSONValue] | None = None
    ) -> JSONObject:
        out: JSONObject = {"model": self._model, "created_at": created_at()}
        if self.kind == "chat":
            message: JSONObject = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            out["message"] = message
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        out["done"] = done
        return out

    def _stats(
        self,
        out: JSONObject,
        finish_reason: str | None,
        usage: Mapping[str, int] | None,
        metadata: Mapping[str, JSONValue] | None,
    ) -> JSONObject:
        usage = usage or {}
        total_s = time.perf_counter() - self._started
        out["done_reason"] = "length" if finish_reason == "length" else "stop"
        out["total_duration"] = int(total_s * NS)
        out["load_duration"] = int(self._load_s * NS)
        if "prompt_tokens" in usage:
            out["prompt_eval_count"] = int(usage["prompt_tokens"])
        if "completion_tokens" in usage:
            out["eval_count"] = int(usage["completion_tokens"])
        execution = (metadata or {}).get("execution")
        if isinstance(execution, Mapping):
            ttft, queue = execution.get("ttft_s"), execution.get("queue_s", 0.0)
            if isinstance(ttft, (int, float)) and isinstance(queue, (int, float)):
                out["prompt_eval_duration"] = int(max(0.0, ttft - queue) * NS)
                out["eval_duration"] = int(max(0.0, total_s - self._load_s - ttft) * NS)
        return out

    def body(self, result: GenerationResult, *, model: str, reasoning_open: bool) -> JSONObject:
        self._model = model
        content, reasoning = result.content, result.reasoning
        if not result.tool_calls:
            content, reasoning = cut_off_reasoning(content, reasoning, reasoning_open=reasoning_open)
        out = self._object(content, done=True, thinking=reasoning, tool_calls=ollama_tool_calls(result.tool_calls))
        return self._stats(out, result.finish_reason, result.usage, result.metadata)

    def opening(self, *, model: str, reasoning_open: bool) -> list[str]:
        self._model = model
        self._splitter = OutputSplitter(tools=self._reads_calls, reasoning_open=reasoning_open)
        return []

    def text(self, delta: str, logprobs: list[TokenLogprob] | None = None, *, index: int = 0) -> str:
        # One answer, no logprobs: this route's body asks for neither (``logprobs`` is always None).
        return "".join(self._lines(self._splitter.feed(delta)))

    def closing(
        self, final: GenerationChunk, *, tail: str, text: str, logprobs: list[TokenLogprob] | None = None
    ) -> list[str]:
        pieces = [*self._splitter.feed(tail), *self._splitter.finish()]
        done = self._stats(self._object("", done=True), final.finish_reason, final.usage, final.metadata)
        return [*self._lines(pieces), _line(done)]

    def _lines(self, pieces: list[StreamPiece]) -> list[str]:
        out: list[str] = []
        for piece in pieces:
            match piece:
                case ReasoningPiece(text=text):
                    out.append(_line(self._object("", done=False, thinking=text)))
                case ContentPiece(text=text):
                    out.append(_line(self._object(text, done=False)))
                case ToolCallPiece(call=call):
                    out.append(
                        _line(self._object("", done=False, tool_calls=[_ollama_call(call.name, call.arguments)]))
                    )
        return out

    def ending(self) -> list[str]:
        return []

    def failure(self, error: BaseException) -> list[str]:
        return [_line(ollama_error_body(error_payload(error)[1]))]
