"""``POST /v1/chat/completions``: OpenAI-compatible chat, streamed or not (``docs/server.md``).

The body is checked at the edge (``schemas.ChatCompletionRequest``, decoded on a thread: it may
be large) and runs through ``calls.serve_call`` like every generating route; ``ChatRenderer``
writes the ``chat.completion`` body and the ``chat.completion.chunk`` stream: a first chunk with
``delta.role``, content deltas, one terminal chunk with ``finish_reason``, ``usage`` and
``abstractcore``, then ``data: [DONE]``; an error after the first byte is a
``data: {"error": ...}`` record followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from starlette.requests import Request
from starlette.responses import Response

from ..json_values import JSONObject, JSONValue
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
    return await serve_call(request, body, route="chat", renderer=ChatRenderer(n=body.n or 1))


class ChatRenderer:
    """Writes one call's answer as ``chat.completion`` objects (``calls.WireRenderer``); ``n``:
    how many answers it has (each chunk names its own in ``choices[0].index``)."""

    ends_at_final = False

    def __init__(self, *, n: int = 1) -> None:
        self.completion_id = new_completion_id()
        self.created = now_s()
        self._model = ""
        self._n = n

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

    def body(self, result: GenerationResult, *, model: str) -> JSONObject:
        return completion_body(result, completion_id=self.completion_id, model=model, created=self.created)

    def opening(self, *, model: str) -> list[str]:
        self._model = model
        return [self._chunk({"role": "assistant", "content": ""}, index=i) for i in range(self._n)]

    def text(self, delta: str, logprobs: list[TokenLogprob] | None = None, *, index: int = 0) -> str:
        return self._chunk({"content": delta}, logprobs=logprobs, index=index)

    def closing(self, final: GenerationChunk, *, tail: str, text: str, logprobs: list[TokenLogprob] | None = None) -> list[str]:
        delta: JSONObject = {"content": tail} if tail else {}
        reason = final.finish_reason or final.choice_finish_reason
        return [
            self._chunk(delta, finish_reason=reason, usage=final.usage, metadata=final.metadata, logprobs=logprobs, index=final.index)
        ]

    def ending(self) -> list[str]:
        return [DONE]

    def failure(self, error: BaseException) -> list[str]:
        return error_records(error)
