"""The engine: one worker thread owns every MLX call for one resident model.

Callers ``submit`` requests and read them back through a ``RequestStream``. Each step the
worker applies cancels, gathers a ``SchedulerState``, asks ``Scheduler.schedule`` for a
``StepPlan`` (who starts, joins, waits, on which lane; see ``scheduler`` and ``lanes``) and
executes it: builds the lane's backend (``lane_factory``) or hands off, inserts the admitted
rows and steps the group; ``output.OutputProcessor`` turns the step's tokens into each
request's deltas (detokenising, stop strings, the bounded output queue) and says which rows
they ended. Controls run between steps.

Who writes what (the ownership rule):

- Caller threads talk to the worker through typed commands (``Submit``, ``RunControl``) put in
  ``_inbox`` under ``_cond``. Besides the inbox they write only, under ``_cond``: ``_live`` (a
  submitted request is live at once), ``_rejected``, ``_stopping`` and ``_retiring``; and,
  without the lock, a request's ``cancel_event`` (an Event, so that an event loop or a
  disconnect handler can cancel without taking the lock) and ``_closed`` once ``stop`` has
  joined the worker.
- The worker writes everything else: it takes commands off the inbox into its own ``_waiting``
  and ``_controls`` queues, and writes ``_group``, ``_admitting``, ``scheduler``, ``loaded``,
  ``prefix_cache``, ``_fatal``, ``_load_error``, ``_closed`` as it ends, all of ``stats``
  (one writer), and every field of a request once submitted (status, uid, timings,
  ``outcome``). It changes ``_waiting``, ``_controls`` and ``_live`` under ``_cond``.
- Callers read the shared collections and counters under ``_cond`` (``snapshot``,
  ``active_count``, ``settle``); single references (``_fatal``, ``_stopping``, ``_closed``,
  ``loaded``) without it, each read once into a local. A request's own results are read
  through its output queue and, once ``request.done`` is set, its ``outcome``.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar, cast

from ...errors import (
    EngineCrashed,
    EngineError,
    LogprobsUnavailable,
    MLXRuntimeError,
    QueueFull,
    QueueTimeout,
    RequestCancelled,
    RuntimeClosed,
)
from ..backends.backend import image_prompt_inputs
from ..backends.rows import (
    Adopts,
    Backend,
    HandsOff,
    LaneName,
    PrefillRow,
    PrefillsPartially,
    RowInput,
    StepResult,
    speculation_counters,
)
from ..cache.prefix_cache import CacheOptions, PrefixCache, restore_alignment
from ..cache.report import PromptCacheReport
from ..model.model import LoadedModel, Upstream
from . import keyed
from .config import EngineConfig
from .lane_factory import BackendFactory, LaneFactory
from .lanes import LANES
from .output import Ending, OutputProcessor, outcome_of
from .reports import SpeculationCounters
from .request import EngineRequest, ExecutionMode, RequestStatus
from .scheduler import (
    Admission,
    GroupKey,
    GroupState,
    NewGroup,
    Scheduler,
    SchedulerState,
    StepPlan,
    prefilling_rows,
)
from .stream import PrefillCallback, RequestStream
from .threads import POOL, WorkerHandle
from .warm import WarmQueue, WarmReport, check_warm

log = logging.getLogger(__name__)

_POLL_S = 0.05
_IDLE_WAIT_S = 0.5


@dataclass(slots=True)
class _Group:
    key: GroupKey
    backend: Backend
    running: dict[int, EngineRequest] = field(default_factory=dict)  # by backend uid
    tombstones: set[int] = field(default_factory=set)
    speculation_baseline: tuple[int, float, int] | None = None
    size: int = 0

    @property
    def mode(self) -> ExecutionMode:
        return self.key.mode


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Submit:
    """Queue a request (``Engine.submit``)."""

    request: EngineRequest


@dataclass(slots=True)
class RunControl(Generic[T]):
    """Run ``fn`` on the worker between steps (``Engine.control``)."""

    fn: Callable[[], T]
    # Runs only while no prompt batch is mid-prefill (prefix-cache blocks are leased then).
    between_prefills: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    result: T | None = None
    error: BaseException | None = None


Command = Submit | RunControl[Any]


@dataclass(slots=True)
class EngineStats:
    """Counters written by the worker alone (callers read them under ``_cond``)."""

    submitted: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    peak_batch_size: int = 0
    # Where the worker's time goes, summed over steps (only ever go up; see ``step_profile``).
    num_steps: int = 0
    step_s: float = 0.0  # whole steps: cancels, admission, the backend step, token handling
    backend_s: float = 0.0  # inside the backend's step: upstream bookkeeping, graph building, device waits
    tokens_s: float = 0.0  # handling the step's tokens: detokenising, stop strings, delivery
    cpu_s: float = 0.0  # the worker thread's CPU time during steps (the rest of ``step_s`` it waited)


class EngineState(StrEnum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"  # the worker could not go on; unload and load the model again
    CLOSED = "closed"


_LIVE_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _stop_live_engines() -> None:
    for engine in list(_LIVE_ENGINES):
        engine.stop(timeout_s=2.0)


class Engine:
    """Owns one resident model. ``load`` runs on the worker thread, so every MLX call,
    loading included, happens there."""

    def __init__(
        self,
        load: Callable[[], LoadedModel],
        config: EngineConfig | None = None,
        *,
        name: str = "model",
        cache_options: CacheOptions | None = None,
        backend_factory: BackendFactory | None = None,
    ) -> None:
        """``backend_factory``: builds each group's backend (default: the loaded model's
        ``LaneFactory``)."""
        self._load = load
        self._cache_options = cache_options
        self.prefix_cache: PrefixCache | None = None
        self.loaded: LoadedModel | None = None
        self.name = name
        self.config = config or EngineConfig()
        self.scheduler = Scheduler(self.config)
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._retiring = False
        self._cond = threading.Condition()
        self._inbox: deque[Command] = deque()
        self._waiting: deque[EngineRequest] = deque()
        self._warms = WarmQueue(self.config.prefill_step_size)  # prefix warms held until the engine is idle
        self._controls: deque[RunControl[Any]] = deque()
        self._group: _Group | None = None
        self._admitting: list[EngineRequest] = []  # taken from the queue, not yet in a group
        self._live: dict[str, EngineRequest] = {}
        self._rejected = 0  # submits refused with QueueFull (counted by callers)
        self._stopping = False
        self._closed = False
        self._fatal: BaseException | None = None
        self._stream: Any = None
        self._lanes: LaneFactory | None = None  # the loaded model's lanes, made at load
        self._backend_factory = backend_factory
        self.stats = EngineStats()
        self._output = OutputProcessor()
        self._thread: WorkerHandle | None = None
        # What closing the prefix cache raised as the worker stopped (read after ``stop()``).
        self.close_error: MLXRuntimeError | None = None

    # --- lifecycle ---------------------------------------------------------------------
    def start(self, timeout_s: float | None = None) -> Engine:
        """Start the worker and wait until the model is loaded (its load error is raised here)."""
        self._thread = POOL.run(self._run, name=f"abstractruntime-mlx:{self.name}")
        _LIVE_ENGINES.add(self)
        self._ready.wait(timeout_s)
        if self._load_error is not None:
            raise self._load_error
        return self

    def retire(self) -> None:
        """Stop once idle, without waiting: garbage collection of the last owner lands here."""
        with self._cond:
            self._retiring = True
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._fatal is None

    @property
    def state(self) -> EngineState:
        if self._fatal is not None:
            return EngineState.FAILED
        if self._closed or self._stopping:
            return EngineState.CLOSED
        return EngineState.READY if self._ready.is_set() else EngineState.LOADING

    @property
    def failure(self) -> BaseException | None:
        """Why the worker stopped serving (None while it serves)."""
        return self._fatal

    @property
    def active_count(self) -> int:
        with self._cond:
            return len(self._live)

    def settle(self, timeout_s: float) -> int:
        """Wait (at most ``timeout_s``) until no cancelled request is still live; return the live count.

        A closed stream only asks the worker to cancel; its request leaves at the next step.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while any(r.cancel_event.is_set() for r in self._live.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._worker_alive():
                    break
                self._cond.wait(min(remaining, 0.01))
            return len(self._live)

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the worker: waiting requests are cancelled, running ones finish as cancelled."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread.is_alive() and not thread.is_current():
            thread.join(timeout_s)
        stopped = thread is None or not thread.is_alive()
        if stopped:
            self._closed = True
            _LIVE_ENGINES.discard(self)
        return stopped

    # --- caller side ------------------------------------------------------------------
    def stream(self, request: EngineRequest, *, on_prefill_progress: PrefillCallback | None = None) -> RequestStream:
        """Queue ``request`` and return its stream (the seed's ``NativeRuntime.stream``).

        ``on_prefill_progress`` receives each ``PrefillObservation`` on the thread that
        iterates the stream; observations are never yielded, so a consumer that did not ask
        sees the stream it saw before.
        """
        if on_prefill_progress is not None:
            request.observe_prefill = True
        return self.submit(request, on_prefill_progress=on_prefill_progress)

    @contextmanager
    def together(self) -> Iterator[None]:
        """Requests submitted inside reach the worker at once: it takes them in one step, so
        they are admitted together where slots allow (a call's several answers, whose shared
        prompt the text lane then prefills once)."""
        with self._cond:  # reentrant: ``submit`` takes it again
            yield

    def submit(self, request: EngineRequest, *, on_prefill_progress: PrefillCallback | None = None) -> RequestStream:
        """Queue ``request``; what the loaded model cannot run is refused here, before MLX sees it."""
        self._check_serving()
        loaded = self.loaded
        if loaded is not None:
            loaded.check_request(
                prompt_tokens=request.num_prompt_tokens,
                max_tokens=request.max_tokens,
                logit_bias=request.sampling.logit_bias,
            )
        with self._cond:
            self._check_serving()
            if self._num_waiting() >= self.config.max_queue_size:
                self._rejected += 1
                raise QueueFull(
                    f"the waiting queue is full ({self.config.max_queue_size} requests); "
                    "retry after active requests finish or raise mlx_max_queue_size"
                )
            request.submitted_at = time.perf_counter()
            self._inbox.append(Submit(request))
            self._live[request.request_id] = request
            self._cond.notify_all()
        return RequestStream(self, request, on_prefill_progress=on_prefill_progress)

    @property
    def _model(self) -> LoadedModel:
        """The loaded model, on the worker (which holds it for as long as it serves)."""
        loaded = self.loaded
        assert loaded is not None, "the model is used only while it is loaded"
        return loaded

    def serving_model(self) -> LoadedModel:
        """The loaded model, or the typed reason this engine serves no requests."""
        loaded = self.loaded  # read first: the worker clears it only after it stops serving
        self._check_serving()
        if loaded is None:
            raise RuntimeClosed("the MLX engine is closed; load the model again")
        return loaded

    def _check_serving(self) -> None:
        fatal = self._fatal
        if fatal is not None:
            raise EngineCrashed(
                f"the model {self.name} failed and serves no requests ({type(fatal).__name__}: {fatal}); "
                "unload it and load it again"
            )
        if self._stopping or self._closed:
            raise RuntimeClosed("the MLX engine is closed; load the model again")

    def cancel(self, request: EngineRequest) -> None:
        request.cancel_event.set()
        with self._cond:
            self._cond.notify_all()

    def control(self, fn: Callable[[], T], timeout_s: float = 60.0, *, between_prefills: bool = False) -> T:
        """Run ``fn`` on the worker thread between steps and return its result.

        ``between_prefills``: wait for a step boundary where no prompt batch is mid-prefill
        (late joiners are held back meanwhile), as clearing the prefix cache needs.
        """
        if self._thread is not None and self._thread.is_current():
            return fn()
        item: RunControl[T] = RunControl(fn, between_prefills=between_prefills)
        with self._cond:
            self._check_serving()
            self._inbox.append(item)
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        while not item.done.wait(_POLL_S):
            if not self._worker_alive():
                raise EngineCrashed("the MLX worker stopped before running a control")
            if time.monotonic() > deadline:
                raise QueueTimeout("a control did not run on the MLX worker in time")
        if item.error is not None:
            raise item.error
        return cast(T, item.result)  # set when done without an error

    def restorable_prefix_tokens(self, request: EngineRequest) -> int | None:
        """The prompt tokens of keyed ``request`` the serialized lane restores now, read on the
        caller's thread (``keyed.restorable_prefix_tokens``)."""
        return keyed.restorable_prefix_tokens(self.loaded, self.prefix_cache, request)

    def attach_head(self, timeout_s: float = 600.0) -> float | None:
        """Attach the resident target's MTP head on the worker, between steps, once.

        Returns the seconds this call spent attaching it, or None when it was already
        attached (by an earlier call or at load). A running group keeps the generator it
        started with; groups started afterwards draft with the head. Raises
        ``UpstreamError`` when the head cannot be attached (remembered: not retried).
        """
        loaded = self.serving_model()
        if loaded.drafter is not None:
            return None
        return self.control(loaded.attach_drafter, timeout_s)

    def _num_waiting(self) -> int:
        """Waiting requests that still hold a queue place (under ``_cond``): a cancelled one
        frees its place at once, before the worker gets round to finishing it."""
        queued = sum(1 for r in self._waiting if not r.cancelled)
        return queued + sum(1 for c in self._inbox if isinstance(c, Submit) and not c.request.cancelled)

    def _take_commands(self) -> None:
        """Move the callers' commands into the worker's queues (under ``_cond``)."""
        while self._inbox:
            command = self._inbox.popleft()
            if isinstance(command, Submit) and command.request.warm:
                self._warms.hold(command.request)
            elif isinstance(command, Submit):
                self._warms.give_way(command.request, self._waiting)
                self._waiting.append(command.request)
                self.stats.submitted += 1
            else:
                self._controls.append(command)
        # Finished warms into the queue, where ``_apply_cancels`` finishes them.
        done, warm = self._warms.take(idle=not self._waiting and self._group is None, cache=self.prefix_cache)
        self._waiting.extend(done)
        if warm is not None:
            self._waiting.append(warm)
            self.stats.submitted += 1

    def _worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            pending = sum(1 for c in self._inbox if isinstance(c, Submit))
            return {
                "submitted": self.stats.submitted + pending,
                "completed": self.stats.completed,
                "cancelled": self.stats.cancelled,
                "failed": self.stats.failed,
                "rejected": self._rejected,
                "peak_batch_size": self.stats.peak_batch_size,
                "queued": self._num_waiting(),
                "active": len(self._live) - len(self._waiting) - len(self._warms) - pending,
                "closed": self._closed,
                "state": self.state,
                "max_batch_size": self.config.max_batch_size,
                "max_queue_size": self.config.max_queue_size,
                "step_profile": self.step_profile(),
            }

    def step_profile(self) -> dict[str, float | int]:
        """Cumulative step timings: subtract two readings to profile a window."""
        stats = self.stats
        return {
            "num_steps": stats.num_steps,
            "step_s": stats.step_s,
            "backend_s": stats.backend_s,
            "tokens_s": stats.tokens_s,
            "cpu_s": stats.cpu_s,
        }

    # --- worker -------------------------------------------------------------------------
    def _run(self) -> None:
        import mlx.core as mx

        # The worker's own stream: upstream's thread-local generation stream, used from a
        # worker thread, aborts the interpreter at exit ("terminate called without an
        # active exception").
        self._stream = mx.new_stream(mx.default_device())
        try:
            with mx.stream(self._stream):
                try:
                    self.loaded = self._load()
                    if self._cache_options is not None:
                        self.prefix_cache = PrefixCache(
                            self.loaded,
                            self._cache_options,
                            max_batch_size=self.config.max_batch_size,
                            restore_align=restore_alignment(self.config.prefill_step_size),
                        )
                    if self._backend_factory is None:  # an injected factory brings its own lanes
                        self._make_lanes().prepare()
                except BaseException as exc:  # noqa: BLE001 - handed to start()
                    self._load_error = exc
                    self._closed = True
                    return
                finally:
                    self._ready.set()
                self._loop()
        finally:
            mx.synchronize(self._stream)
            if self.prefix_cache is not None:
                try:
                    self.prefix_cache.close()  # flushes the SSD tier for later processes
                except Exception as exc:  # noqa: BLE001 - the worker still stops; unload reports it
                    log.warning("closing the prefix cache: %s", exc)
                    failure = (
                        exc
                        if isinstance(exc, MLXRuntimeError)
                        else EngineError(f"closing the prefix cache failed: {exc}")
                    )
                    self.close_error = failure
                self.prefix_cache = None
            self.loaded = None  # the worker owns the weights; they go with it
            if self._lanes is not None:
                self._lanes.close()  # the text lane's model shares them
                self._lanes = None
            mx.clear_cache()

    def _loop(self) -> None:
        try:
            while self._wait_for_work():
                self._run_controls()
                try:
                    self._schedule_and_step()
                except Exception as exc:  # noqa: BLE001 - upstream and our own faults alike
                    # Fail the requests this step touched, keep serving the rest.
                    log.exception("an engine step failed")
                    self._check_device(exc)
                    self._fail_group(_as_engine_error(exc))
        except BaseException as exc:  # noqa: BLE001 - the worker cannot go on: fail every live request
            log.exception("MLX worker failed; the model is marked failed")
            self._fatal = exc
            self._fail_all(EngineCrashed(f"the MLX worker failed: {type(exc).__name__}: {exc}"))
        finally:
            self._close_group()
            self._closed = True

    def _schedule_and_step(self) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        self._apply_cancels()
        self._expire_waiting()
        plan = self._plan()
        self._execute(plan)
        if plan.step and self._group is not None:
            self._step_group()
            stats = self.stats
            stats.num_steps += 1
            stats.step_s += time.perf_counter() - start
            stats.cpu_s += time.thread_time() - cpu

    def _plan(self) -> StepPlan:
        """Ask the scheduler what this step does; while a group waits for company, wait for
        arrivals (each one wakes this thread) and ask again."""
        with self._cond:
            while True:
                self._take_commands()
                plan = self.scheduler.schedule(self._scheduler_state())
                if plan.wait_until is None:
                    return plan
                self._cond.wait(max(0.0, plan.wait_until - time.perf_counter()))

    def _scheduler_state(self) -> SchedulerState:
        """What the scheduler decides from (under ``_cond``: the waiting queue is shared)."""
        group = self._group
        shared = keyed.shared_prefixes(self.prefix_cache, self._model.model)
        view = None
        if group is not None:
            backend = group.backend
            rows = list(group.running.values()) if shared is not None else []
            view = GroupState(
                group.key,
                backend.kind,
                backend.free_slots(),
                row_decoding=isinstance(backend, HandsOff) and backend.can_hand_off,
                prefilling=prefilling_rows(rows),
            )
        return SchedulerState(
            now=time.perf_counter(),
            waiting=tuple(self._waiting),
            group=view,
            stopping=self._stopping,
            model_lanes=self._backends.model_lanes,
            prefix_cache=self.prefix_cache is not None,
            lanes_restore=shared is not None,  # a cache whose prefixes this model shares as blocks
            shared_prefixes=shared,
            admission_paused=self.prefix_cache is not None and any(item.between_prefills for item in self._controls),
        )

    def _execute(self, plan: StepPlan) -> None:
        """Carry out a plan's admission: hand off or start, take its requests off the queue,
        put the held ones back, insert the admitted ones."""
        if plan.hand_off is not None:
            # Before anything leaves the queue: a failed hand-off fails the moving row only.
            assert self._group is not None
            self._hand_off(self._group, plan.hand_off)
        taken: list[EngineRequest] = []
        if plan.num_taken:
            with self._cond:
                taken = [self._waiting.popleft() for _ in range(plan.num_taken)]
        if plan.new_group is not None:
            self._admitting = taken  # a backend that cannot be built fails them
            backend = self._backends.build(plan.new_group, taken[0] if taken else None)
            self._group = _Group(
                key=plan.new_group.key,
                backend=backend,
                speculation_baseline=speculation_counters(backend),
                size=len(taken),
            )
            self._admitting = []
        if plan.held:
            for hold in plan.held:
                hold.request.prefix_leader = hold.leader
            with self._cond:
                self._waiting.extendleft(reversed([hold.request for hold in plan.held]))
        for admission in plan.admit:
            self._admit(admission)

    def _make_lanes(self) -> LaneFactory:
        """The loaded model's lanes (at load, on the worker, once the prefix cache exists)."""
        self._lanes = LaneFactory(
            self._model,
            self.config,
            stream=self._stream,
            prefix_cache=self.prefix_cache,
            on_prefill=self._on_prefill_row,
        )
        return self._lanes

    @property
    def _factory(self) -> LaneFactory:
        """The loaded model's lanes, on the worker (made at load)."""
        lanes = self._lanes
        assert lanes is not None, "the lanes are read only while the model is loaded"
        return lanes

    @property
    def _backends(self) -> BackendFactory:
        return self._backend_factory or self._factory

    def _check_device(self, step_error: Exception) -> None:
        """After a failed step, MLX must still compute on the worker's stream; if it does not,
        the worker cannot go on (raised past the step's handler, before anything finishes)."""
        import mlx.core as mx

        try:
            mx.eval(mx.arange(4).sum())
        except Exception as exc:  # noqa: BLE001
            raise _WorkerBroken(
                f"MLX no longer computes ({type(exc).__name__}: {exc}) after a failed step "
                f"({type(step_error).__name__}: {step_error})"
            ) from exc

    def _wait_for_work(self) -> bool:
        with self._cond:
            while True:
                self._take_commands()
                if self._stopping:
                    self._drain_for_stop()
                    return False
                if self._retiring and not self._live and self._group is None:
                    self._stopping = True
                    return False
                if self._group is not None or self._waiting or self._controls:
                    return True
                self._cond.wait(_IDLE_WAIT_S)

    def _drain_for_stop(self) -> None:
        error = RuntimeClosed("the MLX engine was closed before the request completed")
        for request in list(self._live.values()):
            self._finish(request, RequestStatus.FINISHED_CANCELLED, error=error, locked=True)
        self._waiting.clear()
        self._warms.clear()
        while self._controls:
            item = self._controls.popleft()
            item.error = RuntimeClosed("the MLX engine closed before running the control")
            item.done.set()

    def _run_controls(self) -> None:
        deferred: list[RunControl[Any]] = []
        try:
            while True:
                with self._cond:
                    self._take_commands()
                    if not self._controls:
                        return
                    item = self._controls.popleft()
                if item.between_prefills and self._prefilling():
                    deferred.append(item)
                    continue
                self._run_control(item)
        finally:
            if deferred:
                with self._cond:
                    self._controls.extendleft(reversed(deferred))

    def _prefilling(self) -> bool:
        group = self._group
        return group is not None and group.backend.prefilling

    def _run_control(self, item: RunControl[Any]) -> None:
        try:
            item.result = item.fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            item.error = exc
        item.done.set()

    def _apply_cancels(self) -> None:
        with self._cond:
            cancelled = [r for r in self._waiting if r.cancelled]
            for request in cancelled:
                self._waiting.remove(request)
        for request in cancelled:
            self._finish(request, RequestStatus.FINISHED_CANCELLED)
        group = self._group
        if group is None:
            return
        for uid, request in list(group.running.items()):
            if request.cancelled:
                self._drop_row(group, uid)
                self._finish(request, RequestStatus.FINISHED_CANCELLED)
        self._retry_tombstones(group)
        self._close_group_if_idle()

    def _drop_row(self, group: _Group, uid: int) -> None:
        group.running.pop(uid, None)
        if not group.backend.remove(uid):
            # Mid multi-row prefill upstream cannot drop a row; its tokens are never
            # delivered and the row is retried at the next boundary.
            group.tombstones.add(uid)

    def _retry_tombstones(self, group: _Group) -> None:
        for uid in list(group.tombstones):
            if group.backend.remove(uid):
                group.tombstones.discard(uid)

    def _expire_waiting(self) -> None:
        now = time.perf_counter()
        limit = self.config.queue_timeout_s
        with self._cond:
            expired = [r for r in self._waiting if now - r.submitted_at > limit]
            for request in expired:
                self._waiting.remove(request)
        for request in expired:
            error = QueueTimeout(
                f"the request waited {limit:g}s without being admitted; retry later or raise mlx_queue_timeout_s"
            )
            self._finish(request, RequestStatus.FINISHED_ERROR, error=error)

    def _hand_off(self, group: _Group, lane: LaneName) -> None:
        """Move the group's single decoding row into a new backend of ``lane``, its KV cache as is."""
        single = group.backend
        if not isinstance(single, HandsOff):
            raise RuntimeError(f"the {single.kind.value} lane hands no row off; only the single lane does")
        old_uid, row = single.detach()
        # The row stays in ``group.running`` until the batch holds it: a failure here fails
        # it with the group (``_fail_group``), as any failed step would.
        request = group.running[old_uid]
        assert LANES[lane].adopts_from == single.kind, f"the {lane} lane adopts no {single.kind} row"
        backend = self._backends.build(NewGroup(group.key, lane, self.config.max_batch_size), request)
        group.backend = backend
        single.close()
        if not isinstance(backend, Adopts):
            raise RuntimeError(f"the {backend.kind.value} lane takes no row from another")
        uid = backend.adopt(row)
        request.uid = uid
        request.path = LANES[lane].adopted_path
        group.running[uid] = group.running.pop(old_uid)

    def _admit(self, admission: Admission) -> None:
        group = self._group
        assert group is not None
        request = admission.request
        if admission.target_only:
            request.speculation_deferred = True  # optional MTP under load: target-only, in the batch
        try:
            prompt_inputs = None
            image = request.image_prompt
            if image is not None:
                # Images expand the prompt: its final ids are known here, so its length is checked again.
                request.prompt_ids, prompt_inputs = image_prompt_inputs(
                    self._model.model, self._model.processor, image.text, list(image.images)
                )
                self._model.check_request(prompt_tokens=request.num_prompt_tokens, max_tokens=request.max_tokens)
            row = RowInput(
                request.prompt_ids,
                request.max_tokens,
                request.sampling,
                request.grammar,
                prompt_inputs=prompt_inputs,
                prefix=keyed.prefix_reuse(
                    self.prefix_cache, self._model, request, lane=group.backend.kind, mode=group.mode
                ),
                logprobs=request.logprobs,
            )
            lane_path = LANES[group.backend.kind].path.value
            if request.logprobs is not None and not group.backend.reports_logprobs:
                raise LogprobsUnavailable(
                    f"token logprobs are computed by the batched lanes' per-row sampler; this request runs on "
                    f"the {lane_path} lane, which draws without it (MTP speculation, or a "
                    "provider with mlx_batching=False)",
                    details={"field": "logprobs", "lane": lane_path},
                )
            uid = group.backend.insert(row)
        except MLXRuntimeError as exc:
            self._finish(request, RequestStatus.FINISHED_ERROR, error=exc)
            return
        request.uid = uid
        request.mode = group.mode
        request.path = LANES[group.backend.kind].path
        request.exclusive_reason = group.key.reason
        request.started_at = time.perf_counter()
        request.transition(RequestStatus.PREFILLING)
        group.running[uid] = request
        self._output.add(request, self._model.new_detokenizer(), self._model.eos_token_ids)

    def _step_group(self) -> None:
        group = self._group
        assert group is not None
        with keyed.warm_stores(self.prefix_cache, list(group.running.values())):
            self._step_rows(group)
        self._close_group_if_idle()

    def _step_rows(self, group: _Group) -> None:
        if group.mode == ExecutionMode.CONTINUOUS and isinstance(group.backend, PrefillsPartially):
            group.backend.allow_partial_prefill()
        observe = any(r.observe_prefill for r in group.running.values())
        start = time.perf_counter()
        result = group.backend.step(observe_prefill=observe)
        stepped = time.perf_counter()
        self.stats.backend_s += stepped - start
        self._record_batch(group, result)
        for uid, row in result.prefill.items():
            self._on_prefill_row(uid, row)
        for uid, cached in result.prompt_done.items():
            request = group.running.get(uid)
            if request is not None:
                request.cached_tokens = cached
        for event in result.tokens:
            if event.uid in group.tombstones:
                if event.finish_reason is not None:
                    group.tombstones.discard(event.uid)
                    group.backend.forget(event.uid)
                continue
            request = group.running.get(event.uid)
            if request is None:
                continue
            ending = self._output.on_token(request, event)
            if ending is not None:
                self._end_row(group, event.uid, ending)
        self.stats.tokens_s += time.perf_counter() - stepped

    def _on_prefill_row(self, uid: int, row: PrefillRow) -> bool:
        """Deliver one prefill observation; False when the row's request was cancelled (a
        backend that prefills in one call stops there)."""
        group = self._group
        request = group.running.get(uid) if group is not None else None
        if request is None:
            return True
        if request.cancelled:
            return False
        self._output.on_prefill(request, row)
        return True

    def _record_batch(self, group: _Group, result: StepResult) -> None:
        size = len(result.batch_uids - group.tombstones)
        if size > self.stats.peak_batch_size:
            self.stats.peak_batch_size = size
        for uid in result.batch_uids:
            request = group.running.get(uid)
            if request is not None and size > request.peak_batch_size:
                request.peak_batch_size = size

    def _end_row(self, group: _Group, uid: int, ending: Ending) -> None:
        """A token ended its request: free the row (forgotten where the backend ended it,
        removed otherwise), then finish the request."""
        request = group.running[uid]
        if ending.row_finished:
            group.running.pop(uid)
            group.backend.forget(uid)
        else:
            self._drop_row(group, uid)
        self._finish(request, ending.status, error=ending.error)

    def _close_group_if_idle(self) -> None:
        group = self._group
        if group is not None and not group.running:
            self._close_group()

    def _close_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            try:
                group.backend.close()
            except Exception:  # noqa: BLE001 - a backend that failed may not close cleanly
                log.exception("closing a batch backend failed")

    def _finish(
        self,
        request: EngineRequest,
        status: RequestStatus,
        *,
        error: MLXRuntimeError | None = None,
        locked: bool = False,
    ) -> None:
        if request.is_finished():
            return
        if status == RequestStatus.FINISHED_CANCELLED and error is None:
            error = RequestCancelled("the request was cancelled")
        request.transition(status)
        request.finished_at = time.perf_counter()
        request.outcome = outcome_of(
            request,
            status,
            error,
            speculation=self._speculation_counters(request),
            prompt_cache=self._prompt_cache_report(request),
        )
        if locked:
            self._account(request, status)
        else:
            with self._cond:
                self._account(request, status)
        self._output.end_stream(request)

    def _speculation_counters(self, request: EngineRequest) -> SpeculationCounters | None:
        """MTP counters since the group started (None: no MTP, or a backend without them)."""
        group = self._group
        if group is None or group.speculation_baseline is None or not request.draft_tokens:
            return None
        now = speculation_counters(group.backend)
        if now is None:
            return None
        rounds0, accepted0, drafted0 = group.speculation_baseline
        return SpeculationCounters(
            rounds=now[0] - rounds0,
            accepted_tokens=round(now[1] - accepted0, 3),
            drafted_tokens=now[2] - drafted0,
            shared=group.size > 1,
        )

    def _prompt_cache_report(self, request: EngineRequest) -> PromptCacheReport | None:
        """What the prefix cache did for a keyed request (the one set at admission where the
        lane reuses no prefix; None: unkeyed, or it never reached the cache)."""
        cache = self.prefix_cache
        if cache is None or request.cache_counters is None or request.cache_layout is None:
            return request.prompt_cache
        if request.warm:
            # A warm reports nothing of its own: what it stored is counted by the request restoring it.
            if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                cache.note_warm(request)
                chunk = self._warms.next_chunk(request, cache)
                if chunk is not None:
                    with self._cond:
                        self._live[chunk.request_id] = chunk
                        self._warms.hold(chunk)
            return None
        return keyed.cache_report(cache, request)

    def prompt_cache_stats(self) -> dict[str, Any] | None:
        """The prefix cache's stats, read on the worker; None when this model has none."""
        return self.control(lambda: self.prefix_cache.stats() if self.prefix_cache is not None else None)

    def prompt_cache_clear(self) -> dict[str, Any] | None:
        """Drop every owned RAM and SSD entry, between prefills; None without a prefix cache."""
        return self.control(
            lambda: self.prefix_cache.clear() if self.prefix_cache is not None else None, between_prefills=True
        )

    def prompt_cache_command(self, command: Callable[[PrefixCache], dict[str, Any]]) -> dict[str, Any] | None:
        """Run one prefix-cache command (eviction hints, pin, release) on the worker between
        steps; None when this model has no prefix cache."""
        return self.control(lambda: command(self.prefix_cache) if self.prefix_cache is not None else None)

    def warm_prefix(self, request: EngineRequest) -> WarmReport:
        """Put keyed ``request``'s prompt prefix in RAM ahead of the request that will need it
        (``warm``): held as a warm (one prefill chunk a request, its token dropped) that runs
        only while the engine is idle, unless RAM already
        holds every full block of it, its key's request is live, or this model cannot share
        blocks. Returns at once: the RAM blocks are read on the caller's thread, under the
        cache manager's lock (as its stats are)."""
        key, prompt_ids = check_warm(request.prompt_cache_key, request.prompt_ids)
        loaded, cache = self.serving_model(), self.prefix_cache

        def refused(reason: str) -> WarmReport:
            return WarmReport(key, len(prompt_ids), 0, queued=False, reason=reason)

        if cache is None:
            return refused("prefix_cache_not_loaded")
        if cache.manager is None or loaded.upstream == Upstream.MLX_VLM:
            return refused("lane_without_blocks")
        if request.draft_tokens:
            return refused("speculation")
        salt = cache.salt(request, "batch")
        resident = cache.resident_prefix_tokens(prompt_ids, salt, ssd=False)  # the manager's lock, not ours
        restorable = cache.resident_prefix_tokens(prompt_ids, salt) if cache.disk is not None else resident
        prefix = list(prompt_ids)
        with self._cond:
            self._check_serving()
            # Queued or not (already in RAM, say), the key now owns its prefix's blocks: its hints keep
            # them. On the worker (the owners are its), not waited on.
            self._inbox.append(RunControl(lambda: cache.own(key, prefix, salt)))
            self._cond.notify_all()
            report = self._warms.plan(request, cache, list(self._live.values()), resident, restorable)
            if report.queued:
                self._live[request.request_id] = request
                self._inbox.append(Submit(request))
                self._cond.notify_all()
        return report

    def _account(self, request: EngineRequest, status: RequestStatus) -> None:
        self._live.pop(request.request_id, None)
        if status == RequestStatus.FINISHED_CANCELLED:
            self.stats.cancelled += 1
        elif status == RequestStatus.FINISHED_ERROR:
            self.stats.failed += 1
        else:
            self.stats.completed += 1

    def _fail_group(self, error: MLXRuntimeError) -> None:
        """Fail the requests a failed step touched: the group's rows and any being admitted."""
        group = self._group
        touched = list(group.running.values()) if group is not None else []
        touched += self._admitting
        self._admitting = []
        self._close_group()
        for request in touched:
            self._finish(request, RequestStatus.FINISHED_ERROR, error=error)

    def _fail_all(self, error: MLXRuntimeError) -> None:
        """The worker cannot go on: every live request and control fails, through ``_finish``."""
        self._admitting = []
        self._close_group()
        with self._cond:
            self._take_commands()
            live = list(self._live.values())
            self._waiting.clear()
            self._warms.clear()
            controls = list(self._controls)
            self._controls.clear()
        for request in live:
            self._finish(request, RequestStatus.FINISHED_ERROR, error=error)
        for item in controls:
            item.error = error
            item.done.set()


class _WorkerBroken(BaseException):
    """MLX stopped working on the worker's stream: not a failure of one step."""


def _as_engine_error(exc: Exception) -> MLXRuntimeError:
    if isinstance(exc, MLXRuntimeError):
        return exc
    return EngineError(f"an engine step failed: {type(exc).__name__}: {exc}")
