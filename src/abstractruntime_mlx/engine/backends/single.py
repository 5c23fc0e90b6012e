"""The single-request lane: one request decoding alone, one model step ahead.

A continuous group that starts with one request and nothing else waiting decodes on this
lane instead of upstream's batch step at width 1: a plain KV cache, no batch masks, and
mlx-lm's ``generate_step`` pattern (queue step n+1 with ``mx.async_eval``, then read token n
while the device computes). The engine drives it through the same backend protocol as a
``BatchBackend`` of one slot, so phase events, cancels, stop strings and limits share one path.

When a compatible request arrives, the running row moves into the batch lane of its group
(``BatchBackend.adopt``, or ``TextLoopBackend.adopt`` for a text-lane group) with its KV cache and its token already in flight: no re-prefill,
and the batch's first step decodes that token. A request still prefilling moves once its
first token is out.

Which requests and models qualify (``text_model.supports_model``, ``lanes.single_lane_row``):
text prompts without logits processors, on models whose cache is a plain ``KVCache`` per layer
and whose rows need no position ids. A keyed row (``apc_manager`` given, the salt in
``RowInput.prefix`` as the batch takes it) restores the prefix's KV blocks
into its plain cache (or starts from its key's resident KV, ``cache/resident.py``) and prefills
the rest; once its first token is out (the next step, a hand-off or its end) its new full
blocks are stored as a batch row's are, so either lane finds the other's. The prefill is chunked as upstream
chunks a batch's (``prefill_step_size`` columns, the last prompt token on its own), and a
sampled row draws from its own ``RowStream``, so a row's tokens are the same on either lane.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx

from .backend import map_upstream_errors
from .keyed_prefix import KeyedPrefix
from .rows import DecodingRow, LaneName, PrefillRow, RowInput, StepResult, TokenEvent
from .sampling import RowStream, sample_rows

_CLEAR_CACHE_EVERY = 256  # tokens (mlx-lm's generate_step)


class SingleBackend:
    """One request at a time on a plain KV cache, with the ``BatchBackend`` interface."""

    kind = LaneName.SINGLE
    reports_logprobs = False
    max_batch_size = 1

    def __init__(
        self,
        model: Any,
        *,
        stop_criteria: Callable[[int], bool],
        prefill_step_size: int,
        stream: Any,
        apc_manager: Any = None,
        make_cache: Callable[[], list[Any]] | None = None,
        language_model: Any = None,
    ) -> None:
        self.model = model
        # Which cache classes the row's cache is built from: the ones of the batch it may move
        # into (mlx-vlm's by default; mlx-lm's for a text-lane group, ``text_model.make_cache``).
        self._make_cache = make_cache
        self._apc = apc_manager
        # What each step calls: the model's language model, or the text lane's (``text_model.language_model``).
        self._lm = language_model if language_model is not None else getattr(model, "language_model", model)
        self._stop = stop_criteria
        self._prefill_step_size = prefill_step_size
        self._stream = stream
        self._uids = itertools.count()
        self._uid: int | None = None
        self._cache: list[Any] = []
        self._pending: list[int] = []  # prompt tokens not yet in the cache
        self._total = 0
        self._next: mx.array | None = None  # the token in flight
        self._num_tokens = 0
        self._max_tokens = 0
        self._row: RowStream | None = None
        self.uids: set[int] = set()
        self._prompt: list[int] = []
        self._keyed: KeyedPrefix | None = None  # a keyed row's prefix-cache work
        self._cached = 0
        self._generated: list[int] = []  # tokens delivered, in order (fed to the cache after the prompt)

    # --- admission -------------------------------------------------------------------
    def insert(self, row: RowInput) -> int:
        # mlx-vlm's cache classes, the ones its batch generator builds and extends
        from mlx_vlm.models.cache import KVCache

        if self.uids:
            raise RuntimeError("the single lane runs one request at a time")
        if row.prefix is not None and row.prefix.serial is not None:
            raise RuntimeError("the single lane restores the native prefix cache's blocks, not a serialized snapshot")
        if row.grammar is not None or row.prompt_inputs is not None:
            raise RuntimeError(
                "the single lane runs text rows without logits processors; this request runs in the batch"
            )
        with map_upstream_errors("inserting a prompt"):
            self._row = RowStream.for_sampling(row.sampling)
        if self._make_cache is not None:
            self._cache = self._make_cache()
        else:
            make_cache = getattr(self._lm, "make_cache", None)
            self._cache = list(make_cache()) if make_cache is not None else [KVCache() for _ in self._lm.layers]
        prompt_ids = row.prompt_ids
        self._prompt = list(prompt_ids)
        self._keyed = None
        self._cached = 0
        if row.prefix is not None and self._apc is not None:
            self._keyed = KeyedPrefix(self._apc, row.prefix.salt, row.prefix.key, self._prompt)
            self._cache = self._keyed.restore(self._cache)
            self._cached = self._keyed.cached
        self._generated = []
        self._pending = list(prompt_ids[self._cached :])
        self._total = len(prompt_ids)
        self._next = None
        self._num_tokens = 0
        self._max_tokens = row.max_tokens
        uid = next(self._uids)
        self._uid = uid
        self.uids.add(uid)
        return uid

    def free_slots(self) -> int:
        return self.max_batch_size - len(self.uids)

    def remove(self, uid: int) -> bool:
        self.forget(uid)
        return True

    def forget(self, uid: int) -> None:
        if uid != self._uid:
            return
        self._uid = None
        self._store_if_pending()
        self._cache, self._pending, self._next, self._row = [], [], None, None
        self._release_restored()
        self.uids.discard(uid)

    @property
    def prefilling(self) -> bool:
        """A keyed row holds restored prefix-cache blocks until its prefill is stored."""
        keyed = self._keyed
        return keyed is not None and (bool(keyed.restored) or keyed.store_pending)

    def _store_if_pending(self) -> None:
        if self._keyed is not None:
            self._keyed.store(self._cache)

    def _release_restored(self) -> None:
        if self._keyed is not None:
            self._keyed.release()

    @property
    def decoding(self) -> bool:
        """The row has delivered a token and has the next one in flight: it can move."""
        return self._uid is not None and self._next is not None

    @property
    def can_hand_off(self) -> bool:
        return self.decoding

    def detach(self) -> tuple[int, DecodingRow]:
        """Hand the decoding row over (``BatchBackend.adopt``); this lane is empty afterwards."""
        uid, token = self._uid, self._next
        if uid is None or token is None:
            raise RuntimeError("only a decoding row can move to a batch")
        self._store_if_pending()
        tokens = self._prompt + self._generated if self._keyed is not None else []
        row = DecodingRow(self._cache, token, self._num_tokens, self._max_tokens, self._row, self._keyed, tokens)
        self._cache, self._next, self._row, self._uid, self._keyed = [], None, None, None, None
        self.uids.discard(uid)
        return uid, row

    # --- stepping --------------------------------------------------------------------
    def step(self, *, observe_prefill: bool) -> StepResult:
        result = StepResult()
        uid = self._uid
        if uid is None:
            return result
        result.batch_uids = {uid}
        with mx.stream(self._stream), map_upstream_errors("a single-lane step"):
            self._store_if_pending()
            if len(self._pending) > 1:
                self._prefill_chunk()
                if observe_prefill:
                    done = self._total - len(self._pending)
                    result.prefill[uid] = PrefillRow(processed=done, total=self._total, cached=self._cached)
                if len(self._pending) > 1:
                    return result
            token = self._next
            first = token is None
            if token is None:
                # The prefill's new blocks are stored on the next step: the first token goes
                # out first (the cache keeps the prompt's positions as later tokens append).
                if self._keyed is not None:
                    self._keyed.store_pending = True
                # The last prompt token gives the first generated one.
                token = self._sample(mx.array(self._pending)[None])
                self._pending = []
                mx.async_eval(token)
                result.prompt_done[uid] = self._cached
            self._next = token
            self._num_tokens += 1
            if self._num_tokens % _CLEAR_CACHE_EVERY == 0:
                mx.clear_cache()
            finish = self._num_tokens >= self._max_tokens
            # The first token goes out before step 2 is built (time to first token); from
            # then on one step ahead: the device computes token n+1 while the host reads n.
            value = int(cast(int, token.item())) if first else -1
            if not finish and not (first and self._stop(value)):
                self._next = self._sample(token[None])
                mx.async_eval(self._next)
            if not first:
                value = int(cast(int, token.item()))  # waits for token n only
        if self._stop(value):
            reason: str | None = "stop"
        elif finish:
            reason = "length"
        else:
            reason = None
        result.tokens.append(TokenEvent(uid, value, reason))
        self._generated.append(value)
        if reason is not None:
            self._keep_resident()
            self.forget(uid)
        return result

    def _keep_resident(self) -> None:
        """A keyed row that ended on its own leaves its whole KV for its key's next turn."""
        if self._keyed is None or not self._cache:
            return
        self._store_if_pending()  # the blocks first: the fallback when the resident KV goes
        # The cache holds the prompt, then each delivered token it was fed.
        tokens = (self._prompt + self._generated)[: int(self._cache[0].offset)]
        self._keyed.keep(self._cache, tokens)
        self._cache = []

    def _prefill_chunk(self) -> None:
        n = min(self._prefill_step_size, len(self._pending) - 1)
        self._lm(mx.array(self._pending[:n])[None], cache=self._cache)
        mx.async_eval([c.state for c in self._cache])  # queued: the next chunk is built meanwhile
        self._pending = self._pending[n:]
        mx.clear_cache()

    def _sample(self, inputs: mx.array) -> mx.array:
        output = self._lm(inputs, cache=self._cache)
        logits = getattr(output, "logits", output)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self._row is None:
            return mx.argmax(logprobs, axis=-1)
        return sample_rows(logprobs, [self._row])

    def close(self) -> None:
        if self._uid is not None:
            self.forget(self._uid)
        mx.synchronize(self._stream)
