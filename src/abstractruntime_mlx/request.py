"""The one typed request: built and validated once at an edge, read unchanged below it.

Edges that build it: ``GenerationRequest.from_kwargs`` (``generate(**kwargs)`` of the local
provider and of the remote client), ``LLMNode.prepare`` (the node payload) and the server's
chat route (the HTTP body). Every layer below (provider, remote wire, engine) reads its fields
and none re-parses them. Pure: no I/O, no MLX.

    request = GenerationRequest.from_kwargs("Hello", temperature=0, max_output_tokens=8)
    request.sampling.temperature, request.max_output_tokens, request.messages[-1]
    later = dataclasses.replace(request, cancel=threading.Event())   # still frozen
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from .controls import (
    NOTHING_SAID,
    SAMPLING_FIELDS,
    ControlLevel,
    ResolvedControls,
    Sampling,
    SpeculationControl,
    ThinkingValue,
    normalize_max_output_tokens,
    normalize_sampling,
    normalize_stop,
)
from .conversation import assemble_conversation
from .errors import InvalidControls, InvalidRequest, InvalidTools
from .json_values import JSONObject, JSONValue
from .structured import ResponseFormat
from .tools import AUTO, ToolChoice, check_tools, parse_tool_choice

ProgressSink = Callable[[JSONObject], object]
"""Receives each phase event (a JSON dict) of one request; best-effort, may be called from any thread."""

Message = Mapping[str, JSONValue]
"""One chat turn as JSON (``role``, ``content`` ...): data from outside, checked only for its ``role``."""

MAX_TOP_LOGPROBS: Final = 20
"""Most alternatives a call may ask to see per generated token (OpenAI's ``top_logprobs`` bound)."""

MAX_CHOICES: Final = 8
"""Most answers one call may ask for (OpenAI's ``n``): its rows share one prefill."""

MAX_AFFINITY_KEY_CHARS: Final = 512
"""Longest ``affinity_key`` (a session or run id): it travels in a header a load balancer hashes."""

AFFINITY_HEADER: Final = "X-Session-Affinity"
"""The header carrying a call's affinity key (its run's session id, else its run id): a load
balancer in front of a pool of servers hashes it, so a run's calls and sibling prefetches stay
on one server (``lb_config`` writes such a configuration for HAProxy)."""

MAX_PROMPT_CACHE_KEY_CHARS: Final = 512
"""Longest ``prompt_cache_key``: the prefix cache and the server's key metadata hold every key
they know in memory, so a key's length is bounded like any other input (derived keys are
64-character digests)."""

PROGRESS_ALIASES: Final[tuple[str, ...]] = ("on_progress", "progress_callback", "progress_event_callback")
"""Keyword names AbstractCore callers use for the progress sink (the first callable wins)."""

GENERATE_KEYWORDS: Final[frozenset[str]] = frozenset(
    {
        "messages",
        "system_prompt",
        "tools",
        "tool_choice",
        "media",
        "thinking",
        "speculation",
        "prompt_cache_key",
        "cancel_event",
        "trace_metadata",
        "affinity_key",
        "max_output_tokens",
        "max_tokens",
        "stop",
        "response_model",
        "response_schema",
        "response_format",
        "logprobs",
        *SAMPLING_FIELDS,
        *PROGRESS_ALIASES,
    }
)
"""Every keyword ``generate`` accepts (``max_tokens`` is an alias of ``max_output_tokens``)."""


OUTPUT_CAP_NAMES: Final[tuple[str, ...]] = ("max_output_tokens", "max_tokens", "max_completion_tokens")
"""The names an output cap goes by at the edges (AbstractCore's, then OpenAI's two)."""


def output_cap(
    *, max_output_tokens: object = None, max_tokens: object = None, max_completion_tokens: object = None
) -> object:
    """The one output cap among its aliases, as given (its value is checked by
    ``GenerationRequest.build``): ``None`` when none is given, the value when one is given or
    all given are equal; two different values raise ``InvalidControls`` naming the alias that
    disagrees with the first one given. Every edge (keywords, node payload, HTTP body) asks here."""
    given = {
        name: value
        for name, value in zip(OUTPUT_CAP_NAMES, (max_output_tokens, max_tokens, max_completion_tokens))
        if value is not None
    }
    if not given:
        return None
    first = next(iter(given.values()))
    for name, value in given.items():
        if type(value) is not type(first) or value != first:
            raise InvalidControls(
                f"conflicting output caps {given}; send one of them (or equal values)", field=name, value=given
            )
    return first


def check_prompt_cache_key(value: object, *, field: str = "prompt_cache_key") -> str:
    """The usable prompt-cache key of ``value``: a string, its surrounding whitespace stripped
    (so ``" k"`` and ``"k"`` are one key at every edge), non-empty and of at most
    ``MAX_PROMPT_CACHE_KEY_CHARS`` characters; else ``InvalidControls`` naming ``field``."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidControls(f"{field} must be a non-empty string", field=field, value=value)
    value = value.strip()
    if len(value) > MAX_PROMPT_CACHE_KEY_CHARS:
        raise InvalidControls(
            f"{field} is {len(value):,} characters; the limit is {MAX_PROMPT_CACHE_KEY_CHARS}",
            field=field,
            value=value[:64] + "…",  # the error echoes the key: never all of it
        )
    return value


def check_logprobs(value: object, *, field: str = "logprobs") -> int | None:
    """How many alternatives per token a call asks for with its logprobs: None (no logprobs)
    or an integer 0..``MAX_TOP_LOGPROBS``; else ``InvalidControls`` naming ``field``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidControls(
            f"{field} must be an integer from 0 to {MAX_TOP_LOGPROBS} (the alternatives shown per token)",
            field=field,
            value=value,
        )
    return value


def check_choices(value: object, *, field: str = "n") -> int:
    """How many answers a call asks for: None (one) or an integer 1..``MAX_CHOICES``; else
    ``InvalidControls`` naming ``field``."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHOICES:
        raise InvalidControls(
            f"{field} must be an integer from 1 to {MAX_CHOICES} (the answers asked for)", field=field, value=value
        )
    return value


def check_affinity_key(value: object) -> str:
    """A usable affinity key: a string, surrounding whitespace stripped, non-empty, of at most
    ``MAX_AFFINITY_KEY_CHARS`` characters; else ``InvalidControls`` naming ``affinity_key``.
    Any characters are allowed: the remote client sends a key that is not plain header text as
    its digest (``remote_client._base.affinity_header_value``)."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidControls("affinity_key must be a non-empty string", field="affinity_key", value=value)
    value = value.strip()
    if len(value) > MAX_AFFINITY_KEY_CHARS:
        raise InvalidControls(
            f"affinity_key is {len(value):,} characters; the limit is {MAX_AFFINITY_KEY_CHARS}",
            field="affinity_key",
            value=value[:64] + "…",
        )
    return value


def pick_progress_callback(values: Mapping[str, object]) -> ProgressSink | None:
    """The first callable among ``on_progress``, ``progress_callback``, ``progress_event_callback``."""
    for name in PROGRESS_ALIASES:
        value = values.get(name)
        if callable(value):
            return value
    return None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation call, validated.

    - ``messages``: the conversation after the conversation rule (system prompt first,
      ``prompt`` last as a user turn); never empty.
    - ``tools``: tool schemas for the chat template (``tools.check_tools``); ``tool_choice``:
      whether the model may, must or must not call one (``tools.ToolChoice``); ``media``: images as given (paths,
      bytes, PIL images), attached to the final user turn by whoever renders it.
    - ``sampling``: how tokens are drawn; ``max_output_tokens`` (``None``: the provider's
      default) and ``stop`` are the limits.
    - ``speculation`` / ``thinking``: what the caller says (the ``call`` level; ``None``
      inherits); ``run``: what the enclosing run says (nodes only). Resolution against the
      provider, policy and verified default happens in ``controls.resolve_controls``.
    - ``response_format``: the structured answer asked for (None: free text), see ``structured``.
    - ``continuation``: a plain text the model continues as is, without the chat template
      (OpenAI's legacy completions); ``messages`` then hold it as one user turn, for the record.
    - ``logprobs``: report each generated token's log-probability with this many of the most
      likely alternatives (0..``MAX_TOP_LOGPROBS``); None: none (nothing is computed).
    - ``n``: how many answers to the one prompt (1..``MAX_CHOICES``); the MLX provider runs
      them as rows that share the prompt's prefill (``MLXProvider.agenerate_request``).
    - ``prompt_cache_key``: the caller's prefix-reuse key; ``trace_metadata``: passed to
      remote servers as a header.
    - ``affinity_key``: what keeps this call's conversation on one server of a pool (a run's
      session id, else its run id); a remote client sends it as the ``X-Session-Affinity``
      header, which a load balancer hashes (``lb_config``). Not part of the call's identity.
    - ``cancel`` / ``progress``: the sinks of this call (not part of its identity).
    - ``resolved``: the controls this call resolved to, once, by the provider that serves it
      (``MLXProvider.resolve_controls``); a call that carries them is not resolved again
      (the node edge resolves to record the deciding levels, then hands them on).
    """

    messages: tuple[Message, ...]
    tools: tuple[Message, ...] = ()
    tool_choice: ToolChoice = AUTO
    media: tuple[object, ...] = ()
    sampling: Sampling = field(default_factory=Sampling)
    max_output_tokens: int | None = None
    stop: tuple[str, ...] = ()
    speculation: SpeculationControl | None = None
    thinking: ThinkingValue = None
    run: ControlLevel = NOTHING_SAID
    response_format: ResponseFormat | None = None
    logprobs: int | None = None
    n: int = 1
    continuation: str | None = None
    prompt_cache_key: str | None = None
    trace_metadata: Mapping[str, object] | None = None
    affinity_key: str | None = field(default=None, compare=False)
    cancel: threading.Event | None = field(default=None, compare=False)
    progress: ProgressSink | None = field(default=None, compare=False)
    resolved: ResolvedControls | None = field(default=None, compare=False)

    # -- building -----------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        *,
        prompt: str | None = None,
        messages: object = None,
        system_prompt: object = None,
        tools: object = None,
        tool_choice: object = None,
        media: object = None,
        sampling: Mapping[str, object] | Sampling | None = None,
        max_output_tokens: object = None,
        stop: object = None,
        speculation: object = None,
        thinking: object = None,
        run: ControlLevel = NOTHING_SAID,
        response_format: ResponseFormat | None = None,
        logprobs: object = None,
        n: object = None,
        prompt_cache_key: object = None,
        trace_metadata: object = None,
        affinity_key: object = None,
        cancel: object = None,
        progress: object = None,
    ) -> GenerationRequest:
        """Validate every field (raising ``InvalidControls`` / ``InvalidRequest`` naming the field)."""
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidRequest("prompt must be a string")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise InvalidRequest("system_prompt must be a string")
        if messages is not None and not isinstance(messages, (list, tuple)):
            raise InvalidRequest("messages must be a list of message objects")
        checked_tools = check_tools(tools)
        choice = parse_tool_choice(tool_choice, checked_tools)
        if choice.forced and response_format is not None:
            raise InvalidTools(
                "tool_choice forces a tool call, response_format a structured answer: ask for one of them",
                field="tool_choice",
            )
        cache_key = None if prompt_cache_key is None else check_prompt_cache_key(prompt_cache_key)
        if cache_key is not None and messages is None:
            raise InvalidRequest(
                "prefix reuse with prompt_cache_key needs messages holding the complete conversation "
                "(messages=[] for a standalone prompt); no hidden history is appended"
            )
        if cancel is not None and not isinstance(cancel, threading.Event):
            raise InvalidControls("cancel_event must be a threading.Event", field="cancel_event", value=cancel)
        if progress is not None and not callable(progress):
            raise InvalidControls("the progress callback must be callable", field="on_progress", value=progress)
        if trace_metadata is not None and not isinstance(trace_metadata, Mapping):
            raise InvalidControls("trace_metadata must be an object", field="trace_metadata", value=trace_metadata)
        call = ControlLevel.parse(speculation=speculation, thinking=thinking)
        return cls(
            messages=tuple(assemble_conversation(prompt=prompt, messages=messages, system_prompt=system_prompt)),
            tools=checked_tools,
            tool_choice=choice,
            media=_media(media),
            sampling=sampling if isinstance(sampling, Sampling) else normalize_sampling(**dict(sampling or {})),
            max_output_tokens=normalize_max_output_tokens(max_output_tokens),
            stop=normalize_stop(stop),
            speculation=call.speculation,
            thinking=call.thinking,
            run=run,
            response_format=response_format,
            logprobs=check_logprobs(logprobs),
            n=check_choices(n),
            prompt_cache_key=cache_key,
            trace_metadata=dict(trace_metadata) if trace_metadata else None,
            affinity_key=None if affinity_key is None else check_affinity_key(affinity_key),
            cancel=cancel,
            progress=progress,  # checked callable above
        )

    @classmethod
    def from_kwargs(cls, prompt: str = "", /, **kwargs: object) -> GenerationRequest:
        """The ``generate(prompt, **kwargs)`` edge: AbstractCore's keyword names, validated once.

        Unknown keywords raise ``InvalidRequest`` naming them; ``max_tokens`` is an alias of
        ``max_output_tokens`` (both given: equal, or ``InvalidControls``, see ``output_cap``);
        ``on_progress`` / ``progress_callback`` /
        ``progress_event_callback`` name the progress sink; ``response_model`` (a pydantic
        model), ``response_schema`` (a JSON Schema) or ``response_format`` (OpenAI's form) ask for
        a structured answer.
        """
        unknown = sorted(k for k in kwargs if k not in GENERATE_KEYWORDS)
        if unknown:
            raise InvalidRequest(f"unknown generate() argument(s): {', '.join(unknown)}")
        progress = pick_progress_callback(kwargs)
        return cls.build(
            prompt=prompt,
            messages=kwargs.get("messages"),
            system_prompt=kwargs.get("system_prompt"),
            tools=kwargs.get("tools"),
            tool_choice=kwargs.get("tool_choice"),
            media=kwargs.get("media"),
            sampling={name: kwargs[name] for name in SAMPLING_FIELDS if kwargs.get(name) is not None},
            max_output_tokens=output_cap(
                max_output_tokens=kwargs.get("max_output_tokens"), max_tokens=kwargs.get("max_tokens")
            ),
            stop=kwargs.get("stop"),
            speculation=kwargs.get("speculation"),
            thinking=kwargs.get("thinking"),
            response_format=ResponseFormat.from_call(
                response_model=kwargs.get("response_model"),
                response_schema=kwargs.get("response_schema"),
                response_format=kwargs.get("response_format"),
            ),
            logprobs=kwargs.get("logprobs"),
            prompt_cache_key=kwargs.get("prompt_cache_key"),
            trace_metadata=kwargs.get("trace_metadata"),
            affinity_key=kwargs.get("affinity_key"),
            cancel=kwargs.get("cancel_event"),
            progress=progress,
        )

    # -- reading ------------------------------------------------------------------------

    @property
    def call(self) -> ControlLevel:
        """What this call says about speculation and thinking."""
        return ControlLevel(speculation=self.speculation, thinking=self.thinking)

    def with_sinks(
        self, *, cancel: threading.Event | None = None, progress: ProgressSink | None = None
    ) -> GenerationRequest:
        """The same request with these sinks (others kept)."""
        return dataclasses.replace(
            self,
            cancel=cancel if cancel is not None else self.cancel,
            progress=progress if progress is not None else self.progress,
        )

    def to_dict(self) -> JSONObject:
        """JSON form of what determines the answer (sinks excluded; media by ``repr``)."""
        out: JSONObject = {"messages": [dict(m) for m in self.messages]}
        if self.tools:
            out["tools"] = [dict(t) for t in self.tools]
        if self.tool_choice != AUTO:
            out["tool_choice"] = self.tool_choice.to_openai()
        if self.media:
            out["media"] = [item if isinstance(item, str) else repr(item) for item in self.media]
        out.update(self.sampling.to_dict())
        if self.max_output_tokens is not None:
            out["max_output_tokens"] = self.max_output_tokens
        if self.stop:
            out["stop"] = list(self.stop)
        out.update(self.call.to_dict())
        if self.response_format is not None:
            out["response_format"] = self.response_format.to_openai()
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.n > 1:
            out["n"] = self.n
        if self.continuation is not None:
            out["continuation"] = True
        run = self.run.to_dict()
        if run:
            out["run"] = run
        if self.prompt_cache_key is not None:
            out["prompt_cache_key"] = self.prompt_cache_key
        return out


def _media(value: object) -> tuple[object, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)
