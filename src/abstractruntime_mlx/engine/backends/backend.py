"""The one adapter over mlx-vlm's batch generator.

Every private upstream field the backends read is read here, and only here
(``tests/test_import_graph.py``): ``PromptProcessingBatch`` row counters for prefill progress,
the generation batch for batch sizes, the prefill admission gate, and what ``adopt`` builds a
decoding row from (``GenerationBatch``'s constructor and token counts, the generator's uid
counter, sampler, stop test and ``_extend_generation_batch``); and mlx-lm's ``BatchKVCache``
column count for the text lane (``kv_columns``). Supported ranges: mlx-vlm >=0.7.10,<0.8.0
(the prefix cache needs 0.7.10) and mlx-lm >=0.31.3,<0.33, pinned in ``pyproject.toml``;
``tests/test_backend_contract.py`` checks these fields exist.

Prefix reuse: a group of keyed requests passes the resident model's ``APCManager`` (see
``prefix_cache``); each row carries its salt as ``_apc_semantic_hash``, so upstream keys blocks
by tokens plus that salt instead of hashing the whole prompt's embeddings.

A ``BatchBackend`` is one upstream ``BatchGenerator``: the continuous lane keeps one alive
while requests flow through it; a cohort (MTP) or an exclusive request gets its own.

Upstream takes one sampler per generator but per-row logits processors. Each row therefore
brings its own penalties and logit bias as processors, and the one sampler upstream sees
(``_RowSampler``) draws each row with that row's own controls and random stream
(``sampling.sample_rows``). It finds which request a row is from the batch it samples: the
prefill batch (every position 0) or the decoding batch, in upstream's row order.

Token logprobs (``RowInput.logprobs``) come from the same place: the sampler sees each step's
distribution, so for the rows that asked it queues their drawn token's logprob and top
alternatives (``sampling.row_logprobs``), and ``step`` hands each delivered token the oldest
queued for its row (upstream delivers a token the step after it was sampled). While such a
row decodes, upstream's fused greedy step is off so that every draw goes through the sampler.
A speculative generator draws without it: it reports no logprobs (``reports_logprobs``).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx

from ...controls import Sampling
from ...errors import EngineError, UpstreamError
from ..model.grammar import GrammarProcessor
from ..model.text_model import needs_positions
from .rows import (
    PREFILL_STEP_SIZE,
    DecodingRow,
    Drafter,
    LaneName,
    PrefillRow,
    RowInput,
    SampledLogprob,
    StepResult,
    TokenEvent,
)
from .sampling import PendingLogprobs, RowStream, make_sampler, row_logprobs, sample_rows

# The prompt kwarg upstream's prefix cache reads a row's salt from (``mlx_vlm.apc``).
APC_SALT_KWARG = "_apc_semantic_hash"


@contextlib.contextmanager
def map_upstream_errors(what: str) -> Iterator[None]:
    """Turn an exception from mlx / mlx-vlm into our ``UpstreamError`` (chained)."""
    try:
        yield
    except EngineError:
        raise
    except Exception as exc:  # noqa: BLE001 - upstream raises plain exceptions of every kind
        raise UpstreamError(f"{what} failed in mlx-vlm: {type(exc).__name__}: {exc}") from exc


def make_logits_processors(sampling: Sampling) -> list[Any]:
    from mlx_lm.sample_utils import make_logits_processors as _make

    return _make(
        logit_bias=dict(sampling.logit_bias) or None,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
    )


def row_processors(sampling: Sampling, grammar: GrammarProcessor | None) -> list[LogitsProcessor] | None:
    """One request's logits processors: penalties and bias, then its grammar (None: none)."""
    processors: list[LogitsProcessor] = make_logits_processors(sampling) if sampling.has_logit_processors() else []
    if grammar is not None:
        processors.append(grammar)
    return processors or None


LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
"""``processor(tokens, logits) -> logits``: one row's penalties, bias or grammar."""


