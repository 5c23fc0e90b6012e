"""Several answers to one prompt (OpenAI's ``n``): how their requests are told apart and how
their outputs become one call's.

Each answer is its own engine request, all submitted at once (``Engine.together``) so the
worker admits them in one step, where the text lane prefills their shared prompt once
(``text_loop``). Answer ``i`` of a seeded call draws with ``seed + i``: the answers differ when
sampled, and each one is reproducible.

- ``choice_seed``: the seed of answer ``i``.
- ``combined_usage``: the call's usage, the prompt counted once and every answer's tokens summed.
- ``merge_streams``: the answers' chunk streams as one stream, each piece tagged with its
  answer's ``index``; an answer that ends while others go on ends with a piece carrying its
  ``choice_finish_reason`` (and its ``stop_reason`` as its only metadata); the last one's
  terminal chunk carries the combined usage.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from ..controls import Sampling
from ..json_values import JSONObject
from ..results import GenerationChunk, stop_reason

SEED_SPACE = 2**64


def choice_seed(sampling: Sampling, index: int) -> Sampling:
    """The sampling of answer ``index``: the call's, its seed (when given) moved by ``index``."""
    if sampling.seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % SEED_SPACE)


def combined_usage(usages: Sequence[dict[str, int] | None]) -> dict[str, int] | None:
    """One call's usage from its answers' (in order): the prompt once (the first answer's
    ``prompt_tokens`` and ``cached_input_tokens``: the later ones reuse its prefill), the
    generated tokens summed."""
    known = [u for u in usages if u]
    if not known:
        return None
    first = known[0]
    prompt = first.get("prompt_tokens", 0)
    completion = sum(u.get("completion_tokens", 0) for u in known)
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "input_tokens": prompt,
        "output_tokens": completion,
    }
    if "cached_input_tokens" in first:
        out["cached_input_tokens"] = first["cached_input_tokens"]
    return out


@dataclass(frozen=True, slots=True)
class _Piece:
    """What one answer's reader hands the merge: a chunk, or the error its stream raised."""

    index: int
    chunk: GenerationChunk | None = None
    error: BaseException | None = None


async def merge_streams(streams: Sequence[AsyncIterator[GenerationChunk]]) -> AsyncIterator[GenerationChunk]:
    """The answers' streams read at once (each must be read on: a stalled one would fail for
    backpressure) and yielded as one; the first error ends the merge and cancels the rest."""
    pieces: asyncio.Queue[_Piece] = asyncio.Queue()

    async def read(index: int, stream: AsyncIterator[GenerationChunk]) -> None:
        try:
            async for chunk in stream:
                await pieces.put(_Piece(index, chunk=chunk))
        except Exception as exc:  # noqa: BLE001 - handed to the merge, re-raised there
            await pieces.put(_Piece(index, error=exc))

    readers = [asyncio.create_task(read(i, s)) for i, s in enumerate(streams)]
    usages: list[dict[str, int] | None] = [None] * len(streams)
    left = len(streams)
    try:
        while left:
            piece = await pieces.get()
            if piece.error is not None:
                raise piece.error
            chunk = piece.chunk
            assert chunk is not None
            if not chunk.is_final:
                yield dataclasses.replace(chunk, index=piece.index)
                continue
            left -= 1
            usages[piece.index] = chunk.usage
            if left:
                # The call's metadata comes with its last chunk; this answer keeps what ended it.
                reason = stop_reason(chunk.metadata)
                ended: JSONObject | None = None if reason is None else {"stop_reason": reason}
                yield dataclasses.replace(
                    chunk,
                    index=piece.index,
                    finish_reason=None,
                    choice_finish_reason=chunk.finish_reason,
                    usage=None,
                    metadata=ended,
                )
            else:
                yield dataclasses.replace(chunk, index=piece.index, usage=combined_usage(usages))
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
