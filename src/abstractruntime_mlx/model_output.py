"""What a model's text holds: reasoning, the answer, and tool calls in the model's own format.
Pure: no MLX, no I/O.

Tool calls are read in every format the chat templates of supported models ask for:

- Qwen / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block per call);
- Llama 3.1+: ``<|python_tag|>{"name": ..., "parameters": {...}}`` (calls joined by ``;``), or the
  whole answer one such JSON object;
- Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or (newer tokenizers)
  ``[TOOL_CALLS]name[ARGS]{...}`` per call.

Reasoning is the text of a ``<think>...</think>`` block at the start of the answer, or, when
the prompt itself opened the block, the text before ``</think>``. A whole answer whose block the
prompt opened and that never wrote ``</think>`` (the output cap cut the thinking) is all answer,
as vLLM's Qwen3 parser reads it; a stream told that the prompt opened the block
(``OutputSplitter(reasoning_open=True)``) sends such text as reasoning as it comes, and
``cut_off_reasoning`` reads a whole answer that way (the Anthropic and Ollama routes do, so
that their streams and answers agree).

``parse_output`` reads a whole answer; ``OutputSplitter`` reads one as it streams and says what
may go out now (reasoning pieces, answer pieces, whole tool calls), withholding tool-call text
from the answer. Both read the same way: what a stream sent adds up to what ``parse_output``
gives for the same text (but for the cut-off thinking above, and whitespace around pieces).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Final, Literal

from .json_values import JSONObject

THINK_START: Final = "<think>"
THINK_END: Final = "</think>"

ToolFormat = Literal["hermes", "llama3", "mistral"]
"""The call format of a chat template (``tool_format_of``): what the grammar forces."""

HERMES_START: Final = "<tool_call>"
HERMES_END: Final = "</tool_call>"
LLAMA_TAG: Final = "<|python_tag|>"
MISTRAL_TAG: Final = "[TOOL_CALLS]"
MISTRAL_ARGS: Final = "[ARGS]"
CALL_MARKERS: Final = (HERMES_START, LLAMA_TAG, MISTRAL_TAG)
_LLAMA_ENDS: Final = ("<|eom_id|>", "<|eot_id|>")
_DECODER: Final = json.JSONDecoder()
_NAME: Final = re.compile(r"[A-Za-z0-9_.\-]+")


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One call the model wrote: the function's name and its arguments as compact JSON text."""

    name: str
    arguments: str

    def to_openai(self, call_id: str | None = None) -> JSONObject:
        """OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {
            "id": call_id or new_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ParsedToolCall, ...] = ()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_format_of(chat_template: str | None) -> ToolFormat:
    """The call format a chat template teaches its model (Hermes / Qwen when it names none)."""
    text = chat_template or ""
    if HERMES_START in text:
        return "hermes"
    if MISTRAL_TAG in text:
        return "mistral"
    if LLAMA_TAG in text or "<|start_header_id|>" in text:
        return "llama3"
    return "hermes"


# --------------------------------------------------------------------------- whole answers


def split_reasoning(text: str) -> tuple[str, str | None]:
    """``(answer, reasoning)`` of ``text``. A ``<think>`` block the answer starts with is
    reasoning (all of the text when it never closes); otherwise the text before a ``</think>``
    is (the prompt opened the block). Without either the whole text is the answer."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):
        inner = stripped[len(THINK_START) :]
        reasoning, closed, answer = inner.partition(THINK_END)
        return (answer.lstrip("\n") if closed else ""), reasoning.strip()
    if THINK_END in text:
        reasoning, _, answer = text.partition(THINK_END)
        return answer.lstrip("\n"), reasoning.replace(THINK_START, "").strip()
    return text, None


def cut_off_reasoning(content: str, reasoning: str | None, *, reasoning_open: bool) -> tuple[str, str | None]:
    """``(answer, reasoning)`` of a whole answer read as a stream told ``reasoning_open`` reads it:
    when the prompt opened the think block and the answer never closed it (``reasoning`` is
    ``None``), the whole answer is the cut-off thinking."""
    if not reasoning_open or reasoning is not None:
        return content, reasoning
    return "", content.strip() or None


def parse_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """``(answer without the calls, calls)`` of ``text``; text that looks like a call but does
    not parse as one stays in the answer."""
    spans = _call_spans(text, final=True)
    if not spans:
        return text, []
    kept: list[str] = []
    calls: list[ParsedToolCall] = []
    at = 0
    for start, end, found in spans:
        kept.append(text[at:start])
        calls.extend(found)
        at = end
    kept.append(text[at:])
    return "".join(kept).strip(), calls


