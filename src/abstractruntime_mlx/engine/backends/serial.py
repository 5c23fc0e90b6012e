"""The serialized mlx-lm lane (``mlx_batching=False``) behind the backend protocol.

One request at a time through ``mlx_lm.stream_generate``: each ``step`` pulls one token.
The engine drives it exactly like a ``BatchBackend`` of one slot, so admission, cancels,
stop strings, queue timeouts and every way a request finishes share one code path.

mlx-lm prefills a whole prompt inside the first pull; ``on_prefill`` is called after each
prefill chunk, and a ``False`` answer (the request was cancelled) abandons the prefill there.

``InProcessBackend`` is the same lane on mlx-vlm's own in-process generation
(``mlx_vlm.generate.ar.generate_step``), for a non-batched provider whose model has an MTP
head: a request with a draft depth drafts through mlx-vlm's own speculative rounds (the
head passed as ``draft_model``, ``draft_kind="mtp"``), one without runs target-only. Its
prefill is observed per chunk through generate_step's ``prompt_cache_checkpoint`` hook,
asked for at every chunk boundary (a public keyword; the chunks stay the same).

Prefix reuse on this lane (a row whose ``RowInput.prefix`` names the snapshot store): at its
first step ``lookup_prefix`` restores the key's snapshot and ``prefill_to_checkpoint`` prefills
the prompt up to a few tokens short of its end and keeps a new snapshot there (observed and
cancellable as any prefill); mlx-lm then generates from that cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ...errors import UpstreamError
from ..cache.prefix_cache import GUARD_TOKENS, SerialStore
from .backend import LogitsProcessor, map_upstream_errors, row_processors
from .rows import LaneName, PrefillRow, RestoredPrefix, RowInput, StepResult, TokenEvent
from .sampling import make_sampler

PrefillHook = Callable[[int, PrefillRow], bool]


class _PrefillAbandoned(Exception):
    """Raised from mlx-lm's prefill callback to stop a cancelled request between chunks."""


