"""Faults inside the engine on real MLX: a bad value that reaches MLX fails only its request,
a worker that cannot go on marks the model failed, and unload + load bring it back. Step
failures are injected by running new groups on the fake backend (``fake_backend``)."""

from __future__ import annotations

import threading
import uuid

import pytest

from abstractruntime_mlx import errors
from abstractruntime_mlx.engine.core.loop import Engine
from abstractruntime_mlx.engine.core.request import EngineRequest, Sampling
from abstractruntime_mlx.provider import residency
from fake_backend import FakeLanes

REAL_BACKENDS = Engine._backends


def break_steps(monkeypatch, error: BaseException) -> None:
    """Every group started from now on, on any lane, runs on a fake backend whose first step
    raises ``error`` (the loop's own handling is tested on the fake in test_engine_loop.py)."""

    monkeypatch.setattr(
        Engine,
        "_backends",
        property(lambda self: FakeLanes(fail_at=1, fail_with=error, model_lanes=self._factory.model_lanes)),
    )


def mend_steps(monkeypatch) -> None:
    monkeypatch.setattr(Engine, "_backends", REAL_BACKENDS)


PROMPT = "Explain TTL caches."
LANES = [pytest.param(True, id="batched"), pytest.param(False, id="serialized")]


def raw_request(llm, *, sampling: Sampling, max_tokens: int = 4) -> EngineRequest:
    """An engine request built past the provider's validation, as a bug upstream of MLX would."""
    loaded = llm._engine.loaded
    return EngineRequest(
        request_id=uuid.uuid4().hex, prompt_ids=loaded.encode(PROMPT), max_tokens=max_tokens, sampling=sampling
    )


@pytest.mark.parametrize("batching", LANES)
def test_out_of_range_seed_is_refused_before_mlx(make_llm, dense_model, batching):
    llm = make_llm(dense_model, mlx_batching=batching)
    with pytest.raises(errors.InvalidControls) as info:
        llm.generate(PROMPT, temperature=0.7, seed=2**64, max_output_tokens=4)
    assert info.value.field == "seed" and info.value.http_status == 400
    assert llm.generate(PROMPT, temperature=0.7, seed=2**64 - 1, max_output_tokens=4).usage["completion_tokens"] == 4


@pytest.mark.parametrize("batching", LANES)
def test_logit_bias_outside_the_vocabulary_is_refused(make_llm, dense_model, batching):
    llm = make_llm(dense_model, mlx_batching=batching)
    vocab = llm._engine.loaded.vocab_size
    assert vocab == 2000
    with pytest.raises(errors.InvalidControls) as info:
        llm.generate(PROMPT, logit_bias={str(vocab): 5}, max_output_tokens=4)
    assert info.value.field == f"logit_bias.{vocab}" and info.value.code == "invalid_controls"
    # the engine's own door refuses it too (a request that skipped the provider)
    with pytest.raises(errors.InvalidControls):
        llm._engine.submit(raw_request(llm, sampling=Sampling(logit_bias=((vocab, 5.0),))))
    last = vocab - 1
    biased = llm.generate(PROMPT, logit_bias={str(last): 100}, max_output_tokens=3)
    assert biased.token_ids == [last] * 3


@pytest.mark.parametrize("batching", LANES)
def test_value_mlx_refuses_fails_only_its_request(make_llm, dense_model, batching):
    """A seed MLX cannot take reaches the sampler for real: that request fails typed, a
    request running beside it and every later request are served."""
    llm = make_llm(dense_model, mlx_batching=batching, mlx_max_batch_size=2)
    engine = llm._engine
    running = llm.generate(PROMPT, max_output_tokens=30, stream=True)
    next(running)
    bad = engine.submit(raw_request(llm, sampling=Sampling(temperature=0.7, seed=2**64)))
    with pytest.raises(errors.UpstreamError, match="seed"):
        list(bad)
    assert list(running)[-1].finish_reason == "length"
    assert llm.generate(PROMPT, max_output_tokens=3).finish_reason == "length"
    snapshot = engine.snapshot()
    assert snapshot["failed"] == 1 and snapshot["state"] == "ready" and snapshot["active"] == 0
    assert llm.health() == {"state": "ready"}


class WorkerKilled(BaseException):
    """Not an ``Exception``: escapes the per-step handler, as a worker that cannot go on."""


@pytest.mark.parametrize("batching", LANES)
def test_worker_that_cannot_go_on_marks_the_model_failed(make_llm, dense_model, monkeypatch, batching):
    llm = make_llm(dense_model, mlx_batching=batching, mlx_max_batch_size=1)
    engine = llm._engine
    assert llm.generate(PROMPT, max_output_tokens=2).finish_reason == "length"
    break_steps(monkeypatch, WorkerKilled("simulated worker fault"))
    with pytest.raises(errors.EngineCrashed, match="WorkerKilled"):
        llm.generate(PROMPT, max_output_tokens=4)
    mend_steps(monkeypatch)
    health = llm.health()
    assert health["state"] == "failed" and health["error"]["type"] == "WorkerKilled"
    assert engine.active_count == 0  # every live request was released
    with pytest.raises(errors.EngineCrashed, match="unload it and load it again"):
        llm.generate(PROMPT, max_output_tokens=2)
    # unload and load again, in the same process
    assert llm.unload_model() is True
    assert residency.resident_count() == 0
    again = make_llm(dense_model, mlx_batching=batching, mlx_max_batch_size=1)
    assert again.health() == {"state": "ready"}
    assert again.generate(PROMPT, max_output_tokens=3).finish_reason == "length"


def test_a_step_failure_after_which_mlx_no_longer_computes_fails_the_model(make_llm, dense_model, monkeypatch):
    """A step that raises is isolated only if MLX still computes afterwards (the engine checks);
    when it does not, the model is marked failed. MLX breaking is simulated: no input breaks it."""
    import mlx.core as mx

    llm = make_llm(dense_model, mlx_batching=True)
    real_eval = mx.eval

    def broken_eval(*args, **kwargs):
        raise RuntimeError("simulated device loss")

    class DeviceLost(FakeLanes):
        def count_step(self) -> None:
            monkeypatch.setattr(mx, "eval", broken_eval)
            raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(Engine, "_backends", property(lambda self: DeviceLost(model_lanes=self._factory.model_lanes)))
    with pytest.raises(errors.EngineCrashed, match="kernel failure"):
        llm.generate(PROMPT, max_output_tokens=2)
    monkeypatch.setattr(mx, "eval", real_eval)
    mend_steps(monkeypatch)
    health = llm.health()
    assert health["state"] == "failed" and "simulated device loss" in health["error"]["message"]
    assert llm.unload_model() is True


def test_a_failed_model_is_replaced_by_the_next_load_of_it(make_llm, dense_model, monkeypatch):
    """A new provider of a failed model loads it afresh instead of attaching to the dead engine."""
    llm = make_llm(dense_model, mlx_batching=True)

    break_steps(monkeypatch, WorkerKilled("simulated worker fault"))
    with pytest.raises(errors.EngineCrashed):
        llm.generate(PROMPT, max_output_tokens=2)
    mend_steps(monkeypatch)
    fresh = make_llm(dense_model, mlx_batching=True)
    assert fresh._resident is not llm._resident
    assert fresh.generate(PROMPT, max_output_tokens=3).finish_reason == "length"
    assert llm.unload_model() is True  # the failed holder lets go without touching the new one
    assert fresh.generate(PROMPT, max_output_tokens=3).finish_reason == "length"


# --------------------------------------------------------------------------- context limits


