"""The single-request lane on real MLX, the engine stepped by hand (no worker thread), so
every arrival lands at a chosen step: a lone request decodes alone, a second one moves it
into a batch with its KV cache as is, and its tokens are the same on every path."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

from abstractruntime_mlx import errors
from abstractruntime_mlx.engine.backends.backend import BatchBackend
from abstractruntime_mlx.engine.backends.single import SingleBackend
from abstractruntime_mlx.engine.backends.text_loop import TextLoopBackend
from abstractruntime_mlx.engine.core.loop import Engine, EngineConfig, _as_engine_error
from abstractruntime_mlx.engine.core.request import (
    EngineRequest,
    PrefillObservation,
    Sampling,
    TokenDelta,
    execution_report,
)
from abstractruntime_mlx.engine.model.model import Upstream, load_model

# A batch of text rows runs in the text lane unless mlx_text_lane is off.
BATCH_PATHS = ("batch", "text_batch")

PROMPTS = ["Explain TTL caches.", "Explain LRU caches.", "What is a prefix cache?"]
_ids = itertools.count()


class Stepper:
    """An engine whose worker steps are taken here, one ``step()`` at a time."""

    def __init__(self, path: str, **config: object) -> None:
        self.engine = Engine(lambda: load_model(Path(path), upstream=Upstream.NATIVE), EngineConfig(**config))  # type: ignore[arg-type]
        self.engine.loaded = self.engine._load()
        self.engine._stream = mx.default_stream(mx.default_device())
        self.engine._make_lanes()

    def request(self, prompt: str, max_tokens: int = 24, **kwargs: object) -> EngineRequest:
        loaded = self.engine.loaded
        assert loaded is not None
        req = EngineRequest(
            request_id=f"r{next(_ids)}", prompt_ids=loaded.encode(prompt), max_tokens=max_tokens, **kwargs
        )  # type: ignore[arg-type]
        self.engine.submit(req)
        return req

    def step(self) -> None:
        """One turn of the worker's loop, its fault handling included."""
        try:
            self.engine._schedule_and_step()
        except Exception as exc:  # noqa: BLE001 - as Engine._loop handles a failed turn
            self.engine._check_device(exc)
            self.engine._fail_group(_as_engine_error(exc))

    def drain(self, limit: int = 500) -> None:
        for _ in range(limit):
            if not self.engine._live and self.engine._group is None:
                return
            self.step()
        raise AssertionError("the engine did not finish its requests")

    def until(self, predicate, limit: int = 500) -> None:  # type: ignore[no-untyped-def]
        for _ in range(limit):
            if predicate():
                return
            self.step()
        raise AssertionError("the condition was never reached")


def outputs(req: EngineRequest) -> list[object]:
    items = []
    while not req.outputs.empty():
        items.append(req.outputs.get_nowait())
    return items


@pytest.fixture()
def stepper(dense_model):
    made: list[Stepper] = []

    def factory(**config: object) -> Stepper:
        s = Stepper(dense_model, **config)
        made.append(s)
        return s

    yield factory
    for s in made:
        s.engine._close_group()


def alone(make, prompt: str, **kwargs: object) -> EngineRequest:
    s = make()
    req = s.request(prompt, **kwargs)
    s.drain()
    return req


def test_lone_request_decodes_on_the_single_lane_with_the_batch_tokens(stepper):
    single = alone(stepper, PROMPTS[0])
    batch = alone(lambda: stepper(single_lane=False), PROMPTS[0])
    assert execution_report(single).to_wire()["path"] == "single"
    assert execution_report(batch).to_wire()["path"] in BATCH_PATHS
    assert execution_report(single).to_wire()["mode"] == execution_report(batch).to_wire()["mode"] == "continuous"
    assert single.token_ids == batch.token_ids and len(single.token_ids) == 24
    assert single.outcome is not None and single.outcome.finish_reason == "length"
    assert single.peak_batch_size == 1


