"""The text lane's own batch loop: plain text rows decode over the model's forward directly.

What it saves against mlx-lm's ``BatchGenerator`` (which the lane stepped before; this loop
measured 1.19-1.47x faster), measured on the H200 where every step is bound by the
host building and encoding the graph (``docs/benchmarks.md``):

- Admission costs one forward, not two, and no device wait. Arriving prompts (all but their
  last token) are prefilled together, left-padded, into a ``BatchKVCache`` that then extends
  the batch's; each row's last prompt token is fed by the batch's next decode step, which
  samples the row's first token with everyone else's. Upstream prefills, waits for the cache
  (``mx.eval``), empties MLX's buffer cache, then runs a separate first decode step for the
  newcomers and waits for it.
- A finished row costs no device wait. Each row's left padding is known here, so a compaction
  shifts the cache without reading the padding back from the device (upstream's
  ``BatchKVCache.filter`` does, for every finish), and no finished row's cache is extracted.
  Where the step is bound by the host encoding kernels (MLX's CUDA backend) a finished row
  costs no host work either: its slot idles in the batch until half the batch has finished or
  rows join, then one compaction drops every finished row. Where the step is bound by compute
  (the CPU: each row adds about 7% to a step of 8 rows of the tiny model), it is dropped at once
  (``text_plan.should_compact``).
- Rows admitted together with the same prompt (a call's ``n`` choices) prefill it once: one
  cache row, copied to each of them when the prefill ends; the copies report it as cached.
- One sampling call for the batch (``sampling.sample_rows``; greedy rows share its argmax).
  Rows that ask for token logprobs (``RowInput.logprobs``) get them from the distribution
  they were sampled from, computed in the same step for those rows only (``row_logprobs``);
  a batch where no row asks computes nothing more.

The step keeps mlx-lm's pipelining: the forward for step n+1 is queued (``mx.async_eval``)
before the host reads step n's tokens. Long prompts (more than ``prefill_step_size`` tokens)
prefill one chunk per step, interleaved with decode, so a long prompt arriving never stalls the
rows already decoding for more than a chunk; short prompts are admitted meanwhile, each step
whatever arrived (``text_plan.plan_prefill``).

A sampled row draws from its own ``RowStream``, penalties, bias and grammar are per-row logits
processors fed the tokens so far as mlx-lm feeds them, the tokenizer's end-of-sequence ids stop
a row with ``"stop"`` (as mlx-vlm's loop reports them), and a row that decoded alone on the
single lane moves in with its KV cache (``adopt``; the single lane builds mlx-lm caches for
text-lane groups, ``text_model.make_cache``). It steps mlx-lm's own class for the checkpoint
(``text_model.language_model``), given the resident weight arrays.

Upstream fields read here (mlx-lm >=0.31.3,<0.33, ``tests/test_backend_contract.py``):
``BatchKVCache``'s ``keys``, ``values``, ``offset`` and ``left_padding``; its private column
count through ``backend.kv_columns`` / ``drop_kv_columns``.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from ..model.prefill_shapes import Buckets
from ..model.text_model import make_cache
from .backend import LogitsProcessor, drop_kv_columns, kv_columns, map_upstream_errors, row_processors
from .keyed_prefix import KeyedPrefix
from .rows import DecodingRow, LaneName, PrefillRow, RowInput, StepResult, TokenEvent
from .sampling import PendingLogprobs, RowStream, row_logprobs, sample_rows
from .text_plan import plan_prefill, should_compact

__all__ = ["TextLoopBackend"]

_CLEAR_CACHE_EVERY = 512  # decode steps, as mlx-lm's batch loop


@dataclass(slots=True, eq=False)
class _Row:
    uid: int
    prompt: list[int]
    max_tokens: int
    stream: RowStream | None
    processors: list[LogitsProcessor]
    context: Any = None  # the tokens fed so far (mlx-lm's ``TokenBuffer``), for the processors
    num_tokens: int = 0  # tokens delivered
    pad: int = 0  # left padding in the cache that holds the row
    generated: bool = False  # its token in flight is a generated one, not its last prompt token
    done: bool = False  # finished: its slot idles in the batch until the next compaction
    logprobs: int | None = None  # alternatives asked per position (None: no logprobs)
    pending: PendingLogprobs | None = None  # the logprobs of its token in flight
    # A keyed row: its prefix-cache work, the plain cache it starts from (its restored prefix),
    # the tokens its cache holds once it decodes (the prompt, then each one delivered), and
    # its prompt's KV (but the last token) until its blocks are stored.
    keyed: KeyedPrefix | None = None
    start: list[Any] | None = None
    tokens: list[int] | None = None
    prompt_kv: list[Any] | None = None


@dataclass(slots=True, eq=False)
class _Prefill:
    """Rows prefilling together: their distinct prompts but the last token, left-padded to one
    width (``tokens``, one cache row each); ``source[i]``: the prompt row of ``rows[i]`` (rows
    with the same prompt share one)."""

    rows: list[_Row]
    tokens: list[list[int]]
    cache: list[Any]
    chunks: list[int]  # column counts still to run, in order
    source: list[int]
    done: int = 0  # columns run
    cached: int = 0  # a keyed row's group: the prompt tokens its cache started with


class TextLoopBackend:
    """A batch of plain text rows stepped over the language model's forward."""

    kind = LaneName.TEXT
    reports_logprobs = True

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
        idle_finished: bool = False,
        apc_manager: Any = None,
    ) -> None:
        """``language_model``: ``text_model.language_model``'s result (``model(tokens, cache=)
        -> logits``, a plain ``KVCache`` per layer); ``buckets``: pad the last chunk of each
        prefill to these lengths (``prefill_shapes``); ``idle_finished``: finished rows idle in
        the batch until half of it has finished or rows join (False: each step drops its
        finished rows); ``apc_manager``: the prefix cache's manager, for a group of keyed rows."""
        self.model = model
        self.max_batch_size = max_batch_size
        self._lm = language_model
        self._eos = eos_token_ids
        self._step_size = prefill_step_size
        self._stream = stream
        self._buckets = buckets
        self._uid_count = itertools.count()
        self.uids: set[int] = set()
        self._waiting: collections.deque[_Row] = collections.deque()
        self._chunked: _Prefill | None = None  # long prompts, one chunk a step
        self._rows: list[_Row] = []  # decoding, in the batch cache's row order
        self._cache: list[Any] = []  # a BatchKVCache per layer
        self._inputs: mx.array | None = None  # each decoding row's next input token, in flight
        self._steps = 0
        self._idle_finished = idle_finished
        self._apc = apc_manager
        self._storing: list[_Row] = []  # keyed rows whose blocks are stored once their first token is out

    # --- admission -------------------------------------------------------------------
    def insert(self, row: RowInput) -> int:
        if row.prompt_inputs is not None:
            raise RuntimeError("the text lane runs text rows")
        if row.prefix is not None and (row.prefix.serial is not None or self._apc is None):
            raise RuntimeError("the text lane restores the native prefix cache's blocks of a keyed group")
        with map_upstream_errors("inserting a prompt"):
            if not row.prompt_ids:
                raise ValueError("a prompt needs at least one token")
            if row.max_tokens <= 0:
                raise ValueError(f"max_tokens must be > 0, got {row.max_tokens}")
            # Built before the row exists: a value refused here fails this request only.
            stream = RowStream.for_sampling(row.sampling)
            processors = row_processors(row.sampling, row.grammar) or []
            context = _token_buffer(row.prompt_ids[:-1]) if processors else None
        uid = next(self._uid_count)
        prompt = list(row.prompt_ids)
        waiting = _Row(uid, prompt, row.max_tokens, stream, processors, context, logprobs=row.logprobs)
        if row.prefix is not None:  # restored when a step first sees it (``_prefill``)
            waiting.keyed = KeyedPrefix(self._apc, row.prefix.salt, row.prefix.key, prompt)
        self._waiting.append(waiting)
        self.uids.add(uid)
        return uid

    def adopt(self, row: DecodingRow) -> int:
        """Take a row that decoded alone (``single.SingleBackend.detach``) into the batch, its KV
        cache as is: the next step delivers its token in flight and samples the one after."""
        uid = next(self._uid_count)
        with map_upstream_errors("moving a row into the text batch"):
            cache = [type(c).merge([c]) for c in row.cache]  # mlx-lm: a BatchKVCache of one row
            moving = _Row(uid, [], row.max_tokens, row.row, [], num_tokens=row.num_tokens, generated=True)
            if row.keyed is not None:  # its blocks are stored: its KV stays resident when it ends
                moving.keyed, moving.tokens = row.keyed, list(row.tokens)
            self._join([moving], cache, row.next_token.reshape(1).astype(mx.uint32))
        self.uids.add(uid)
        return uid

    def free_slots(self) -> int:
        return self.max_batch_size - len(self.uids)

    def remove(self, uid: int) -> bool:
        """Drop a row at any stage (waiting, mid-prefill or decoding)."""
        with map_upstream_errors("removing a request"):
            group_rows = self._chunked.rows if self._chunked is not None else []
            for r in itertools.chain(self._waiting, group_rows, self._rows):
                if r.uid == uid:
                    self._end_keyed(r)
            self._waiting = collections.deque(r for r in self._waiting if r.uid != uid)
            group = self._chunked
            if group is not None and any(r.uid == uid for r in group.rows):
                keep = [i for i, r in enumerate(group.rows) if r.uid != uid]
                if keep:
                    prompts = sorted({group.source[i] for i in keep})  # the prompt rows still needed
                    group.rows = [group.rows[i] for i in keep]
                    group.source = [prompts.index(group.source[i]) for i in keep]
                    if len(prompts) < len(group.tokens):
                        group.tokens = [group.tokens[j] for j in prompts]
                        _filter(group.cache, prompts, shift=0)
                else:
                    self._chunked = None
            if any(r.uid == uid for r in self._rows):
                self._keep([i for i, r in enumerate(self._rows) if r.uid != uid])
        self.forget(uid)
        return True

    def forget(self, uid: int) -> None:
        self.uids.discard(uid)

    # --- keyed rows ------------------------------------------------------------------
    def _store_ready(self) -> None:
        """Store the blocks of the keyed rows whose first token went out since the last step
        (after it: the first token does not wait for the store)."""
        ready = [r for r in self._storing if r.keyed is not None and r.keyed.store_pending]
        for r in ready:
            self._end_keyed(r)

    def _end_keyed(self, r: _Row) -> None:
        """A keyed row's prefill is over for the cache: its new blocks stored if its first token
        is out, else (cancelled before it) its restored blocks let go."""
        if r in self._storing:
            self._storing.remove(r)
        keyed = r.keyed
        if keyed is None:
            return
        if r.prompt_kv is not None:
            keyed.store(r.prompt_kv)
        keyed.release()
        r.prompt_kv, r.start = None, None

    def _keep_resident(self, r: _Row, e: int) -> None:
        """A keyed row that ended on its own (row ``e`` of the batch, its last token fed) leaves
        its whole KV for its key's next turn."""
        if r.keyed is None or r.tokens is None:
            return
        self._end_keyed(r)
        kv = make_cache(self._lm)
        for mine, c in zip(kv, self._cache):
            end = kv_columns(c)
            mine.keys = mx.contiguous(c.keys[e : e + 1, :, r.pad : end, :])
            mine.values = mx.contiguous(c.values[e : e + 1, :, r.pad : end, :])
            mine.offset = end - r.pad
        r.keyed.keep(kv, r.tokens[: kv[0].offset])
        r.keyed, r.tokens = None, None

    @property
    def prefilling(self) -> bool:
        return bool(self._waiting) or self._chunked is not None or bool(self._storing)

    @property
    def has_work(self) -> bool:
        return bool(self.uids)

    # --- stepping --------------------------------------------------------------------
    def step(self, *, observe_prefill: bool) -> StepResult:
        result = StepResult()
        with mx.stream(self._stream), map_upstream_errors("a text batch step"):
            self._store_ready()
            if self._rows:
                self._decode(result)
            self._prefill(result, observe_prefill)
        result.batch_uids = {r.uid for r in self._rows if not r.done}
        if self._chunked is not None:
            result.batch_uids.update(r.uid for r in self._chunked.rows)
        return result

    def _decode(self, result: StepResult) -> None:
        """Queue the next step, then deliver the tokens of the one before (the device computes
        step n+1 while the host reads step n)."""
        rows, inputs = self._rows, self._inputs
        assert inputs is not None  # decoding rows always have their next input
        logits = self._lm(inputs[:, None], cache=self._cache)[:, -1, :]
        contexts = []
        if any(r.processors and not r.done for r in rows):
            parts = []
            for e, r in enumerate(rows):
                part = logits[e : e + 1]
                if r.processors and not r.done:
                    context = r.context.update_and_fetch(inputs[e : e + 1])
                    contexts.append(context)
                    for processor in r.processors:
                        part = processor(context, part)
                parts.append(part)
            logits = mx.concatenate(parts, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self._inputs = sample_rows(logprobs, [None if r.done else r.stream for r in rows])
        delivered = [r.pending for r in rows]  # the logprobs of the tokens read below
        asking = [e for e, r in enumerate(rows) if r.logprobs is not None and not r.done]
        pending: list[mx.array] = []
        if asking:
            tops = [rows[e].logprobs or 0 for e in asking]
            for e, entry in zip(asking, row_logprobs(logprobs, self._inputs, asking, tops)):
                rows[e].pending = entry
                pending.extend(entry.arrays())
        mx.async_eval(self._inputs, contexts, pending)
        self._steps += 1
        if self._steps % _CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        tokens = cast(list[int], inputs.tolist())  # waits for the step before only
        for e, (row, token, lp) in enumerate(zip(rows, tokens, delivered)):
            if row.done:
                continue
            if not row.generated:  # its last prompt token: the first generated one is now in flight
                row.generated = True
                continue
            row.num_tokens += 1
            if row.tokens is not None:
                row.tokens.append(token)
            if row.keyed is not None and row in self._storing:
                row.keyed.store_pending = True  # the next step stores its blocks
            if token in self._eos:
                reason: str | None = "stop"
            elif row.num_tokens >= row.max_tokens:
                reason = "length"
            else:
                reason = None
            row.done = reason is not None
            if row.done:
                self._keep_resident(row, e)
            result.tokens.append(TokenEvent(row.uid, token, reason, None if lp is None else lp.read(token)))
        # Idle slots cost compute, each compaction host work (every layer's cache rebuilt): which
        # costs more depends on what bounds the step (``idle_finished``).
        if should_compact(len(rows), sum(r.done for r in rows), joining=False, idle_allowed=self._idle_finished):
            self._compact()

    def _compact(self) -> None:
        live = [i for i, r in enumerate(self._rows) if not r.done]
        if len(live) < len(self._rows):
            self._keep(live)

    def _keep(self, keep: list[int]) -> None:
        """Keep these decoding rows (indices, in order); the cache sheds the left padding that
        every remaining row has."""
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache, self._inputs = [], None
            return
        assert self._inputs is not None
        self._inputs = self._inputs[mx.array(keep)]
        shift = min(r.pad for r in self._rows)
        _filter(self._cache, keep, shift)
        for r in self._rows:
            r.pad -= shift

    def _prefill(self, result: StepResult, observe: bool) -> None:
        """Admit what the free slots allow (``text_plan.plan_prefill``): short prompts in one
        forward, long ones as a group that runs a chunk a step (one such group at a time)."""
        live = sum(not r.done for r in self._rows)
        free = self.max_batch_size - live - (len(self._chunked.rows) if self._chunked else 0)
        rows = list(self._waiting)
        for r in rows:
            # After the step's stores (``_store_ready``): a row admitted once its prefix leader's
            # first token is out finds the leader's blocks.
            if r.keyed is not None and r.start is None:
                r.start = r.keyed.restore(make_cache(self._lm))
        plan = plan_prefill(
            [len(r.prompt) - (r.keyed.cached if r.keyed is not None else 0) for r in rows],
            free=free,
            step_size=self._step_size,
            chunking=self._chunked is not None,
            alone=[r.keyed is not None for r in rows],
        )
        short = [rows[i] for i in plan.short]
        long = [rows[i] for i in plan.long]
        taken = {*plan.short, *plan.long}
        self._waiting = collections.deque(r for i, r in enumerate(rows) if i not in taken)
        if long:
            self._chunked = self._start(long)
        if short:
            together = [r for r in short if r.keyed is None]
            groups = [self._start(together)] if together else []
            groups += [self._start([r]) for r in short if r.keyed is not None]
            for arrived in groups:
                while arrived.chunks:  # one chunk: every prompt fits
                    self._run_chunk(arrived, result, observe)
                self._finish_prefill(arrived, result)
        chunked = self._chunked
        if chunked is not None:
            self._run_chunk(chunked, result, observe)
            if not chunked.chunks:
                self._chunked = None
                self._finish_prefill(chunked, result)

    def _start(self, rows: list[_Row]) -> _Prefill:
        """A prefill group: each distinct prompt but its last token, left-padded to whole chunks
        of ``prefill_step_size`` columns and a last, shorter one (padded to its length bucket,
        where buckets are on): the longest prompt is chunked as the single lane chunks it.
        Rows with the same prompt (a call's several choices) share its row: its KV is computed
        once and copied to each of them when the prefill ends. A keyed row prefills alone
        (``_start_keyed``)."""
        from mlx_lm.models.cache import BatchKVCache

        if rows[0].keyed is not None:
            assert len(rows) == 1, "a keyed row prefills in a group of its own"
            return self._start_keyed(rows[0])
        distinct: dict[tuple[int, ...], int] = {}
        source = [distinct.setdefault(tuple(r.prompt), len(distinct)) for r in rows]
        prompts = [list(p) for p in distinct]
        lengths = [len(p) - 1 for p in prompts]
        longest = max(lengths)
        full = max(0, longest - 1) // self._step_size
        last = longest - full * self._step_size
        if self._buckets is not None and last > 0:
            last = self._buckets.length(last)
        width = full * self._step_size + last
        pads = [width - n for n in lengths]
        for r, j in zip(rows, source):
            r.pad = pads[j]
        tokens = [[0] * pad + p[:-1] for p, pad in zip(prompts, pads)]
        chunks = [self._step_size] * full + ([last] if last else [])
        cache = [BatchKVCache(pads) for _ in self._lm.layers]
        return _Prefill(rows, tokens, cache, chunks, source)

    def _start_keyed(self, row: _Row) -> _Prefill:
        """A keyed row's group: its cache starts from its restored prefix, and what follows
        (but the last prompt token) is chunked as the single lane chunks it. No left padding
        (it would sit between the prefix and the rest), so no length buckets either."""
        from mlx_lm.models.cache import BatchKVCache

        assert row.keyed is not None and row.start is not None
        cached = row.keyed.cached
        rest = row.prompt[cached:-1]
        full = max(0, len(rest) - 1) // self._step_size
        last = len(rest) - full * self._step_size
        chunks = [self._step_size] * full + ([last] if last else [])
        cache = [BatchKVCache.merge([c]) for c in row.start]
        row.start, row.pad = None, 0
        return _Prefill([row], [rest], cache, chunks, [0], cached=cached)

    def _run_chunk(self, group: _Prefill, result: StepResult, observe: bool) -> None:
        n = group.chunks.pop(0)
        columns = mx.array([t[group.done : group.done + n] for t in group.tokens])
        self._lm(columns, cache=group.cache)
        mx.async_eval([(c.keys, c.values) for c in group.cache])  # queued: the host goes on
        group.done += n
        if observe:
            for r in group.rows:
                done = group.cached + max(0, group.done - r.pad)
                result.prefill[r.uid] = PrefillRow(processed=done, total=len(r.prompt), cached=group.cached)

    def _finish_prefill(self, group: _Prefill, result: StepResult) -> None:
        last = mx.array([r.prompt[-1] for r in group.rows], dtype=mx.uint32)
        if len(group.tokens) < len(group.rows):  # one cache row per row: a shared prompt's copied
            _filter(group.cache, group.source, shift=0)
        if group.rows[0].keyed is not None:
            self._await_store(group.rows[0], group.cache)
        self._join(group.rows, group.cache, last)
        first: set[int] = set()
        for r, j in zip(group.rows, group.source):
            # A row whose prompt another row computed reports that KV as cached.
            result.prompt_done[r.uid] = group.cached if j not in first else len(r.prompt) - 1
            first.add(j)
            r.prompt = []

    def _await_store(self, row: _Row, cache: list[Any]) -> None:
        """Hold a keyed row's prompt KV (the group's cache, which the batch now extends) until
        its first token is out, then store its blocks (``_store_ready``)."""
        kv = make_cache(self._lm)
        for mine, c in zip(kv, cache):
            end = kv_columns(c)
            mine.keys, mine.values, mine.offset = c.keys[..., :end, :], c.values[..., :end, :], end
        row.prompt_kv, row.tokens = kv, list(row.prompt)
        self._storing.append(row)

    def _join(self, rows: list[_Row], cache: list[Any], inputs: mx.array) -> None:
        """Append rows (their cache, their next inputs) to the decoding batch, finished rows
        dropped first."""
        if should_compact(
            len(self._rows), sum(r.done for r in self._rows), joining=True, idle_allowed=self._idle_finished
        ):
            self._compact()
        if not self._rows:
            self._rows, self._cache, self._inputs = list(rows), cache, inputs
            return
        assert self._inputs is not None
        ours, theirs = kv_columns(self._cache[0]), kv_columns(cache[0])
        for mine, other in zip(self._cache, cache):
            mine.extend(other)  # right-justifies both at the longer one's length
        longest = max(ours, theirs)
        for r in self._rows:
            r.pad += longest - ours
        for r in rows:
            r.pad += longest - theirs
        self._rows.extend(rows)
        self._inputs = mx.concatenate([self._inputs, inputs])

    def close(self) -> None:
        group_rows = self._chunked.rows if self._chunked is not None else []
        for r in [*self._waiting, *group_rows, *self._rows, *self._storing]:
            self._end_keyed(r)
        self._waiting.clear()
        self._chunked = None
        self._rows, self._cache, self._inputs = [], [], None
        self.uids.clear()
        mx.synchronize(self._stream)


def _filter(cache: list[Any], keep: list[int], shift: int) -> None:
    """Keep rows ``keep`` of each layer's ``BatchKVCache`` and drop ``shift`` leading columns
    (padding for every kept row), as upstream's ``filter`` does but without reading the
    padding back from the device."""
    index = mx.array(keep)
    for c in cache:
        c.offset = c.offset[index]
        c.left_padding = c.left_padding[index]
        if c.keys is not None:
            c.keys, c.values = c.keys[index], c.values[index]
            if shift:
                c.keys, c.values = c.keys[..., shift:, :], c.values[..., shift:, :]
        if shift:
            drop_kv_columns(c, shift)
            c.left_padding = c.left_padding - shift


def _token_buffer(tokens: list[int]) -> Any:
    from mlx_lm.models.cache import TokenBuffer

    return TokenBuffer(tokens)
