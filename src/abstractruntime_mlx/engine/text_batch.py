"""The text lane on mlx-lm's ``BatchGenerator`` (``EngineConfig.own_text_loop=False``; the
default is the lane's own loop, ``text_loop``, which reuses ``language_model`` and ``make_cache``).

Bare, mlx-lm's batch loop steps faster than mlx-vlm's at 16 and more rows (measured on CUDA,
``docs/benchmarks.md``; inside the engine the gain shows at 16 rows, not yet at 32-64), and it
interleaves prefill with decode by itself: each ``next()``
decodes the running rows first, then prefills one chunk (``prefill_step_size`` columns) of
the prompts waiting, so a long prompt arriving never stalls the rows already decoding for
more than one chunk.

It drives mlx-lm's own model class for the checkpoint (``language_model``: built lazily by
mlx-lm's loader, then given the resident model's weight arrays, so no second copy of the
weights), the class mlx-lm's loop is tuned for: on CUDA mlx-vlm's language model took ~10 ms
more per step in this loop at 32-64 rows. Where mlx-lm has no class for the checkpoint, or its
parameters differ, the lane drives mlx-vlm's language model through ``_Logits``. Which rows run
here (``scheduler.text_lane_row``): continuous rows of text without a prefix-cache key or
MTP, structured ones included; which models (``supports_model``): a plain ``KVCache`` per
layer and no position ids, the single lane's rule. Everything else keeps mlx-vlm's loop
(images, MTP, prefix blocks).

Each row brings its own controls: a sampled row its own ``RowStream`` as its sampler, its
penalties, bias and grammar as its logits processors; greedy rows share mlx-lm's batched argmax. The
tokenizer's end-of-sequence ids are the stop tokens, reported as ``finish_reason == "stop"``
like mlx-vlm's loop reports them, so the engine finishes rows the same way on either lane.

A lone request that started on the single lane moves in here when a text request joins
(``adopt``), its KV cache as is (the single lane builds mlx-lm caches for text-lane groups,
``make_cache``) and its token in flight delivered first, as ``BatchBackend.adopt`` does for
mlx-vlm's loop.

Private upstream fields read here (mlx-lm >=0.31.3,<0.33, pinned in ``pyproject.toml``;
``tests/test_backend_contract.py`` checks them): ``BatchGenerator._prompt_batch``,
``_generation_batch``, ``_unprocessed_sequences``, ``_uid_count``, ``_default_stop_sequences``;
and for ``adopt``, ``GenerationBatch``'s step state (``_next_tokens``, ``_next_logprobs``,
``_current_tokens``, ``_current_logprobs``, ``_token_context``, ``_num_tokens``,
``_matchers``) and ``models.cache.TokenBuffer``.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from .backend import DecodingRow, PrefillRow, RowInput, StepResult, TokenEvent, map_upstream_errors, row_processors
from ..controls import Sampling
from .prefill_shapes import Buckets, bucket_prompt_batch
from .sampling import RowStream, sample_rows
from .scheduler import BackendKind
from .single import supports_model

__all__ = ["TextBatchBackend", "language_model", "make_cache", "supports_model"]

log = logging.getLogger(__name__)


class _Logits:
    """The language model as mlx-lm's loop calls it: ``model(tokens, cache=...) -> logits``."""

    def __init__(self, language_model: Any) -> None:
        self.language_model = language_model

    @property
    def layers(self) -> Any:
        return self.language_model.layers

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        output = self.language_model(inputs, cache=cache)
        logits: mx.array = getattr(output, "logits", output)
        return logits


