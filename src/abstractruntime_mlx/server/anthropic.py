"""``POST /v1/messages``: Anthropic's Messages API, a thin translation onto the chat call path.

The body becomes a chat body (``calls.chat_body``) and runs through ``calls.serve_call``:

- ``system`` (a string or text blocks) is a system message first; ``messages`` take a string or
  content blocks: ``text``, ``image`` (``source.type = "base64"``; the chat route's image rules,
  ``media.py``), ``tool_use`` in assistant turns (the chat form's ``tool_calls``),
  ``tool_result`` in user turns (a ``tool`` message each, before the turn's other content) and
  ``thinking`` in assistant turns (the message's ``reasoning``); ``cache_control`` is accepted
  and changes nothing (the prefix cache works without it);
- ``max_tokens`` (required), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``,
  ``thinking`` (``{"type": "enabled" | "disabled"}``), ``tools`` (custom tools: ``name``,
  ``description``, ``input_schema``), ``tool_choice`` (``auto``, ``none``, ``any``: the chat
  form's ``required``, ``{"type": "tool", "name": N}``: the named function; the grammar forces
  the call; ``disable_parallel_tool_use`` changes nothing: one call is forced), and this
  server's ``speculation``, ``prompt_cache_key`` and ``keep_alive``.

The answer is a ``message`` whose ``content`` holds a ``thinking`` block when the model thought,
a ``text`` block, and a ``tool_use`` block per tool call the provider parsed (then
``stop_reason: "tool_use"``); a stop string that matched is ``stop_reason: "stop_sequence"``
with ``stop_sequence`` set to it; ``usage`` has ``input_tokens`` (the prompt tokens computed for
this call), ``cache_read_input_tokens`` (those the prefix cache gave) and ``output_tokens``.
When the prompt opened a think block and the answer never closed it (the output cap cut the
thinking), the answer is a ``thinking`` block and an empty ``text`` block.
``stream: true`` sends Anthropic's events as the answer is read (``model_output.OutputSplitter``):
``message_start``, ``ping``, then per block in the order of the message's ``content``
``content_block_start``, its deltas (``thinking_delta``, ``text_delta``; a ``tool_use`` block,
started with its ``id`` and ``name`` once the call is complete, one ``input_json_delta``) and
``content_block_stop``; then ``message_delta`` (``stop_reason``, ``usage``) and
``message_stop``. The blocks a stream adds up to are the non-streamed message's. Every error is Anthropic's
``{"type": "error", "error": {"type", "message", "code"}}`` (``dialects.py``); after the first
byte it is an ``error`` event.

``POST /v1/messages/count_tokens`` takes the conversation fields (``ConversationRequest``) and
answers ``{"input_tokens": N}``, the provider's ``count_prompt_tokens`` of the same chat body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Mapping
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import InvalidMedia, InvalidRequest, TokenCountUnsupported, UpstreamError
from ..json_values import JSONObject, JSONValue
from ..model_output import ContentPiece, OutputSplitter, ReasoningPiece, StreamPiece, ToolCallPiece, cut_off_reasoning
from ..results import GenerationChunk, GenerationResult, TokenLogprob, stop_reason
from .calls import chat_body, serve_call
from .dialects import anthropic_error_body, dialect_route
from .edge import generation_request, pool_of, read_body, served_provider
from .pool import UNSET
from .schemas import MAX_MESSAGES, FiniteFloat, ModelName, parse_body
from .sse import named_event
from .wire import abstractcore_block, error_payload, format_tool_calls

log = logging.getLogger(__name__)

TOLERATED_FIELDS: Final = frozenset({"metadata", "service_tier", "container", "mcp_servers"})


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: StrictStr | list[dict[str, object]]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    description: StrictStr | None = None
    input_schema: dict[str, object]
    type: Literal["custom"] | None = None


class ConversationRequest(BaseModel):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the prompt as the template renders it."""

    model_config = ConfigDict(extra="allow")

    model: ModelName | None = None
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: StrictStr | list[dict[str, object]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, object] | None = None
    thinking: dict[str, object] | None = None

    def unknown_fields(self) -> list[str]:
        return sorted(k for k in (self.model_extra or {}) if k not in TOLERATED_FIELDS)


