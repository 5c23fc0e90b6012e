"""The engine's loop on a fake backend (``fake_backend``): cancels and tombstones, the waiting
queue's bounds, stream backpressure, hand-off, step failures and stop. Tokens are a function of
the prompt, so each test knows every token a request must (and must not) receive."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from abstractruntime_mlx import errors
from abstractruntime_mlx.engine.backends.rows import Adopts, HandsOff, LaneName, PrefillsPartially, Speculates
from abstractruntime_mlx.engine.core.loop import Engine, _as_engine_error
from abstractruntime_mlx.engine.core.request import (
    EngineRequest,
    PrefillObservation,
    RequestStatus,
    TokenDelta,
    execution_report,
)
from fake_backend import EOS, FakeBackend, FakeLanes, expected_tokens, fake_engine, text_of

_ids = itertools.count()


class Stepper:
    """A fake-backed engine whose worker turns are taken here, one ``step()`` at a time."""

    def __init__(self, lanes: FakeLanes | None = None, **config: object) -> None:
        self.lanes = lanes or FakeLanes()
        config.setdefault("burst_gap_ms", 0)
        self.engine: Engine = fake_engine(self.lanes, **config)
        self.engine.loaded = self.engine._load()

    def request(self, prompt: list[int], max_tokens: int = 6, **kwargs: object) -> EngineRequest:
        req = EngineRequest(request_id=f"r{next(_ids)}", prompt_ids=prompt, max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]
        self.engine.submit(req)
        return req

    def step(self) -> None:
        """One turn of the worker's loop, its fault handling included (as ``Engine._loop``)."""
        try:
            self.engine._schedule_and_step()
        except Exception as exc:  # noqa: BLE001
            self.engine._check_device(exc)
            self.engine._fail_group(_as_engine_error(exc))

    def drain(self, limit: int = 200) -> None:
        for _ in range(limit):
            if not self.engine._live and self.engine._group is None:
                return
            self.step()
        raise AssertionError("the engine did not finish its requests")

    @property
    def backend(self) -> FakeBackend:
        group = self.engine._group
        assert group is not None
        assert isinstance(group.backend, FakeBackend)
        return group.backend


def outputs(req: EngineRequest) -> list[object]:
    items = []
    while not req.outputs.empty():
        items.append(req.outputs.get_nowait())
    return items


def delivered(req: EngineRequest) -> tuple[list[int], str]:
    deltas = [item for item in outputs(req) if isinstance(item, TokenDelta)]
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)


def test_a_request_gets_its_tokens_and_text():
    s = Stepper()
    req = s.request([3], max_tokens=5)
    s.drain()
    tokens, text = delivered(req)
    assert tokens == expected_tokens([3], 5) == list(req.token_ids)
    assert text == "defgh"
    assert req.outcome is not None and req.outcome.finish_reason == "length" and req.outcome.completion_tokens == 5
    assert s.lanes.kinds == [LaneName.SINGLE] and execution_report(req).to_wire()["path"] == "single"
    assert s.engine.snapshot()["completed"] == 1


def test_end_of_sequence_and_stop_strings_end_a_request():
    lanes = FakeLanes(eos_at={(0,): 3})
    s = Stepper(lanes)
    eos = s.request([0], max_tokens=10)
    stopped = s.request([10], max_tokens=10, stop=("mn",))  # tokens k l m n ...
    s.drain()
    assert delivered(eos) == ([0, 1, 2], "abc")  # the EOS token is not part of the answer
    assert eos.outcome.finish_reason == "stop" and eos.outcome.stop_reason == EOS
    assert delivered(stopped)[1] == "kl" and stopped.outcome.stop_reason == "mn"
    assert stopped.outcome.finish_reason == "stop" and stopped.num_output_tokens == 4


def test_cancel_while_prefilling_leaves_a_tombstone_until_the_row_can_go():
    """Mid multi-row prefill the backend cannot drop a row: the request ends cancelled at once,
    the row is a tombstone whose tokens are never delivered, and it goes at the next boundary."""
    lanes = FakeLanes(prefill_steps=3, pin_prefill=True)
    s = Stepper(lanes, max_batch_size=4)
    keep, cancel = s.request([0], max_tokens=4), s.request([5], max_tokens=4)
    s.step()  # one group of two, both prefilling
    assert s.lanes.kinds == [LaneName.TEXT] and s.backend.prefilling
    s.engine.cancel(cancel)
    s.step()
    group = s.engine._group
    assert group is not None and cancel.uid in group.tombstones
    assert cancel.status == RequestStatus.FINISHED_CANCELLED and cancel.outcome.finish_reason == "cancelled"
    assert isinstance(cancel.outcome.error, errors.RequestCancelled)
    assert s.backend.free_slots() == 2  # the tombstone still holds its slot
    s.drain()
    assert delivered(cancel) == ([], "")
    assert delivered(keep)[0] == expected_tokens([0], 4)
    assert cancel.uid in lanes.built[0].removed  # dropped once its prefill ended
    snap = s.engine.snapshot()
    assert snap["cancelled"] == 1 and snap["completed"] == 1 and snap["active"] == 0