def parse_output(text: str, *, tools: bool) -> ParsedOutput:
    """Reasoning, answer and (when ``tools`` were offered) tool calls of a whole answer."""
    content, reasoning = split_reasoning(text)
    calls: list[ParsedToolCall] = []
    if tools:
        content, calls = parse_tool_calls(content)
    return ParsedOutput(content=content, reasoning=reasoning, tool_calls=tuple(calls))


# --------------------------------------------------------------------------- streams


@dataclass(frozen=True, slots=True)
class ReasoningPiece:
    text: str


@dataclass(frozen=True, slots=True)
class ContentPiece:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallPiece:
    """A whole call, ready to go out: its place among the answer's calls and its id."""

    index: int
    call_id: str
    call: ParsedToolCall


StreamPiece = ReasoningPiece | ContentPiece | ToolCallPiece


@dataclass(slots=True)
class OutputSplitter:
    """Reads an answer as it streams: ``feed(delta)`` and, at the end, ``finish()`` return what
    may go out now. Text that may still turn out to be a marker (the start of ``</think>`` or
    ``<tool_call>``) waits for the next delta; a call goes out once its JSON is complete."""

    tools: bool
    reasoning_open: bool = False
    text: str = ""
    _phase: Literal["undecided", "reasoning", "answer"] = "undecided"
    _reasoning_start: int = 0
    _answer_start: int = 0
    _reasoning_sent: int = 0
    _content_sent: str = ""
    _call_ids: list[str] = field(default_factory=list)

    @property
    def num_calls(self) -> int:
        return len(self._call_ids)

    def feed(self, delta: str) -> list[StreamPiece]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> list[StreamPiece]:
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> list[StreamPiece]:
        out: list[StreamPiece] = []
        if self._phase == "undecided":
            stripped = self.text.lstrip()
            if stripped.startswith(THINK_START):
                self._phase = "reasoning"
                self._reasoning_start = self.text.index(THINK_START) + len(THINK_START)
            elif THINK_START.startswith(stripped) and stripped and not final:
                return out  # maybe the opening of a think block
            elif not stripped and not final:
                return out
            elif self.reasoning_open:
                self._phase = "reasoning"
            else:
                self._phase = "answer"
        if self._phase == "reasoning":
            body = self.text[self._reasoning_start :]
            end = body.find(THINK_END)
            if end < 0:
                upto = len(body) if final else len(body) - _partial_suffix(body, (THINK_END,))
                out.extend(self._reasoning(body, upto))
                return out
            out.extend(self._reasoning(body, end))
            self._phase = "answer"
            self._answer_start = self._reasoning_start + end + len(THINK_END)
        answer = self.text[self._answer_start :]
        if self._answer_start:
            answer = answer.lstrip("\n")
        out.extend(self._answer(answer, final=final))
        return out

    def _reasoning(self, body: str, upto: int) -> list[StreamPiece]:
        # Leading whitespace of the block is not part of the reasoning (``split_reasoning`` strips it).
        if self._reasoning_sent == 0:
            lead = len(body[:upto]) - len(body[:upto].lstrip())
            if lead == upto:
                return []
            self._reasoning_sent = lead
        piece = body[self._reasoning_sent : upto]
        self._reasoning_sent = max(self._reasoning_sent, upto)
        return [ReasoningPiece(piece)] if piece else []

    def _answer(self, answer: str, *, final: bool) -> list[StreamPiece]:
        out: list[StreamPiece] = []
        if not self.tools:
            safe = answer
            calls: list[ParsedToolCall] = []
        elif final:
            safe, calls = parse_tool_calls(answer)
            if not safe.startswith(self._content_sent):
                safe = self._content_sent  # the answer was sent already; only calls remain
        else:
            spans = _call_spans(answer, final=False)
            first = min(
                [answer.find(m) for m in CALL_MARKERS if m in answer] + [s for s, _, _ in spans] + [len(answer)]
            )
            held = _partial_suffix(answer[:first], CALL_MARKERS) if first == len(answer) else 0
            if not self._content_sent and answer[:first].lstrip().startswith("{"):
                held = first  # maybe a Llama call written as bare JSON: decided at the end
            safe = answer[: first - held]
            calls = [call for _, _, found in spans for call in found]
        if len(safe) > len(self._content_sent) and safe.startswith(self._content_sent):
            out.append(ContentPiece(safe[len(self._content_sent) :]))
            self._content_sent = safe
        for index in range(len(self._call_ids), len(calls)):
            self._call_ids.append(new_call_id())
            out.append(ToolCallPiece(index=index, call_id=self._call_ids[index], call=calls[index]))
        return out


# --------------------------------------------------------------------------- formats


Span = tuple[int, int, list[ParsedToolCall]]


