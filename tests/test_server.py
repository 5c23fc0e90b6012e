"""The HTTP server: OpenAI SDK, SSE, batching, progress, disconnects, auth, residency, errors.

Real servers run uvicorn on 127.0.0.1 in a background thread over a tiny random model; the
rule-by-rule tests use a scripted fake provider through Starlette's in-process TestClient.
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from abstractruntime_mlx import create_llm
from abstractruntime_mlx.errors import EngineCrashed, QueueFull
from abstractruntime_mlx.results import GenerationChunk
from abstractruntime_mlx.server import create_app
from abstractruntime_mlx.testing import tiny_model
from test_server_harness import FakeProvider, engine_stats, serve_in_thread, wait_until

USER = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_model(tmp_path_factory.mktemp("server-models") / "dense", kind="dense"))


@pytest.fixture(scope="module")
def llm(model_path: str) -> Any:
    provider = create_llm("mlx", model=model_path, mlx_batching=True, mlx_max_batch_size=4)
    yield provider
    provider.unload_model(provider.model)


@pytest.fixture(scope="module")
def server_url(llm: Any) -> str:
    with serve_in_thread(create_app(llm)) as url:
        yield url


def sse_records(text: str) -> list[tuple[str | None, str]]:
    """``(event, data)`` pairs of an SSE body."""
    out = []
    for block in text.strip().split("\n\n"):
        event, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        out.append((event, "\n".join(data)))
    return out


# --------------------------------------------------------------------------- OpenAI SDK


def test_openai_sdk_chat_reports_usage_and_abstractcore(server_url: str, llm: Any) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=llm.model,
        messages=USER,
        max_tokens=8,
        temperature=0,
        extra_body={"speculation": False, "thinking": False, "seed": 3, "top_k": 5},
    )
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage is not None and reply.usage.completion_tokens <= 8
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    extra = reply.model_extra["abstractcore"]
    assert extra["execution"]["mode"] == "continuous"
    assert extra["speculation"]["used"] is False
    assert extra["speculation"]["reason"] == "disabled_for_this_call"


def test_openai_sdk_stream_ends_with_terminal_chunk_and_done(server_url: str, llm: Any) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.chat.completions.create(model=llm.model, messages=USER, max_tokens=6, temperature=0, stream=True)
    )
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0] is chunks[-1]
    assert finals[0].usage.completion_tokens == 6
    assert finals[0].model_extra["abstractcore"]["execution"]["peak_batch_size"] >= 1
    # The tiny template opens a think block in the prompt: its text streams as reasoning_content.
    delta_text = [
        (c.choices[0].delta.content or "") + ((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "")
        for c in chunks
        if c.choices
    ]
    assert "".join(delta_text)

    raw = httpx.post(
        f"{server_url}/v1/chat/completions",
        json={"messages": USER, "max_tokens": 4, "stream": True, "temperature": 0},
        timeout=30,
    )
    records = sse_records(raw.text)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert records[-1] == (None, "[DONE]")
    terminal = json.loads(records[-2][1])
    assert terminal["choices"][0]["finish_reason"] == "length"
    assert terminal["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert set(terminal["abstractcore"]) >= {"execution", "speculation"}
    assert all(event is None for event, _ in records)  # no progress events unless asked


def test_concurrent_streams_are_batched(server_url: str) -> None:
    body = {"messages": USER, "max_tokens": 48, "stream": True, "temperature": 0, "speculation": False}

    def one(_: int) -> dict[str, Any]:
        response = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=60)
        records = sse_records(response.text)
        return json.loads(records[-2][1])["abstractcore"]["execution"]

    with ThreadPoolExecutor(max_workers=4) as pool:
        executions = list(pool.map(one, range(4)))
    assert max(e["peak_batch_size"] for e in executions) > 1
    assert all(e["mode"] == "continuous" for e in executions)


def test_progress_events_are_sent_when_asked(server_url: str) -> None:
    response = httpx.post(
        f"{server_url}/v1/chat/completions",
        json={
            "messages": USER,
            "max_tokens": 5,
            "stream": True,
            "temperature": 0,
            "stream_options": {"include_progress": True},
        },
        timeout=30,
    )
    records = sse_records(response.text)
    progress = [json.loads(data) for event, data in records if event == "progress"]
    phases = [p["phase"] for p in progress]
    assert phases[0] == "prefill" and "generate" in phases and phases[-1] == "complete"
    assert all(p["kind"] == "llm" for p in progress)
    assert progress[-1]["final"] is True
    assert records[-1] == (None, "[DONE]")


def test_execution_capabilities_describe_the_loaded_instance(server_url: str, llm: Any) -> None:
    caps = httpx.get(f"{server_url}/v1/models/execution-capabilities", params={"model_name": llm.model}).json()
    assert caps["model"] == llm.model
    assert caps["concurrency"] == {"supported": True, "source": "loaded_instance", "reason": None}
    models = httpx.get(f"{server_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [llm.model]
    assert httpx.get(f"{server_url}/health").json()["loaded"] is True


def test_unknown_model_and_bad_controls_are_typed_errors(server_url: str) -> None:
    wrong = httpx.post(f"{server_url}/v1/chat/completions", json={"model": "other", "messages": USER})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(f"{server_url}/v1/chat/completions", json={"messages": USER, "temperature": -1, "stream": True})
    assert bad.status_code == 400
    assert bad.json()["error"] == {
        "message": "temperature must be >= 0",
        "type": "invalid_request_error",
        "code": "invalid_controls",
        "details": {"field": "temperature", "value": -1.0},
    }
    spec = httpx.post(f"{server_url}/v1/chat/completions", json={"messages": USER, "speculation": {"mode": "warp"}})
    assert spec.status_code == 400 and spec.json()["error"]["code"] == "invalid_controls"
    missing = httpx.post(f"{server_url}/v1/chat/completions", json={"messages": []})
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "invalid_request"
    route = httpx.get(f"{server_url}/nope")
    assert route.status_code == 404 and route.json()["error"]["code"] == "not_found"


# --------------------------------------------------------------------------- cancellation, queue full


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One batch slot and one waiting place, on its own model copy (its own engine).

    Seed 0 with this prompt does not sample EOS for thousands of tokens, so ``LONG`` runs
    until it is cancelled."""
    path = tiny_model(tmp_path_factory.mktemp("server-narrow") / "dense", kind="dense")
    provider = create_llm("mlx", model=str(path), mlx_batching=True, mlx_max_batch_size=1, mlx_max_queue_size=1)
    with serve_in_thread(create_app(provider)) as url:
        yield provider, url
    provider.unload_model(provider.model)


