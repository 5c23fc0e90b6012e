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
  token logprobs on its ``output_text`` part and on its text delta events (the chat route's);
- ``tools``: function tools (``{"type": "function", "name", "description", "parameters"}``) and
  ``tool_choice`` (``auto`` / ``none`` / ``required`` / ``{"type": "function", "name"}``), with
  the chat route's rules (``invalid_tools`` naming the field); ``function_call`` and
  ``function_call_output`` input items carry earlier calls and their results.

Refused with ``invalid_request`` (400) naming the field: ``previous_response_id`` (nothing is
stored: send the whole conversation), ``background: true``, input items of other types, any
other ``include`` value, ``top_logprobs`` without the logprobs ``include``, and any field that is
neither used nor in ``TOLERATED_FIELDS`` (``details.fields`` lists them all).
The output: a ``reasoning`` item when the model thought, a ``message`` item (left out when the
answer is only calls), then one ``function_call`` item per call. A stream sends the Responses
events (``response.created`` ... ``response.reasoning_text.delta`` ...
``response.output_text.delta`` ... ``response.function_call_arguments.delta`` / ``.done`` ...
``response.completed``, or ``response.incomplete`` when the output cap cut the answer), each
item opened (``response.output_item.added``) when its first piece is ready and closed
(``response.output_item.done``) before the next one opens; a failure after the first byte is an
``error`` event holding ``{"error": {...}}``. Asked-for logprobs cover every generated token
(thinking and call text included) and ride the message: an ``output_text.delta`` carries those
of the tokens since the previous one, the message's ``output_text`` part all of them (in a
stream: those up to its end, when calls follow it).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import Response

from ..errors import InvalidRequest
from ..json_values import JSONObject, JSONValue
from ..model_output import ContentPiece, OutputSplitter, ReasoningPiece, StreamPiece, ToolCallPiece
from ..results import GenerationChunk, GenerationResult, TokenLogprob
from ..tools import check_tools
from .calls import chat_body, serve_call
from .edge import read_body
from .schemas import FiniteFloat, ModelName, StreamOptions, parse_body, refuse_unknown
from .sse import named_event
from .wire import error_payload, logprob_entries, with_usage_and_block

TOLERATED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "truncation",
        "parallel_tool_calls",
        "safety_identifier",
        "prompt_cache_retention",
        "max_tool_calls",
    }
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
    tools: object = None  # checked by ``tools.check_tools``
    tool_choice: object = None
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
                    f"include {value!r} is not supported here (only {LOGPROBS_INCLUDE!r})",
                    details={"field": f"include.{index}"},
                )
        if LOGPROBS_INCLUDE not in included:
            if self.top_logprobs is not None:
                raise InvalidRequest(
                    f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]", details={"field": "top_logprobs"}
                )
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
        if kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last.get("role") == "assistant" and isinstance(last.get("tool_calls"), list):
                calls = last["tool_calls"]
                assert isinstance(calls, list)
                calls.append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise InvalidRequest(f"{where} needs a string 'call_id' and 'output'", details={"field": where})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            continue
        if kind != "message":
            raise InvalidRequest(
                f"{where}: input items of type {kind!r} are not supported here "
                "(messages, function_call and function_call_output are)",
                details={"field": f"{where}.type"},
            )
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise InvalidRequest(
                f"{where}.role must be user, system, developer or assistant", details={"field": f"{where}.role"}
            )
        messages.append({"role": str(role), "content": _content(item.get("content"), where=f"{where}.content")})
    return messages


def _function_call(item: dict[str, object], where: str) -> JSONObject:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
        raise InvalidRequest(f"{where} needs string 'call_id', 'name' and 'arguments'", details={"field": where})
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_tools(tools: object) -> list[JSONObject] | None:
    """The chat route's tools of Responses function tools (checked here, in their own form)."""
    checked = check_tools(tools)
    out: list[JSONObject] = []
    for tool in checked:
        spec: JSONObject = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": spec})
    return out or None


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
        f"text.format.type must be 'text', 'json_object' or 'json_schema' (got {kind!r})",
        details={"field": "text.format.type"},
    )