class _RowSampler:
    """The one sampler upstream calls: each row drawn with its own request's stream."""

    def __init__(self, backend: BatchBackend) -> None:
        self._backend = backend

    def __call__(self, logprobs: mx.array) -> mx.array:
        raise RuntimeError(
            "mlx-vlm sampled without row positions; per-row sampling needs a supported mlx-vlm (>=0.7.10,<0.8.0)"
        )

    def sample_target(self, logprobs: mx.array, *, row_ids: list[int], positions: list[int]) -> mx.array:
        gen = self._backend._gen
        # Upstream samples a prefill batch's first tokens at position 0, decode steps from 1.
        batch = gen._generation_batch if any(positions) else gen._prompt_batch
        uids = list(batch.uids) if batch is not None else []
        if len(uids) != logprobs.shape[0]:
            raise RuntimeError(f"mlx-vlm sampled {logprobs.shape[0]} rows of a batch holding {len(uids)}")
        rows = self._backend._rows
        tokens = sample_rows(logprobs, [rows.get(uid) for uid in uids])
        self._backend._queue_logprobs(logprobs, tokens, uids)
        return tokens


class BatchBackend:
    """One upstream BatchGenerator and the uids it holds.

    Without a drafter every row is sampled with its own controls (``insert(..., sampling)``).
    A speculative generator (MTP) draws through one sampler: ``speculative_sampling`` for a
    sampled request running exclusive, greedy otherwise.
    """

    kind = LaneName.BATCH

    def __init__(
        self,
        model: Any,
        processor: Any,
        *,
        max_batch_size: int,
        drafter: Drafter | None = None,
        draft_tokens: int = 0,
        speculative_sampling: Sampling | None = None,
        prefill_step_size: int = PREFILL_STEP_SIZE,
        stream: Any = None,
        apc_manager: Any = None,
    ) -> None:
        from mlx_vlm.generate.ar import BatchGenerator

        self.model = model
        self.max_batch_size = max_batch_size
        self._rows: dict[int, RowStream] = {}  # sampled rows only; greedy rows are absent
        kwargs: dict[str, Any] = {"greedy_sampling": True}
        speculative = False
        if drafter is not None and draft_tokens > 0:
            speculative = True
            # Upstream's block size includes the target's seed token; ours counts proposals.
            kwargs.update(draft_model=drafter.model, draft_kind=drafter.kind, draft_block_size=draft_tokens + 1)
        self._per_row = not speculative
        self.reports_logprobs = not speculative  # the per-row sampler reads them
        self._asking: dict[int, int] = {}  # uid -> alternatives asked, for rows that asked
        self._logprobs: dict[int, collections.deque[PendingLogprobs]] = {}  # uid -> drawn, not delivered
        # The sampler touches MLX with request values (the seed): a value MLX refuses fails
        # this backend's requests, never the worker.
        with map_upstream_errors("creating the batch generator"):
            if not speculative:
                # Greedy stays on (upstream's fused greedy head, where a model has one) while
                # no sampled row decodes; ``step`` switches it per step.
                kwargs["sampler"] = _RowSampler(self)
            elif speculative_sampling is not None and speculative_sampling.temperature:
                kwargs.update(sampler=make_sampler(speculative_sampling), greedy_sampling=False)
            self._gen = BatchGenerator(
                getattr(model, "language_model", model),
                processor,
                completion_batch_size=max_batch_size,
                prefill_batch_size=max_batch_size,
                prefill_step_size=prefill_step_size,
                compute_logprobs=False,
                stream=stream,
                apc_manager=apc_manager,
                **kwargs,
            )
        self.uids: set[int] = set()

    # --- admission -------------------------------------------------------------------
    def insert(self, row: RowInput) -> int:
        """Queue one row with its own sampling controls and, for structured output, its own
        grammar (applied last, after penalties and bias). A keyed row's prefix comes from the
        generator's prefix cache (``apc_manager``), looked up by its salt."""
        if row.prefix is not None and row.prefix.serial is not None:
            raise RuntimeError("a batch restores prefixes through its prefix-cache manager")
        prompt_kwargs = (
            row.prompt_inputs if row.prompt_inputs is not None else text_prompt_kwargs(self.model, row.prompt_ids)
        )
        if row.prefix is not None:
            prompt_kwargs = {**prompt_kwargs, APC_SALT_KWARG: row.prefix.salt}
        with map_upstream_errors("inserting a prompt"):
            # Built before the row exists: a value refused here (seed, bias ids) fails this
            # request only, never the batch it would have joined.
            stream = RowStream.for_sampling(row.sampling) if self._per_row else None
            processors = row_processors(row.sampling, row.grammar)
            (uid,) = self._gen.insert(
                [row.prompt_ids],
                max_tokens=[row.max_tokens],
                prompt_kwargs=[prompt_kwargs],
                logits_processors=[processors],
            )
        if stream is not None:
            self._rows[uid] = stream
        if row.logprobs is not None:
            if not self.reports_logprobs:
                raise RuntimeError("a speculative batch draws without the per-row sampler: no logprobs")
            self._asking[int(uid)] = row.logprobs
        self.uids.add(uid)
        return int(uid)

    def adopt(self, row: DecodingRow) -> int:
        """Take a row that decoded alone (``single.SingleBackend.detach``) into the decoding
        batch, its KV cache as is: the batch's next step decodes its token in flight."""
        from mlx_vlm.generate.ar import GenerationBatch

        gen = self._gen
        with map_upstream_errors("moving a row into the batch"):
            uid = int(gen.uid_count)
            gen.uid_count += 1
            batch = GenerationBatch(
                model=gen.model,
                uids=[uid],
                inputs=row.next_token,
                prompt_cache=[type(c).merge([c]) for c in row.cache],
                sampler=gen.sampler,
                stop_criteria=gen.tokenizer.stopping_criteria,
                max_tokens=[row.max_tokens],
                greedy_sampling=gen.greedy_sampling,
                thinking_budget_criteria=[None],  # one slot per row, as a prefilled batch has
            )
            batch.compute_logprobs = gen.compute_logprobs
            batch._num_tokens = [row.num_tokens]
            gen._extend_generation_batch(batch)
        if row.row is not None:
            self._rows[uid] = row.row
        self.uids.add(uid)
        return uid

    def free_slots(self) -> int:
        return self.max_batch_size - len(self.uids)

    def allow_partial_prefill(self) -> None:
        """Let a late request start prefilling while others decode.

        Upstream admits queued prompts only when free slots >= ``prefill_batch_size``; with that
        left at the batch size a request arriving mid-decode would wait for the whole batch
        (continuous admission silently becoming cohorts). Setting it to the free-slot count
        keeps admission continuous.
        """
        decoding = len(self._gen._generation_batch)
        self._gen.prefill_batch_size = max(1, self.max_batch_size - decoding)

    def remove(self, uid: int) -> bool:
        with map_upstream_errors("removing a request"):
            removed = bool(self._gen.remove(uid))
        if removed:
            self.forget(uid)
        return removed

    def forget(self, uid: int) -> None:
        """The uid finished upstream on its own (stop or length)."""
        self.uids.discard(uid)
        self._rows.pop(uid, None)
        self._asking.pop(uid, None)
        self._logprobs.pop(uid, None)  # the token drawn after its last one is never delivered

    @property
    def prefilling(self) -> bool:
        """A prompt batch is mid-prefill: its prefix-cache blocks are leased until it ends."""
        return self._gen._prompt_batch is not None

    @property
    def has_work(self) -> bool:
        return bool(self._gen.has_work)

    # --- stepping --------------------------------------------------------------------
    def step(self, *, observe_prefill: bool) -> StepResult:
        if self._per_row:
            decoding = self._gen._generation_batch
            decoding.greedy_sampling = not any(uid in self._rows or uid in self._asking for uid in decoding.uids)
        with map_upstream_errors("a batch step"):
            prompt_responses, responses = self._gen.next()
            result = StepResult()
            for p in prompt_responses:
                result.prompt_done[int(p.uid)] = int(getattr(p, "cached_tokens", 0) or 0)
            for r in responses:
                uid, token = int(r.uid), int(r.token)
                result.tokens.append(TokenEvent(uid, token, r.finish_reason, self._delivered_logprob(uid, token)))
        result.batch_uids = self._batch_uids()
        if observe_prefill:
            result.prefill = self._prefill_rows()
        return result

    def _queue_logprobs(self, logprobs: mx.array, tokens: mx.array, uids: list[int]) -> None:
        """Queue the logprobs of the rows that asked, drawn from ``logprobs`` (B, V), upstream's
        rows ``uids`` in order (lazy arrays, evaluated with the step's tokens)."""
        rows = [i for i, uid in enumerate(uids) if uid in self._asking]
        if not rows:
            return
        entries = row_logprobs(logprobs, tokens, rows, [self._asking[uids[i]] for i in rows])
        for i, entry in zip(rows, entries):
            self._logprobs.setdefault(uids[i], collections.deque()).append(entry)
        mx.async_eval([a for entry in entries for a in entry.arrays()])

    def _delivered_logprob(self, uid: int, token: int) -> SampledLogprob | None:
        """The logprob of ``token``, delivered now for row ``uid`` (None: the row did not ask)."""
        if uid not in self._asking:
            return None
        queued = self._logprobs.get(uid)
        if not queued:
            raise RuntimeError(f"row {uid}'s token {token} was not drawn by the per-row sampler")
        return queued.popleft().read(token)

    def _batch_uids(self) -> set[int]:
        uids = set(self._gen._generation_batch.uids)
        prompt_batch = self._gen._prompt_batch
        if prompt_batch is not None:
            uids.update(prompt_batch.uids)
        return uids

    def _prefill_rows(self) -> dict[int, PrefillRow]:
        """Per-row prompt tokens already in the KV cache, read from the prefill batch."""
        batch = self._gen._prompt_batch
        if batch is None:
            return {}
        rows: dict[int, PrefillRow] = {}
        columns = int(batch._processed_prompt_columns)
        right_pad = batch._right_pad_per_row
        for i, uid in enumerate(batch.uids):
            suffix = int(batch._suffix_lens[i])
            cached = int(batch._cached_tokens_per_row[i]) if batch._cached_tokens_per_row else 0
            if right_pad is not None:
                done = min(suffix, max(0, columns))
            else:
                done = min(suffix, max(0, columns - int(batch._left_padding_per_row[i])))
            rows[int(uid)] = PrefillRow(processed=cached + done, total=cached + suffix, cached=cached)
        return rows

    def speculation_counters(self) -> tuple[int, float, int] | None:
        """The drafter's lifetime (rounds, accepted, drafted) counters, or None without one."""
        drafter = self._gen.draft_model
        if drafter is None:
            return None
        from mlx_vlm.speculative.common import speculative_stats_snapshot

        return speculative_stats_snapshot(drafter)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._gen.close()
            # Work the generator scheduled ahead (async_eval) must finish before the
            # stream can be dropped.
            mx.synchronize(self._gen.stream())
        self.uids.clear()
        self._rows.clear()