class MessagesRequest(ConversationRequest):
    max_tokens: StrictInt
    stop_sequences: list[StrictStr] | None = None
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    # this server's controls (``extra_body`` in the SDK)
    speculation: object = None
    prompt_cache_key: StrictStr | None = None
    keep_alive: object = None


# --------------------------------------------------------------------------- request


def _text_of(block: Mapping[str, object], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}: a text block needs a string 'text'", details={"field": f"{where}.text"})
    return text


def system_text(system: str | list[dict[str, object]] | None) -> str | None:
    """The system prompt of ``system`` (text blocks joined with a newline)."""
    if system is None or isinstance(system, str):
        return system
    texts = []
    for index, block in enumerate(system):
        where = f"system.{index}"
        if block.get("type") != "text":
            raise InvalidRequest(f"{where}: system blocks must be text blocks", details={"field": f"{where}.type"})
        texts.append(_text_of(block, where))
    return "\n".join(texts)


def _image_part(block: Mapping[str, object], where: str) -> JSONObject:
    source = block.get("source")
    if not isinstance(source, dict):
        raise InvalidMedia(f"{where}: an image block needs a 'source' object")
    if source.get("type") != "base64":
        raise InvalidMedia(
            f"{where}: image source type {source.get('type')!r} is not supported; send the image inline "
            "(source.type 'base64' with media_type and data)"
        )
    media_type, data = source.get("media_type"), source.get("data")
    if not isinstance(media_type, str) or not isinstance(data, str):
        raise InvalidMedia(f"{where}: a base64 image source needs string 'media_type' and 'data'")
    # the chat route's image part: media.extract_images checks the type, the base64 and the bytes
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}


def _tool_result_text(block: Mapping[str, object], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or text blocks", details={"field": f"{where}.content"})
    texts = []
    for index, part in enumerate(content):
        at = f"{where}.content.{index}"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidRequest(f"{at}: a tool_result's content holds text blocks only", details={"field": at})
        texts.append(_text_of(part, at))
    return "\n".join(texts)


def _block_type(block: Mapping[str, object]) -> object:
    return block.get("type")


def _user_turn(blocks: list[dict[str, object]], where: str) -> list[JSONObject]:
    results: list[JSONObject] = []
    parts: list[JSONValue] = []
    for index, block in enumerate(blocks):
        at = f"{where}.{index}"
        kind = _block_type(block)
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(block, at)})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest(
                    f"{at}: a tool_result block needs 'tool_use_id'", details={"field": f"{at}.tool_use_id"}
                )
            results.append({"role": "tool", "tool_call_id": call_id, "content": _tool_result_text(block, at)})
        else:
            raise _bad_block(kind, at, "user", ("text", "image", "tool_result"))
    out = list(results)
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_turn(blocks: list[dict[str, object]], where: str) -> JSONObject:
    texts: list[str] = []
    calls: list[JSONValue] = []
    reasoning: list[str] = []
    for index, block in enumerate(blocks):
        at = f"{where}.{index}"
        kind = _block_type(block)
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, dict):
                raise InvalidRequest(
                    f"{at}: a tool_use block needs string 'id' and 'name' and an object 'input'", details={"field": at}
                )
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "thinking":
            thought = block.get("thinking")
            if not isinstance(thought, str):
                raise InvalidRequest(
                    f"{at}: a thinking block needs a string 'thinking'", details={"field": f"{at}.thinking"}
                )
            reasoning.append(thought)
        else:
            raise _bad_block(kind, at, "assistant", ("text", "tool_use", "thinking"))
    message: JSONObject = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning"] = "\n".join(reasoning)
    return message


