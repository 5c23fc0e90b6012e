"""One ``chat`` conversation: its history, its prompt-cache key, its slash commands and turns.

The REPL (``chat_cmd``) reads lines and hands each to ``ChatSession.handle``; a session knows
nothing of readline, stdin or how the model was reached: it calls ``open_stream`` with a
validated ``GenerationRequest`` and reads ``GenerationChunk``s, the local provider's
``generate_request(..., stream=True)`` and the remote client's alike.

Every turn resends the whole conversation with the session's ``prompt_cache_key``, so the
engine restores the prefix the previous turn left (``cached`` in the turn's figures) and
prefills only what is new. ``/clear`` starts a new key with the empty history.
"""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final, TextIO

from ..controls import normalize_thinking
from ..errors import EngineError, InvalidControls, InvalidRequest
from ..json_values import JSONValue
from ..request import GenerationRequest
from ..results import GenerationChunk
from .terminal import printable

ThinkingValue = bool | str | None
StreamOpener = Callable[[GenerationRequest], Iterator[GenerationChunk]]

HELP: Final = """\
/system TEXT    set the system prompt (/system alone shows it, /system off removes it)
/thinking MODE  on, off, low, medium, high (also minimal, xhigh; auto: the model's default)
/clear          forget the conversation (the system prompt stays)
/stats          this session's totals and the last turn's figures
/exit           leave (also /quit, or Ctrl-D)
/help           this list
Ctrl-C during a reply stops that reply."""


class Exit(Exception):
    """``/exit``: the REPL ends."""