def test_cancel_while_decoding_drops_the_row_at_once():
    s = Stepper(max_batch_size=4)
    keep, cancel = s.request([0], max_tokens=8), s.request([5], max_tokens=8)
    s.step()
    s.step()
    s.engine.cancel(cancel)
    s.step()
    group = s.engine._group
    assert group is not None and not group.tombstones and cancel.uid in s.backend.removed
    s.drain()
    assert delivered(cancel)[0] == expected_tokens([5], 2)  # what it had before the cancel
    assert cancel.outcome.finish_reason == "cancelled" and cancel.outcome.completion_tokens == 2
    assert delivered(keep)[0] == expected_tokens([0], 8)


def test_a_full_queue_refuses_and_a_long_wait_times_out():
    s = Stepper(max_batch_size=1, max_queue_size=2)
    running = s.request([0], max_tokens=4)
    waiting = s.request([1], max_tokens=4)
    with pytest.raises(errors.QueueFull):
        s.request([2])
    assert s.engine.snapshot()["rejected"] == 1
    s.engine.cancel(waiting)  # a cancelled request frees its place at once
    late = s.request([3], max_tokens=4)
    s.step()  # the running one starts; ``late`` waits for the only slot
    late.submitted_at -= s.engine.config.queue_timeout_s + 1
    s.drain()
    assert isinstance(late.outcome.error, errors.QueueTimeout) and late.outcome.finish_reason == "error"
    assert waiting.outcome.finish_reason == "cancelled"
    assert delivered(running)[0] == expected_tokens([0], 4)


def test_a_slow_reader_ends_its_stream_with_backpressure():
    """Prefill observations yield to tokens once the queue is half full; a token that finds it
    full ends the request typed and frees its row, and the other request goes on."""
    lanes = FakeLanes(prefill_steps=6)
    s = Stepper(lanes, max_batch_size=4)
    slow = s.request(list(range(12)), max_tokens=20, output_queue_size=4, observe_prefill=True)
    other = s.request([1], max_tokens=10)
    s.drain()
    items = outputs(slow)
    assert [type(i) for i in items[:4]] == [PrefillObservation, PrefillObservation, TokenDelta, TokenDelta]
    assert [i.processed for i in items[:2]] == [2, 4]  # the rest were dropped, not queued
    assert [t for i in items[2:4] for t in i.token_ids] == expected_tokens(list(range(12)), 2)
    assert isinstance(slow.outcome.error, errors.StreamBackpressure) and slow.outcome.finish_reason == "error"
    assert slow.uid in lanes.built[0].removed
    assert delivered(other)[0] == expected_tokens([1], 10)
    assert s.engine.snapshot()["failed"] == 1


def test_hand_off_moves_the_single_row_into_a_batch_keeping_its_tokens():
    s = Stepper(max_batch_size=4)
    first = s.request([0], max_tokens=8)
    s.step()
    s.step()
    assert s.lanes.kinds == [LaneName.SINGLE] and first.num_output_tokens == 2
    second = s.request([9], max_tokens=4)
    s.step()
    assert s.lanes.kinds == [LaneName.SINGLE, LaneName.TEXT]
    assert s.lanes.built[0].closed and first.uid in s.backend.rows
    s.drain()
    assert delivered(first) == (expected_tokens([0], 8), text_of(expected_tokens([0], 8)))
    assert delivered(second)[0] == expected_tokens([9], 4)
    assert execution_report(first).to_wire()["path"] == "single_then_batch"
    assert execution_report(second).to_wire()["path"] == "text_batch"
    assert first.peak_batch_size == 2


def test_a_step_failure_fails_the_group_typed_and_the_engine_serves_on():
    lanes = FakeLanes(fail_at=3)
    s = Stepper(lanes, max_batch_size=4)
    a, b = s.request([0], max_tokens=8), s.request([4], max_tokens=8)
    s.drain()
    for req in (a, b):
        assert req.outcome.finish_reason == "error" and isinstance(req.outcome.error, errors.EngineError)
        assert "simulated step failure" in str(req.outcome.error)
        assert delivered(req)[0] == expected_tokens(req.prompt_ids, 2)  # the steps before the failure
    assert lanes.built[0].closed and s.engine._group is None
    after = s.request([2], max_tokens=3)
    s.drain()
    assert delivered(after)[0] == expected_tokens([2], 3) and s.engine.snapshot()["failed"] == 2


