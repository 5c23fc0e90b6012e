"""Grammar-constrained decoding with llguidance: a JSON Schema becomes a token mask per step.

``GrammarCompiler`` belongs to one resident model: it builds the llguidance tokenizer once and
compiles each schema once (cached by schema hash). ``GrammarCompiler.processor`` gives one
request its own ``GrammarProcessor``: a logits processor that keeps that request's matcher and
masks its row of the logits, so constrained and free rows share a batch (upstream applies
logits processors per row). Compiling happens on the caller's thread, before the request is
submitted; the worker only advances matchers and computes masks (tens of microseconds).

The mask is applied with plain MLX ops (unpack the 32-bit words, ``where``), so it runs on
every backend: Metal, CPU and CUDA.

Objects that list ``properties`` and say nothing of other keys are compiled closed
(``closed_objects``), as OpenAI's and xgrammar's strict modes do. Two rules beyond the
grammar, both reported in ``metadata.structured``:

- Thinking: when the prompt leaves a think block open (or thinking is asked for), the grammar
  waits for ``</think>`` and constrains the answer after it; the answer cannot end inside the
  think block. Thinking may use half the output budget; then ``</think>`` is forced.
- Budget: in the last ``closing_reserve`` tokens of the output cap (room for the schema's
  shortest answer, at least a quarter of the cap up to 64 tokens) the mask keeps only the
  tokens that close the JSON soonest (end of answer, ``"``, ``}``/``]``, ``,``) when the
  grammar allows any of them, so an answer that would be cut at the cap is closed instead
  (``closed_at_budget: true``).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
import numpy.typing as npt

from ...errors import InvalidResponseSchema, InvalidTools, MLXRuntimeError
from ...model_output import HERMES_END, HERMES_START, MISTRAL_TAG, ToolFormat
from ...structured import ResponseFormat
from ...tools import ToolChoice, call_schema

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

GRAMMAR_CACHE_SIZE: Final = 64
_NEG_INF: Final = float("-inf")
# Thinking may use at most this share of a structured request's output cap.
THINKING_SHARE: Final = 0.5
# A forced call's JSON as chat templates write it: ``{"name": "f", "arguments": {"k": 1}}``.
_CALL_JSON_STYLE: Final = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


Encode = Callable[..., list[int]]
"""A Hugging Face tokenizer's ``encode(text, add_special_tokens=False)``."""