def _bad_block(kind: object, where: str, role: str, accepted: tuple[str, ...]) -> InvalidRequest:
    return InvalidRequest(
        f"{where}: content blocks of type {kind!r} are not supported in {role} turns (accepted: {', '.join(accepted)})",
        details={"field": f"{where}.type"},
    )


def chat_messages(body: ConversationRequest) -> list[JSONObject]:
    """The chat messages of ``system`` and ``messages``."""
    messages: list[JSONObject] = []
    system = system_text(body.system)
    if system:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(body.messages):
        where = f"messages.{index}.content"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            messages.extend(_user_turn(message.content, where))
        else:
            messages.append(_assistant_turn(message.content, where))
    return messages


def chat_tool_choice(body: ConversationRequest) -> JSONValue:
    """The chat form of ``tool_choice``: ``auto`` / ``none`` as they are, ``any`` is ``required``,
    ``{"type": "tool", "name": N}`` the function N (checked against the tools by ``tools.parse_tool_choice``)."""
    choice = body.tool_choice or {}
    kind = choice.get("type", "auto")
    if kind in ("auto", "none"):
        return str(kind)
    if kind == "any":
        return "required"
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(
                "tool_choice of type 'tool' needs a string 'name'", details={"field": "tool_choice.name"}
            )
        return {"type": "function", "function": {"name": name}}
    raise InvalidRequest(
        f"tool_choice type {kind!r} is not supported (accepted: auto, any, tool, none)",
        details={"field": "tool_choice.type"},
    )


def chat_tools(body: ConversationRequest) -> list[JSONObject] | None:
    """The chat form of ``tools`` (``None`` when there are none or ``tool_choice`` is ``none``)."""
    if not body.tools or chat_tool_choice(body) == "none":
        return None
    out: list[JSONObject] = []
    for tool in body.tools:
        function: JSONObject = {"name": tool.name, "parameters": _json(tool.input_schema)}
        if tool.description is not None:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


def thinking_of(thinking: Mapping[str, object] | None) -> bool | None:
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise InvalidRequest(
            f"thinking.type must be 'enabled', 'adaptive' or 'disabled' (got {kind!r})",
            details={"field": "thinking.type"},
        )
    return kind != "disabled"


def _json(value: Mapping[str, object]) -> JSONObject:
    return {str(k): v for k, v in json.loads(json.dumps(value)).items()}


# --------------------------------------------------------------------------- route


@dialect_route
async def create_message(request: Request) -> Response:
    body = await asyncio.to_thread(parse_body, MessagesRequest, await read_body(request))
    unknown = body.unknown_fields()
    if unknown:
        log.warning("messages request: ignoring unknown field(s) %s", ", ".join(unknown))
    tools = chat_tools(body)
    chat = await chat_body(
        {
            "model": body.model,
            "messages": chat_messages(body),
            "stream": body.stream,
            "max_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "tools": tools,
            "tool_choice": chat_tool_choice(body),
            "thinking": thinking_of(body.thinking),
            "speculation": body.speculation,
            "prompt_cache_key": body.prompt_cache_key,
            "keep_alive": body.keep_alive,
        }
    )
    return await serve_call(
        request, chat, route="messages", renderer=MessagesRenderer(reads_calls=chat.reads_tool_calls())
    )


@dialect_route
async def count_tokens(request: Request) -> Response:
    """``{"input_tokens": N}``: the prompt tokens ``/v1/messages`` would be given for this body
    (system, messages and tools through the chat template; nothing is generated)."""
    body = await asyncio.to_thread(parse_body, ConversationRequest, await read_body(request))
    unknown = body.unknown_fields()
    if unknown:
        log.warning("count_tokens request: ignoring unknown field(s) %s", ", ".join(unknown))
    tools = chat_tools(body)
    chat = await chat_body(
        {
            "model": body.model,
            "messages": chat_messages(body),
            "tools": tools,
            "tool_choice": chat_tool_choice(body),
            "thinking": thinking_of(body.thinking),
        }
    )
    typed = generation_request(chat, None)
    # The model is resident (loaded now if it was not) while its template renders the prompt.
    lease = await pool_of(request).acquire(body.model, keep_alive=UNSET)
    try:
        counter = getattr(served_provider(lease), "count_prompt_tokens", None)
        if not callable(counter):
            raise TokenCountUnsupported(
                f"{lease.name} cannot count tokens without generating", details={"model": lease.name}
            )
        count = await asyncio.to_thread(counter, typed)
    finally:
        lease.release()
    return JSONResponse({"input_tokens": int(count)})