@pytest.mark.parametrize("text_lane", [True, False], ids=["into-text-batch", "into-batch"])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, seed=11)], ids=["greedy", "seeded"])
def test_a_second_request_moves_the_first_into_a_batch_without_a_pause(stepper, sampling, text_lane):
    reference = alone(stepper, PROMPTS[0], sampling=sampling)
    joiner_alone = alone(stepper, PROMPTS[1], max_tokens=8)
    s = stepper(max_batch_size=4, text_lane=text_lane)
    first = s.request(PROMPTS[0], sampling=sampling)
    s.until(lambda: first.num_output_tokens == 5)
    assert isinstance(s.engine._group.backend, SingleBackend)
    second = s.request(PROMPTS[1], max_tokens=8)
    counts = []
    while not first.is_finished():
        before = first.num_output_tokens
        s.step()
        counts.append(first.num_output_tokens - before)
    s.drain()
    # every step after the arrival gave the first request one token: the hand-off took no extra step
    assert counts == [1] * (24 - 5)
    assert execution_report(first).to_wire()["path"] == "single_then_batch"
    assert execution_report(second).to_wire()["path"] == ("text_batch" if text_lane else "batch")
    assert first.peak_batch_size == second.peak_batch_size == 2
    assert first.token_ids == reference.token_ids
    assert second.token_ids == joiner_alone.token_ids
    assert s.engine.stats.completed == 2


@pytest.mark.slow
def test_a_request_still_prefilling_moves_after_its_first_token(stepper):
    long_prompt = " ".join(PROMPTS * 6)
    reference = alone(lambda: stepper(prefill_step_size=8), long_prompt, max_tokens=12)
    s = stepper(prefill_step_size=8, max_batch_size=4)
    first = s.request(long_prompt, max_tokens=12, observe_prefill=True)
    s.step()  # admitted, one prefill chunk
    assert first.num_output_tokens == 0
    second = s.request(PROMPTS[1], max_tokens=6)
    s.until(lambda: first.num_output_tokens == 1)
    assert isinstance(s.engine._group.backend, SingleBackend)  # it finished its prefill alone
    s.drain()
    assert execution_report(first).to_wire()["path"] == "single_then_batch"
    assert first.token_ids == reference.token_ids
    observed = [o.processed for o in outputs(first) if isinstance(o, PrefillObservation)]
    total = first.num_prompt_tokens
    # one observation per real change of position: the start (0) is the start event's, not an observation
    assert observed == [*range(8, total - 1, 8), total - 1] and total > 40
    assert second.outcome is not None and second.outcome.completion_tokens == 6


@pytest.mark.slow
def test_prefill_observations_match_the_batch_lane(stepper):
    long_prompt = " ".join(PROMPTS * 6)
    seen = []
    for single_lane in (True, False):
        s = stepper(prefill_step_size=8, single_lane=single_lane)
        req = s.request(long_prompt, max_tokens=4, observe_prefill=True)
        s.drain()
        seen.append([(o.processed, o.total) for o in outputs(req) if isinstance(o, PrefillObservation)])
    assert seen[0] == seen[1] and len(seen[0]) > 3


def test_stop_string_and_cancel_on_the_single_lane(stepper):
    reference = alone(stepper, PROMPTS[0])
    text = reference.outcome is not None and "".join(o.text for o in outputs(reference) if isinstance(o, TokenDelta))
    assert isinstance(text, str) and len(text) > 6
    stop = text[3:6]
    s = stepper()
    stopped = s.request(PROMPTS[0], stop=(stop,))
    s.drain()
    delivered = "".join(o.text for o in outputs(stopped) if isinstance(o, TokenDelta))
    assert stopped.outcome is not None and stopped.outcome.finish_reason == "stop"
    assert delivered == text[: text.index(stop)]
    assert execution_report(stopped).to_wire()["path"] == "single"

    s = stepper()
    cancelled = s.request(PROMPTS[0])
    s.until(lambda: cancelled.num_output_tokens == 3)
    s.engine.cancel(cancelled)
    s.step()
    assert cancelled.outcome is not None and cancelled.outcome.finish_reason == "cancelled"
    assert isinstance(cancelled.outcome.error, errors.RequestCancelled)
    assert cancelled.num_output_tokens == 3 and s.engine._group is None


