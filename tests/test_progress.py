"""Phase events (prefill vs generation) from real engine observations, per lane."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from abstractruntime_mlx.provider.progress import ProgressTracker
from abstractruntime_mlx.request import pick_progress_callback

LONG_PROMPT = "The cache keeps the most recent entries and drops the oldest ones. " * 30
LANES = {
    "batched": ({"mlx_batching": True}, {}),
    "sampled": ({"mlx_batching": True}, {"temperature": 0.8, "seed": 1}),
    "exclusive": ({"mlx_batching": True, "mlx_sampled_exclusive": True}, {"temperature": 0.8, "seed": 1}),
    "serialized": ({"mlx_batching": False}, {}),
}
LANE_MODE = {"batched": "continuous", "sampled": "continuous", "exclusive": "exclusive", "serialized": "exclusive"}


def run(llm, events, **kwargs):
    return llm.generate(LONG_PROMPT, thinking=False, max_output_tokens=12, on_progress=events.append, **kwargs)


def check_sequence(events, result):
    assert events, "no events"
    assert events[0]["phase"] == "prefill" and "prefill_processed_tokens" not in events[0]
    assert events[-1]["phase"] == "complete" and events[-1]["final"] is True
    assert events[-1]["finish_reason"] == result.finish_reason
    assert [e["event_index"] for e in events] == list(range(len(events)))
    assert all(e["kind"] == "llm" for e in events)
    prompt = [e["prompt_tokens"] for e in events]
    assert prompt == sorted(prompt) and prompt[-1] == result.usage["prompt_tokens"]
    phases = [e["phase"] for e in events]
    first_generate = phases.index("generate")
    assert "prefill" not in phases[first_generate:]  # no prefill after the first token
    first = events[first_generate]
    assert first.get("first_token") is True and first["generated_tokens"] == 1
    assert "tokens_per_second" not in first  # one token is not a rate
    ttft = first["ttft_s"]
    assert all(e["ttft_s"] == ttft for e in events[first_generate:])
    for e in events[:first_generate]:
        assert "ttft_s" not in e and "generated_tokens" not in e
    processed = [e["prefill_processed_tokens"] for e in events if "prefill_processed_tokens" in e]
    assert processed == sorted(processed)
    assert all(
        p <= e["prompt_tokens"] for p, e in zip(processed, [e for e in events if "prefill_processed_tokens" in e])
    )
    for e in events:
        if e["phase"] != "prefill":
            assert "prefill_processed_tokens" not in e and "prefill_tokens_per_second" not in e
    assert events[-1]["generated_tokens"] == result.usage["completion_tokens"]
    # which lane ran: known from admission on, so absent on the start event only
    assert "execution_mode" not in events[0]
    assert {e["execution_mode"] for e in events[1:]} == {result.metadata["execution"]["mode"]}
    return processed


@pytest.mark.parametrize("lane", sorted(LANES))
def test_event_sequence_per_lane(make_llm, dense_model, lane):
    options, call = LANES[lane]
    llm = make_llm(dense_model, mlx_prefill_step_size=64, progress_min_interval_s=0.0, **options)
    events = []
    result = run(llm, events, **call)
    assert result.metadata["execution"]["mode"] == LANE_MODE[lane]
    processed = check_sequence(events, result)
    # several real per-chunk observations, ending at the whole prompt
    assert len(processed) >= 3, processed
    assert processed[-1] <= result.usage["prompt_tokens"]
    assert processed[-1] >= result.usage["prompt_tokens"] - 64
    assert any("prefill_tokens_per_second" in e for e in events)
    assert result.metadata["progress"]["events"] == len(events)


def test_throttle_large_interval_keeps_the_milestones(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_prefill_step_size=64, progress_min_interval_s=60.0)
    events = []
    result = run(llm, events)
    assert [e["phase"] for e in events] == ["prefill", "generate", "complete"]
    assert events[1]["first_token"] is True
    assert result.metadata["progress"]["events"] == 3


def test_throttle_reads_the_environment(make_llm, dense_model, monkeypatch):
    monkeypatch.setenv("ABSTRACTCORE_PROGRESS_MIN_INTERVAL_S", "0")
    llm = make_llm(dense_model, mlx_batching=True, mlx_prefill_step_size=64)
    assert llm.progress_min_interval_s == 0.0
    events = []
    run(llm, events)
    assert len(events) > 5  # every generated token and every chunk reported


@pytest.mark.slow
def test_outputs_identical_with_and_without_subscriber(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_prefill_step_size=64, progress_min_interval_s=0.0)
    plain = llm.generate(LONG_PROMPT, thinking=False, max_output_tokens=12)
    observed = run(llm, [])
    assert plain.token_ids == observed.token_ids and plain.content == observed.content
    assert "progress" not in plain.metadata


def test_raising_callback_is_disabled_and_reported(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, progress_min_interval_s=0.0)
    calls = []

    def bad(event):
        calls.append(event)
        raise RuntimeError("host UI went away")

    result = llm.generate(LONG_PROMPT, max_output_tokens=8, on_progress=bad)
    assert len(calls) == 1
    assert result.finish_reason == "length" and result.usage["completion_tokens"] == 8
    assert result.metadata["progress"]["callback_error"] == "RuntimeError: host UI went away"


def test_alias_names_first_callable_wins(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    a, b = [], []
    llm.generate(
        "hi", max_output_tokens=2, on_progress=None, progress_callback=a.append, progress_event_callback=b.append
    )
    assert a and not b
    assert pick_progress_callback({"progress_event_callback": b.append}) is not None
    assert llm.supports_text_progress_events() is True


def test_concurrent_requests_keep_their_own_events(make_llm, dense_model):
    llm = make_llm(
        dense_model, mlx_batching=True, mlx_prefill_step_size=64, mlx_batch_wait_ms=50, progress_min_interval_s=0.0
    )
    prompts = [LONG_PROMPT, "short question?"]
    logs = [[], []]
    barrier = threading.Barrier(2)

    def go(i):
        barrier.wait()
        return llm.generate(prompts[i], max_output_tokens=6 + 4 * i, on_progress=logs[i].append)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(go, range(2)))
    assert max(r.metadata["execution"]["peak_batch_size"] for r in results) == 2
    for log, result in zip(logs, results):
        assert {e["prompt_tokens"] for e in log} == {result.usage["prompt_tokens"]}
        assert log[-1]["generated_tokens"] == result.usage["completion_tokens"]


def test_tracker_absent_not_zero_and_monotone():
    clock = iter([0.0, 0.0, 0.1, 0.1, 0.2, 0.2, 0.3, 0.3, 0.4, 0.4, 0.5, 0.5, 0.6, 0.6]).__next__
    events = []
    tracker = ProgressTracker(events.append, min_interval_s=0.0, clock=clock, started_at=0.0)
    tracker.start(100)
    tracker.prefill(40, 100, cached=0)
    tracker.prefill(30, 90, cached=0)  # a narrower, older claim is not news
    tracker.tokens(1)
    tracker.prefill(100, 100)  # no prefill event after the first token
    tracker.complete("stop")
    assert [e["phase"] for e in events] == ["prefill", "prefill", "prefill", "generate", "complete"]
    assert events[2]["prefill_processed_tokens"] == 40 and events[2]["prompt_tokens"] == 100
    assert "cached_tokens" not in events[0]
    assert events[1]["cached_tokens"] == 0 and events[1]["fed_tokens"] == 100
