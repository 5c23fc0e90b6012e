"""Where a keyed prompt stopped extending its key's previous prompt (cache-miss attribution).

Two halves, so that hits cost nothing and misses cost little on the worker:

- ``find_break`` (worker thread, every keyed report): from the shared prefix the report
  already measures, decide whether the prompt broke the previous one, and keep the previous
  prompt's few tokens after the break (the worker is the only holder of that prompt).
- ``attribute`` (the caller's thread, only when a break was found): map the break's token
  offset to a segment of the rendered conversation (a message, the tools block, or the
  generation prompt) by rendering prefixes of the conversation through the chat template
  (a binary search over messages, compared as text: nothing is tokenized again), and decode
  an excerpt on each side.

A prompt that extends the previous one diverges only inside the previous generation prompt
(the next turn renders the assistant's reply where the previous one had the assistant header
and thinking opener): the last ``guard`` tokens of the previous prompt, the allowance the
cache's checkpoints keep (``prefix_cache.GUARD_TOKENS``). A divergence before that is a break.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidRequest
from ..model.chat import render_prompt

EXCERPT_TOKENS = 16
EXCERPT_CHARS = 40
CONTEXT_TOKENS = 6


@dataclass(frozen=True, slots=True)
class PrefixBreak:
    """A keyed prompt diverged from its key's previous prompt at ``token``."""

    token: int  # offset of the first differing token (the shared prefix's length)
    reused_tokens: int  # prompt tokens restored from the cache
    expected_tokens: int  # the previous prompt's length: what a continuing turn would share
    previous_ids: tuple[int, ...]  # the previous prompt's tokens from ``token`` on (a few)


def find_break(previous: Sequence[int], *, shared: int, reused: int, guard: int) -> PrefixBreak | None:
    """The break when a prompt shares only ``shared`` tokens with ``previous`` and that ends
    before the previous prompt's last ``guard`` tokens; None when it extends it."""
    if shared >= len(previous) - guard:
        return None
    return PrefixBreak(shared, reused, len(previous), tuple(previous[shared : shared + EXCERPT_TOKENS]))


@dataclass(frozen=True, slots=True)
class _Renderer:
    tokenizer: Any
    tools: Sequence[Mapping[str, Any]] | None
    thinking: bool | str | None

    def text(self, conversation: list[dict[str, Any]], *, tools: bool = True, generation_prompt: bool = False) -> str:
        return render_prompt(
            self.tokenizer,
            conversation,
            tools=self.tools if tools else None,
            thinking=self.thinking,
            add_generation_prompt=generation_prompt,
        )


def _shared_chars(a: str, b: str) -> int:
    """The length of the common prefix of ``a`` and ``b`` (slice compares, not a char loop)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _excerpt(tokenizer: Any, ids: Sequence[int], *, tail: bool = False) -> str:
    text = str(tokenizer.decode(list(ids)))
    return text[-EXCERPT_CHARS:] if tail else text[:EXCERPT_CHARS]


def locate(
    token: int, prompt_ids: Sequence[int], text: str, conversation: list[dict[str, Any]], renderer: _Renderer
) -> dict[str, Any]:
    """The segment of the rendered prompt ``text`` (tokenized: ``prompt_ids``) holding ``token``:
    ``{"segment": "tools"}``, ``{"segment": "message", "message_index", "role"}``,
    ``{"segment": "generation_prompt"}`` or ``{"segment": "prompt_end"}``.

    Works on characters: the token's offset in ``text`` is the decoded prefix's length (cut
    where it stops agreeing with ``text``), and each probe renders a conversation prefix
    without tokenizing it."""
    if token >= len(prompt_ids):
        return {"segment": "prompt_end"}
    offset = _shared_chars(str(renderer.tokenizer.decode(list(prompt_ids[:token]))), text)
    if renderer.tools:
        # The tools block is what the prompt rendered without tools lacks.
        bare = renderer.text(conversation, tools=False, generation_prompt=True)
        start = _shared_chars(bare, text)
        end = len(text) - _shared_chars(bare[start:][::-1], text[start:][::-1])
        if start <= offset < end:
            return {"segment": "tools"}
    # boundary(k): how far the rendering of the first k messages agrees with the prompt. The
    # message holding the break is the first k whose boundary passes it, less one.
    if _shared_chars(renderer.text(conversation), text) <= offset:
        return {"segment": "generation_prompt"}
    lo, hi = 1, len(conversation)
    while lo < hi:
        mid = (lo + hi) // 2
        if _shared_chars(renderer.text(conversation[:mid]), text) > offset:
            hi = mid
        else:
            lo = mid + 1
    index = lo - 1
    return {"segment": "message", "message_index": index, "role": str(conversation[index].get("role", ""))}


def attribute(
    brk: PrefixBreak,
    *,
    prompt_ids: Sequence[int],
    text: str,
    conversation: list[dict[str, Any]],
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]] | None,
    thinking: bool | str | None,
) -> dict[str, Any]:
    """``prompt_cache.prefix_break``: where the prompt diverged, with the counts and excerpts."""
    out: dict[str, Any] = {
        "token": brk.token,
        "reused_tokens": brk.reused_tokens,
        "expected_tokens": brk.expected_tokens,
    }
    renderer = _Renderer(tokenizer, tools or None, thinking)
    try:
        out.update(locate(brk.token, prompt_ids, text, conversation, renderer))
    except InvalidRequest as exc:
        # Some templates refuse a partial conversation (e.g. one without a user turn).
        out.update(segment="unknown", reason=f"the chat template cannot render part of the conversation: {exc.message}")
    out["context"] = _excerpt(tokenizer, prompt_ids[max(0, brk.token - CONTEXT_TOKENS) : brk.token], tail=True)
    out["previous"] = _excerpt(tokenizer, brk.previous_ids)
    out["current"] = _excerpt(tokenizer, prompt_ids[brk.token : brk.token + EXCERPT_TOKENS])
    return out