def _idle(provider: Any) -> bool:
    stats = engine_stats(provider)
    return stats.get("active") == 0 and stats.get("queued") == 0


LONG = {"messages": USER, "max_tokens": 4000, "temperature": 0, "speculation": False, "thinking": False}


def test_stream_disconnect_cancels_and_frees_the_slot(narrow: Any) -> None:
    provider, url = narrow
    before = engine_stats(provider)["cancelled"]
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json={**LONG, "stream": True}) as response:
            lines = response.iter_lines()
            assert any('"content":"' in line and '"content":""' not in line for line in (next(lines) for _ in range(8)))
        # leaving the block closed the connection mid-stream
    assert wait_until(lambda: _idle(provider), timeout_s=10)
    assert engine_stats(provider)["cancelled"] == before + 1
    # the only slot is free again: a short request completes
    done = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "temperature": 0}, timeout=30
    )
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_nonstream_disconnect_cancels_and_frees_the_slot(narrow: Any) -> None:
    provider, url = narrow
    before = engine_stats(provider)["cancelled"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json=LONG, timeout=httpx.Timeout(0.5, connect=5))
    assert wait_until(lambda: _idle(provider), timeout_s=10)
    assert engine_stats(provider)["cancelled"] == before + 1
    done = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "temperature": 0}, timeout=30
    )
    assert done.status_code == 200


def test_queue_full_is_503_and_the_client_raises_queue_full(narrow: Any) -> None:
    from abstractruntime_mlx.remote_client import RemoteClient

    provider, url = narrow
    stop = threading.Event()

    def hold(index: int) -> None:
        """Keep one LONG stream open (and read, so it never backs up) until ``stop``."""
        with httpx.Client(timeout=30) as own:
            with own.stream("POST", f"{url}/v1/chat/completions", json={**LONG, "stream": True}) as response:
                for _ in response.iter_lines():
                    if stop.is_set():
                        return

    holders = [threading.Thread(target=hold, args=(i,)) for i in range(2)]
    try:
        holders[0].start()
        assert wait_until(lambda: engine_stats(provider).get("active") == 1)
        holders[1].start()
        assert wait_until(lambda: engine_stats(provider).get("queued") == 1)
        full = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, timeout=30)
        assert full.status_code == 503
        assert full.json()["error"]["code"] == "queue_full"
        with RemoteClient(url, max_retries=0) as client, pytest.raises(QueueFull):
            client.generate("hi", max_output_tokens=2)
    finally:
        stop.set()
        for holder in holders:
            holder.join(timeout=30)
    assert wait_until(lambda: _idle(provider), timeout_s=10)


# --------------------------------------------------------------------------- residency


def test_load_same_options_is_a_no_op_and_different_ones_conflict(server_url: str, llm: Any) -> None:
    same = httpx.post(
        f"{server_url}/acore/models/load",
        json={"provider": "mlx", "model": llm.model, "options": {"mlx_batching": True, "mlx_max_batch_size": 4}},
    )
    assert same.status_code == 200 and same.json()["loaded_new"] is False
    other = httpx.post(
        f"{server_url}/acore/models/load", json={"model": llm.model, "options": {"mlx_max_batch_size": 2}}
    )
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "residency_conflict"
    assert "unload" in other.json()["error"]["message"]
    unknown = httpx.post(f"{server_url}/acore/models/load", json={"model": llm.model, "options": {"warp": 1}})
    assert unknown.status_code == 400 and "warp" in unknown.json()["error"]["message"]