def _call_spans(text: str, *, final: bool) -> list[Span]:
    """Where ``text`` holds calls: ``(start, end, calls)`` per block, in order. Before the end of
    the answer (``final=False``) a block counts once its JSON is complete."""
    spans: list[Span] = []
    at = 0
    while True:
        found = [(text.find(marker, at), marker) for marker in CALL_MARKERS]
        found = [(pos, marker) for pos, marker in found if pos >= 0]
        if not found:
            break
        start, marker = min(found)
        parsed = _PARSERS[marker](text, start + len(marker), final)
        if parsed is None:
            at = start + len(marker)
            continue
        end, calls = parsed
        spans.append((start, end, calls))
        at = end
    if not spans and final:
        whole = _bare_json_calls(text)
        if whole:
            spans.append((0, len(text), whole))
    return spans


def _hermes(text: str, at: int, final: bool) -> tuple[int, list[ParsedToolCall]] | None:
    close = text.find(HERMES_END, at)
    body = text[at:close] if close >= 0 else text[at:]
    decoded = _first_json(body)
    if decoded is None:
        return None
    value, used = decoded
    call = _call_of(value)
    if call is None:
        return None
    if close >= 0:
        return close + len(HERMES_END), [call]
    # Unclosed (the answer ended at the stop token): the call ends with its JSON.
    return at + (len(body) - len(body.lstrip())) + used, [call]


def _llama(text: str, at: int, final: bool) -> tuple[int, list[ParsedToolCall]] | None:
    calls: list[ParsedToolCall] = []
    pos = at
    while True:
        rest = text[pos:]
        decoded = _first_json(rest)
        if decoded is None:
            break
        value, used = decoded
        call = _call_of(value)
        if call is None:
            break
        calls.append(call)
        pos += len(rest) - len(rest.lstrip()) + used
        after = text[pos:].lstrip()
        if not after.startswith(";"):
            break
        pos = text.index(";", pos) + 1
    if not calls:
        return None
    for end_token in _LLAMA_ENDS:
        if text[pos:].lstrip().startswith(end_token):
            pos = text.index(end_token, pos) + len(end_token)
    return pos, calls


def _mistral(text: str, at: int, final: bool) -> tuple[int, list[ParsedToolCall]] | None:
    rest = text[at:]
    decoded = _first_json(rest)
    if decoded is not None:
        value, used = decoded
        items = value if isinstance(value, list) else [value]
        calls = [c for c in (_call_of(item) for item in items) if c is not None]
        if calls and len(calls) == len(items):
            return at + len(rest) - len(rest.lstrip()) + used, calls
        return None
    # ``name[ARGS]{...}``, once per call (each after its own [TOOL_CALLS]).
    name_end = rest.find(MISTRAL_ARGS)
    name = rest[:name_end].strip() if name_end >= 0 else ""
    if not _NAME.fullmatch(name):
        return None
    args = rest[name_end + len(MISTRAL_ARGS) :]
    decoded = _first_json(args)
    if decoded is None or not isinstance(decoded[0], dict):
        return None
    used = len(args) - len(args.lstrip()) + decoded[1]
    return at + name_end + len(MISTRAL_ARGS) + used, [ParsedToolCall(name, _compact(decoded[0]))]


_PARSERS = {HERMES_START: _hermes, LLAMA_TAG: _llama, MISTRAL_TAG: _mistral}


def _bare_json_calls(text: str) -> list[ParsedToolCall]:
    """Llama 3's other form: the whole answer is one call object (``{"name", "parameters"}``)."""
    stripped = text.strip()
    for end_token in _LLAMA_ENDS:
        stripped = stripped.removesuffix(end_token).rstrip()
    if not stripped.startswith("{"):
        return []
    parsed = _llama(stripped, 0, True)
    if parsed is None or parsed[0] != len(stripped):
        return []
    return parsed[1]


def _first_json(text: str) -> tuple[object, int] | None:
    """The JSON value ``text`` starts with (after whitespace) and how many characters it used."""
    body = text.lstrip()
    if body[:1] not in ("{", "["):
        return None
    try:
        value, end = _DECODER.raw_decode(body)
    except json.JSONDecodeError:
        return None
    return value, end


def _call_of(value: object) -> ParsedToolCall | None:
    """A call of a decoded object: ``name`` and ``arguments`` (or Llama's ``parameters``; an
    OpenAI-shaped ``{"function": {...}}`` too). Arguments given as a JSON string are decoded."""
    if not isinstance(value, dict):
        return None
    spec = value["function"] if isinstance(value.get("function"), dict) else value
    assert isinstance(spec, dict)
    value = spec
    name = value.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(name, _compact(arguments))


def _compact(arguments: object) -> str:
    return json.dumps(arguments, ensure_ascii=False, separators=(", ", ": "))


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """How many last characters of ``text`` could begin one of ``markers``."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest
