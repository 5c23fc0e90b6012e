"""The local provider on real MLX: concurrency modes, typed errors, cancellation, residency."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from abstractruntime_mlx import errors
from abstractruntime_mlx.provider import residency

PROMPTS = ["Explain TTL caches.", "Explain LRU caches.", "What is a prefix cache?", "Why batch requests?"]


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_seed_example_two_threads(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=4)

    start = threading.Barrier(2)

    def answer(question):
        start.wait()  # both arrive together, as two concurrent callers would
        return llm.generate(question, thinking=False, temperature=0, max_output_tokens=24)

    with ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(pool.map(answer, PROMPTS[:2]))
    for answer in answers:
        assert isinstance(answer.content, str)
        assert answer.usage["completion_tokens"] == len(answer.token_ids) > 0
        assert answer.usage["total_tokens"] == answer.usage["prompt_tokens"] + answer.usage["completion_tokens"]
        execution = answer.metadata["execution"]
        assert execution["mode"] == "continuous"
        assert set(execution) == {"mode", "path", "peak_batch_size", "queue_s", "ttft_s"}
        assert execution["ttft_s"] >= execution["queue_s"] >= 0
    assert max(a.metadata["execution"]["peak_batch_size"] for a in answers) == 2
    assert llm.supports_concurrent_generation() is True
    assert llm.unload_model(llm.model) is True
    assert residency.resident_count() == 0
    with pytest.raises(errors.RuntimeClosed):
        llm.generate("again", max_output_tokens=2)


def test_late_join_is_continuous(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=4)
    first = llm.generate(PROMPTS[0], max_output_tokens=300, stream=True)
    next(first)  # the first request is decoding
    late = llm.generate(PROMPTS[1], max_output_tokens=8)
    rest = list(first)
    early = rest[-1]
    assert late.metadata["execution"]["mode"] == "continuous"
    assert late.metadata["execution"]["peak_batch_size"] == 2
    assert early.metadata["execution"]["peak_batch_size"] == 2
    # the late request finished while the first was still decoding: it joined, not queued behind it
    assert late.finish_reason == "length" and early.finish_reason == "length"
    assert late.metadata["execution"]["queue_s"] < 1.0


def test_seeded_sampling_is_reproducible(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    a = llm.generate(PROMPTS[0], temperature=1.0, seed=7, max_output_tokens=12)
    b = llm.generate(PROMPTS[0], temperature=1.0, seed=7, max_output_tokens=12)
    c = llm.generate(PROMPTS[0], temperature=1.0, seed=8, max_output_tokens=12)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("model_fixture", ["dense_model", "hybrid_model"])
def test_greedy_identical_alone_or_batched(make_llm, request, model_fixture):
    model = request.getfixturevalue(model_fixture)
    llm = make_llm(model, mlx_batching=True, mlx_max_batch_size=4, mlx_batch_wait_ms=100, speculation=False)
    alone = [llm.generate(p, thinking=False, max_output_tokens=16).token_ids for p in PROMPTS]
    start = threading.Barrier(len(PROMPTS))

    def together(prompt):
        start.wait()
        return llm.generate(prompt, thinking=False, max_output_tokens=16)

    with ThreadPoolExecutor(max_workers=4) as pool:
        batched = list(pool.map(together, PROMPTS))
    assert max(r.metadata["execution"]["peak_batch_size"] for r in batched) > 1
    assert [r.token_ids for r in batched] == alone


@pytest.mark.slow
def test_mtp_cohort_separate_from_target_only(make_llm, hybrid_model):
    mtp = {"mode": "native_mtp", "num_draft_tokens": 2, "require_acceleration": True}
    llm = make_llm(hybrid_model, mlx_batching=True, mlx_max_batch_size=4, mlx_batch_wait_ms=100, speculation=mtp)
    assert llm.speculation_ready()
    plain = llm.generate(PROMPTS[0], thinking=False, max_output_tokens=12, speculation=False)
    submitted = llm._engine.snapshot()["submitted"]
    with ThreadPoolExecutor(max_workers=3) as pool:
        cohort = [pool.submit(llm.generate, p, thinking=False, max_output_tokens=12) for p in PROMPTS[:2]]
        # both MTP requests are queued before the target-only one (arrival order decides groups)
        assert wait_until(lambda: llm._engine.snapshot()["submitted"] >= submitted + 2)
        target_only = pool.submit(llm.generate, PROMPTS[2], thinking=False, max_output_tokens=12, speculation=False)
        cohort = [c.result() for c in cohort]
        target_only = target_only.result()
    for r in cohort:
        assert r.metadata["execution"]["mode"] == "cohort"
        spec = r.metadata["speculation"]
        assert spec["used"] is True and spec["num_draft_tokens"] == 2
        assert spec["rounds"] > 0 and spec["drafted_tokens"] > 0
        assert (
            spec["accounting"] == "cohort" and spec["counter_semantics"] == "sum_of_round_means_not_batch_token_totals"
        )
    assert max(r.metadata["execution"]["peak_batch_size"] for r in cohort) == 2
    assert target_only.metadata["execution"]["mode"] == "continuous"
    assert target_only.metadata["execution"]["peak_batch_size"] == 1
    assert target_only.metadata["speculation"] == {
        **target_only.metadata["speculation"],
        "used": False,
        "reason": "disabled_for_this_call",
    }
    # MTP preserves greedy output
    assert cohort[0].token_ids == plain.token_ids
    alone = llm.generate(PROMPTS[0], thinking=False, max_output_tokens=12)
    assert alone.metadata["speculation"]["accounting"] == "request"
    assert alone.metadata["speculation"]["accepted_tokens"] > 0  # the aligned head agrees with the target
    assert alone.metadata["speculation"]["rounds"] < 12  # fewer verify rounds than tokens


def test_strict_mtp_refuses_penalties_optional_reports(make_llm, hybrid_model):
    llm = make_llm(hybrid_model, mlx_batching=True, speculation={"mode": "native_mtp", "num_draft_tokens": 2})
    with pytest.raises(errors.SpeculationUnavailable) as info:
        llm.generate(
            "hi",
            max_output_tokens=4,
            repetition_penalty=1.3,
            speculation={"mode": "native_mtp", "require_acceleration": True},
        )
    assert info.value.reason == "mtp_logit_processors_unsupported" and info.value.http_status == 422
    result = llm.generate("hi", max_output_tokens=4, repetition_penalty=1.3)
    assert result.metadata["speculation"]["used"] is False
    assert result.metadata["speculation"]["reason"] == "mtp_logit_processors_unsupported"
    assert result.metadata["execution"]["mode"] == "continuous"  # without MTP the penalty is a per-row processor


def test_no_head_strict_fails_optional_falls_back(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    with pytest.raises(errors.SpeculationUnavailable) as info:
        llm.generate("hi", max_output_tokens=2, speculation={"mode": "native_mtp", "require_acceleration": True})
    assert info.value.reason == "no_mtp_drafter_for_model"
    r = llm.generate("hi", max_output_tokens=2, speculation={"mode": "native_mtp"})
    assert (
        r.metadata["speculation"]["used"] is False and r.metadata["speculation"]["reason"] == "no_mtp_drafter_for_model"
    )


def test_queue_full(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=1, mlx_max_queue_size=1, mlx_batch_wait_ms=0)
    running = llm.generate(PROMPTS[0], max_output_tokens=400, stream=True)
    next(running)
    waiting = llm.generate(PROMPTS[1], max_output_tokens=4, stream=True)  # fills the one waiting slot
    with pytest.raises(errors.QueueFull) as info:
        llm.generate(PROMPTS[2], max_output_tokens=4)
    assert info.value.code == "queue_full" and info.value.http_status == 503
    running.close()
    assert list(waiting)[-1].finish_reason == "length"  # nothing already accepted was lost


@pytest.mark.slow
def test_queue_timeout_only_expires_waiting(make_llm, dense_model):
    # An output queue the unread running request cannot fill before the timeout: it must not
    # end with backpressure first (which would admit the waiting one).
    llm = make_llm(
        dense_model,
        mlx_batching=True,
        mlx_max_batch_size=1,
        mlx_queue_timeout_s=0.3,
        mlx_batch_wait_ms=0,
        mlx_output_queue_size=4096,
    )
    running = llm.generate(PROMPTS[0], max_output_tokens=2000, stream=True)
    next(running)
    with pytest.raises(errors.QueueTimeout) as info:
        llm.generate(PROMPTS[1], max_output_tokens=4)
    assert info.value.code == "queue_timeout" and info.value.http_status == 504
    # The running request started before the expired one was queued: it is past the timeout too.
    assert time.perf_counter() - running._submitted.request.submitted_at > 0.3
    chunks = [next(running) for _ in range(3)]  # the running request never expires
    assert all(c.finish_reason is None for c in chunks)
    running.close()


def test_slow_consumer_backpressure(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_output_queue_size=4)
    stream = llm.generate(PROMPTS[0], max_output_tokens=200, stream=True)
    engine = llm._engine
    assert wait_until(lambda: engine.snapshot()["failed"] >= 1)
    with pytest.raises(errors.StreamBackpressure) as info:
        list(stream)
    assert info.value.http_status == 429
    assert llm.generate(PROMPTS[1], max_output_tokens=3).finish_reason == "length"


def test_cancel_from_another_thread_frees_slot(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=1)
    cancel, decoding = threading.Event(), threading.Event()

    def on_progress(event):
        if event.get("phase") == "generate":
            decoding.set()

    def canceller():
        if decoding.wait(30):  # the first token is out: cancel mid-decode, from this thread
            cancel.set()

    other = threading.Thread(target=canceller)
    other.start()
    result = llm.generate(PROMPTS[0], max_output_tokens=4000, cancel_event=cancel, on_progress=on_progress)
    other.join()
    assert result.finish_reason == "cancelled"
    assert result.usage["completion_tokens"] < 4000
    assert wait_until(lambda: llm._engine.snapshot()["active"] == 0)
    assert llm.generate(PROMPTS[1], max_output_tokens=3).finish_reason == "length"


def test_closing_stream_cancels(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=1)
    stream = llm.generate(PROMPTS[0], max_output_tokens=4000, stream=True)
    next(stream)
    stream.close()
    engine = llm._engine
    assert wait_until(lambda: engine.snapshot()["active"] == 0 and engine.snapshot()["cancelled"] == 1)
    assert llm.generate(PROMPTS[1], max_output_tokens=3).finish_reason == "length"


def test_async_stream_aclose_cancels(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=1)

    async def main():
        stream = await llm.agenerate(PROMPTS[0], max_output_tokens=4000, stream=True)
        got = 0
        async for _chunk in stream:
            got += 1
            if got == 2:
                break
        await stream.aclose()
        result = await llm.agenerate(PROMPTS[1], max_output_tokens=4)
        return result

    result = asyncio.run(main())
    assert result.finish_reason == "length"
    assert llm._engine.snapshot()["cancelled"] == 1


def test_async_and_sync_agree(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    sync = llm.generate(PROMPTS[0], max_output_tokens=10)

    async def main():
        results = await asyncio.gather(*(llm.agenerate(PROMPTS[0], max_output_tokens=10) for _ in range(3)))
        return results

    for r in asyncio.run(main()):
        assert r.token_ids == sync.token_ids


def test_stop_string_across_tokens_and_one_terminal_chunk(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    chunks = list(llm.generate(PROMPTS[0], max_output_tokens=40, stream=True))
    assert sum(1 for c in chunks if c.finish_reason is not None) == 1 and chunks[-1].finish_reason
    pieces = [c.content for c in chunks if c.content]
    full = "".join(pieces)
    # a stop string that starts inside one token's text and ends inside the next one
    boundary = len(pieces[0]) + len(pieces[1])
    stop = full[boundary - 1 : boundary + 1]
    assert len(stop) == 2
    expected = full[: full.find(stop)]
    result = llm.generate(PROMPTS[0], max_output_tokens=40, stop=[stop])
    assert result.content == expected
    assert result.finish_reason == "stop"
    streamed = list(llm.generate(PROMPTS[0], max_output_tokens=40, stop=[stop], stream=True))
    assert "".join(c.content for c in streamed) == expected
    assert [c.finish_reason for c in streamed].count("stop") == 1


def test_serialized_lane(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=False)
    assert llm.supports_concurrent_generation() is False
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda p: llm.generate(p, max_output_tokens=12), PROMPTS[:3]))
    for r in results:
        assert r.metadata["execution"]["mode"] == "exclusive"
        assert r.metadata["execution"]["peak_batch_size"] == 1
    assert llm._engine.snapshot()["peak_batch_size"] == 1
    # the serialized mlx-lm lane and the batched mlx-vlm lane decode the same greedy tokens
    batched = make_llm(dense_model, mlx_batching=True)
    assert batched.generate(PROMPTS[0], max_output_tokens=12).token_ids == results[0].token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"speculation": {"mode": "warp"}}, "speculation.mode"),
        ({"thinking": "sideways"}, "thinking"),
        ({"prompt_cache_key": 5}, "prompt_cache_key"),
    ],
)
def test_invalid_controls(make_llm, dense_model, kwargs, field):
    llm = make_llm(dense_model, mlx_batching=True)
    with pytest.raises(errors.InvalidControls) as info:
        llm.generate("hi", **kwargs)
    assert info.value.http_status == 400
    assert info.value.field == field


def test_unknown_argument_and_option(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    with pytest.raises(errors.InvalidRequest, match="frobnicate"):
        llm.generate("hi", frobnicate=True)
    with pytest.raises(errors.InvalidRequest, match="mlx_warp"):
        make_llm(dense_model, mlx_warp=1)
    with pytest.raises(errors.InvalidControls):
        make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=0)
    with pytest.raises(errors.ModelNotFound, match="models download"):
        make_llm("nobody/no-such-model")


def test_residency_sharing_and_release(make_llm, dense_model):
    a = make_llm(dense_model, mlx_batching=True)
    b = make_llm(dense_model, mlx_batching=True)
    assert a._resident is b._resident
    with pytest.raises(errors.ResidencyConflict):
        make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=2)
    stream = b.generate(PROMPTS[0], max_output_tokens=500, stream=True)
    next(stream)
    with pytest.raises(errors.OwnerBusy):
        a.unload_model()
    stream.close()
    assert wait_until(lambda: a._engine.snapshot()["active"] == 0)
    assert a.unload_model() is True
    # releasing one provider leaves the other's model resident
    assert b.generate(PROMPTS[1], max_output_tokens=3).finish_reason == "length"
    b.unload_model()
    assert residency.resident_count() == 0


def test_garbage_collection_retires_without_blocking(policy_file, dense_model):
    from abstractruntime_mlx import create_llm

    llm = create_llm("mlx", model=dense_model, mlx_batching=True)
    engine = llm._engine
    # Long enough that the worker is still decoding when the control below parks it (a lone
    # request decodes on the fast single lane); within the output queue's 256 records.
    stream = llm.generate(PROMPTS[0], max_output_tokens=200, stream=True)
    next(stream)
    # Park the worker between steps, so the in-flight request cannot finish meanwhile; if
    # retiring waited for it, the safety timer would release the worker and the request
    # would be done by the time the collection returns.
    gate, parked = threading.Event(), threading.Event()

    def hold():
        parked.set()
        gate.wait()

    holder = threading.Thread(target=engine.control, args=(hold,))
    holder.start()
    assert parked.wait(10)
    safety = threading.Timer(10, gate.set)
    safety.start()
    del llm
    gc.collect()
    assert not stream._submitted.request.done.is_set()  # did not wait for the in-flight request
    gate.set()
    safety.cancel()
    holder.join()
    assert list(stream)[-1].finish_reason == "length"  # the in-flight request completed
    assert wait_until(lambda: not engine.alive)
    assert residency.resident_count() == 0


def test_vision_images_change_output(make_llm, vision_model, tmp_path):
    from abstractruntime_mlx.testing import tiny_image

    left = tiny_image(tmp_path / "rb.png", (255, 0, 0), (0, 0, 255))
    right = tiny_image(tmp_path / "br.png", (0, 0, 255), (255, 0, 0))
    llm = make_llm(vision_model, mlx_batching=True, speculation=False)
    a = llm.generate("Describe the image.", media=[str(left)], thinking=False, max_output_tokens=8)
    b = llm.generate("Describe the image.", media=[right.read_bytes()], thinking=False, max_output_tokens=8)
    again = llm.generate("Describe the image.", media=[str(left)], thinking=False, max_output_tokens=8)
    assert a.token_ids == again.token_ids
    assert a.token_ids != b.token_ids
    with pytest.raises(errors.InvalidMedia):
        llm.generate("x", media=[b"not an image"])
    with pytest.raises(errors.InvalidMedia):
        llm.generate("x", media=[str(tmp_path / "missing.png")])


@pytest.mark.parametrize("lane", ["single", "batch", "text"])
def test_upstream_failure_fails_the_group_not_the_engine(make_llm, dense_model, monkeypatch, lane):
    from abstractruntime_mlx.engine.backends import backend, single, text_loop

    llm = make_llm(dense_model, mlx_batching=True, mlx_single_lane=lane == "single", mlx_text_lane=lane == "text")
    cls = {"single": single.SingleBackend, "batch": backend.BatchBackend, "text": text_loop.TextLoopBackend}[lane]
    real_step = cls.step
    calls = {"n": 0}

    def flaky(self, *, observe_prefill):
        calls["n"] += 1
        if calls["n"] == 2:
            with backend.map_upstream_errors("a batch step"):
                raise ValueError("simulated kernel failure")
        return real_step(self, observe_prefill=observe_prefill)

    monkeypatch.setattr(cls, "step", flaky)
    with pytest.raises(errors.UpstreamError, match="simulated kernel failure"):
        llm.generate(PROMPTS[0], max_output_tokens=8)
    assert llm.generate(PROMPTS[1], max_output_tokens=3).finish_reason == "length"
    assert llm._engine.snapshot()["failed"] == 1


def test_cancelled_waiting_request_frees_its_queue_place_at_once(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=1, mlx_max_queue_size=1)
    running = llm.generate(PROMPTS[0], max_output_tokens=2000, stream=True)
    next(running)
    waiting = llm.generate(PROMPTS[1], max_output_tokens=4, stream=True)
    waiting.close()  # cancelled while queued: its place is free before the worker notices
    replacement = llm.generate(PROMPTS[2], max_output_tokens=4, stream=True)
    running.close()
    assert list(replacement)[-1].finish_reason == "length"


def test_an_empty_prompt_alone_is_an_empty_user_turn(make_llm, dense_model):
    # As AbstractCore does: a flow's start input left empty and wired into a prompt still runs.
    from abstractruntime_mlx.conversation import assemble_conversation
    from abstractruntime_mlx.errors import InvalidRequest

    assert assemble_conversation(prompt="", messages=None, system_prompt=None) == [{"role": "user", "content": ""}]
    assert assemble_conversation(prompt="", messages=None, system_prompt="s") == [{"role": "system", "content": "s"}]
    with pytest.raises(InvalidRequest):
        assemble_conversation(prompt=None, messages=[], system_prompt=None)
    llm = make_llm(dense_model, mlx_batching=True, speculation=False)
    assert llm.generate("", thinking=False, temperature=0, max_output_tokens=3).usage["completion_tokens"] == 3