def test_unload_then_load_through_the_factory(tmp_path: Any) -> None:
    built: list[tuple[str, dict[str, Any]]] = []
    (tmp_path / "second").mkdir()
    (tmp_path / "third").mkdir()

    def factory(model: str, **options: Any) -> FakeProvider:
        built.append((model, options))
        return FakeProvider(model=model)

    app = create_app(FakeProvider(model="first"), model_factory=factory, model_roots=[tmp_path])
    with TestClient(app) as client:
        assert client.post("/acore/models/unload", json={"model": "first"}).json()["unloaded"] is True
        gone = client.post("/v1/chat/completions", json={"messages": USER})
        assert gone.status_code == 404 and "load" in gone.json()["error"]["message"]
        loaded = client.post("/acore/models/load", json={"model": "second", "options": {"mlx_max_batch_size": 2}})
        assert loaded.json()["loaded_new"] is True
        assert built == [(str((tmp_path / "second").resolve()), {"mlx_max_batch_size": 2})]
        assert client.post("/v1/chat/completions", json={"messages": USER}).status_code == 200
        # A second model loads beside the first (the server holds several); an unknown one is 404.
        assert client.post("/acore/models/load", json={"model": "third"}).json()["loaded_new"] is True
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["second", "third"]
        missing = client.post("/acore/models/load", json={"model": "fourth"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_failed_ssd_flush_at_unload_is_a_500_and_the_model_is_gone(tmp_path: Any) -> None:
    path = tiny_model(tmp_path / "dense", kind="dense")
    provider = create_llm("mlx", model=str(path), mlx_batching=True, mlx_cache_disk_path=str(tmp_path / "cache"))
    namespace = Path(provider.get_prompt_cache_stats()["disk"]["path"])
    namespace.rename(tmp_path / "moved")  # the directory gives way to a file: every snapshot write fails
    namespace.write_text("not a directory")
    with TestClient(create_app(provider)) as client:
        long_chat = [{"role": "system", "content": "You answer briefly. " * 20}, *USER]  # long enough to store blocks
        chat = client.post(
            "/v1/chat/completions", json={"messages": long_chat, "max_tokens": 2, "prompt_cache_key": "k"}
        )
        assert chat.status_code == 200, chat.text
        failed = client.post("/acore/models/unload", json={})
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "prompt_cache_flush_failed"
        assert failed.json()["error"]["details"]["write_failures"] >= 1
        assert client.get("/health").json()["loaded"] is False
        assert client.post("/acore/models/unload", json={}).json()["unloaded"] is False


def test_unload_with_active_requests_is_refused(tmp_path: Any) -> None:
    path = tiny_model(tmp_path / "dense", kind="dense")
    provider = create_llm("mlx", model=str(path), mlx_batching=True)
    try:
        with serve_in_thread(create_app(provider)) as url, httpx.Client(timeout=30) as client:
            with client.stream("POST", f"{url}/v1/chat/completions", json={**LONG, "stream": True}) as running:
                lines = running.iter_lines()  # keep it: a collected line iterator closes the connection
                next(lines)
                assert wait_until(lambda: engine_stats(provider)["active"] == 1), engine_stats(provider)
                busy = client.post(f"{url}/acore/models/unload", json={})
                assert busy.status_code == 409 and busy.json()["error"]["code"] == "owner_busy", (
                    busy.text,
                    engine_stats(provider),
                )
            assert wait_until(lambda: _idle(provider), timeout_s=10)
            assert client.post(f"{url}/acore/models/unload", json={}).json()["unloaded"] is True
            assert client.get(f"{url}/health").json()["loaded"] is False
    finally:
        if provider.supports_concurrent_generation():
            provider.unload_model(provider.model)


# --------------------------------------------------------------------------- auth


def test_auth_on_requires_bearer_except_health() -> None:
    with TestClient(create_app(FakeProvider(), api_key="s3cret")) as client:
        assert client.get("/health").status_code == 200
        missing = client.get("/v1/models")
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "unauthorized"
        wrong = client.post("/v1/chat/completions", json={"messages": USER}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = client.post("/v1/chat/completions", json={"messages": USER}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "Hello world"


def test_auth_off_accepts_any_or_no_header() -> None:
    with TestClient(create_app(FakeProvider())) as client:
        assert client.get("/v1/models").status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "Bearer whatever"}).status_code == 200


# --------------------------------------------------------------------------- wire details (fake provider)


def test_controls_are_forwarded_to_the_provider() -> None:
    fake = FakeProvider()
    with TestClient(create_app(fake)) as client:
        body = {
            "messages": [{"role": "system", "content": "Be brief."}, *USER],
            "speculation": {"mode": "native_mtp", "num_draft_tokens": 3},
            "thinking": "high",
            "prompt_cache_key": "session:1",
            "stop": ["\n\n"],
            "seed": 7,
            "max_output_tokens": 9,
            "temperature": 0.2,
            "top_p": 0.9,
            "top_k": 4,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.1,
            "frequency_penalty": 0.2,
            "logit_bias": {"5": -1.0},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "timeout_s": 7200.0,
        }
        reply = client.post("/v1/chat/completions", json=body).json()
        off = client.post("/v1/chat/completions", json={"messages": USER, "speculation": False, "max_tokens": 3})
    call = fake.calls[0]
    assert call["messages"] == body["messages"]
    for key in ("speculation", "thinking", "prompt_cache_key", "stop", "seed", "temperature", "top_p", "top_k", "min_p",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "tools"):  # fmt: skip
        assert call[key] == body[key], key
    assert call["max_output_tokens"] == 9
    assert "timeout_s" not in call
    assert isinstance(call["cancel_event"], threading.Event)
    assert fake.calls[1]["speculation"] is False and fake.calls[1]["max_output_tokens"] == 3
    assert off.status_code == 200
    assert reply["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert reply["abstractcore"]["speculation"]["reason"] == "disabled_for_this_call"


def test_conflicting_output_caps_are_rejected() -> None:
    with TestClient(create_app(FakeProvider())) as client:
        reply = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "max_output_tokens": 4})
    assert reply.status_code == 400 and "max_tokens" in reply.json()["error"]["message"]
    assert reply.json()["error"]["code"] == "invalid_controls"


def test_error_after_the_first_byte_is_an_sse_error_event() -> None:
    fake = FakeProvider(texts=("a", "b", "c"), error=EngineCrashed("the MLX worker died"), fail_after=2)
    with TestClient(create_app(fake)) as client:
        response = client.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    assert response.status_code == 200
    records = sse_records(response.text)
    assert records[-1] == (None, "[DONE]")
    assert json.loads(records[-2][1]) == {
        "error": {"message": "the MLX worker died", "type": "native_runtime_error", "code": "engine_crashed"}
    }


def test_error_before_the_first_byte_keeps_its_status() -> None:
    fake = FakeProvider(error=QueueFull("the waiting queue is full"), fail_after=0)
    with TestClient(create_app(fake)) as client:
        streamed = client.post("/v1/chat/completions", json={"messages": USER, "stream": True})
        plain = client.post("/v1/chat/completions", json={"messages": USER})
    for response in (streamed, plain):
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "queue_full"


def test_nonstream_with_progress_is_sse_ending_in_a_result_event() -> None:
    fake = FakeProvider()
    with TestClient(create_app(fake)) as client:
        response = client.post(
            "/v1/chat/completions", json={"messages": USER, "stream_options": {"include_progress": True}}
        )
    records = sse_records(response.text)
    assert [e for e, _ in records] == ["progress", "progress", "progress", "result", None]
    result = json.loads(records[3][1])
    assert result["object"] == "chat.completion" and result["choices"][0]["message"]["content"] == "Hello world"


def test_prompt_cache_routes() -> None:
    with TestClient(create_app(FakeProvider())) as client:
        stats = client.get("/acore/prompt_cache/stats").json()
        assert stats["supported"] is True and "execution" in stats["stats"]
        cleared = client.post("/acore/prompt_cache/clear", json={"key": "k"}).json()
        assert cleared["ok"] is True and cleared["result"]["key"] == "k"
        meta = {"session_id": "s1", "run_id": "r1", "node_id": "llm"}
        stored = client.post(
            "/acore/prompt_cache/key_meta", json={"provider": "mlx", "model": "fake-model", "key": "k", "meta": meta}
        )
        assert stored.json() == {"ok": True, "supported": True, "operation": "key_meta", "key": "k", "meta": meta}
        merged = client.post("/acore/prompt_cache/key_meta", json={"key": "k", "meta": {"attempt": 2}}).json()
        assert merged["meta"] == {**meta, "attempt": 2}
        assert client.get("/acore/prompt_cache/key_meta", params={"key": "k"}).json()["meta"]["attempt"] == 2
        reserved = client.post("/acore/prompt_cache/key_meta", json={"key": "k", "meta": {"fed_token_ids": [1]}})
        assert reserved.status_code == 400
        # a key in the form every edge gives it: " k" is "k"; only whitespace is no key
        assert (
            client.post("/acore/prompt_cache/key_meta", json={"key": " k ", "meta": {"attempt": 3}}).json()["key"]
            == "k"
        )
        assert client.get("/acore/prompt_cache/key_meta", params={"key": " k"}).json()["meta"]["attempt"] == 3
        assert client.post("/acore/prompt_cache/clear", json={"key": "  k"}).json()["result"]["key"] == "k"
        for bad in (
            client.post("/acore/prompt_cache/key_meta", json={"key": "   ", "meta": {}}),
            client.get("/acore/prompt_cache/key_meta", params={"key": " "}),
        ):
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
        long_key = client.get("/acore/prompt_cache/key_meta", params={"key": "k" * 513})
        assert long_key.status_code == 400 and "limit is 512" in long_key.json()["error"]["message"]


def test_malformed_json_is_a_400() -> None:
    with TestClient(create_app(FakeProvider())) as client:
        reply = client.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request"


def test_serve_command_binds_loopback_by_default() -> None:
    import argparse

    from abstractruntime_mlx.cli import serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "--model", "m", "--no-mlx-batching", "--mlx-max-batch-size", "2", "--speculation", "3"]
    )
    settings = serve_cmd.settings_from_args(args, environ={"ABSTRACTRUNTIME_MLX_API_KEY": "k"})
    assert settings.host == "127.0.0.1" and settings.port == 8080 and settings.api_key == "k"
    assert settings.options == {
        "mlx_batching": False,
        "mlx_max_batch_size": 2,
        "speculation": {"mode": "native_mtp", "num_draft_tokens": 3},
    }
    assert callable(args.handler)