@pytest.mark.slow
def test_context_too_long_in_the_provider(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    loaded = llm._engine.loaded
    context = loaded.context_length
    assert context == 4096
    long_prompt = " ".join(["cache"] * 5000)  # several thousand tokens
    assert len(loaded.encode(long_prompt)) > context
    with pytest.raises(errors.ContextTooLong) as info:
        llm.generate(long_prompt, max_output_tokens=4)
    assert info.value.code == "context_too_long" and info.value.http_status == 400
    assert info.value.details["context_length"] == context
    # the prompt fits, but not with this output cap
    short = llm.generate(PROMPT, max_output_tokens=2)
    prompt_tokens = short.usage["prompt_tokens"]
    with pytest.raises(errors.ContextTooLong):
        llm.generate(PROMPT, max_output_tokens=context - prompt_tokens + 1)
    assert llm.generate(PROMPT, max_output_tokens=context - prompt_tokens, stream=True).close() is None
    # without a cap the default (1024) shrinks to what the context leaves
    per_word = len(loaded.encode(" cache" * 100)) / 100
    filler = " cache" * int((context - 100) / per_word)
    near = llm.generate(filler, max_output_tokens=1)
    assert context - 1024 < near.usage["prompt_tokens"] < context
    uncapped = llm.generate(filler)
    assert uncapped.usage["prompt_tokens"] + uncapped.usage["completion_tokens"] <= context
    with pytest.raises(errors.InvalidControls) as capped:
        llm.generate(PROMPT, max_output_tokens=10**7)
    assert capped.value.field == "max_output_tokens"


def test_a_huge_prompt_is_refused_before_tokenizing(make_llm, dense_model, monkeypatch):
    llm = make_llm(dense_model, mlx_batching=True)
    loaded = llm._engine.loaded

    def encode(self, text):  # pragma: no cover - must not run
        raise AssertionError("a prompt that cannot fit was tokenized")

    monkeypatch.setattr(type(loaded), "encode", encode)
    with pytest.raises(errors.ContextTooLong, match="at least"):
        llm.generate("x" * 5_000_000, max_output_tokens=4)


def test_agenerate_tokenizes_off_the_event_loop(make_llm, dense_model, monkeypatch):
    """The event loop keeps running while a prompt is rendered and tokenized: the encoder
    here waits for a coroutine on the same loop, which would deadlock on the loop itself."""
    import asyncio

    llm = make_llm(dense_model, mlx_batching=True)
    loaded = llm._engine.loaded
    real_encode = type(loaded).encode
    released = threading.Event()

    def encode(self, text):
        assert released.wait(10), "the event loop did not run while the prompt was tokenized"
        return real_encode(self, text)

    monkeypatch.setattr(type(loaded), "encode", encode)

    async def main():
        call = asyncio.ensure_future(llm.agenerate(PROMPT, max_output_tokens=3))
        await asyncio.sleep(0)
        released.set()  # runs only if agenerate let go of the loop
        return await call

    assert asyncio.run(main()).finish_reason == "length"


# --------------------------------------------------------------------------- over HTTP


def test_server_refuses_bad_values_and_recovers_a_failed_model(dense_model, policy_file, monkeypatch):
    import httpx

    from abstractruntime_mlx import create_llm
    from abstractruntime_mlx.server import create_app
    from test_server_harness import serve_in_thread

    def factory(model, **options):
        return create_llm("mlx", model=dense_model, **options)

    user = [{"role": "user", "content": PROMPT}]
    from pathlib import Path

    app = create_app(
        factory(dense_model, mlx_batching=True), model_factory=factory, model_roots=[Path(dense_model).parent]
    )
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        chat = lambda **extra: client.post("/v1/chat/completions", json={"messages": user, "max_tokens": 3, **extra})  # noqa: E731
        bias = chat(logit_bias={"2000": 5})
        assert bias.status_code == 400 and bias.json()["error"]["details"]["field"] == "logit_bias.2000"
        seed = chat(temperature=0.7, seed=2**64)
        assert seed.status_code == 400 and seed.json()["error"]["details"]["field"] == "seed"
        too_long = chat(messages=[{"role": "user", "content": " cache" * 5000}])
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_too_long"
        from abstractruntime_mlx.remote_client import RemoteClient

        with RemoteClient(url) as remote:  # the remote client raises the same typed error
            with pytest.raises(errors.ContextTooLong):
                remote.generate(" cache" * 5000, max_output_tokens=3)
            with pytest.raises(errors.InvalidControls) as bad_bias:
                remote.generate(PROMPT, logit_bias={"2000": 5}, max_output_tokens=3)
            assert bad_bias.value.field == "logit_bias.2000"
        assert chat().status_code == 200
        assert client.get("/health").json()["model_state"] == "ready"

        break_steps(monkeypatch, WorkerKilled("simulated worker fault"))
        crashed = chat()
        assert crashed.status_code == 500 and crashed.json()["error"]["code"] == "engine_crashed"
        mend_steps(monkeypatch)
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "unhealthy" and health.json()["model_state"] == "failed"
        assert chat().json()["error"]["code"] == "engine_crashed"
        # load of the failed model replaces it; no restart
        loaded = client.post("/acore/models/load", json={"model": dense_model, "options": {"mlx_batching": True}})
        assert loaded.status_code == 200 and loaded.json()["loaded_new"] is True
        assert client.get("/health").status_code == 200
        assert chat().status_code == 200
        # and unload of a failed model works too
        break_steps(monkeypatch, WorkerKilled("simulated worker fault"))
        assert chat().status_code == 500
        mend_steps(monkeypatch)
        assert client.post("/acore/models/unload", json={}).json()["unloaded"] is True
        assert client.get("/health").json()["loaded"] is False


# --------------------------------------------------------------------------- residency


def test_a_load_blocks_only_its_own_model(dense_model, models_dir, policy_file, monkeypatch):
    """While one model loads, another model loads and serves; a second provider of the
    loading model waits for that load and shares it."""
    from pathlib import Path

    from abstractruntime_mlx import create_llm
    from abstractruntime_mlx.engine.model import model as model_module
    from abstractruntime_mlx.testing import tiny_model

    other = str(tiny_model(models_dir / "dense-other", kind="dense", seed=1))
    real_load = model_module.load_model
    loading, release = threading.Event(), threading.Event()

    def load_model(path, **kwargs):
        if Path(path) == Path(dense_model).resolve() or str(path) == dense_model:
            loading.set()
            assert release.wait(30)
        return real_load(path, **kwargs)

    monkeypatch.setattr(residency, "load_model", load_model)
    made: list = []
    first = threading.Thread(target=lambda: made.append(create_llm("mlx", model=dense_model, mlx_batching=True)))
    second = threading.Thread(target=lambda: made.append(create_llm("mlx", model=dense_model, mlx_batching=True)))
    first.start()
    assert loading.wait(30)
    second.start()
    unrelated = create_llm("mlx", model=other, mlx_batching=True)  # not blocked by the pending load
    try:
        assert unrelated.generate(PROMPT, max_output_tokens=2).finish_reason == "length"
        assert not made  # both providers of the loading model are still waiting
        release.set()
        first.join(30)
        second.join(30)
        assert len(made) == 2 and made[0]._resident is made[1]._resident
        assert made[0].generate(PROMPT, max_output_tokens=2).finish_reason == "length"
    finally:
        release.set()
        for llm in [unrelated, *made]:
            llm.unload_model()
    assert residency.resident_count() == 0


def test_mtp_head_detection_runs_once_per_load(make_llm, hybrid_model, monkeypatch):
    from abstractruntime_mlx import artifacts

    calls: list = []
    real = artifacts.detect_mtp

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(artifacts, "detect_mtp", counting)
    from abstractruntime_mlx.provider import mlx_provider

    monkeypatch.setattr(mlx_provider, "detect_mtp", counting)
    llm = make_llm(hybrid_model, mlx_batching=True, speculation={"mode": "native_mtp"})
    assert llm.speculation_ready() is True  # the head was found and loaded
    assert len(calls) == 1
