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
``tool_choice`` is not ``none``. With ``n`` answers every chunk names its answer in
``choices[0].index`` and each answer is read apart (its own role chunk, reasoning, calls and
terminal chunk); asked-for logprobs ride the chunk that sends their tokens' text (a token whose
text is held back, as a possible marker, rides the answer's next chunk).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from starlette.requests import Request
from starlette.responses import Response

from ..json_values import JSONObject, JSONValue
from ..model_output import ContentPiece, OutputSplitter, ReasoningPiece, StreamPiece, ToolCallPiece
from ..results import GenerationChunk, GenerationResult, TokenLogprob
from .calls import serve_call
from .edge import read_body
from .schemas import ChatCompletionRequest, parse_body, refuse_unknown
from .sse import DONE, data_event, error_records
from .wire import chunk_body, completion_body, new_completion_id, now_s

log = logging.getLogger(__name__)


async def chat_completions(request: Request) -> Response:
    # Decoding and checking a large body (up to the body limit) takes long: off the event loop.
    body = await asyncio.to_thread(parse_body, ChatCompletionRequest, await read_body(request))
    refuse_unknown(body.unknown_fields())
    renderer = ChatRenderer(n=body.n or 1, reads_calls=body.reads_tool_calls())
    return await serve_call(request, body, route="chat", renderer=renderer)


class ChatRenderer:
    """Writes one call's answer as ``chat.completion`` objects (``calls.WireRenderer``); ``n``:
    how many answers it has (each chunk names its own in ``choices[0].index``)."""

    ends_at_final = False

    def __init__(self, *, n: int = 1, reads_calls: bool = False) -> None:
        self.completion_id = new_completion_id()
        self.created = now_s()
        self._model = ""
        self._n = n
        self._reads_calls = reads_calls
        # Each answer is read apart: its own reasoning, text and calls, and the logprobs of
        # tokens whose text is still held back (they ride the answer's next chunk).
        self._splitters = [OutputSplitter(tools=reads_calls) for _ in range(n)]
        self._held: list[list[TokenLogprob] | None] = [None] * n

    def _chunk(
        self,
        delta: JSONObject,
        *,
        finish_reason: str | None = None,
        usage: Mapping[str, int] | None = None,
        metadata: Mapping[str, JSONValue] | None = None,
        logprobs: list[TokenLogprob] | None = None,
        index: int = 0,
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
                logprobs=logprobs,
                index=index,
            )
        )

    def body(self, result: GenerationResult, *, model: str, reasoning_open: bool = False) -> JSONObject:
        return completion_body(result, completion_id=self.completion_id, model=model, created=self.created)

    def opening(self, *, model: str, reasoning_open: bool) -> list[str]:
        self._model = model
        self._splitters = [
            OutputSplitter(tools=self._reads_calls, reasoning_open=reasoning_open) for _ in range(self._n)
        ]
        return [self._chunk({"role": "assistant", "content": ""}, index=i) for i in range(self._n)]

    def text(self, delta: str, logprobs: list[TokenLogprob] | None = None, *, index: int = 0) -> str:
        self._hold(index, logprobs)
        return "".join(self._pieces(self._splitters[index].feed(delta), index))

    def closing(
        self, final: GenerationChunk, *, tail: str, text: str, logprobs: list[TokenLogprob] | None = None
    ) -> list[str]:
        index = final.index
        splitter = self._splitters[index]
        self._hold(index, logprobs)
        pieces = [*splitter.feed(tail), *splitter.finish()]
        # Trailing answer text rides on the terminal chunk.
        last: JSONObject = {}
        if pieces and isinstance(trailing := pieces[-1], ContentPiece):
            last = {"content": trailing.text}
            pieces.pop()
        finish = final.finish_reason or final.choice_finish_reason
        if splitter.num_calls and finish == "stop":
            finish = "tool_calls"
        out = self._pieces(pieces, index)
        held, self._held[index] = self._held[index], None
        out.append(
            self._chunk(
                last, finish_reason=finish, usage=final.usage, metadata=final.metadata, logprobs=held, index=index
            )
        )
        return out

    def _hold(self, index: int, logprobs: list[TokenLogprob] | None) -> None:
        if logprobs is not None:
            self._held[index] = [*(self._held[index] or ()), *logprobs]

    def _pieces(self, pieces: list[StreamPiece], index: int) -> list[str]:
        out: list[str] = []
        for piece in pieces:
            held, self._held[index] = self._held[index], None
            match piece:
                case ReasoningPiece(text=text):
                    out.append(self._chunk({"reasoning_content": text}, logprobs=held, index=index))
                case ContentPiece(text=text):
                    out.append(self._chunk({"content": text}, logprobs=held, index=index))
                case ToolCallPiece(index=call, call_id=call_id, call=parsed):
                    head: JSONObject = {
                        "index": call,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": parsed.name, "arguments": ""},
                    }
                    out.append(self._chunk({"tool_calls": [head]}, logprobs=held, index=index))
                    arguments: JSONObject = {"index": call, "function": {"arguments": parsed.arguments}}
                    out.append(self._chunk({"tool_calls": [arguments]}, index=index))
        return out

    def ending(self) -> list[str]:
        return [DONE]

    def failure(self, error: BaseException) -> list[str]:
        return error_records(error)
