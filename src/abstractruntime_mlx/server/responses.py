"""``POST /v1/responses``: OpenAI's Responses API (text in, text out; streamed or not).

The body becomes a chat body (``calls.chat_body``) and runs as a chat call does:

- ``input`` (a string, or a list of messages whose content is a string or ``input_text`` /
  ``output_text`` / ``input_image`` parts) and ``instructions`` (a system message first);
- ``max_output_tokens``, ``temperature``, ``top_p``, ``seed``, ``reasoning.effort`` (thinking),
  ``prompt_cache_key``, and this server's ``speculation`` / ``thinking`` (``extra_body`` in
  the OpenAI SDK), with the chat route's rules and errors;
- ``text.format``: ``{"type": "json_schema", "name", "schema"}`` asks for a structured answer
  (the chat route's ``response_format``), ``{"type": "json_object"}`` for any JSON object;
- ``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` (0..20): the answer's
  token logprobs on its ``output_text`` part and on each text delta event (the chat route's).

Refused with ``invalid_request`` (400) naming the field: ``previous_response_id`` (nothing is
stored: send the whole conversation), ``tools`` and tool items in ``input`` (use
``/v1/chat/completions``), ``background: true``, input items of other types, any other
``include`` value, and ``top_logprobs`` without the logprobs ``include``. The answer is
one ``message`` output item (a ``reasoning`` item before it when the model thought). A stream
sends the Responses events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``, or ``response.incomplete`` when the output cap cut the answer); a
failure after the first byte is an ``error`` event holding ``{"error": {...}}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import Response

from ..errors import InvalidRequest
from ..json_values import JSONObject, JSONValue
from ..results import GenerationChunk, GenerationResult, TokenLogprob
from .edge import read_body
from .calls import chat_body, serve_call
from .schemas import FiniteFloat, ModelName, StreamOptions, parse_body
from .sse import named_event
from .wire import error_payload, logprob_entries, with_usage_and_block

log = logging.getLogger(__name__)

TOLERATED_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "truncation", "parallel_tool_calls", "tool_choice",
     "safety_identifier", "prompt_cache_retention", "max_tool_calls"}
)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_PART_TYPES = {"input_text": "text", "output_text": "text", "text": "text"}


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="allow")

    effort: StrictStr | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: dict[str, object] | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: ModelName | None = None
    input: StrictStr | list[dict[str, object]]
    instructions: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None  # this server's: include_progress
    max_output_tokens: StrictInt | None = None
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    seed: StrictInt | None = None
    reasoning: Reasoning | None = None
    text: TextOptions | None = None
    prompt_cache_key: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    tools: list[dict[str, object]] | None = None
    background: StrictBool | None = None
    speculation: object = None
    thinking: object = None
    keep_alive: object = None  # as on chat: how long the model stays resident once idle
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = None

    def unknown_fields(self) -> list[str]:
        return sorted(k for k in (self.model_extra or {}) if k not in TOLERATED_FIELDS)

    def logprobs_asked(self) -> int | None:
        """The alternatives per token asked with the logprobs ``include`` (None: no logprobs);
        another ``include`` value, or ``top_logprobs`` without it, is a 400 naming the field."""
        included = self.include or []
        for index, value in enumerate(included):
            if value != LOGPROBS_INCLUDE:
                raise InvalidRequest(
                    f"include {value!r} is not supported here (only {LOGPROBS_INCLUDE!r})", details={"field": f"include.{index}"}
                )
        if LOGPROBS_INCLUDE not in included:
            if self.top_logprobs is not None:
                raise InvalidRequest(f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]", details={"field": "top_logprobs"})
            return None
        return 0 if self.top_logprobs is None else self.top_logprobs


def messages_of(body: ResponsesRequest) -> list[JSONObject]:
    """The chat messages of ``instructions`` and ``input``."""
    messages: list[JSONObject] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    for index, item in enumerate(body.input):
        where = f"input.{index}"
        kind = item.get("type", "message")
        if kind != "message":
            raise InvalidRequest(
                f"{where}: input items of type {kind!r} are not supported here (only messages); "
                "tool calls go through /v1/chat/completions",
                details={"field": f"{where}.type"},
            )
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise InvalidRequest(f"{where}.role must be user, system, developer or assistant", details={"field": f"{where}.role"})
        messages.append({"role": str(role), "content": _content(item.get("content"), where=f"{where}.content")})
    return messages


def _content(content: object, *, where: str) -> JSONValue:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of content parts", details={"field": where})
    parts: list[JSONValue] = []
    for index, part in enumerate(content):
        at = f"{where}.{index}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _PART_TYPES and isinstance(part, dict) and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part, dict) and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise InvalidRequest(
                f"{at} must be an input_text / output_text part with 'text' or an input_image part with 'image_url'",
                details={"field": at},
            )
    return parts


def response_format_of(text: TextOptions | None) -> JSONObject | None:
    """The chat route's ``response_format`` for ``text.format``."""
    fmt = None if text is None else text.format
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec: JSONObject = {"name": fmt.get("name") or "response", "schema": fmt.get("schema")}  # type: ignore[dict-item]
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidRequest(
        f"text.format.type must be 'text', 'json_object' or 'json_schema' (got {kind!r})", details={"field": "text.format.type"}
    )


