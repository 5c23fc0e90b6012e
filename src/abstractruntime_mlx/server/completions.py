"""``POST /v1/completions``: OpenAI's legacy text completions (a prompt string in, text out).

The prompt is continued as plain text, as OpenAI continues it: no chat template (the
tokenizer's begin-of-sequence token first, where it has one). The body takes the chat route's
sampling fields (``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop`` ...), its
controls (``speculation``, ``prompt_cache_key``) and ``stream`` / ``stream_options``, with the
same checks and errors, and ``n`` answers (``choices[i].index``) as chat gives them.
``prompt`` is a string, or a list of one string. ``echo: true`` puts the prompt before each
answer's text; ``logprobs: N`` (0..20) reports each generated token's
logprob and its ``N`` most likely alternatives in the legacy shape (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``). Refused with ``invalid_request`` (400)
naming the field: several prompts, ``best_of`` above 1, ``suffix``, ``echo`` with
``logprobs`` (the prompt's own logprobs are not computed), ``thinking`` (no template to
carry it) and any field this route does not know.

The answer is a ``text_completion`` object (``choices[0].text``, ``usage``, and the additive
``abstractcore`` block); a stream sends ``text_completion`` chunks, the terminal one with
``finish_reason`` (and vLLM's ``stop_reason``, ``wire.finished_choice``), ``usage`` and
``abstractcore``, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import Response

from ..errors import InvalidRequest
from ..json_values import JSONObject, JSONValue
from ..request import check_logprobs
from ..results import GenerationChunk, GenerationResult, TokenLogprob
from .calls import chat_body, serve_call
from .edge import read_body
from .schemas import ModelName, SamplingFields, StreamOptions, parse_body, refuse_unknown
from .sse import DONE, data_event, error_records
from .wire import completion_logprobs, finished_choice, usage_to_wire, with_usage_and_block

TOLERATED_FIELDS = frozenset({"user"})
"""OpenAI fields accepted that change nothing here (``user`` only labels the caller)."""


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")

    model: ModelName | None = None
    prompt: StrictStr | list[StrictStr] = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None  # checked as the chat body's (1..MAX_CHOICES)
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


_REFUSED: tuple[tuple[str, Callable[[CompletionRequest], bool], str], ...] = (
    ("suffix", lambda b: b.suffix is not None, "suffix (insertion) is not supported"),
    (
        "thinking",
        lambda b: b.thinking is not None,
        "thinking is a chat-template control; a plain completion has no template",
    ),
    (
        "echo",
        lambda b: b.echo and b.logprobs is not None,
        "echo with logprobs is not supported: the prompt tokens' logprobs are not computed",
    ),
)


async def create_completion(request: Request) -> Response:
    body = await asyncio.to_thread(parse_body, CompletionRequest, await read_body(request))
    refuse_unknown(body.unknown_fields())
    for field, refused, message in _REFUSED:
        if refused(body):
            raise InvalidRequest(message, details={"field": field})
    prompt = body.the_prompt()
    top = check_logprobs(body.logprobs)
    chat = await chat_body(
        {
            "model": body.model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": body.stream,
            "stream_options": None
            if body.stream_options is None
            else body.stream_options.model_dump(exclude_none=True),
            "max_tokens": body.max_tokens,
            "speculation": body.speculation,
            "keep_alive": body.keep_alive,
            "prompt_cache_key": body.prompt_cache_key,
            "logprobs": None if top is None else True,
            "top_logprobs": top,
            "n": body.n,
            **body.sampling_given(),
        }
    )
    renderer = CompletionRenderer(echo=prompt if body.echo else "", n=body.n or 1)
    return await serve_call(request, chat, route="completions", renderer=renderer, continuation=prompt)


class CompletionRenderer:
    """Writes one call's answer as ``text_completion`` objects (``calls.WireRenderer``);
    ``echo``: the prompt text each answer's text starts with; ``n``: how many answers."""

    ends_at_final = True

    def __init__(self, *, echo: str = "", n: int = 1) -> None:
        self.completion_id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._model = ""
        self._echo = echo
        self._n = n
        self._offsets = [len(echo)] * n  # each answer's next token's text_offset

    def _choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: list[TokenLogprob] | None,
        metadata: Mapping[str, JSONValue] | None = None,
    ) -> JSONObject:
        wire: JSONValue = None
        if logprobs is not None:
            wire, self._offsets[index] = completion_logprobs(logprobs, offset=self._offsets[index])
        return finished_choice({"index": index, "text": text, "logprobs": wire}, finish_reason, metadata)

    def _body(
        self, choices: list[JSONValue], *, usage: dict[str, int] | None = None, metadata: JSONObject | None = None
    ) -> JSONObject:
        body: JSONObject = {
            "id": self.completion_id,
            "object": "text_completion",
            "created": self.created,
            "model": self._model,
            "choices": choices,
        }
        return with_usage_and_block(body, usage=usage_to_wire(usage), metadata=metadata)

    def body(self, result: GenerationResult, *, model: str, reasoning_open: bool = False) -> JSONObject:
        self._model = model
        choices: list[JSONValue] = [
            self._choice(i, self._echo + one.content, one.finish_reason or "stop", one.logprobs, one.metadata)
            for i, one in enumerate(result.choices or [result])
        ]
        return self._body(choices, usage=result.usage, metadata=result.metadata)

    def opening(self, *, model: str, reasoning_open: bool) -> list[str]:
        self._model = model
        return [self.text(self._echo, index=i) for i in range(self._n)] if self._echo else []

    def text(self, delta: str, logprobs: list[TokenLogprob] | None = None, *, index: int = 0) -> str:
        return data_event(self._body([self._choice(index, delta, None, logprobs)]))

    def closing(
        self, final: GenerationChunk, *, tail: str, text: str, logprobs: list[TokenLogprob] | None = None
    ) -> list[str]:
        reason = final.finish_reason or final.choice_finish_reason
        last = data_event(
            self._body(
                [self._choice(final.index, "", reason, None, final.metadata)],
                usage=final.usage,
                metadata=final.metadata,
            )
        )
        return [self.text(tail, logprobs, index=final.index), last] if tail or logprobs else [last]

    def ending(self) -> list[str]:
        return [DONE]

    def failure(self, error: BaseException) -> list[str]:
        return error_records(error)
