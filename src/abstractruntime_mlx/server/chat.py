"""``POST /v1/chat/completions``: OpenAI-compatible chat, streamed or not (``docs/server.md``).

The body is checked at the edge (``schemas.ChatCompletionRequest``, decoded on a thread: it may
be large) and runs through ``calls.serve_call`` like every generating route; ``ChatRenderer``
writes the ``chat.completion`` body and the ``chat.completion.chunk`` stream: a first chunk with
``delta.role``, ``delta.reasoning_content`` and ``delta.content`` deltas, ``delta.tool_calls``
chunks (per call: one with its ``index``, ``id``, ``type`` and ``function.name``, then its
``function.arguments``; the call's text never reaches ``delta.content``), one terminal chunk
with ``finish_reason`` (``tool_calls`` when calls were made), ``usage`` and ``abstractcore``,
then ``data: [DONE]``; an error after the first byte is a ``data: {"error": ...}`` record
followed by ``[DONE]``. Calls are read (``model_output``) when tools were offered and
``tool_choice`` is not ``none``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from starlette.requests import Request
from starlette.responses import Response

from ..json_values import JSONObject, JSONValue
from ..model_output import ContentPiece, OutputSplitter, ReasoningPiece, StreamPiece, ToolCallPiece
from ..results import GenerationChunk, GenerationResult
from .calls import serve_call
from .edge import read_body
from .schemas import ChatCompletionRequest, parse_body
from .sse import DONE, data_event, error_records
from .wire import chunk_body, completion_body, new_completion_id, now_s

log = logging.getLogger(__name__)


async def chat_completions(request: Request) -> Response:
    # Decoding and checking a large body (up to the body limit) takes long: off the event loop.
    body = await asyncio.to_thread(parse_body, ChatCompletionRequest, await read_body(request))
    unknown = body.unknown_fields()
    if unknown:
        log.warning("chat request: ignoring unknown field(s) %s", ", ".join(unknown))
    return await serve_call(request, body, route="chat", renderer=ChatRenderer(reads_calls=body.reads_tool_calls()))


class ChatRenderer:
    """Writes one call's answer as ``chat.completion`` objects (``calls.WireRenderer``)."""

    ends_at_final = False

    def __init__(self, *, reads_calls: bool = False) -> None:
        self.completion_id = new_completion_id()
        self.created = now_s()
        self._model = ""
        self._reads_calls = reads_calls
        self._splitter = OutputSplitter(tools=reads_calls)

    def _chunk(
        self,
        delta: JSONObject,
        *,
        finish_reason: str | None = None,
        usage: Mapping[str, int] | None = None,
        metadata: Mapping[str, JSONValue] | None = None,
    ) -> str:
        return data_event(
            chunk_body(
                completion_id=self.completion_id,
                model=self._model,
                created=self.created,
                delta=delta,
                finish_reason=finish_reason,
                usage=usage,
                metadata=metadata,
            )
        )

    def body(self, result: GenerationResult, *, model: str, reasoning_open: bool = False) -> JSONObject:
        return completion_body(result, completion_id=self.completion_id, model=model, created=self.created)

    def opening(self, *, model: str, reasoning_open: bool) -> list[str]:
        self._model = model
        self._splitter = OutputSplitter(tools=self._reads_calls, reasoning_open=reasoning_open)
        return [self._chunk({"role": "assistant", "content": ""})]

    def text(self, delta: str) -> str:
        return "".join(self._pieces(self._splitter.feed(delta)))

    def closing(self, final: GenerationChunk, *, tail: str, text: str) -> list[str]:
        pieces = [*self._splitter.feed(tail), *self._splitter.finish()]
        # Trailing answer text rides on the terminal chunk.
        last: JSONObject = {}
        if pieces and isinstance(trailing := pieces[-1], ContentPiece):
            last = {"content": trailing.text}
            pieces.pop()
        finish = final.finish_reason
        if self._splitter.num_calls and finish == "stop":
            finish = "tool_calls"
        return [*self._pieces(pieces), self._chunk(last, finish_reason=finish, usage=final.usage, metadata=final.metadata)]

    def _pieces(self, pieces: list[StreamPiece]) -> list[str]:
        out: list[str] = []
        for piece in pieces:
            match piece:
                case ReasoningPiece(text=text):
                    out.append(self._chunk({"reasoning_content": text}))
                case ContentPiece(text=text):
                    out.append(self._chunk({"content": text}))
                case ToolCallPiece(index=index, call_id=call_id, call=call):
                    head: JSONObject = {"index": index, "id": call_id, "type": "function", "function": {"name": call.name, "arguments": ""}}
                    out.append(self._chunk({"tool_calls": [head]}))
                    out.append(self._chunk({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}))
        return out

    def ending(self) -> list[str]:
        return [DONE]

    def failure(self, error: BaseException) -> list[str]:
        return error_records(error)
