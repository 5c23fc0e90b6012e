"""The text lane behaves as mlx-vlm's batch loop does: the same tokens, stops, limits, phase
events, structured answers and cancels, row by row."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from abstractruntime_mlx import errors
from test_call_harness import together

PROMPTS = ["Explain TTL caches.", "Explain LRU caches.", "What is a prefix cache?", "Why batch requests?"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def batched(make_llm, model, text_lane, **options):
    return make_llm(
        model,
        mlx_batching=True,
        mlx_max_batch_size=4,
        mlx_batch_wait_ms=200,
        mlx_single_lane=False,
        mlx_text_lane=text_lane,
        speculation=False,
        **options,
    )


MIXED = [
    {"prompt": PROMPTS[0], "thinking": False, "max_output_tokens": 12},
    {"prompt": PROMPTS[1], "thinking": False, "max_output_tokens": 7, "temperature": 0.9, "seed": 5},
    {
        "prompt": PROMPTS[2],
        "thinking": False,
        "max_output_tokens": 10,
        "repetition_penalty": 1.3,
        "logit_bias": {5: 2.0},
    },
    {"prompt": PROMPTS[3], "thinking": False, "max_output_tokens": 9, "temperature": 0.7, "top_k": 20, "seed": 9},
]


def test_a_mixed_batch_gives_the_same_tokens_as_mlx_vlms_loop(make_llm, dense_model):
    llm = batched(make_llm, dense_model, True)
    text = together(llm, MIXED)
    text_lm = llm._engine._lanes._text_lm
    llm.unload_model()
    full = together(batched(make_llm, dense_model, False), MIXED)
    assert {r.metadata["execution"]["path"] for r in text} == {"text_batch"}
    assert type(text_lm).__module__.startswith("mlx_lm.models.")  # mlx-lm's class, on the resident weights
    assert {r.metadata["execution"]["path"] for r in full} == {"batch"}
    assert max(r.metadata["execution"]["peak_batch_size"] for r in text) > 1
    assert [r.token_ids for r in text] == [r.token_ids for r in full]
    assert [r.finish_reason for r in text] == [r.finish_reason for r in full]
    assert [r.usage for r in text] == [r.usage for r in full]


def test_stop_strings_and_structured_rows_on_the_text_lane(make_llm, dense_model):
    llm = batched(make_llm, dense_model, True)
    free = llm.generate(PROMPTS[0], thinking=False, max_output_tokens=24)
    stop = free.content[3:6]
    calls = [
        {"prompt": PROMPTS[0], "thinking": False, "max_output_tokens": 24, "stop": [stop]},
        {"prompt": "Describe it.", "thinking": False, "max_output_tokens": 64, "response_schema": SCHEMA},
    ]
    stopped, structured = together(llm, calls)
    assert stopped.metadata["execution"]["path"] == "text_batch"
    assert stopped.content == free.content[: free.content.index(stop)]
    assert stopped.finish_reason == "stop"
    assert structured.metadata["execution"]["path"] == "text_batch"
    assert structured.parsed is not None and set(structured.parsed) == {"name", "n"}


def test_phase_events_on_the_text_lane(make_llm, dense_model):
    llm = batched(make_llm, dense_model, True, mlx_prefill_step_size=16, progress_min_interval_s=0.0)
    events: list[dict] = []
    result = llm.generate("word " * 80, thinking=False, max_output_tokens=5, on_progress=events.append)
    assert result.metadata["execution"]["path"] == "text_batch"
    phases = [e["phase"] for e in events]
    assert phases[0] == "prefill" and phases[-1] == "complete"
    processed = [e["prefill_processed_tokens"] for e in events if "prefill_processed_tokens" in e]
    assert len(processed) > 1 and processed == sorted(processed)  # observed chunk by chunk
    assert "prefill" not in phases[phases.index("generate") :]
    assert events[-1]["generated_tokens"] == result.usage["completion_tokens"]


def test_a_cancelled_row_leaves_the_others_running(make_llm, dense_model):
    llm = batched(make_llm, dense_model, True)
    start = threading.Barrier(2)

    def long_stream():
        start.wait()
        stream = llm.generate(PROMPTS[0], thinking=False, max_output_tokens=2000, stream=True)
        next(stream)
        stream.close()  # the client goes away mid-decode
        return stream

    def short():
        start.wait()
        return llm.generate(PROMPTS[1], thinking=False, max_output_tokens=12)

    with ThreadPoolExecutor(max_workers=2) as pool:
        cancelled, finished = pool.submit(long_stream), pool.submit(short)
        cancelled.result()
        result = finished.result()
    assert result.finish_reason == "length" and result.usage["completion_tokens"] == 12
    assert llm._engine.settle(10.0) == 0
    snapshot = llm._engine.snapshot()
    assert snapshot["cancelled"] == 1 and snapshot["completed"] >= 1


def test_bad_sampling_values_fail_that_request_only(make_llm, dense_model):
    llm = batched(make_llm, dense_model, True)
    with pytest.raises(errors.InvalidControls):
        llm.generate(PROMPTS[0], max_output_tokens=4, logit_bias={10**9: 1.0})
    assert llm.generate(PROMPTS[1], thinking=False, max_output_tokens=3).finish_reason == "length"