def _start(lanes: FakeLanes, **config: object) -> Engine:
    config.setdefault("burst_gap_ms", 0)
    return fake_engine(lanes, **config).start(timeout_s=30)


def _request(prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id=f"r{next(_ids)}", prompt_ids=prompt, max_tokens=max_tokens)


class WorkerKilled(BaseException):
    """Not an ``Exception``: escapes the per-step handler, as a worker that cannot go on."""


def test_a_worker_that_cannot_go_on_fails_every_live_request():
    lanes = FakeLanes(fail_at=3, fail_with=WorkerKilled("simulated worker fault"))
    engine = _start(lanes, max_batch_size=1)
    try:
        running = engine.submit(_request([0], 100))
        waiting = engine.submit(_request([1], 4))
        for stream in (running, waiting):
            with pytest.raises(errors.EngineCrashed, match="WorkerKilled"):
                list(stream)
        assert engine.state == "failed" and isinstance(engine.failure, WorkerKilled)
        assert engine.active_count == 0
        with pytest.raises(errors.EngineCrashed, match="unload it and load it again"):
            engine.submit(_request([2], 2))
    finally:
        engine.stop(timeout_s=10)


def test_stop_finishes_live_requests_as_closed():
    gate = threading.Event()

    class Gated(FakeLanes):
        def count_step(self) -> None:
            super().count_step()
            if self.num_steps == 2:
                gate.wait(10)  # the worker holds here until the test has stopped the engine

    lanes = Gated()
    engine = _start(lanes, max_batch_size=1)
    running = engine.submit(_request([0], 100))
    waiting = engine.submit(_request([1], 4))
    next(iter(running))
    stopper = threading.Thread(target=engine.stop, kwargs={"timeout_s": 10})
    stopper.start()
    while not engine._stopping:
        time.sleep(0.001)  # until stop() has asked; what follows is ordered by the gate
    gate.set()
    stopper.join(10)
    assert engine.state == "closed" and engine.active_count == 0
    for stream in (running, waiting):
        with pytest.raises(errors.RuntimeClosed):
            list(stream)
        assert stream.request.outcome.finish_reason == "cancelled"
    with pytest.raises(errors.RuntimeClosed):
        engine.submit(_request([2], 2))


def test_capabilities_are_asked_not_stubbed():
    """Only the lanes that can hand off, adopt, speculate or prefill partially say they can."""
    from abstractruntime_mlx.engine.backends.backend import BatchBackend
    from abstractruntime_mlx.engine.backends.serial import InProcessBackend, SerialBackend
    from abstractruntime_mlx.engine.backends.single import SingleBackend
    from abstractruntime_mlx.engine.backends.text_loop import TextLoopBackend

    members = {
        HandsOff: ("can_hand_off", "detach"),
        Adopts: ("adopt",),
        Speculates: ("speculation_counters",),
        PrefillsPartially: ("allow_partial_prefill",),
    }
    names = {HandsOff: "hands_off", Adopts: "adopts", Speculates: "speculates", PrefillsPartially: "partial"}

    def able(cls: type) -> set[str]:
        return {names[capability] for capability, needs in members.items() if all(hasattr(cls, m) for m in needs)}

    assert able(SingleBackend) == {"hands_off"}
    assert able(BatchBackend) == {"adopts", "speculates", "partial"}
    assert able(TextLoopBackend) == {"adopts"}
    assert able(SerialBackend) == set() and able(InProcessBackend) == {"speculates"}


def test_every_lane_says_whether_its_tokens_carry_logprobs():
    """``reports_logprobs`` is a member of every backend, not an attribute the loop guesses at:
    the text lane computes them; the single and serialized lanes do not (``BatchBackend``
    decides per generator: not when it speculates)."""
    from abstractruntime_mlx.engine.backends.serial import InProcessBackend, SerialBackend
    from abstractruntime_mlx.engine.backends.single import SingleBackend
    from abstractruntime_mlx.engine.backends.text_loop import TextLoopBackend

    lanes = (SingleBackend, SerialBackend, InProcessBackend, TextLoopBackend)
    assert {cls.__name__: cls.reports_logprobs for cls in lanes} == {
        "SingleBackend": False,
        "SerialBackend": False,
        "InProcessBackend": False,
        "TextLoopBackend": True,
    }