def test_requests_that_cannot_move_as_is_use_the_batch_lane(stepper, hybrid_model):
    penalised = alone(stepper, PROMPTS[0], sampling=Sampling(repetition_penalty=1.3))
    assert execution_report(penalised).to_wire()["path"] in BATCH_PATHS
    s = Stepper(hybrid_model)  # a hybrid cache cannot merge into a batch as is
    hybrid = s.request(PROMPTS[0], max_tokens=4)
    s.drain()
    assert execution_report(hybrid).to_wire()["path"] in BATCH_PATHS
    # two requests that arrive together start a batch at once
    s = stepper()
    a, b = s.request(PROMPTS[0], max_tokens=4), s.request(PROMPTS[1], max_tokens=4)
    s.drain()
    assert {execution_report(a).to_wire()["path"], execution_report(b).to_wire()["path"]} & set(BATCH_PATHS)
    assert execution_report(a).to_wire()["path"] == execution_report(b).to_wire()["path"]


@pytest.mark.parametrize("text_lane", [True, False], ids=["into-text-batch", "into-batch"])
def test_a_failed_hand_off_fails_the_moving_request_only(stepper, monkeypatch, text_lane):
    def refuse(self, row):
        raise errors.UpstreamError("simulated: the batch refused the row")

    monkeypatch.setattr(TextLoopBackend if text_lane else BatchBackend, "adopt", refuse)
    s = stepper(max_batch_size=4, text_lane=text_lane)
    first = s.request(PROMPTS[0])
    s.until(lambda: first.num_output_tokens == 2)
    second = s.request(PROMPTS[1], max_tokens=6)
    s.drain()
    assert first.outcome is not None and isinstance(first.outcome.error, errors.UpstreamError)
    assert first.outcome.finish_reason == "error"
    # the newcomer was still waiting: it runs next, alone
    assert second.outcome is not None and second.outcome.finish_reason == "length"
    assert execution_report(second).to_wire()["path"] == "single"
    assert s.engine._live == {} and s.engine.stats.failed == 1


@pytest.mark.slow
def test_a_burst_starts_as_one_batch(stepper):
    # A continuous group starts once ``burst_gap_ms`` pass without a new arrival (at most
    # ``batch_wait_ms`` after the first): requests arriving 30 ms apart are prefilled together.
    s = stepper(max_batch_size=4, burst_gap_ms=500, batch_wait_ms=10_000)
    first = s.request(PROMPTS[0], max_tokens=6)
    arrivals: list[EngineRequest] = []

    def arrive_later() -> None:
        for prompt in PROMPTS[1:]:
            time.sleep(0.03)
            arrivals.append(s.request(prompt, max_tokens=6))

    thread = threading.Thread(target=arrive_later)
    thread.start()
    s.step()  # starts the group once the arrivals stop
    thread.join()
    assert len(s.engine._group.running) == 3  # all three admitted by the first step
    s.drain()
    for req in (first, *arrivals):
        assert execution_report(req).to_wire()["path"] in BATCH_PATHS and req.peak_batch_size == 3
    # without the gap the same first request starts alone on the single lane, then moves
    s = stepper(max_batch_size=4, burst_gap_ms=0)
    first = s.request(PROMPTS[0], max_tokens=6)
    s.step()
    assert isinstance(s.engine._group.backend, SingleBackend)
    s.request(PROMPTS[1], max_tokens=6)
    s.drain()
    assert execution_report(first).to_wire()["path"] == "single_then_batch"


def test_a_full_batch_starts_without_waiting_out_the_gap(stepper):
    s = stepper(max_batch_size=2, burst_gap_ms=60_000, batch_wait_ms=60_000)  # a wait would stall for a minute
    a, b = s.request(PROMPTS[0], max_tokens=4), s.request(PROMPTS[1], max_tokens=4)
    s.drain()
    assert a.peak_batch_size == b.peak_batch_size == 2