# --------------------------------------------------------------------------- wire


def usage_of(usage: Mapping[str, int] | None) -> JSONObject:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the prefix cache."""
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens", usage.get("input_tokens", 0)))
    cached = int(usage.get("cached_input_tokens", 0))
    return {
        "input_tokens": max(0, prompt - cached),
        "cache_read_input_tokens": cached,
        "output_tokens": int(usage.get("completion_tokens", usage.get("output_tokens", 0))),
    }


def stop_of(
    finish_reason: str | None, metadata: Mapping[str, JSONValue] | None, *, tool_use: bool
) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)``: ``stop_sequence`` names the stop string that matched."""
    if tool_use:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    matched = stop_reason(metadata)
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def content_blocks(result: GenerationResult, *, reasoning_open: bool) -> list[JSONValue]:
    """The message's ``content``: a ``thinking`` block when the model thought, a ``text`` block
    (unless the answer is only tool calls), a ``tool_use`` block per call."""
    content, reasoning = result.content, result.reasoning
    if not result.tool_calls:
        content, reasoning = cut_off_reasoning(content, reasoning, reasoning_open=reasoning_open)
    blocks: list[JSONValue] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content or not result.tool_calls:
        blocks.append({"type": "text", "text": content})
    for call in format_tool_calls(result.tool_calls or []):
        function = call["function"]
        assert isinstance(function, dict)  # format_tool_calls' shape
        blocks.append({"type": "tool_use", "id": call["id"], "name": function["name"], "input": _arguments(function)})
    return blocks


def _arguments(function: Mapping[str, JSONValue]) -> JSONObject:
    arguments = json.loads(str(function["arguments"] or "{}"))
    if not isinstance(arguments, dict):
        raise UpstreamError(f"the tool call {function['name']!r} has arguments that are not a JSON object")
    return arguments


