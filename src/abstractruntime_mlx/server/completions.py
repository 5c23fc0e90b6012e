"""``POST /v1/completions``: OpenAI's legacy text completions (a prompt string in, text out).

The prompt is sent as one user turn through the model's chat template (the engine renders
every request with the template; raw-text continuation is not available), so the answer is
what ``/v1/chat/completions`` gives for that one message. The body takes the chat route's
sampling fields (``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop`` ...), its
controls (``speculation``, ``thinking``, ``prompt_cache_key``) and ``stream`` /
``stream_options``, with the same checks and errors. ``prompt`` is a string, or a list of one
string. Refused with ``invalid_request`` (400) naming the field: several prompts, ``n`` or
``best_of`` above 1, ``echo: true``, ``logprobs`` and ``suffix``.

The answer is a ``text_completion`` object (``choices[0].text``, ``usage``, and the additive
``abstractcore`` block); a stream sends ``text_completion`` chunks, the terminal one with
``finish_reason`` (and vLLM's ``stop_reason``, ``wire.finished_choice``), ``usage`` and
``abstractcore``, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import Response

from ..errors import InvalidRequest
from ..json_values import JSONObject
from ..results import GenerationChunk, GenerationResult
from .edge import read_body
from .calls import chat_body, serve_call
from .schemas import ModelName, SamplingFields, StreamOptions, parse_body
from .sse import DONE, data_event, error_records
from .wire import finished_choice, usage_to_wire, with_usage_and_block

log = logging.getLogger(__name__)

TOLERATED_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")

    model: ModelName | None = None
    prompt: StrictStr | list[StrictStr] = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(default=None, ge=1, le=1)
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None
    max_tokens: StrictInt | None = None
    speculation: object = None
    thinking: object = None
    keep_alive: object = None  # as on chat: how long the model stays resident once idle
    prompt_cache_key: StrictStr | None = None

    def unknown_fields(self) -> list[str]:
        return sorted(k for k in (self.model_extra or {}) if k not in TOLERATED_FIELDS)

    def the_prompt(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise InvalidRequest(
                f"prompt holds {len(self.prompt)} prompts; this server completes one prompt per request",
                details={"field": "prompt"},
            )
        return self.prompt[0]


_REFUSED = (
    ("echo", lambda b: b.echo, "echo is not supported: the answer never repeats the prompt"),
    ("logprobs", lambda b: b.logprobs is not None, "logprobs are not supported"),
    ("suffix", lambda b: b.suffix is not None, "suffix (insertion) is not supported"),
)


async def create_completion(request: Request) -> Response:
    body = await asyncio.to_thread(parse_body, CompletionRequest, await read_body(request))
    unknown = body.unknown_fields()
    if unknown:
        log.warning("completions request: ignoring unknown field(s) %s", ", ".join(unknown))
    for field, refused, message in _REFUSED:
        if refused(body):
            raise InvalidRequest(message, details={"field": field})
    chat = await chat_body(
        {
            "model": body.model,
            "messages": [{"role": "user", "content": body.the_prompt()}],
            "stream": body.stream,
            "stream_options": None if body.stream_options is None else body.stream_options.model_dump(exclude_none=True),
            "max_tokens": body.max_tokens,
            "speculation": body.speculation,
            "thinking": body.thinking,
            "keep_alive": body.keep_alive,
            "prompt_cache_key": body.prompt_cache_key,
            **body.sampling_given(),
        }
    )
    return await serve_call(request, chat, route="completions", renderer=CompletionRenderer())


class CompletionRenderer:
    """Writes one call's answer as ``text_completion`` objects (``calls.WireRenderer``)."""

    ends_at_final = True

    def __init__(self) -> None:
        self.completion_id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._model = ""

    def _body(self, text: str, *, finish_reason: str | None, usage: dict[str, int] | None = None, metadata: JSONObject | None = None) -> JSONObject:
        body: JSONObject = {
            "id": self.completion_id,
            "object": "text_completion",
            "created": self.created,
            "model": self._model,
            "choices": [finished_choice({"index": 0, "text": text, "logprobs": None}, finish_reason, metadata)],
        }
        return with_usage_and_block(body, usage=usage_to_wire(usage), metadata=metadata)

    def body(self, result: GenerationResult, *, model: str, reasoning_open: bool = False) -> JSONObject:
        self._model = model
        return self._body(result.content, finish_reason=result.finish_reason or "stop", usage=result.usage, metadata=result.metadata)

    def opening(self, *, model: str, reasoning_open: bool) -> list[str]:
        self._model = model
        return []

    def text(self, delta: str) -> str:
        return data_event(self._body(delta, finish_reason=None))

    def closing(self, final: GenerationChunk, *, tail: str, text: str) -> list[str]:
        last = data_event(self._body("", finish_reason=final.finish_reason, usage=final.usage, metadata=final.metadata))
        return [self.text(tail), last] if tail else [last]

    def ending(self) -> list[str]:
        return [DONE]

    def failure(self, error: BaseException) -> list[str]:
        return error_records(error)