@dataclass(frozen=True, slots=True)
class TurnFigures:
    """What one answered turn cost. ``ttft_s`` and ``decode_tps`` are the engine's
    (``execution.ttft_s``, ``performance.generation_tokens_per_second``) when the answer
    reports them, else measured here from the stream."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    decode_tps: float | None
    finish_reason: str

    def line(self) -> str:
        parts = [
            f"prompt {self.prompt_tokens} tokens ({self.cached_tokens} cached)",
            f"{self.completion_tokens} generated",
        ]
        if self.ttft_s is not None:
            parts.append(f"TTFT {self.ttft_s * 1000:.0f} ms")
        if self.decode_tps is not None:
            parts.append(f"decode {self.decode_tps:.1f} tok/s")
        return " | ".join(parts)


@dataclass(slots=True)
class Totals:
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, figures: TurnFigures) -> None:
        self.turns += 1
        self.prompt_tokens += figures.prompt_tokens
        self.cached_tokens += figures.cached_tokens
        self.completion_tokens += figures.completion_tokens


def new_cache_key() -> str:
    return f"chat-{secrets.token_hex(8)}"


@dataclass(slots=True)
class ChatSession:
    """The conversation and its controls. ``out`` gets the replies, ``err`` the figures,
    notices and ``error: [code] message`` lines."""

    open_stream: StreamOpener
    model: str
    system: str | None = None
    thinking: ThinkingValue = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    show_stats: bool = True
    out: TextIO = field(default_factory=lambda: sys.stdout)
    err: TextIO = field(default_factory=lambda: sys.stderr)
    messages: list[dict[str, JSONValue]] = field(default_factory=list)
    cache_key: str = field(default_factory=new_cache_key)
    last: TurnFigures | None = None
    totals: Totals = field(default_factory=Totals)

    def handle(self, line: str) -> TurnFigures | None:
        """A slash command, or a user turn answered on ``out`` (its figures; ``None`` for a
        command, an empty line or a reply stopped by Ctrl-C). ``Exit`` for ``/exit``; a bad
        command or a failed turn raises its typed error (the history is left as before)."""
        text = line.strip()
        if not text:
            return None
        if text.startswith("/"):
            self.command(text)
            return None
        return self.turn(text)

    def command(self, text: str) -> None:
        name, _, rest = text.partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit", "/bye"):
            raise Exit
        if name == "/help":
            self._note(HELP)
        elif name == "/system":
            self._system(rest)
        elif name == "/thinking":
            self._thinking(rest)
        elif name == "/clear":
            self.messages.clear()
            self.cache_key = new_cache_key()
            self._note("conversation cleared")
        elif name == "/stats":
            self._note(self.stats())
        else:
            raise InvalidRequest(f"unknown command {name!r} (/help lists them)", details={"field": "command"})

    def _system(self, rest: str) -> None:
        if not rest:
            self._note(f"system: {self.system!r}" if self.system else "system: none")
        elif rest == "off":
            self.system = None
            self._note("system prompt removed")
        else:
            self.system = rest
            self._note("system prompt set")

    def _thinking(self, rest: str) -> None:
        if not rest:
            self._note(f"thinking: {_thinking_word(self.thinking)}")
            return
        try:
            self.thinking = normalize_thinking(rest, field="/thinking")
        except InvalidControls as exc:
            raise InvalidControls(
                f"/thinking takes on, off, auto or a level (minimal, low, medium, high, xhigh); got {rest!r}",
                field="/thinking",
                value=rest,
            ) from exc
        self._note(f"thinking: {_thinking_word(self.thinking)}")

    def stats(self) -> str:
        t = self.totals
        lines = [
            f"model: {self.model}",
            f"turns: {t.turns}, messages in the conversation: {len(self.messages)}",
            f"tokens: {t.prompt_tokens} prompt ({t.cached_tokens} cached), {t.completion_tokens} generated",
            f"thinking: {_thinking_word(self.thinking)}, system prompt: {'set' if self.system else 'none'}",
            f"prompt cache key: {self.cache_key}",
        ]
        if self.last is not None:
            lines.append(f"last turn: {self.last.line()}")
        return "\n".join(lines)

    def conversation(self, user: str) -> list[dict[str, JSONValue]]:
        system: list[dict[str, JSONValue]] = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.messages, {"role": "user", "content": user}]

    def request(self, user: str) -> GenerationRequest:
        kwargs: dict[str, object] = {"messages": self.conversation(user), "prompt_cache_key": self.cache_key}
        if self.thinking is not None:
            kwargs["thinking"] = self.thinking
        if self.max_output_tokens is not None:
            kwargs["max_output_tokens"] = self.max_output_tokens
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        return GenerationRequest.from_kwargs("", **kwargs)

    def turn(self, user: str) -> TurnFigures | None:
        """Stream the answer to ``user`` onto ``out``. Ctrl-C stops the reply (the request is
        cancelled) and the turn is left out of the history; the session goes on."""
        request = self.request(user)
        started = time.perf_counter()
        stream: Iterator[GenerationChunk] | None = None
        reply: list[str] = []
        first_at: float | None = None
        final: GenerationChunk | None = None
        try:
            stream = self.open_stream(request)  # a remote one waits here for the server's answer
            for chunk in stream:
                if chunk.content:
                    if first_at is None:
                        first_at = time.perf_counter()
                    reply.append(chunk.content)
                    self.out.write(printable(chunk.content, keep="\n\t"))
                    self.out.flush()
                if chunk.is_final:
                    final = chunk
        except KeyboardInterrupt:
            if stream is not None:
                _close(stream)
            self.out.write("\n")
            self.out.flush()
            self._note("reply stopped (Ctrl-C); it is left out of the conversation")
            return None
        finally:
            if stream is not None:
                _close(stream)
        ended = time.perf_counter()
        self.out.write("\n")
        self.out.flush()
        if final is None:
            raise EngineError("the reply's stream ended without its final chunk")
        figures = _figures(final, started=started, first_at=first_at, ended=ended)
        self.messages.append({"role": "user", "content": user})
        self.messages.append({"role": "assistant", "content": "".join(reply)})
        self.last = figures
        self.totals.add(figures)
        if self.show_stats:
            self._note(figures.line())
        return figures

    def _note(self, text: str) -> None:
        print(printable(text), file=self.err, flush=True)


def _close(stream: Iterator[GenerationChunk]) -> None:
    """Close a chunk stream (the provider's and the remote client's cancel their request)."""
    close = getattr(stream, "close", None)
    if callable(close):
        close()


def _thinking_word(value: ThinkingValue) -> str:
    if value is None:
        return "auto (the model's default)"
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


def _figures(final: GenerationChunk, *, started: float, first_at: float | None, ended: float) -> TurnFigures:
    usage = final.usage or {}
    metadata: Mapping[str, object] = final.metadata or {}
    completion = int(usage.get("completion_tokens", 0))
    ttft = _number(metadata, "execution", "ttft_s")
    if ttft is None and first_at is not None:
        ttft = first_at - started
    tps = _number(metadata, "performance", "generation_tokens_per_second")
    if tps is None and first_at is not None and completion > 1 and ended > first_at:
        tps = (completion - 1) / (ended - first_at)
    return TurnFigures(
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(usage.get("cached_input_tokens", 0)),
        completion_tokens=completion,
        ttft_s=ttft,
        decode_tps=tps,
        finish_reason=str(final.finish_reason),
    )


def _number(metadata: Mapping[str, object], block: str, key: str) -> float | None:
    inner = metadata.get(block)
    if not isinstance(inner, Mapping):
        return None
    value = inner.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
