"""The request lifecycle: one object per request, a status that only moves forward."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, Any

from ...controls import Sampling
from ...errors import MLXRuntimeError
from ..backends.rows import SampledLogprob
from ..cache.prefix_break import PrefixBreak
from ..cache.report import PromptCacheReport
from .reports import SpeculationPlan, SpeculationReport

if TYPE_CHECKING:
    from ..model.grammar import GrammarProcessor


class RequestStatus(IntEnum):
    WAITING = 0
    PREFILLING = 1
    DECODING = 2
    # Finished states sort last, so ``is_finished`` is one comparison.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_CANCELLED = 12
    FINISHED_ERROR = 13


class FinishReason(StrEnum):
    """Why a request ended (``Outcome.finish_reason``); the values are the wire's."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_CANCELLED: FinishReason.CANCELLED,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}

_ALLOWED = {
    RequestStatus.WAITING: {RequestStatus.PREFILLING, RequestStatus.FINISHED_CANCELLED, RequestStatus.FINISHED_ERROR},
    RequestStatus.PREFILLING: {
        RequestStatus.DECODING,
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_CANCELLED,
        RequestStatus.FINISHED_ERROR,
    },
    RequestStatus.DECODING: {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_CANCELLED,
        RequestStatus.FINISHED_ERROR,
    },
}


class ExecutionMode(StrEnum):
    """How a group of requests shares its lane (reported as ``execution.mode``): every row with
    its own controls and late joiners (continuous), one MTP depth and no joiners (cohort), or
    alone (exclusive). Not a lane: a continuous group runs on the single, text or batch lane."""

    CONTINUOUS = "continuous"
    COHORT = "cohort"
    EXCLUSIVE = "exclusive"


class DecodePath(StrEnum):
    """What ``execution.path`` reports: a lane's ``path`` (``lanes.LANES``), or
    ``single_then_batch`` for a row a batch adopted from the single lane."""

    SINGLE = "single"  # alone on the single-request lane
    SINGLE_THEN_BATCH = "single_then_batch"  # began alone, moved into a batch with its KV cache
    BATCH = "batch"  # mlx-vlm's batch generator
    TEXT_BATCH = "text_batch"  # the text lane's own loop (plain text rows)
    SERIAL = "serial"  # a one-at-a-time lane (mlx-lm's, or mlx-vlm's in-process one)


class ExclusiveReason(StrEnum):
    """Why a request ran alone (``execution.reason``)."""

    SERIALIZED_LANE = "serialized_lane"  # mlx_batching=False: the mlx-lm lane runs one at a time
    SAMPLED_SPECULATION = "sampled_speculation"  # an MTP generator draws every row with one sampler
    SAMPLED_EXCLUSIVE = "sampled_exclusive"  # the mlx_sampled_exclusive option


# Messages from the worker to the consumer of one request. Terminal outcomes are not
# queued: they are stored on the request, so a full output queue can never lose them.


@dataclass(slots=True)
class TokenDelta:
    text: str
    token_ids: list[int]
    # The logprobs of the tokens this text completes (a request that asked for them only);
    # the text of a token held back by a stop string arrives later, its logprob now or then.
    logprobs: list[SampledLogprob] = field(default_factory=list)


@dataclass(slots=True)
class PrefillObservation:
    """A real per-chunk observation: ``processed`` prompt tokens are in the KV cache.

    Handed to a stream's ``on_prefill_progress`` callback on the iterating thread, never
    yielded (``stream.RequestStream``).
    """

    processed: int
    total: int
    cached: int | None = None


# The seed's name for the same observation (``NativeRuntime.stream(request, on_prefill_progress=...)``).
NativePrefillProgress = PrefillObservation


class EndOfStream:
    """Queued last, so a consumer wakes the moment its request finishes."""


END_OF_STREAM = EndOfStream()


@dataclass(slots=True)
class Outcome:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    execution: ExecutionReport
    speculation: SpeculationReport | None  # None: submitted without a plan (``EngineRequest.speculation``)
    error: MLXRuntimeError | None = None
    prompt_cache: PromptCacheReport | None = None  # keyed requests that reached the cache
    stop_reason: str | int | None = None
    """What ended a stopped request: the stop string that matched, or the end-of-sequence token
    id (None: it ended otherwise)."""


@dataclass(frozen=True, slots=True)
class ImagePrompt:
    """A prompt with images. Its final ids and the row's embeddings come from the vision
    processor, on the worker at admission (``Engine._admit``), which sets ``prompt_ids``."""

    text: str
    images: tuple[Any, ...]


