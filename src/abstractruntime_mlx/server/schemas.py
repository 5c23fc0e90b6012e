"""Request bodies of the HTTP API (pydantic stays at this edge).

The chat body follows OpenAI's ``/v1/chat/completions`` plus AbstractCore's additive
controls (``speculation``, ``thinking``, ``prompt_cache_key`` ...). OpenAI clients send fields
this server has no use for (``user``, ``tool_choice`` ...): those in ``TOLERATED_CHAT_FIELDS``
are accepted and dropped by name; any other unknown field is reported in a warning log line
naming it, never dropped silently. Our own routes (``/acore/*``) forbid unknown fields.

``parse_body(model, raw)`` turns a validation failure into ``InvalidRequest`` (400) whose
message names the offending field.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from ..errors import InvalidRequest

# OpenAI / AbstractCore fields accepted for compatibility that change nothing here.
TOLERATED_CHAT_FIELDS: frozenset[str] = frozenset(
    {
        "user",
        "tool_choice",
        "parallel_tool_calls",
        "timeout_s",
        "prompt_cache_retention",
        "metadata",
        "store",
        "service_tier",
    }
)

# Load options besides the provider's execution options (``EXECUTION_DEFAULTS``).
LOAD_TIME_CONTROLS: frozenset[str] = frozenset({"speculation", "mtp_head"})


def load_options() -> frozenset[str]:
    """Options ``/acore/models/load`` forwards to ``create_llm`` (AbstractCore's ``options``)."""
    from ..provider.mlx_provider import EXECUTION_DEFAULTS

    return frozenset(EXECUTION_DEFAULTS) | LOAD_TIME_CONTROLS


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = None
    # Our extension: phase events as ``event: progress`` SSE records.
    include_progress: StrictBool = False


class ChatMessage(BaseModel):
    """One chat turn. Extra keys (``refusal``, ``reasoning`` ...) travel on to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=1)

    # sampling
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    max_output_tokens: int | None = None
    max_completion_tokens: int | None = None

    # AbstractCore controls
    # Validated by ``controls.normalize_speculation`` / ``normalize_thinking`` (every accepted form).
    speculation: Any = None
    thinking: Any = None
    reasoning_effort: str | None = None
    prompt_cache_key: str | None = None
    tools: list[dict[str, Any]] | None = None

    def unknown_fields(self) -> list[str]:
        """Extra top-level fields that are neither known nor tolerated (for the warning)."""
        extra = self.model_extra or {}
        return sorted(k for k in extra if k not in TOLERATED_CHAT_FIELDS)

    @property
    def include_progress(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_progress

    def max_output(self) -> int | None:
        """The output cap from ``max_tokens`` / ``max_output_tokens`` / ``max_completion_tokens``."""
        given = {
            name: value
            for name in ("max_tokens", "max_output_tokens", "max_completion_tokens")
            if (value := getattr(self, name)) is not None
        }
        values = set(given.values())
        if len(values) > 1:
            raise InvalidRequest(f"conflicting output caps {given}; send one of them")
        return values.pop() if values else None


class LoadModelRequest(BaseModel):
    """``POST /acore/models/load`` (AbstractCore's ``LoadedModelRequest`` fields we honour)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    provider: str = "mlx"
    options: dict[str, Any] = Field(default_factory=dict)
    task: str | None = None
    pin: bool = True

    def checked_options(self) -> dict[str, Any]:
        if self.provider.strip().lower() != "mlx":
            raise InvalidRequest(f"this server loads provider 'mlx' only, not {self.provider!r}")
        if self.task not in (None, "text_generation", "text"):
            raise InvalidRequest(f"this server serves text generation only, not task {self.task!r}")
        accepted = load_options()
        unknown = sorted(set(self.options) - accepted)
        if unknown:
            raise InvalidRequest(f"unknown load option(s) {unknown}; accepted: {sorted(accepted)}")
        return dict(self.options)


class UnloadModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    provider: str | None = None
    force: bool = False
    task: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)


class PromptCacheClearRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str | None = None


class PromptCacheKeyMetaRequest(BaseModel):
    """What AbstractRuntime's remote client posts after a keyed call in a session."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(min_length=1)
    meta: dict[str, Any] = Field(default_factory=dict)
    provider: str | None = None
    model: str | None = None


M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], raw: bytes) -> M:
    """Decode JSON ``raw`` into ``model``; every failure is an ``InvalidRequest`` naming the field."""
    if not raw.strip():
        data: Any = {}
    else:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(_describe(exc), details={"errors": _errors(exc)}) from exc


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "invalid request: " + "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def _errors(exc: ValidationError) -> list[dict[str, Any]]:
    return [{"loc": [str(p) for p in err["loc"]], "msg": err["msg"]} for err in exc.errors()[:20]]