class SerialBackend:
    """mlx-lm generation for one request at a time, with the ``BatchBackend`` interface."""

    kind = LaneName.SERIAL
    reports_logprobs = False
    max_batch_size = 1

    def __init__(
        self, model: Any, tokenizer: Any, *, prefill_step_size: int, stream: Any, on_prefill: PrefillHook
    ) -> None:
        self.model = model
        self._tokenizer = tokenizer
        self._prefill_step_size = prefill_step_size
        self._stream = stream
        self._on_prefill = on_prefill
        self._uids = itertools.count()
        self._uid: int | None = None
        self._row: RowInput | None = None  # the admitted request's row
        self._sampler: Any = None
        self._processors: list[LogitsProcessor] | None = None
        self._responses: Iterator[Any] | None = None
        self._prompt_reported = False
        self._prefilled = 0
        self._cached = 0
        self.uids: set[int] = set()

    # --- admission -------------------------------------------------------------------
    def insert(self, row: RowInput) -> int:
        """Admit one request; its prefix lookup, prefill and generation run from the first step.
        A keyed row (``row.prefix.serial``) restores the key's snapshot and prefills to a new
        checkpoint first (``lookup_prefix``, ``prefill_to_checkpoint``)."""
        if self.uids:
            raise RuntimeError("the serialized lane runs one request at a time")
        if row.prompt_inputs is not None:
            raise RuntimeError("the serialized lane takes text prompts only")
        if row.prefix is not None and row.prefix.serial is None:
            raise RuntimeError("the serialized lane keeps snapshots, not a batch's prefix blocks")
        with map_upstream_errors("building the sampler"):
            # Built before the row exists: a value refused here fails this request only.
            self._sampler = make_sampler(row.sampling)
            self._processors = row_processors(row.sampling, row.grammar)
        uid = next(self._uids)
        self._uid, self._row, self._responses = uid, row, None
        self._prompt_reported = False
        self._prefilled = self._cached = 0
        self.uids.add(uid)
        return uid

    def _start(self, uid: int, row: RowInput) -> Iterator[Any] | None:
        """Restore and extend the row's prefix (keyed rows), then open mlx-lm's generator;
        None when a cancel stopped the prefix prefill."""
        prompt_cache: Any = None
        prompt = row.prompt_ids
        if row.prefix is not None and row.prefix.serial is not None:
            store, salt = row.prefix.serial, row.prefix.salt
            restored = lookup_prefix(self._prefix_model(), store, salt, prompt)
            self._cached = restored.cached

            cancelled = False

            def observe(position: int) -> bool:
                nonlocal cancelled
                cancelled = not self._on_prefill(
                    uid, PrefillRow(processed=position, total=len(prompt), cached=restored.cached)
                )
                return not cancelled

            restored = prefill_to_checkpoint(
                self._prefix_model(),
                store,
                salt,
                prompt,
                restored,
                prefill_step_size=self._prefill_step_size,
                observe=observe,
            )
            if cancelled:
                return None
            self._prefilled = restored.prefilled
            prompt_cache = restored.prompt_cache
        # A generator: nothing runs until the first pull.
        return self._generate(prompt[self._prefilled :], row, prompt_cache)

    def _prefix_model(self) -> Any:
        """What prefix snapshots are built from and prefilled with."""
        return self.model

    def _generate(self, prompt: list[int], row: RowInput, prompt_cache: Any) -> Iterator[Any]:
        """mlx-lm's stream over ``prompt`` (the part not in ``prompt_cache`` yet)."""
        import mlx_lm

        kwargs: dict[str, Any] = {
            "sampler": self._sampler,
            "prompt_progress_callback": self._progress,
            "prefill_step_size": self._prefill_step_size,
        }
        if self._processors:
            kwargs["logits_processors"] = self._processors
        if prompt_cache is not None:
            kwargs["prompt_cache"] = prompt_cache
        return iter(
            mlx_lm.stream_generate(
                self.model, self._tokenizer, prompt, max_tokens=row.max_tokens, stream=self._stream, **kwargs
            )
        )

    def free_slots(self) -> int:
        return self.max_batch_size - len(self.uids)

    def remove(self, uid: int) -> bool:
        self.forget(uid)
        return True

    def forget(self, uid: int) -> None:
        if uid != self._uid:
            return
        responses, self._responses, self._uid, self._row = self._responses, None, None, None
        self.uids.discard(uid)
        close = getattr(responses, "close", None)
        if close is not None:
            close()

    @property
    def prefilling(self) -> bool:
        """Never between steps: mlx-lm prefills a whole prompt inside one step."""
        return False

    @property
    def has_work(self) -> bool:
        return self._row is not None

    # --- stepping --------------------------------------------------------------------
    def step(self, *, observe_prefill: bool) -> StepResult:
        result = StepResult()
        uid, row = self._uid, self._row
        if uid is None or row is None:
            return result
        result.batch_uids = {uid}
        with map_upstream_errors("a generation step (mlx-lm)"):
            if self._responses is None:
                self._responses = self._start(uid, row)
                if self._responses is None:
                    self.forget(uid)
                    return result
            try:
                response = next(self._responses, None)
            except _PrefillAbandoned:
                self.forget(uid)
                return result
        if response is None:
            self.forget(uid)
            raise UpstreamError("mlx-lm ended a generation without its final response")
        if not self._prompt_reported:
            self._prompt_reported = True
            result.prompt_done[uid] = self._cached
        result.tokens.append(TokenEvent(uid, int(response.token), response.finish_reason))
        return result

    def _progress(self, processed: int, total: int) -> None:
        uid = self._uid
        row = PrefillRow(processed=self._prefilled + processed, total=self._prefilled + total, cached=self._cached)
        if uid is not None and not self._on_prefill(uid, row):
            raise _PrefillAbandoned()

    def close(self) -> None:
        if self._uid is not None:
            self.forget(self._uid)


@dataclass(frozen=True, slots=True)
class _Response:
    """One token of mlx-vlm's in-process generation, as mlx-lm's stream reports it: the last
    one carries ``finish_reason`` ("stop": an end-of-sequence token; "length": the cap)."""

    token: int
    finish_reason: str | None = None


