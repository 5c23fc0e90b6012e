"""Request bodies of the HTTP API (pydantic stays at this edge).

The chat body follows OpenAI's ``/v1/chat/completions`` plus AbstractCore's additive
controls (``speculation``, ``thinking``, ``prompt_cache_key`` ...). OpenAI clients send fields
this server has no use for (``user``, ``tool_choice`` ...): those in ``TOLERATED_CHAT_FIELDS``
are accepted and dropped by name; any other unknown field is a 400 naming it
(``refuse_unknown``), never dropped silently. Our own routes (``/acore/*``) forbid unknown fields.

``parse_body(model, raw)`` turns every bad body into ``InvalidRequest`` (400) whose message
and ``details.field`` name the offending field: invalid JSON, JSON nested deeper than
``MAX_JSON_DEPTH``, a non-finite number (``NaN``, ``Infinity``, ``1e999``) or a lone UTF-16
surrogate anywhere in the body, and every schema violation. Numeric fields are strict: an
integer field takes only a JSON integer (not ``"10"``, ``true`` or ``10.0``), a float field a
finite JSON number (not a string or a boolean).
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Final, Literal, TypeVar

from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    StringConstraints,
    ValidationError,
    model_validator,
)

from ..controls import parse_speculation_option
from ..errors import InvalidRequest, OptionRemoved
from ..request import MAX_PROMPT_CACHE_KEY_CHARS, check_logprobs

MAX_JSON_DEPTH: Final = 64
"""Deepest nesting of objects and arrays a body may have (tool schemas need far less)."""
MAX_MESSAGES: Final = 4096
"""Most chat messages one request may carry."""
MAX_MODEL_NAME_CHARS: Final = 255
"""Longest model name (a hub id or a directory path) any route accepts."""

FiniteFloat = Annotated[float, Strict(), AllowInfNan(False)]
"""A finite JSON number (an integer is fine); never a string, a boolean, NaN or Infinity."""
ModelName = Annotated[StrictStr, Field(min_length=1, max_length=MAX_MODEL_NAME_CHARS)]
PromptCacheKey = Annotated[
    StrictStr, StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_PROMPT_CACHE_KEY_CHARS)
]
"""A key of the ``/acore/prompt_cache/*`` routes, in the chat body's form: surrounding whitespace
stripped, then non-empty and within the limit (the chat body's ``prompt_cache_key`` is checked
by ``request.check_prompt_cache_key``, as ``invalid_controls``)."""

# OpenAI / AbstractCore fields accepted for compatibility that change nothing here.
TOLERATED_CHAT_FIELDS: frozenset[str] = frozenset(
    {
        "user",
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


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: StrictStr
    # OpenAI sends a JSON string; AbstractCore and chat templates also take the decoded object.
    arguments: StrictStr | dict[str, object] = ""


class ToolCall(BaseModel):
    """An assistant turn's tool call: OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``,
    or AbstractCore's flat ``{"name", "arguments", "call_id"?}`` (chat templates read both)."""

    model_config = ConfigDict(extra="allow")

    id: StrictStr | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunction | None = None
    name: StrictStr | None = None
    arguments: StrictStr | dict[str, object] | None = None

    @model_validator(mode="after")
    def _names_a_function(self) -> ToolCall:
        if self.function is None and self.name is None:
            raise ValueError('a tool call needs "function": {"name", "arguments"} (or a flat "name")')
        return self


class ChatMessage(BaseModel):
    """One chat turn. Extra keys (``refusal``, ``reasoning`` ...) travel on to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Content parts stay unvalidated JSON here (pydantic takes ``object`` as any value);
    # ``media.extract_images`` checks each part.
    content: StrictStr | list[dict[str, object]] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None


class SamplingFields(BaseModel):
    """The sampling fields of the chat and completions bodies (ranges and the model-dependent
    checks are the provider's)."""

    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    top_k: StrictInt | None = None
    min_p: FiniteFloat | None = None
    repetition_penalty: FiniteFloat | None = None
    presence_penalty: FiniteFloat | None = None
    frequency_penalty: FiniteFloat | None = None
    logit_bias: dict[str, FiniteFloat] | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None

    def sampling_given(self) -> dict[str, object]:
        """The sampling fields this body gives (those left out are absent)."""
        return {name: value for name in SamplingFields.model_fields if (value := getattr(self, name)) is not None}


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")

    model: ModelName | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None  # answers asked for: 1..MAX_CHOICES (``request.check_choices``)
    max_tokens: StrictInt | None = None
    max_output_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    # OpenAI's: each generated token's logprob, with ``top_logprobs`` alternatives (0..20).
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None

    # AbstractCore controls
    # Validated by ``controls.normalize_speculation`` / ``normalize_thinking`` (every accepted form).
    speculation: object = None
    thinking: object = None
    reasoning_effort: StrictStr | None = None
    # mlx_lm.server's form of thinking (``{"enable_thinking": false}``), which the remote client
    # sends beside ``thinking``; only ``enable_thinking`` is read, when ``thinking`` is absent.
    chat_template_kwargs: dict[str, object] | None = None
    prompt_cache_key: StrictStr | None = None
    # Checked by ``tools.check_tools`` / ``parse_tool_choice`` (``invalid_tools`` naming the field).
    tools: object = None
    tool_choice: object = None
    # OpenAI's structured output; checked by ``structured.ResponseFormat.from_openai``.
    response_format: dict[str, object] | None = None
    # Ollama's: how long the model stays resident once idle (``keep_alive.parse_keep_alive``).
    keep_alive: object = None

    def unknown_fields(self) -> list[str]:
        """Extra top-level fields that are neither known nor tolerated (for the warning)."""
        extra = self.model_extra or {}
        return sorted(k for k in extra if k not in TOLERATED_CHAT_FIELDS)

    def logprobs_asked(self) -> int | None:
        """How many alternatives per token the body asks for with its logprobs (None: no
        logprobs); ``top_logprobs`` without ``logprobs: true`` is refused, as OpenAI refuses it."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise InvalidRequest("top_logprobs needs logprobs: true", details={"field": "top_logprobs"})
            return None
        return check_logprobs(0 if self.top_logprobs is None else self.top_logprobs, field="top_logprobs")

    def reads_tool_calls(self) -> bool:
        """Whether the answer is read for tool calls: tools offered, ``tool_choice`` not ``none``."""
        return isinstance(self.tools, list) and bool(self.tools) and self.tool_choice != "none"

    def thinking_said(self) -> object:
        """The thinking control of this body: ``thinking``, else ``reasoning_effort``, else
        ``chat_template_kwargs.enable_thinking`` (mlx_lm.server's form); ``None`` when none says."""
        if self.thinking is not None:
            return self.thinking
        if self.reasoning_effort is not None:
            return self.reasoning_effort
        return (self.chat_template_kwargs or {}).get("enable_thinking")

    @property
    def include_progress(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_progress


class LoadModelRequest(BaseModel):
    """``POST /acore/models/load`` (AbstractCore's ``LoadedModelRequest`` fields we honour)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName
    provider: StrictStr = "mlx"
    options: dict[str, object] = Field(default_factory=dict)
    # The constructor speculation, also accepted at the top level; the same forms as
    # ``serve --speculation`` (``2``, ``"off"``, ``"inherit"``, an object).
    speculation: object = None
    task: StrictStr | None = None
    # AbstractCore's "keep it loaded": no idle unload (eviction for memory still applies; only
    # ``serve --pin`` protects a model from it). ``keep_alive`` (Ollama's forms) wins when given.
    pin: StrictBool = True
    keep_alive: object = None

    def checked_options(self) -> dict[str, object]:
        if self.provider.strip().lower() != "mlx":
            raise InvalidRequest(f"this server loads provider 'mlx' only, not {self.provider!r}")
        if self.task not in (None, "text_generation", "text"):
            raise InvalidRequest(f"this server serves text generation only, not task {self.task!r}")
        from ..provider.mlx_provider import REMOVED_OPTIONS

        for name in sorted(set(self.options) & REMOVED_OPTIONS.keys()):
            raise OptionRemoved(name, REMOVED_OPTIONS[name])
        accepted = load_options()
        unknown = sorted(set(self.options) - accepted)
        if unknown:
            raise InvalidRequest(f"unknown load option(s) {unknown}; accepted: {sorted(accepted)}")
        options = dict(self.options)
        said = (("speculation", self.speculation), ("options.speculation", options.pop("speculation", None)))
        given = {name: value for name, value in said if value is not None}
        controls = {name: parse_speculation_option(value, field=name) for name, value in given.items()}
        if len({None if c is None else json.dumps(c.to_wire(), sort_keys=True) for c in controls.values()}) > 1:
            raise InvalidRequest(f"speculation and options.speculation disagree ({given}); send one")
        for control in controls.values():
            if control is not None:
                options["speculation"] = control.to_wire()
        return options


class UnloadModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelName | None = None
    provider: StrictStr | None = None
    force: StrictBool = False
    task: StrictStr | None = None
    options: dict[str, object] = Field(default_factory=dict)


class PromptCacheClearRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: PromptCacheKey | None = None
    model: ModelName | None = None  # which resident model (default: the server's default model)


class PromptCacheKeyMetaRequest(BaseModel):
    """What AbstractRuntime's remote client posts after a keyed call in a session."""

    model_config = ConfigDict(extra="forbid")

    key: PromptCacheKey
    meta: dict[str, object] = Field(default_factory=dict)
    provider: StrictStr | None = None
    model: ModelName | None = None


M = TypeVar("M", bound=BaseModel)


def refuse_unknown(fields: list[str]) -> None:
    """A body's fields this route neither uses nor tolerates are a 400 naming them (the
    first in ``details.field``, all in ``details.fields``): never dropped silently."""
    if fields:
        raise InvalidRequest(
            f"unsupported request field(s): {', '.join(fields)}",
            details={"field": fields[0], "fields": list(fields)},
        )


def parse_body(model: type[M], raw: bytes) -> M:
    """Decode JSON ``raw`` into ``model``; every failure is an ``InvalidRequest`` naming the field."""
    if not raw.strip():
        data: object = {}
    else:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise _bad_value("body", f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_json_values(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = _errors(exc, data)
        raise InvalidRequest(_describe(errors), details={"field": errors[0]["field"], "errors": errors}) from exc


def check_json_values(data: object, *, where: str = "") -> None:
    """Reject what JSON cannot carry faithfully: deep nesting, non-finite numbers, lone surrogates.

    Walks iteratively (no recursion, so any depth is safe to inspect); the error names the
    first offending field as a dotted path (``messages.0.content``, ``logit_bias.5``).
    """
    stack: list[tuple[object, str, int]] = [(data, where, 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise _bad_value(path or "body", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                child = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not _encodable(key):
                    raise _bad_value(child, "the key holds a lone UTF-16 surrogate (not valid Unicode)")
                stack.append((item, child, depth + 1))
        elif isinstance(value, float) and not math.isfinite(value):
            raise _bad_value(path or "body", f"{_spelled(value)} is not a finite number (JSON has no NaN or Infinity)")
        elif isinstance(value, str) and not _encodable(value):
            raise _bad_value(path or "body", "the text holds a lone UTF-16 surrogate (not valid Unicode)")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad_value(field: str, problem: str) -> InvalidRequest:
    return InvalidRequest(f"invalid request: {field}: {problem}", details={"field": field})


def _describe(errors: list[dict[str, str]]) -> str:
    parts = [f"{err['field']}: {err['msg']}" for err in errors[:5]]
    more = len(errors) - len(parts)
    return "invalid request: " + "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def _errors(exc: ValidationError, data: object) -> list[dict[str, str]]:
    """One entry per offending field (a union reports each member; the first message is kept)."""
    out: dict[str, dict[str, str]] = {}
    for err in exc.errors():
        field = _field_path(err["loc"], data)
        out.setdefault(field, {"field": field, "msg": err["msg"]})
    return list(out.values())[:20]


def _field_path(loc: tuple[int | str, ...], data: object) -> str:
    """The dotted path of ``loc`` in the body, without pydantic's union member tags (``str``, ``list[str]``)."""
    parts: list[str] = []
    node = data
    for i, step in enumerate(loc):
        if isinstance(node, dict):
            if step in node:
                parts.append(str(step))
                node = node[step]
            elif i == len(loc) - 1:
                parts.append(str(step))  # a missing field
        elif isinstance(node, list):
            if isinstance(step, int) and 0 <= step < len(node):
                parts.append(str(step))
                node = node[step]
        else:
            break  # a scalar: what follows names a union member, not a field
    return ".".join(parts) or "body"


def _spelled(value: float) -> str:
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
