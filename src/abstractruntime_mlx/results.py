"""What a generation returns, locally or over HTTP: one shape for both.

Plain dataclasses with JSON-safe fields, so the server can serialise them and the remote
client can rebuild them without knowing anything about MLX.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from pydantic import BaseModel

from .json_values import JSONObject, JSONValue

FinishReason = Literal["stop", "length", "cancelled", "tool_calls", "error"]

WIRE_METADATA_KEYS: Final = ("execution", "speculation", "performance", "prompt_cache", "controls", "structured")
"""The metadata blocks a result carries over HTTP (under ``abstractcore`` in a completion body)."""


def stop_reason(metadata: Mapping[str, JSONValue] | None) -> str | int | None:
    """What ended a stopped answer (``metadata["stop_reason"]``): the stop string that matched, or
    the id of the end-of-sequence token the model generated; None when neither did (a length cap,
    a cancel, or a result that does not say)."""
    value = (metadata or {}).get("stop_reason")
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    return None


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely tokens at a position: its text, id and log-probability."""

    token: str
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token: its text (the token alone, decoded), id, log-probability (<= 0)
    and the most likely tokens at its position (``top``, most likely first; as many as asked)."""

    token: str
    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()

    def to_dict(self) -> JSONObject:
        return {
            "token": self.token,
            "token_id": self.token_id,
            "logprob": self.logprob,
            "top": [{"token": t.token, "token_id": t.token_id, "logprob": t.logprob} for t in self.top],
        }


@dataclass(slots=True)
class GenerationResult:
    """The answer to one ``generate`` call.

    ``usage`` holds ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
    ``cached_input_tokens`` (plus the ``input_tokens``/``output_tokens`` aliases AbstractCore
    uses). ``metadata`` holds ``execution``, ``speculation``, ``performance``, ``prompt_cache``
    and ``progress`` blocks, and ``stop_reason`` when a stop ended the answer (``stop_reason()``);
    a block or key with no known value is absent.
    """

    content: str
    finish_reason: FinishReason | None
    usage: dict[str, int] = field(default_factory=dict)
    metadata: JSONObject = field(default_factory=dict)
    model: str | None = None
    reasoning: str | None = None
    tool_calls: list[JSONObject] | None = None
    token_ids: list[int] | None = None
    parsed: JSONValue | BaseModel = None
    """The structured answer (``response_model`` / ``response_schema``): the pydantic instance or
    the JSON value; None for free text."""
    logprobs: list[TokenLogprob] | None = None
    """One entry per generated token (``completion_tokens`` of them), when the call asked."""
    choices: list[GenerationResult] | None = None
    """A call that asked for several answers (``n``): each one, in order (``usage`` each its
    own); this result is the first one's, its ``usage`` the prompt once and every answer's
    tokens summed. None for one answer."""

    def to_dict(self) -> JSONObject:
        out: JSONObject = {
            "content": self.content,
            "finish_reason": self.finish_reason,
            "usage": dict(self.usage),
            "metadata": dict(self.metadata),
        }
        for key in ("model", "reasoning", "tool_calls", "token_ids"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        parsed = self.parsed_json()
        if parsed is not None:
            out["parsed"] = parsed
        if self.logprobs is not None:
            out["logprobs"] = [entry.to_dict() for entry in self.logprobs]
        if self.choices is not None:
            out["choices"] = [choice.to_dict() for choice in self.choices]
        return out

    def parsed_json(self) -> JSONValue:
        """``parsed`` as JSON (a pydantic instance dumped); None for free text."""
        if isinstance(self.parsed, BaseModel):
            dumped: JSONObject = self.parsed.model_dump(mode="json")
            return dumped
        return self.parsed


@dataclass(slots=True)
class GenerationChunk:
    """One streamed piece. Exactly one chunk per request is terminal (``finish_reason`` set);
    it carries ``usage`` and the full ``metadata``. A call with several answers (``n``) tags
    each piece with its answer's ``index``; an answer that ends before the last one ends with a
    piece whose ``choice_finish_reason`` is set, and the last one's terminal chunk carries the
    call's ``usage`` (the prompt once, every answer's tokens summed). ``reasoning``: thinking text
    a server sent apart (``delta.reasoning_content``); a local stream's thinking is in ``content``, raw.
    ``tool_calls``: the calls a server's stream completed with this chunk (``delta.tool_calls``
    rebuilt into OpenAI's ``{"id", "type", "function": {"name", "arguments"}}``), each call on
    one chunk only; a local stream's calls are in ``content``, raw."""

    content: str = ""
    finish_reason: FinishReason | None = None
    usage: dict[str, int] | None = None
    metadata: JSONObject | None = None
    token_ids: list[int] | None = None
    model: str | None = None
    logprobs: list[TokenLogprob] | None = None  # of the tokens this piece completes (when asked)
    index: int = 0  # which of the call's answers this piece belongs to
    choice_finish_reason: FinishReason | None = None  # answer ``index`` ended here, others go on
    reasoning: str | None = None
    tool_calls: list[JSONObject] | None = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None