def closing_reserve(max_tokens: int, shortest: int = 0) -> int:
    """The last tokens of the cap in which the answer is steered to close: room for the
    shortest answer of the schema (``shortest`` characters; a token spells at least one),
    and at least a quarter of the cap up to 64 tokens."""
    return min(max_tokens, max(shortest + 8, min(64, max(8, max_tokens // 4))))


def shortest_answer_chars(schema: Mapping[str, object]) -> int:
    """About how many characters the shortest answer of ``schema`` has (its required members
    only, empty strings and arrays, one-digit numbers); recursion through ``$ref`` stops at a
    few levels. An estimate for the budget rule, never a check."""
    defs = schema.get("$defs") or schema.get("definitions") or {}

    def size(node: object, depth: int) -> int:
        if not isinstance(node, Mapping) or depth > 4:
            return 4
        if "const" in node:
            return len(json.dumps(node["const"]))
        if isinstance(node.get("enum"), list) and node["enum"]:
            return min(len(json.dumps(v)) for v in node["enum"])
        ref = node.get("$ref")
        if isinstance(ref, str) and isinstance(defs, Mapping):
            return size(defs.get(ref.rsplit("/", 1)[-1]), depth + 1)
        for combinator in ("anyOf", "oneOf", "allOf"):
            options = node.get(combinator)
            if isinstance(options, list) and options:
                sizes = [size(o, depth + 1) for o in options]
                return sum(sizes) if combinator == "allOf" else min(sizes)
        kind = node.get("type")
        kind = kind[0] if isinstance(kind, list) and kind else kind
        if kind == "object" or isinstance(node.get("properties"), Mapping):
            props = node.get("properties")
            props = props if isinstance(props, Mapping) else {}
            required = node.get("required")
            names = [k for k in required if isinstance(k, str)] if isinstance(required, list) else []
            return 2 + sum(len(k) + 4 + size(props.get(k), depth + 1) for k in names)
        if kind == "array":
            count = node.get("minItems")
            return 2 + (count if isinstance(count, int) else 0) * (size(node.get("items"), depth + 1) + 1)
        if kind == "string":
            length = node.get("minLength")
            return 2 + (length if isinstance(length, int) else 0)
        if kind in ("boolean", "null"):
            return 5
        return 1

    return size(schema, 0)


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A schema compiled once: a matcher that never advances (requests get copies of it)."""

    template: llguidance.LLMatcher
    shortest_chars: int
    compile_s: float


class GrammarCompiler:
    """One resident model's llguidance tokenizer and its compiled grammars (thread-safe)."""

    def __init__(
        self, hf_tokenizer: PreTrainedTokenizerFast, *, vocab_rows: int, eos_token_ids: frozenset[int]
    ) -> None:
        self.vocab_rows = vocab_rows
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_rows, eos_token=self.eos_token_ids or None
        )
        encode: Encode = hf_tokenizer.encode
        self._encode = encode
        self._closers = _closing_groups(encode, self.eos_token_ids)
        self._think_start = _single_token(encode, "<think>")
        self._think_end = _single_token(encode, "</think>")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()

    def compile(self, fmt: ResponseFormat) -> tuple[CompiledGrammar, bool]:
        """The grammar of ``fmt`` and whether it came from the cache; an uncompilable schema
        raises ``InvalidResponseSchema`` naming where."""

        def build() -> str:
            try:
                grammar: str = llguidance.LLMatcher.grammar_from_json_schema(
                    closed_objects(fmt.schema), overrides={"whitespace_flexible": False}
                )
            except ValueError as exc:
                raise InvalidResponseSchema(
                    f"the response schema cannot be compiled to a grammar: {exc}", path=_error_path(str(exc))
                ) from None
            return grammar

        def failed(error: str) -> MLXRuntimeError:
            return InvalidResponseSchema(
                f"the response schema cannot be compiled to a grammar: {error}", path=_error_path(error)
            )

        return self._compile(fmt.schema_hash, build, shortest_answer_chars(fmt.schema), failed)

    def _compile(
        self, key: str, build: Callable[[], str], shortest: int, failed: Callable[[str], MLXRuntimeError]
    ) -> tuple[CompiledGrammar, bool]:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit, True
        started = time.perf_counter()
        grammar = build()
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise failed(error)
        template = llguidance.LLMatcher(self._tokenizer, grammar)
        if template.is_error():
            raise failed(template.get_error())
        compiled = CompiledGrammar(template, shortest, time.perf_counter() - started)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled, False

    def processor(
        self, fmt: ResponseFormat, *, max_tokens: int, prompt_text: str, thinking: bool | str | None
    ) -> GrammarProcessor:
        """A fresh processor for one request (its own copy of the matcher), compiled on this thread."""
        started = time.perf_counter()
        compiled, cached = self.compile(fmt)
        meta: dict[str, object] = {"mode": "constrained", "schema_hash": fmt.schema_hash, "name": fmt.name}
        return self._processor(
            compiled, cached, meta, started=started, max_tokens=max_tokens, prompt_text=prompt_text, thinking=thinking
        )

    def tool_processor(
        self,
        tools: Sequence[Mapping[str, object]],
        choice: ToolChoice,
        fmt: ToolFormat,
        *,
        max_tokens: int,
        prompt_text: str,
        thinking: bool | str | None,
    ) -> GrammarProcessor:
        """A processor forcing one call that ``choice`` allows, written in the model's format
        ``fmt`` (``tool_call_grammar``), arguments matching the tool's ``parameters``."""
        started = time.perf_counter()
        schema = call_schema(tools, choice, fmt)
        grammar = tool_call_grammar(schema, fmt, self._encode)
        key = "tool:" + hashlib.sha256(grammar.encode("utf-8")).hexdigest()

        def failed(error: str) -> MLXRuntimeError:
            return InvalidTools(f"the tools' parameters cannot be compiled to a grammar: {error}", field="tools")

        compiled, cached = self._compile(key, lambda: grammar, shortest_answer_chars(schema) + 16, failed)
        meta: dict[str, object] = {"mode": "tool_call", "tool_choice": choice.to_openai(), "format": fmt}
        return self._processor(
            compiled, cached, meta, started=started, max_tokens=max_tokens, prompt_text=prompt_text, thinking=thinking
        )

    def _processor(
        self,
        compiled: CompiledGrammar,
        cached: bool,
        meta: dict[str, object],
        *,
        started: float,
        max_tokens: int,
        prompt_text: str,
        thinking: bool | str | None,
    ) -> GrammarProcessor:
        with self._lock:
            matcher = compiled.template.deep_copy()
        think = _thinking_state(prompt_text, thinking, self._think_start, self._think_end, tuple(self.eos_token_ids))
        compile_s = time.perf_counter() - started  # the lookup only, when the grammar was cached
        return GrammarProcessor(
            matcher,
            max_tokens=max_tokens,
            reserve=closing_reserve(max_tokens, compiled.shortest_chars),
            closers=self._closers,
            think=think,
            meta={**meta, "engine": "llguidance", "grammar_cached": cached, "compile_s": round(compile_s, 6)},
        )


def tool_call_grammar(schema: Mapping[str, object], fmt: ToolFormat, encode: Encode) -> str:
    """A Lark grammar (llguidance's dialect) of one call in ``fmt``: Hermes / Qwen
    ``<tool_call>\\n{json}\\n</tool_call>``, Llama 3 the JSON object alone, Mistral
    ``[TOOL_CALLS][{json}]``. A marker the tokenizer spells as one token is matched as that token."""
    closed = {**closed_objects(schema), "x-guidance": _CALL_JSON_STYLE}
    if fmt == "mistral":
        closed = {
            "type": "array",
            "items": closed_objects(schema),
            "minItems": 1,
            "maxItems": 1,
            "x-guidance": _CALL_JSON_STYLE,
        }
        if "$defs" in schema or "definitions" in schema:
            closed = {**closed, **{k: schema[k] for k in ("$defs", "definitions") if k in schema}}
    body = "%json " + json.dumps(closed)
    if fmt == "hermes":
        return f'start: {_lark_marker(encode, HERMES_START)} "\\n" {body} "\\n" {_lark_marker(encode, HERMES_END)}\n'
    if fmt == "mistral":
        return f"start: {_lark_marker(encode, MISTRAL_TAG)} {body}\n"
    return f"start: {body}\n"


def _lark_marker(encode: Encode, text: str) -> str:
    """``text`` in a Lark rule: its token (``<[id]>``, which also matches a special token) when it
    is one, else the literal string."""
    token = _single_token(encode, text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


@dataclass(slots=True)
class _Think:
    """Where a request stands with its think block: ``open`` once it is inside one."""

    start_id: int | None
    end_id: int
    open: bool
    eos_ids: tuple[int, ...] = ()  # the answer must not end inside the think block


class GrammarProcessor:
    """One structured request's grammar as a logits processor.

    Called as ``processor(tokens, logits)`` (mlx-lm, and mlx-vlm at the end of a prefill: the
    last of ``tokens`` is the newest once generation started) and as
    ``process_last_token(token, logits)`` (mlx-vlm's decode steps). Either way it first
    consumes the token sampled last, then masks ``logits`` for the next one.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        *,
        max_tokens: int,
        reserve: int,
        closers: tuple[tuple[int, ...], ...],
        think: _Think | None,
        meta: dict[str, object],
    ) -> None:
        self._matcher = matcher
        self._closers = closers
        self._think = think
        self._close_at = max(0, max_tokens - reserve)
        self._think_close_at = int(max_tokens * THINKING_SHARE)
        self._started = False
        self._generated = 0
        self.meta = meta
        self.closed_at_budget = False

    # -- the two upstream call forms -------------------------------------------------------

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._started:
            newest = tokens.reshape(-1)[-1].item()
            assert isinstance(newest, int)
            self._consume(newest)
        self._started = True
        return self._mask(logits)

    def process_last_token(self, last_token: int, logits: mx.array) -> mx.array:
        if self._started:
            self._consume(int(last_token))
        self._started = True
        return self._mask(logits)

    # -- reading ----------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        """The answer so far is complete JSON of the schema."""
        return self._matcher.is_accepting()

    def metadata(self) -> dict[str, object]:
        out = dict(self.meta)
        out["complete"] = self.accepting
        if self.closed_at_budget:
            out["closed_at_budget"] = True
        return out

    # -- internals ----------------------------------------------------------------------

    def _consume(self, token: int) -> None:
        self._generated += 1
        think = self._think
        if think is not None:
            if token == think.end_id:
                self._think = None
            elif think.start_id is not None and token == think.start_id:
                think.open = True
            return
        self._matcher.consume_token(token)

    def _mask(self, logits: mx.array) -> mx.array:
        think = self._think
        if think is not None:
            if not think.open and think.start_id is not None:
                return _only(logits, (think.start_id,))
            if self._generated >= self._think_close_at:
                self.closed_at_budget = True
                return _only(logits, (think.end_id,))
            return _ban(logits, think.eos_ids)
        # Start the step's forward pass now: the device computes it while the host walks the
        # grammar (the mask needs only the last token, already on the host).
        mx.async_eval(logits)
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint32)
        if self._generated >= self._close_at:
            narrowed = _narrow_to_closers(words, self._closers)
            if narrowed is not None:
                self.closed_at_budget = self.closed_at_budget or not self.accepting
                return _only(logits, narrowed)
        # Arrays are made here, not at import: MLX streams belong to the thread that made them.
        shifts = mx.arange(32, dtype=mx.uint32)
        allowed = ((mx.array(words)[:, None] >> shifts) & 1).reshape(-1)[: logits.shape[-1]]
        return mx.where(allowed.astype(mx.bool_), logits, _NEG_INF)


def closed_objects(schema: Mapping[str, object]) -> dict[str, object]:
    """``schema`` with every object that lists ``properties`` and says nothing of other keys
    closed (``additionalProperties: false``), as OpenAI's and xgrammar's strict modes do.

    An answer of the closed schema is an answer of the open one. Open objects would let the
    model (and the budget rule) write unnamed keys without end instead of the required ones.
    """

    def close(node: object) -> object:
        if isinstance(node, list):
            return [close(item) for item in node]
        if not isinstance(node, Mapping):
            return node
        out = {key: close(value) for key, value in node.items()}
        says_other_keys = any(k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))
        if isinstance(out.get("properties"), Mapping) and out["properties"] and not says_other_keys:
            out["additionalProperties"] = False
        return out

    closed = close(schema)
    assert isinstance(closed, dict)
    return closed


def _ban(logits: mx.array, token_ids: tuple[int, ...]) -> mx.array:
    return _masked(logits, token_ids, allow=False) if token_ids else logits


def _only(logits: mx.array, token_ids: tuple[int, ...]) -> mx.array:
    return _masked(logits, token_ids, allow=True)


def _masked(logits: mx.array, token_ids: tuple[int, ...], *, allow: bool) -> mx.array:
    """``logits`` with only ``token_ids`` kept (``allow``) or with them removed."""
    keep = np.full(logits.shape[-1], not allow, dtype=np.bool_)
    keep[[t for t in token_ids if t < keep.shape[0]]] = allow
    return mx.where(mx.array(keep), logits, _NEG_INF)


def _narrow_to_closers(words: npt.NDArray[np.uint32], groups: tuple[tuple[int, ...], ...]) -> tuple[int, ...] | None:
    """The first group of closing tokens the mask allows any of (None: it allows none)."""
    for group in groups:
        allowed = tuple(t for t in group if (int(words[t >> 5]) >> (t & 31)) & 1)
        if allowed:
            return allowed
    return None


def _closing_groups(encode: Encode, eos_token_ids: list[int]) -> tuple[tuple[int, ...], ...]:
    """Token ids that end a JSON answer soonest, best first: the end of the answer, a quote (it
    ends the string the answer is in; a key it opens is forced by the schema or ends at the next
    quote), the end of an object or array, the next member. Inside a string ``}`` is text, so
    the quote comes before it."""
    groups = [tuple(eos_token_ids)]
    for texts in (('"',), ("}", "]"), (",",)):
        ids = tuple(t for t in (_single_token(encode, text) for text in texts) if t is not None)
        if ids:
            groups.append(ids)
    return tuple(g for g in groups if g)


def _single_token(encode: Encode, text: str) -> int | None:
    ids = encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def _thinking_state(
    prompt_text: str,
    thinking: bool | str | None,
    start_id: int | None,
    end_id: int | None,
    eos_ids: tuple[int, ...] = (),
) -> _Think | None:
    """Whether the answer starts after a think block: the prompt leaves one open, or thinking is
    asked for (then ``<think>`` is the first token)."""
    if end_id is None or thinking is False:
        return None
    opened, closed = prompt_text.rfind("<think>"), prompt_text.rfind("</think>")
    if opened > closed:
        return _Think(start_id=start_id, end_id=end_id, open=True, eos_ids=eos_ids)
    if thinking and start_id is not None:
        return _Think(start_id=start_id, end_id=end_id, open=False, eos_ids=eos_ids)
    return None


def _error_path(message: str) -> str:
    """The JSON pointer llguidance names in a compile error, when it names one."""
    for marker in ("at path ", "path: "):
        at = message.find(marker)
        if at >= 0:
            rest = message[at + len(marker) :].split()[0].strip("'\",;")
            return rest if rest.startswith("/") else ""
    return ""