class InProcessBackend(SerialBackend):
    """mlx-vlm's in-process generation for one request at a time, MTP included.

    ``drafter`` (the resident target's MTP head) drafts ``draft_tokens`` proposals per round
    for the group's requests; None or 0 runs target-only.
    """

    kind = LaneName.IN_PROCESS

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        prefill_step_size: int,
        stream: Any,
        on_prefill: PrefillHook,
        eos_token_ids: frozenset[int],
        drafter: Any = None,
        draft_tokens: int = 0,
    ) -> None:
        super().__init__(model, tokenizer, prefill_step_size=prefill_step_size, stream=stream, on_prefill=on_prefill)
        self._eos = eos_token_ids
        self._drafter = drafter if draft_tokens > 0 else None
        self._draft_tokens = draft_tokens

    def _prefix_model(self) -> Any:
        return getattr(self.model, "language_model", self.model)

    def _generate(self, prompt: list[int], row: RowInput, prompt_cache: Any) -> Iterator[Any]:
        import mlx.core as mx
        from mlx_vlm.generate.ar import generate_step

        step = self._prefill_step_size
        kwargs: dict[str, Any] = {
            "max_tokens": row.max_tokens,
            "prefill_step_size": step,
            # Called at each chunk boundary: the real per-chunk observation (and the cancel point).
            "prompt_cache_checkpoint": lambda processed, _cache: self._progress(processed, len(prompt)),
            "prompt_cache_checkpoint_lengths": list(range(step, len(prompt), step)),
        }
        if prompt_cache is not None:
            kwargs["prompt_cache"] = prompt_cache
        if row.sampling.temperature:
            kwargs["sampler"] = self._sampler
        else:
            kwargs["temperature"] = 0.0  # mlx-vlm's greedy path (what its MTP rounds verify with)
        if self._processors:
            kwargs["logits_processors"] = self._processors
        if self._drafter is not None:
            kwargs.update(draft_model=self._drafter, draft_kind="mtp", draft_block_size=self._draft_tokens + 1)
        with mx.stream(self._stream):
            steps = generate_step(mx.array([prompt]), self.model, None, None, **kwargs)
            count = 0
            for value, _logprobs in steps:
                count += 1
                token = int(value)
                if token in self._eos:
                    yield _Response(token, "stop")
                    return
                if count >= row.max_tokens:
                    yield _Response(token, "length")
                    return
                yield _Response(token)

    def speculation_counters(self) -> tuple[int, float, int] | None:
        """The head's lifetime (rounds, accepted, drafted) counters while this lane drafts."""
        if self._drafter is None:
            return None
        from mlx_vlm.speculative.common import speculative_stats_snapshot

        return speculative_stats_snapshot(self._drafter)


# --- prefix reuse ------------------------------------------------------------------------


def lookup_prefix(model: Any, store: SerialStore, salt: int, prompt: list[int]) -> RestoredPrefix:
    """The snapshot ``store`` keeps for ``salt`` that ``prompt`` extends, or a fresh cache."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt_cache, cached = store.lookup(salt, prompt)
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model)
    return RestoredPrefix(prompt_cache, cached, cached)


def prefill_to_checkpoint(
    model: Any,
    store: SerialStore,
    salt: int,
    prompt: list[int],
    restored: RestoredPrefix,
    *,
    prefill_step_size: int,
    observe: Callable[[int], bool],
) -> RestoredPrefix:
    """Prefill ``prompt`` into ``restored``'s cache up to the checkpoint (``GUARD_TOKENS`` short
    of its end) and store a snapshot there.

    ``observe(position)`` runs before the first chunk and after each; False (the request was
    cancelled) stops the prefill there, keeping no snapshot.
    """
    import mlx.core as mx

    prompt_cache, position = restored.prompt_cache, restored.prefilled
    checkpoint = len(prompt) - GUARD_TOKENS
    if checkpoint <= position:
        return restored
    if not observe(position):
        return restored
    while position < checkpoint:
        end = min(checkpoint, position + prefill_step_size)
        model(mx.array([prompt[position:end]]), cache=prompt_cache)
        mx.eval([c.state for c in prompt_cache])
        position = end
        if not observe(position):
            return RestoredPrefix(prompt_cache, position, restored.cached)
    store.store(salt, prompt[:checkpoint], prompt_cache)
    return RestoredPrefix(prompt_cache, checkpoint, restored.cached)