@pytest.mark.slow
def test_serve_command_runs_uvicorn(model_path: str) -> None:
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "abstractruntime_mlx.cli.main",
            "serve",
            "--model",
            model_path,
            "--port",
            str(port),
            "--api-key",
            "k",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return bool(httpx.get(f"{url}/health", timeout=1).json()["loaded"])
            except httpx.HTTPError:
                return False

        assert wait_until(healthy, timeout_s=60, interval_s=0.1)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": USER, "max_tokens": 2},
            headers={"Authorization": "Bearer k"},
            timeout=30,
        )
        assert reply.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode in (0, -15)


class GatedProvider(FakeProvider):
    """A fake whose stream yields exactly the chunks the test sends, when it sends them: each
    ``send`` is one burst, yielded with no pause between its chunks (so the server finds them
    queued together), and the stream ends with the burst holding the terminal chunk."""

    def __init__(self) -> None:
        super().__init__()
        self._bursts: queue.Queue[list[GenerationChunk]] = queue.Queue()

    def send(self, *texts: str, finish: bool = False) -> None:
        burst = [GenerationChunk(content=text, model=self.model) for text in texts]
        if finish:
            burst.append(
                GenerationChunk(
                    content="",
                    finish_reason="stop",
                    usage=self._usage(),
                    metadata=dict(self.metadata),
                    model=self.model,
                )
            )
        self._bursts.put(burst)

    async def _chunks(self, on_progress: Any) -> Any:
        while True:
            # A bounded wait, so that a failed test cannot leave a thread behind forever.
            burst = await asyncio.to_thread(self._bursts.get, True, 30)
            for chunk in burst:
                yield chunk
            if burst and burst[-1].finish_reason is not None:
                return


