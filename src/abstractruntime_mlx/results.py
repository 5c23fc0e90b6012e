"""What a generation returns, locally or over HTTP: one shape for both.

Plain dataclasses with JSON-safe fields, so the server can serialise them and the remote
client can rebuild them without knowing anything about MLX.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

FinishReason = Literal["stop", "length", "cancelled", "tool_calls", "error"]

JSONValue: TypeAlias = str | int | float | bool | None | Sequence["JSONValue"] | Mapping[str, "JSONValue"]
"""A value JSON can carry. Read-only containers, so a ``dict[str, int]`` or a ``list[dict[str, str]]``
fits where a JSON value is expected; narrow with ``isinstance(value, Mapping)`` to read into it."""

JSONObject: TypeAlias = dict[str, JSONValue]
"""A JSON object this package builds (wire bodies, metadata blocks, error details)."""


@dataclass(slots=True)
class GenerationResult:
    """The answer to one ``generate`` call.

    ``usage`` holds ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
    ``cached_input_tokens`` (plus the ``input_tokens``/``output_tokens`` aliases AbstractCore
    uses). ``metadata`` holds ``execution``, ``speculation``, ``performance``, ``prompt_cache``
    and ``progress`` blocks; a block or key with no known value is absent.
    """

    content: str
    finish_reason: FinishReason | None
    usage: dict[str, int] = field(default_factory=dict)
    metadata: JSONObject = field(default_factory=dict)
    model: str | None = None
    reasoning: str | None = None
    tool_calls: list[JSONObject] | None = None
    token_ids: list[int] | None = None

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
        return out


@dataclass(slots=True)
class GenerationChunk:
    """One streamed piece. Exactly one chunk per request is terminal (``finish_reason`` set);
    it carries ``usage`` and the full ``metadata``."""

    content: str = ""
    finish_reason: FinishReason | None = None
    usage: dict[str, int] | None = None
    metadata: JSONObject | None = None
    token_ids: list[int] | None = None
    model: str | None = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None
