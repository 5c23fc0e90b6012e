"""What each running request's consumer reads: backend tokens turned into ``TokenDelta``s.

The engine hands every ``TokenEvent`` of a step to ``OutputProcessor.on_token``. The processor
owns each running request's output state (its streaming detokenizer, its stop-string matcher,
the logprobs of tokens whose text is not out yet) and puts deltas and prefill observations on
the request's bounded output queue. When a token ends its request it says so with an
``Ending``; the engine then frees the row and finishes the request (``Engine._finish``, the one
finish path), whose ``outcome_of`` and ``end_stream`` are here. Nothing here touches the
backend or MLX.

Delivery rules: a finished or cancelled request takes nothing more; a prefill observation
yields to tokens once the queue is half full; a token that would overflow the queue ends the
request with ``StreamBackpressure``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import MLXRuntimeError, StreamBackpressure
from ..backends.rows import PrefillRow, SampledLogprob, TokenEvent
from ..cache.report import PromptCacheReport
from .reports import SpeculationCounters, speculation_report
from .request import (
    END_OF_STREAM,
    EngineRequest,
    FinishReason,
    Outcome,
    PrefillObservation,
    RequestStatus,
    TokenDelta,
    execution_report,
)
from .stops import StopMatcher


@dataclass(frozen=True, slots=True)
class Ending:
    """A token ended its request: finish it as ``status`` (with ``error``). ``row_finished``:
    the backend ended the row itself (forget it); otherwise the engine removes it."""

    status: RequestStatus
    error: MLXRuntimeError | None = None
    row_finished: bool = False


@dataclass(slots=True)
class _Output:
    detokenizer: Any
    stops: StopMatcher
    eos_token_ids: frozenset[int]
    # Logprobs of tokens whose text is not delivered yet (held by the stop matcher or the
    # detokenizer): they go out with the next delta, or alone before the request finishes.
    logprobs: list[SampledLogprob] = field(default_factory=list)


class OutputProcessor:
    """The output state of every running request, written by the engine's worker alone."""

    def __init__(self) -> None:
        self._outputs: dict[EngineRequest, _Output] = {}

    def add(self, request: EngineRequest, detokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        """Start ``request``'s output (at admission): a fresh detokenizer, its stop strings."""
        self._outputs[request] = _Output(detokenizer, StopMatcher(request.stop), eos_token_ids)

    def __contains__(self, request: EngineRequest) -> bool:
        return request in self._outputs

    def on_token(self, request: EngineRequest, event: TokenEvent) -> Ending | None:
        """Deliver one token of ``request``'s row; the ``Ending`` when it ended the request."""
        out = self._outputs[request]
        if event.logprob is not None:
            out.logprobs.append(event.logprob)
        try:
            return self._on_token(request, out, event.token, event.finish_reason)
        except StreamBackpressure as exc:
            return Ending(RequestStatus.FINISHED_ERROR, error=exc, row_finished=event.finish_reason is not None)

    def _on_token(self, request: EngineRequest, out: _Output, token: int, finish_reason: str | None) -> Ending | None:
        if request.status == RequestStatus.PREFILLING:
            request.transition(RequestStatus.DECODING)
        if not (token in out.eos_token_ids and finish_reason == "stop"):
            request.append_tokens([token])
            out.detokenizer.add_token(token)
            segment = out.detokenizer.last_segment
            _give_text(out.logprobs, segment)
            text, stopped = out.stops.feed(segment)
            if text and not _deliver(request, TokenDelta(text, [token], _take(out.logprobs))):
                return None  # cancelled: the cancel ends it between steps
            if stopped:
                request.stop_reason = out.stops.matched
                if out.logprobs:
                    _deliver(request, TokenDelta("", [], _take(out.logprobs)))
                return Ending(RequestStatus.FINISHED_STOPPED, row_finished=finish_reason is not None)
        else:
            request.stop_reason = token
            if out.logprobs:  # the end-of-sequence token is not part of the answer
                out.logprobs.pop()
            if request.first_token_at is None:
                request.first_token_at = time.perf_counter()
        if finish_reason is None:
            return None
        out.detokenizer.finalize()
        segment = out.detokenizer.last_segment
        _give_text(out.logprobs, segment, more=True)
        tail = out.stops.flush(segment)
        if tail or out.logprobs:
            _deliver(request, TokenDelta(tail, [], _take(out.logprobs)))
        if out.stops.matched is not None:  # the text the last token completed held a stop
            request.stop_reason = out.stops.matched
        stopped = finish_reason != "length" or out.stops.matched is not None
        return Ending(RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_LENGTH, row_finished=True)

    def on_prefill(self, request: EngineRequest, row: PrefillRow) -> None:
        """Deliver a prefill observation to a consumer that asked for them, when it is news."""
        if (
            request.observe_prefill
            and request.first_token_at is None
            and reports_position(request.prefill_position, row)
        ):
            request.prefill_position = row.processed
            _deliver(
                request, PrefillObservation(processed=row.processed, total=row.total, cached=row.cached), droppable=True
            )

    def end_stream(self, request: EngineRequest) -> None:
        """The request finished (its ``outcome`` set): drop its output state, wake its consumer."""
        self._outputs.pop(request, None)
        request.done.set()
        request.outputs.put(END_OF_STREAM)  # past the bound: the end is never refused
        request.notify()


def outcome_of(
    request: EngineRequest,
    status: RequestStatus,
    error: MLXRuntimeError | None,
    *,
    speculation: SpeculationCounters | None = None,
    prompt_cache: PromptCacheReport | None = None,
) -> Outcome:
    """What a finished request reports (its status already set), with the group's MTP counters
    and the prefix cache's report, which the engine reads."""
    plan = request.speculation
    return Outcome(
        finish_reason=request.finish_reason() or FinishReason.ERROR,
        prompt_tokens=request.num_prompt_tokens,
        completion_tokens=request.num_output_tokens,
        cached_tokens=request.cached_tokens,
        execution=execution_report(request),
        speculation=None if plan is None else speculation_report(plan, speculation, request.speculation_deferred),
        error=error,
        prompt_cache=prompt_cache,
        stop_reason=request.stop_reason if status == RequestStatus.FINISHED_STOPPED else None,
    )


def reports_position(last: int, row: PrefillRow) -> bool:
    """Whether a prefill observation is news for the consumer: one observation per real
    change of position (backends re-read the same counters, and the start of a prefill is
    the start event's, not an observation), and none for a prefill that one chunk finished:
    a prompt shorter than one chunk reports no position, its first token follows."""
    if row.processed <= last:
        return False
    return not (last == 0 and row.processed >= row.total - 1)


def _deliver(request: EngineRequest, item: TokenDelta | PrefillObservation, *, droppable: bool = False) -> bool:
    """Put ``item`` on the request's output queue; False when the request takes no more
    outputs. A droppable item (a prefill observation) yields to tokens when the consumer
    lags; a token that finds the queue full raises ``StreamBackpressure``."""
    if request.is_finished() or request.cancelled:
        return False
    q = request.outputs
    budget = request.output_queue_size
    if droppable and q.qsize() * 2 >= budget:
        return True
    if q.qsize() >= budget:
        raise StreamBackpressure(
            f"the stream consumer is too slow: {budget} undelivered outputs; "
            "read the stream faster or raise mlx_output_queue_size"
        )
    q.put(item)
    request.notify()
    return True


def _give_text(pending: list[SampledLogprob], segment: str, *, more: bool = False) -> None:
    """The detokenizer's ``segment`` becomes the text of the last token still pending (its
    own; ``more``: added to it, the detokenizer's tail at the end). A token the detokenizer
    holds back (an incomplete UTF-8 sequence, a lone space) gets ``""`` and the next one its
    text, so that the tokens' texts concatenate to the answer's."""
    if pending:
        last = pending[-1]
        text = (last.text or "") + segment if more else segment
        pending[-1] = replace(last, text=text)


def _take(items: list[SampledLogprob]) -> list[SampledLogprob]:
    """The items, the list emptied (what a delta carries away)."""
    taken = list(items)
    items.clear()
    return taken