def sse_data(response: httpx.Response) -> Iterator[Any]:
    """The ``data:`` records of a streamed response as they arrive (``"[DONE]"`` as is)."""
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            yield data if data == "[DONE]" else json.loads(data)


def delta_text(record: dict[str, Any]) -> str:
    return str(record["choices"][0]["delta"].get("content", ""))


@pytest.mark.parametrize("interval_ms", [0.0, 60_000.0])
def test_stream_interval_never_delays_the_first_token_or_the_end(interval_ms: float) -> None:
    """With any interval, even a minute: the first token and the terminal chunk go out at once.
    (A delayed one would stall the read below past its timeout.)"""
    provider = GatedProvider()
    with serve_in_thread(create_app(provider, stream_interval_ms=interval_ms)) as url:
        body = {"messages": USER, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
            records = sse_data(response)
            assert next(records)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            provider.send("t0 ")
            assert delta_text(next(records)) == "t0 "
            provider.send(finish=True)
            final = next(records)
            assert final["choices"][0]["finish_reason"] == "stop" and delta_text(final) == ""
            assert list(records) == ["[DONE]"]


@pytest.mark.slow
def test_stream_writes_each_token_apart_when_they_come_apart_and_together_when_they_queue_up() -> None:
    """The verdict depends on order only: the test sends a token and reads its write before it
    sends the next; then it sends a burst that is queued at once, which goes out as one delta."""
    provider = GatedProvider()
    texts = [f"t{i} " for i in range(20)]
    with serve_in_thread(create_app(provider, stream_interval_ms=0)) as url:
        body = {"messages": USER, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
            records = sse_data(response)
            assert "role" in next(records)["choices"][0]["delta"]
            for text in texts[:5]:
                provider.send(text)
                assert delta_text(next(records)) == text  # one write per token that came alone
            provider.send(*texts[5:], finish=True)
            gathered = next(records)
            assert delta_text(gathered) == "".join(texts[5:])  # one write for what queued up together
            assert gathered["choices"][0]["finish_reason"] == "stop"
            assert list(records) == ["[DONE]"]