def language_model(path: Path, model: Any) -> Any:
    """The model the text lane steps: mlx-lm's class for the checkpoint at ``path`` holding the
    resident ``model``'s weight arrays, or mlx-vlm's language model behind ``_Logits``."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model as load_lm

    resident = getattr(model, "language_model", model)
    try:
        twin, _config = load_lm(path, lazy=True)  # lazy: its own arrays are never read
    except Exception as exc:  # noqa: BLE001 - no mlx-lm class for this checkpoint: keep mlx-vlm's
        log.info("text lane: mlx-lm cannot build %s (%s); stepping mlx-vlm's language model", path, exc)
        return _Logits(resident)
    ours = dict(tree_flatten(resident.parameters()))
    theirs = dict(tree_flatten(twin.parameters()))
    same = ours.keys() == theirs.keys() and all(
        ours[k].shape == theirs[k].shape and ours[k].dtype == theirs[k].dtype for k in ours
    )
    if not same:
        log.info("text lane: mlx-lm's parameters for %s differ from mlx-vlm's; stepping mlx-vlm's language model", path)
        return _Logits(resident)
    twin.load_weights(list(ours.items()))  # the resident arrays, shared
    return twin


def make_cache(model: Any) -> list[Any]:
    """A fresh per-layer KV cache of the kind mlx-lm's batch loop merges, for ``model`` (what
    ``language_model`` returned): for the single lane, whose row may move into a text batch."""
    from mlx_lm.models.cache import make_prompt_cache

    caches: list[Any] = make_prompt_cache(model)
    return caches


def _row_sampler(stream: RowStream | None) -> Callable[[mx.array], mx.array] | None:
    """A sampled row's own sampler (its ``RowStream``); None for a greedy row (mlx-lm's argmax,
    one call for every greedy row of the batch)."""
    if stream is None:
        return None

    def sample(logprobs: mx.array) -> mx.array:
        return sample_rows(logprobs, [stream])

    return sample


class TextBatchBackend:
    """One mlx-lm ``BatchGenerator`` and the uids it holds."""

    kind = BackendKind.TEXT_BATCH

    def __init__(
        self,
        model: Any,
        *,
        language_model: Any,
        eos_token_ids: frozenset[int],
        max_batch_size: int,
        prefill_step_size: int,
        stream: Any,
        buckets: Buckets | None = None,
    ) -> None:
        """``buckets``: pad prompt chunks to these lengths (``prefill_shapes``); None: upstream's
        shapes."""
        from mlx_lm.generate import BatchGenerator

        self.model = model
        self.max_batch_size = max_batch_size
        with map_upstream_errors("creating the text batch generator"):
            self._gen = BatchGenerator(
                language_model,
                stop_tokens=[[eos] for eos in sorted(eos_token_ids)] or None,
                completion_batch_size=max_batch_size,
                prefill_batch_size=max_batch_size,
                prefill_step_size=prefill_step_size,
                stream=stream,
            )
            if buckets is not None:
                bucket_prompt_batch(self._gen, buckets)
        self.uids: set[int] = set()

    # --- admission -------------------------------------------------------------------
    def insert(self, row: RowInput) -> int:
        if row.prefix is not None or row.prompt_inputs is not None:
            raise RuntimeError("the text lane runs text rows without a prefix-cache key")
        with map_upstream_errors("inserting a prompt"):
            # Built before the row exists: a value refused here fails this request only.
            sampler = _row_sampler(RowStream.for_sampling(row.sampling))
            processors = row_processors(row.sampling, row.grammar) or []
            (uid,) = self._gen.insert(
                [row.prompt_ids],
                max_tokens=[row.max_tokens],
                samplers=[sampler] if sampler is not None else None,  # None: the batch's greedy argmax
                logits_processors=[processors],
            )
        self.uids.add(int(uid))
        return int(uid)

    def adopt(self, row: DecodingRow) -> int:
        """Take a row that decoded alone (``single.SingleBackend.detach``) into the decoding
        batch, its KV cache as is: the batch's next step feeds its token in flight (delivered
        then, first) and samples the one after, with the row's own sampler."""
        from mlx_lm.generate import GenerationBatch
        from mlx_lm.models.cache import TokenBuffer

        gen = self._gen
        with map_upstream_errors("moving a row into the text batch"):
            uid = int(gen._uid_count)
            gen._uid_count += 1
            stop = gen._default_stop_sequences
            moving = GenerationBatch.__new__(GenerationBatch)  # built without its first step:
            moving.uids = [uid]  # the token in flight is already sampled
            moving.prompt_cache = [type(c).merge([c]) for c in row.cache]
            moving.tokens = [[]]
            moving.samplers = [_row_sampler(row.row) or gen.sampler]
            moving.logits_processors = [[]]
            moving.max_tokens = [row.max_tokens]
            moving.stop_sequences = [stop]
            moving._current_tokens = None
            moving._current_logprobs = []
            moving._next_tokens = row.next_token.reshape(1).astype(mx.uint32)
            moving._next_logprobs = [mx.zeros((1,))]  # not read: responses' logprobs are unused
            moving._token_context = [TokenBuffer([])]
            moving._num_tokens = [row.num_tokens]
            moving._matchers = [stop.matcher()]
            gen._generation_batch.extend(moving)
        self.uids.add(uid)
        return uid

    def free_slots(self) -> int:
        return self.max_batch_size - len(self.uids)

    def remove(self, uid: int) -> bool:
        """mlx-lm drops a row at any stage (waiting, mid-prefill or decoding)."""
        with map_upstream_errors("removing a request"):
            self._gen.remove([uid])
        self.forget(uid)
        return True

    def forget(self, uid: int) -> None:
        self.uids.discard(uid)

    @property
    def prefilling(self) -> bool:
        return len(self._gen._prompt_batch) > 0 or bool(self._gen._unprocessed_sequences)

    @property
    def has_work(self) -> bool:
        return bool(self.uids)

    # --- stepping --------------------------------------------------------------------
    def step(self, *, observe_prefill: bool) -> StepResult:
        with map_upstream_errors("a text batch step (mlx-lm)"):
            prompt_responses, responses = self._gen.next()
        result = StepResult()
        for p in prompt_responses:
            uid = int(p.uid)
            processed, total = (int(x) for x in p.progress)
            if p.end_of_prompt:
                result.prompt_done[uid] = 0
            elif observe_prefill:
                result.prefill[uid] = PrefillRow(processed=processed, total=total, cached=0)
        for r in responses:
            result.tokens.append(TokenEvent(int(r.uid), int(r.token), r.finish_reason))
        result.batch_uids = set(self._gen._generation_batch.uids) | set(self._gen._prompt_batch.uids)
        return result

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._gen.close()
            mx.synchronize(self._gen.stream)
        self.uids.clear()