async def create_response(request: Request) -> Response:
    body = await asyncio.to_thread(parse_body, ResponsesRequest, await read_body(request))
    unknown = body.unknown_fields()
    if unknown:
        log.warning("responses request: ignoring unknown field(s) %s", ", ".join(unknown))
    if body.previous_response_id is not None:
        raise InvalidRequest(
            "previous_response_id is not supported: this server stores no responses; send the whole conversation in input",
            details={"field": "previous_response_id"},
        )
    if body.tools:
        raise InvalidRequest("tools are not supported on /v1/responses; use /v1/chat/completions", details={"field": "tools"})
    if body.background:
        raise InvalidRequest("background responses are not supported (nothing is stored)", details={"field": "background"})
    top = body.logprobs_asked()
    chat = await chat_body(
        {
            "model": body.model,
            "messages": messages_of(body),
            "stream": body.stream,
            "stream_options": None if body.stream_options is None else body.stream_options.model_dump(exclude_none=True),
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "seed": body.seed,
            "reasoning_effort": None if body.reasoning is None else body.reasoning.effort,
            "prompt_cache_key": body.prompt_cache_key,
            "response_format": response_format_of(body.text),
            "speculation": body.speculation,
            "thinking": body.thinking,
            "keep_alive": body.keep_alive,
            "logprobs": None if top is None else True,
            "top_logprobs": top,
        }
    )
    # the body's JSON, as given (decoded from JSON, so JSON values)
    format_echo = cast(JSONObject, dict(body.text.format)) if body.text is not None and body.text.format else {"type": "text"}
    echo: JSONObject = {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "text": {"format": format_echo},
    }
    return await serve_call(request, chat, route="responses", renderer=ResponsesRenderer(echo, logprobs=top is not None))


# --------------------------------------------------------------------------- wire


def usage_of(usage: dict[str, int] | None) -> JSONObject | None:
    if not usage:
        return None
    prompt = int(usage.get("prompt_tokens", usage.get("input_tokens", 0)))
    completion = int(usage.get("completion_tokens", usage.get("output_tokens", 0)))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(usage.get("cached_input_tokens", 0))},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


class ResponsesRenderer:
    """Writes one call's answer as a Responses object, or as its stream of events (``calls.WireRenderer``)."""

    ends_at_final = True

    def __init__(self, echo: JSONObject, *, logprobs: bool = False) -> None:
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self._echo = echo
        self._model = ""
        self._seq = 0
        self._logprobs: list[TokenLogprob] | None = [] if logprobs else None  # streamed so far, when asked

    def _response(self, *, status: str, output: list[JSONValue], usage: JSONObject | None, finish_reason: str | None, metadata: JSONObject | None) -> JSONObject:
        body: JSONObject = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self._model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": [],
            "metadata": {},
            **self._echo,
        }
        return with_usage_and_block(body, usage=usage, metadata=metadata)

    def _message(self, text: str, status: str, logprobs: list[TokenLogprob] | None = None) -> JSONObject:
        part: JSONObject = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprob_entries(logprobs)
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": [part]}

    def body(self, result: GenerationResult, *, model: str) -> JSONObject:
        self._model = model
        output: list[JSONValue] = []
        if result.reasoning:
            output.append(
                {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": [{"type": "reasoning_text", "text": result.reasoning}]}
            )
        output.append(self._message(result.content, "completed", None if self._logprobs is None else result.logprobs or []))
        return self._response(
            status=_status(result.finish_reason), output=output, usage=usage_of(result.usage),
            finish_reason=result.finish_reason, metadata=result.metadata,
        )

    def _event(self, kind: str, fields: JSONObject) -> str:
        self._seq += 1
        return named_event(kind, {"type": kind, "sequence_number": self._seq, **fields})

    def opening(self, *, model: str) -> list[str]:
        self._model = model
        started = self._response(status="in_progress", output=[], usage=None, finish_reason=None, metadata=None)
        place: JSONObject = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.created", {"response": started}),
            self._event("response.in_progress", {"response": started}),
            self._event("response.output_item.added", {"output_index": 0, "item": {**self._message("", "in_progress"), "content": []}}),
            self._event("response.content_part.added", {**place, "part": {"type": "output_text", "text": "", "annotations": []}}),
        ]

    def text(self, delta: str, logprobs: list[TokenLogprob] | None = None, *, index: int = 0) -> str:
        if self._logprobs is not None and logprobs:
            self._logprobs.extend(logprobs)
        return self._event(
            "response.output_text.delta",
            {"item_id": self.message_id, "output_index": 0, "content_index": 0, "delta": delta, "logprobs": logprob_entries(logprobs or [])},
        )

    def closing(self, final: GenerationChunk, *, tail: str, text: str, logprobs: list[TokenLogprob] | None = None) -> list[str]:
        deltas = [self.text(tail, logprobs)] if tail or logprobs else []
        place: JSONObject = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        status = _status(final.finish_reason)
        done = self._response(
            status=status, output=[self._message(text, "completed", self._logprobs)], usage=usage_of(final.usage),
            finish_reason=final.finish_reason, metadata=final.metadata,
        )
        return [
            *deltas,
            self._event("response.output_text.done", {**place, "text": text, "logprobs": logprob_entries(self._logprobs or [])}),
            self._event("response.content_part.done", {**place, "part": {"type": "output_text", "text": text, "annotations": []}}),
            self._event("response.output_item.done", {"output_index": 0, "item": self._message(text, "completed", self._logprobs)}),
            self._event(f"response.{status}", {"response": done}),
        ]

    def ending(self) -> list[str]:
        return []  # the Responses stream has no [DONE]

    def failure(self, error: BaseException) -> list[str]:
        return [named_event("error", error_payload(error)[1])]


def _status(finish_reason: str | None) -> Literal["completed", "incomplete"]:
    return "incomplete" if finish_reason == "length" else "completed"