def text_prompt_kwargs(model: Any, prompt_ids: list[int]) -> dict[str, Any]:
    """Row kwargs for a text prompt: the embeddings plus rope metadata.

    Needed even without images: hybrid Qwen rows that get left-padded diverge unless the
    row carries its own position ids.
    """
    if not hasattr(model, "get_input_embeddings"):
        return {}
    with map_upstream_errors("embedding a prompt"):
        out = model.get_input_embeddings(mx.array([prompt_ids]), None)
    kwargs = {k: v for k, v in out.to_dict().items() if v is not None}
    if "position_ids" not in kwargs and needs_positions(model):
        n = len(prompt_ids)
        kwargs["position_ids"] = mx.arange(n)[None]
        kwargs["rope_deltas"] = mx.zeros((1, 1))
    return kwargs


def image_prompt_inputs(model: Any, processor: Any, prompt: str, images: list[Any]) -> tuple[list[int], dict[str, Any]]:
    """Tokenise a prompt with its images and return (prompt ids, row kwargs with embeddings)."""
    from mlx_vlm.utils import prepare_inputs

    config = getattr(model, "config", None)
    image_token_index = getattr(config, "image_token_index", None) or getattr(config, "image_token_id", None)
    with map_upstream_errors("preparing image inputs"):
        inputs = prepare_inputs(processor, images=images, prompts=[prompt], image_token_index=image_token_index)
        input_ids = inputs["input_ids"]
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        out = model.get_input_embeddings(
            input_ids, inputs.get("pixel_values"), mask=inputs.get("attention_mask"), **extra
        )
    kwargs = {k: v for k, v in out.to_dict().items() if v is not None}
    for key in ("image_grid_thw",):
        if key in extra and key not in kwargs:
            kwargs[key] = extra[key]
    return [int(t) for t in input_ids[0].tolist()], kwargs


# mlx-lm's ``BatchKVCache`` keeps how many columns it holds in the private ``_idx``; the text
# lane reads it to right-justify a merge and moves it when it drops leading padding.
def kv_columns(cache: Any) -> int:
    """The columns (positions) one layer's ``BatchKVCache`` holds."""
    return int(cache._idx)


def drop_kv_columns(cache: Any, shift: int) -> None:
    """Say that ``cache`` lost its ``shift`` leading columns (its arrays already cut)."""
    cache._idx -= shift