@dataclass(slots=True, eq=False)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    draft_tokens: int = 0
    # Strict MTP (``require_acceleration``): never deferred. Optional MTP runs target-only in
    # the continuous batch while target-only work waits or runs (``speculation_deferred``).
    speculation_required: bool = False
    image_prompt: ImagePrompt | None = None
    cache_group: Any = None
    prompt_cache_key: str | None = None
    media_hash: int = 0
    output_queue_size: int = 256
    observe_prefill: bool = False
    cancel_event: threading.Event = field(default_factory=threading.Event)
    grammar: GrammarProcessor | None = None  # structured output: this request's own matcher
    logprobs: int | None = None  # token logprobs with this many alternatives each (None: off)
    # A prefix warm (``core.warm``): runs only while the engine is idle, its token is dropped;
    # ``warm_target`` is the whole prefix it warms, one prefill chunk a request.
    warm: bool = False
    warm_target: tuple[int, ...] = ()

    status: RequestStatus = RequestStatus.WAITING
    mode: ExecutionMode | None = None
    path: DecodePath | None = None
    exclusive_reason: ExclusiveReason | None = None
    uid: int | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    peak_batch_size: int = 0
    cached_tokens: int | None = None
    speculation: SpeculationPlan | None = None  # the provider's plan (``draft_tokens`` is its depth)
    speculation_deferred: bool = False  # optional MTP admitted target-only under load
    cache_counters: dict[str, int] | None = None  # prefix-cache counters at admission
    cache_layout: str | None = None
    warm_ram_tokens: int = 0  # a warm's prompt tokens already in RAM when it was admitted
    prompt_cache: PromptCacheReport | None = None  # set at admission where the lane reuses no prefix
    prefix_break: PrefixBreak | None = None  # set with ``prompt_cache`` when the prompt broke its key's prefix
    stop_reason: str | int | None = None  # the matched stop string or end-of-sequence id (``Outcome``)
    # The admitted request whose prefill stores the prefix this one shares (see scheduler).
    prefix_leader: EngineRequest | None = None
    # The prefill position last delivered to the consumer (``Engine._on_prefill_row``): an
    # observation is delivered only when it moves past it.
    prefill_position: int = 0
    outputs: queue.SimpleQueue[Any] = field(init=False)
    done: threading.Event = field(default_factory=threading.Event)
    outcome: Outcome | None = None
    waker: Callable[[], None] | None = None
    _token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Bounded by the worker (``output_queue_size``), which checks ``qsize()`` before each
        # put; a SimpleQueue's put is far cheaper than a Queue's on the per-token path. The end
        # marker may go past the bound, so it can never be refused.
        self.outputs = queue.SimpleQueue()

    # lifecycle ------------------------------------------------------------------------
    def transition(self, new: RequestStatus) -> None:
        if new == self.status:
            return
        if new not in _ALLOWED.get(self.status, set()):
            raise RuntimeError(f"request {self.request_id}: illegal transition {self.status.name} -> {new.name}")
        self.status = new

    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def append_tokens(self, token_ids: list[int]) -> None:
        if token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self._token_ids.extend(token_ids)

    @property
    def waits_for_prefix(self) -> bool:
        """Held until its prefix leader's prefill has stored the prefix they share."""
        leader = self.prefix_leader
        return leader is not None and leader.status <= RequestStatus.PREFILLING

    @property
    def deferrable(self) -> bool:
        """Optional MTP: under load it may run target-only instead of waiting for a cohort."""
        return self.draft_tokens > 0 and not self.speculation_required

    @property
    def running_draft_tokens(self) -> int:
        """The depth this request runs at: 0 once deferred (it runs target-only)."""
        return 0 if self.speculation_deferred else self.draft_tokens

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def notify(self) -> None:
        waker = self.waker
        if waker is not None:
            waker()


@dataclass(frozen=True, slots=True)
class ExecutionReport:
    """``metadata["execution"]``: the group's mode, the decode loop, why it ran alone, the
    widest batch it shared, and its queue and first-token times (seconds from submit)."""

    mode: ExecutionMode | None = None
    path: DecodePath | None = None
    reason: ExclusiveReason | None = None
    peak_batch_size: int = 0
    queue_s: float | None = None
    ttft_s: float | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.mode is not None:
            out["mode"] = self.mode
        if self.path is not None:
            out["path"] = self.path
        if self.reason is not None:
            out["reason"] = self.reason
        if self.peak_batch_size:
            out["peak_batch_size"] = self.peak_batch_size
        if self.queue_s is not None:
            out["queue_s"] = self.queue_s
        if self.ttft_s is not None:
            out["ttft_s"] = self.ttft_s
        return out


def execution_report(request: EngineRequest) -> ExecutionReport:
    submitted = request.submitted_at
    return ExecutionReport(
        mode=request.mode,
        path=request.path,
        reason=request.exclusive_reason,
        peak_batch_size=request.peak_batch_size,
        queue_s=None if request.started_at is None else round(request.started_at - submitted, 6),
        ttft_s=None if request.first_token_at is None else round(request.first_token_at - submitted, 6),
    )