class MessagesRenderer:
    """Writes one call's answer as an Anthropic ``message``, or as its events (``calls.WireRenderer``).

    A stream's pieces (``OutputSplitter``) go into blocks as the message's ``content`` holds
    them: whitespace that ends a block (or, before tool calls, a whole text block of it) is held
    back until more of the block comes, as the answer's parser strips it.
    """

    ends_at_final = True

    def __init__(self, *, reads_calls: bool = False) -> None:
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self._model = ""
        self._reads_calls = reads_calls
        self._splitter = OutputSplitter(tools=reads_calls)
        self._num_blocks = 0
        self._open: Literal["thinking", "text"] | None = None
        self._has_text = False
        self._held = ""  # whitespace at the end of the open block (or before the text block opens), not sent yet

    def _message(
        self, content: list[JSONValue], *, stop: tuple[str | None, str | None], usage: JSONObject
    ) -> JSONObject:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }

    def body(self, result: GenerationResult, *, model: str, reasoning_open: bool) -> JSONObject:
        self._model = model
        blocks = content_blocks(result, reasoning_open=reasoning_open)
        tool_use = any(isinstance(b, dict) and b.get("type") == "tool_use" for b in blocks)
        message = self._message(
            blocks, stop=stop_of(result.finish_reason, result.metadata, tool_use=tool_use), usage=usage_of(result.usage)
        )
        block = abstractcore_block(result.metadata)
        if block is not None:
            message["abstractcore"] = block
        return message

    def opening(self, *, model: str, reasoning_open: bool) -> list[str]:
        self._model = model
        self._splitter = OutputSplitter(tools=self._reads_calls, reasoning_open=reasoning_open)
        start = self._message([], stop=(None, None), usage={"input_tokens": 0, "output_tokens": 0})
        return [_event("message_start", {"message": start}), _event("ping", {})]

    def text(self, delta: str, logprobs: list[TokenLogprob] | None = None, *, index: int = 0) -> str:
        # One answer, no logprobs: this route's body asks for neither (``logprobs`` is always None).
        return "".join(self._pieces(self._splitter.feed(delta)))

    def closing(
        self, final: GenerationChunk, *, tail: str, text: str, logprobs: list[TokenLogprob] | None = None
    ) -> list[str]:
        out = self._pieces([*self._splitter.feed(tail), *self._splitter.finish()])
        tool_use = self._splitter.num_calls > 0
        if not tool_use:
            # An answer without calls has a text block, whitespace and all (an empty one, too).
            if self._open == "thinking":
                out.extend(self._close())
            if self._open is None and not self._has_text:
                out.append(self._open_block("text"))
            if self._held:
                out.append(self._delta(self._held))
        out.extend(self._close())
        reason, sequence = stop_of(final.finish_reason, final.metadata, tool_use=tool_use)
        ending: JSONObject = {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage_of(final.usage),
        }
        block = abstractcore_block(final.metadata)
        if block is not None:
            ending["abstractcore"] = block
        return [*out, _event("message_delta", ending), _event("message_stop", {})]

    def _pieces(self, pieces: list[StreamPiece]) -> list[str]:
        out: list[str] = []
        for piece in pieces:
            match piece:
                case ReasoningPiece(text=text):
                    out.extend(self._write("thinking", text))
                case ContentPiece(text=text):
                    out.extend(self._write("text", text))
                case ToolCallPiece(call_id=call_id, call=call):
                    out.extend(self._close())
                    opened: JSONObject = {"type": "tool_use", "id": call_id, "name": call.name, "input": {}}
                    index = self._next_index()
                    out.append(_event("content_block_start", {"index": index, "content_block": opened}))
                    out.append(
                        _event(
                            "content_block_delta",
                            {"index": index, "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
                        )
                    )
                    out.append(_event("content_block_stop", {"index": index}))
        return out

    def _next_index(self) -> int:
        self._num_blocks += 1
        return self._num_blocks - 1

    def _write(self, kind: Literal["thinking", "text"], text: str) -> list[str]:
        """``text`` into a ``kind`` block (the open one, or a new one after closing it); the
        block opens with its first text that is not whitespace, and its trailing whitespace
        waits for more of the block."""
        out = self._close() if self._open not in (None, kind) else []
        pending = self._held + text
        visible = pending.rstrip()
        self._held = pending[len(visible) :]
        if not visible:
            return out
        if self._open is None:
            out.append(self._open_block(kind))
        out.append(self._delta(visible))
        return out

    def _open_block(self, kind: Literal["thinking", "text"]) -> str:
        opened: JSONObject = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        self._open = kind
        self._has_text = self._has_text or kind == "text"
        return _event("content_block_start", {"index": self._next_index(), "content_block": opened})

    def _delta(self, text: str) -> str:
        delta: JSONObject = (
            {"type": "thinking_delta", "thinking": text}
            if self._open == "thinking"
            else {"type": "text_delta", "text": text}
        )
        return _event("content_block_delta", {"index": self._num_blocks - 1, "delta": delta})

    def _close(self) -> list[str]:
        """Close the open block; whitespace it held back is not part of it."""
        self._held = ""
        if self._open is None:
            return []
        self._open = None
        return [_event("content_block_stop", {"index": self._num_blocks - 1})]

    def ending(self) -> list[str]:
        return []

    def failure(self, error: BaseException) -> list[str]:
        status, payload = error_payload(error)
        return [named_event("error", anthropic_error_body(status, payload))]


def _event(kind: str, fields: JSONObject) -> str:
    return named_event(kind, {"type": kind, **fields})