async def create_response(request: Request) -> Response:
    body = await asyncio.to_thread(parse_body, ResponsesRequest, await read_body(request))
    refuse_unknown(body.unknown_fields())
    if body.previous_response_id is not None:
        raise InvalidRequest(
            "previous_response_id is not supported: this server stores no "
            "responses; send the whole conversation in input",
            details={"field": "previous_response_id"},
        )
    tools = chat_tools(body.tools)
    if body.background:
        raise InvalidRequest(
            "background responses are not supported (nothing is stored)", details={"field": "background"}
        )
    top = body.logprobs_asked()
    chat = await chat_body(
        {
            "model": body.model,
            "messages": messages_of(body),
            "stream": body.stream,
            "stream_options": None
            if body.stream_options is None
            else body.stream_options.model_dump(exclude_none=True),
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
            "tools": tools,
            "tool_choice": body.tool_choice,
            "logprobs": None if top is None else True,
            "top_logprobs": top,
        }
    )
    # the body's JSON, as given (decoded from JSON, so JSON values)
    format_echo = (
        cast(JSONObject, dict(body.text.format)) if body.text is not None and body.text.format else {"type": "text"}
    )
    echo: JSONObject = {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "text": {"format": format_echo},
        "tools": cast(list[JSONValue], list(check_tools(body.tools))),
        "tool_choice": cast(JSONValue, body.tool_choice if body.tool_choice is not None else "auto"),
    }
    renderer = ResponsesRenderer(echo, reads_calls=chat.reads_tool_calls(), logprobs=top is not None)
    return await serve_call(request, chat, route="responses", renderer=renderer)


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

    def __init__(self, echo: JSONObject, *, reads_calls: bool = False, logprobs: bool = False) -> None:
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self._echo = echo
        self._model = ""
        self._seq = 0
        self._reads_calls = reads_calls
        self._splitter = OutputSplitter(tools=reads_calls)
        self._output: list[JSONObject] = []  # the stream's finished items
        self._open: JSONObject | None = None  # the item being streamed
        self._open_text: list[str] = []
        # Logprobs when asked: all streamed so far (the message's part), and those no delta carried yet.
        self._logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self._held: list[TokenLogprob] = []

    def _response(
        self,
        *,
        status: str,
        output: list[JSONValue],
        usage: JSONObject | None,
        finish_reason: str | None,
        metadata: JSONObject | None,
    ) -> JSONObject:
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
            "metadata": {},
            **self._echo,
        }
        return with_usage_and_block(body, usage=usage, metadata=metadata)

    @staticmethod
    def _message(
        text: str, status: str, item_id: str | None = None, logprobs: list[TokenLogprob] | None = None
    ) -> JSONObject:
        part: JSONObject = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprob_entries(logprobs)
        return {
            "type": "message",
            "id": item_id or f"msg_{uuid.uuid4().hex}",
            "status": status,
            "role": "assistant",
            "content": [part],
        }

    @staticmethod
    def _reasoning(text: str, item_id: str | None = None) -> JSONObject:
        return {
            "type": "reasoning",
            "id": item_id or f"rs_{uuid.uuid4().hex}",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    @staticmethod
    def _function_call(call_id: str, name: str, arguments: str, status: str) -> JSONObject:
        return {
            "type": "function_call",
            "id": f"fc_{call_id.removeprefix('call_')}",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def body(self, result: GenerationResult, *, model: str, reasoning_open: bool = False) -> JSONObject:
        self._model = model
        output: list[JSONValue] = []
        if result.reasoning:
            output.append(self._reasoning(result.reasoning))
        calls = result.tool_calls or []
        if result.content or not calls:
            output.append(
                self._message(
                    result.content, "completed", logprobs=None if self._logprobs is None else result.logprobs or []
                )
            )
        for call in calls:
            fn = call.get("function")
            assert isinstance(fn, dict)
            output.append(self._function_call(str(call["id"]), str(fn["name"]), str(fn["arguments"]), "completed"))
        return self._response(
            status=_status(result.finish_reason),
            output=output,
            usage=usage_of(result.usage),
            finish_reason=result.finish_reason,
            metadata=result.metadata,
        )

    def _event(self, kind: str, fields: JSONObject) -> str:
        self._seq += 1
        return named_event(kind, {"type": kind, "sequence_number": self._seq, **fields})

    def opening(self, *, model: str, reasoning_open: bool) -> list[str]:
        self._model = model
        self._splitter = OutputSplitter(tools=self._reads_calls, reasoning_open=reasoning_open)
        started = self._response(status="in_progress", output=[], usage=None, finish_reason=None, metadata=None)
        return [
            self._event("response.created", {"response": started}),
            self._event("response.in_progress", {"response": started}),
        ]

    def text(self, delta: str, logprobs: list[TokenLogprob] | None = None, *, index: int = 0) -> str:
        self._hold(logprobs)
        return "".join(self._pieces(self._splitter.feed(delta)))

    def closing(
        self, final: GenerationChunk, *, tail: str, text: str, logprobs: list[TokenLogprob] | None = None
    ) -> list[str]:
        self._hold(logprobs)
        records = self._pieces([*self._splitter.feed(tail), *self._splitter.finish()])
        if (
            not self._output
            and self._open is None
            or self._open is not None
            and self._open["type"] == "reasoning"
            and not self._splitter.num_calls
        ):
            records.extend(self._begin("message"))  # every answer has its message, empty or not
        records.extend(self._end())
        status = _status(final.finish_reason)
        done = self._response(
            status=status,
            output=list(self._output),
            usage=usage_of(final.usage),
            finish_reason=final.finish_reason,
            metadata=final.metadata,
        )
        return [*records, self._event(f"response.{status}", {"response": done})]

    def _hold(self, logprobs: list[TokenLogprob] | None) -> None:
        if self._logprobs is not None and logprobs:
            self._logprobs.extend(logprobs)
            self._held.extend(logprobs)

    def _delta(self, text: str) -> str:
        """An ``output_text.delta`` of the open message, with the logprobs no delta carried yet."""
        held, self._held = self._held, []
        return self._event(
            "response.output_text.delta", {**self._place(), "delta": text, "logprobs": logprob_entries(held)}
        )

    def _pieces(self, pieces: list[StreamPiece]) -> list[str]:
        out: list[str] = []
        for piece in pieces:
            match piece:
                case ReasoningPiece(text=text):
                    out.extend(self._begin("reasoning"))
                    out.append(self._event("response.reasoning_text.delta", {**self._place(), "delta": text}))
                    self._open_text.append(text)
                case ContentPiece(text=text):
                    out.extend(self._begin("message"))
                    out.append(self._delta(text))
                    self._open_text.append(text)
                case ToolCallPiece(call_id=call_id, call=call):
                    out.extend(self._end())
                    item = self._function_call(call_id, call.name, "", "in_progress")
                    index = len(self._output)
                    place: JSONObject = {"item_id": item["id"], "output_index": index}
                    out.append(self._event("response.output_item.added", {"output_index": index, "item": item}))
                    out.append(
                        self._event("response.function_call_arguments.delta", {**place, "delta": call.arguments})
                    )
                    out.append(
                        self._event("response.function_call_arguments.done", {**place, "arguments": call.arguments})
                    )
                    done = self._function_call(call_id, call.name, call.arguments, "completed")
                    out.append(self._event("response.output_item.done", {"output_index": index, "item": done}))
                    self._output.append(done)
        return out

    def _place(self) -> JSONObject:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self._output), "content_index": 0}

    def _begin(self, kind: str) -> list[str]:
        """Open an item of ``kind`` (closing the open one of another kind)."""
        if self._open is not None and self._open["type"] == kind:
            return []
        out = self._end()
        if kind == "reasoning":
            self._open = {**self._reasoning(""), "content": []}
            out.append(
                self._event("response.output_item.added", {"output_index": len(self._output), "item": self._open})
            )
            return out
        self._open = {**self._message("", "in_progress"), "content": []}
        out.append(self._event("response.output_item.added", {"output_index": len(self._output), "item": self._open}))
        out.append(
            self._event(
                "response.content_part.added",
                {**self._place(), "part": {"type": "output_text", "text": "", "annotations": []}},
            )
        )
        return out

    def _end(self) -> list[str]:
        """Close the open item, if any."""
        item, text = self._open, "".join(self._open_text)
        if item is None:
            return []
        place = self._place()
        out: list[str] = []
        if item["type"] == "reasoning":
            done = self._reasoning(text, str(item["id"]))
            out.append(self._event("response.reasoning_text.done", {**place, "text": text}))
        else:
            if self._held:  # tokens whose text no delta sent (thinking, a held-back tail)
                out.append(self._delta(""))
            done = self._message(text, "completed", str(item["id"]), self._logprobs)
            part: JSONObject = {"type": "output_text", "text": text, "annotations": []}
            entries = logprob_entries(self._logprobs or [])
            out.append(self._event("response.output_text.done", {**place, "text": text, "logprobs": entries}))
            out.append(self._event("response.content_part.done", {**place, "part": part}))
        out.append(self._event("response.output_item.done", {"output_index": len(self._output), "item": done}))
        self._output.append(done)
        self._open, self._open_text = None, []
        return out

    def ending(self) -> list[str]:
        return []  # the Responses stream has no [DONE]

    def failure(self, error: BaseException) -> list[str]:
        return [named_event("error", error_payload(error)[1])]


def _status(finish_reason: str | None) -> Literal["completed", "incomplete"]:
    return "incomplete" if finish_reason == "length" else "completed"
