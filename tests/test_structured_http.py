"""Structured output over HTTP: ``response_format`` at our server, the remote client against it
(constrained) and against servers that do not constrain (prompted, validated, retried), and a
flow whose next node reads a field of the structured answer."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI

from abstractruntime_mlx import structured
from abstractruntime_mlx.engine.model.grammar import GrammarCompiler
from abstractruntime_mlx.errors import StructuredOutputInvalid
from abstractruntime_mlx.remote_client import AsyncRemoteClient, RemoteClient
from abstractruntime_mlx.server import create_app
from test_server_harness import serve_in_thread, wait_until

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server_url(dense_model):
    from abstractruntime_mlx import create_llm

    llm = create_llm("mlx", model=dense_model, mlx_batching=True, speculation=False)
    with serve_in_thread(create_app(llm)) as url:
        yield url
    llm.unload_model()


def test_openai_sdk_json_schema_and_json_object(server_url, dense_model):
    client = OpenAI(base_url=f"{server_url}/v1", api_key="none")
    completion = client.chat.completions.create(
        model=dense_model,
        messages=[{"role": "user", "content": "Pick."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}},
        extra_body={"thinking": False},
    )
    jsonschema.validate(json.loads(completion.choices[0].message.content or ""), SCHEMA)
    structured = completion.model_extra["abstractcore"]["structured"]
    assert structured["mode"] == "constrained" and structured["name"] == "pick"
    body = httpx.post(
        f"{server_url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_object"},
            "max_tokens": 40,
            "thinking": False,
        },
    ).json()
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize(
    ("response_format", "status", "code"),
    [
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": 5}}}}},
            400,
            "invalid_response_schema",
        ),
        ({"type": "yaml"}, 400, "invalid_request"),
        ("json", 400, "invalid_request"),
    ],
)
def test_bad_response_format_is_a_400_naming_it(server_url, response_format, status, code):
    answer = httpx.post(
        f"{server_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "response_format": response_format},
    )
    assert answer.status_code == status
    assert answer.json()["error"]["code"] == code
    assert httpx.get(f"{server_url}/health").status_code == 200


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}


def _chat(server_url: str, response_format: dict[str, Any] | None = None, max_tokens: int = 40) -> httpx.Response:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Pick."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "thinking": False,
    }
    if response_format is not None:
        body["response_format"] = response_format
    return httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=120)


def _nested_objects(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("schema", "limit", "maximum"),
    [
        ({"anyOf": [{"const": f"value-{i}"} for i in range(20_000)]}, "max_schema_nodes", structured.MAX_SCHEMA_NODES),
        (_nested_objects(20), "max_schema_depth", structured.MAX_SCHEMA_DEPTH),
        ({"const": "x" * (structured.MAX_SCHEMA_BYTES + 1)}, "max_schema_bytes", structured.MAX_SCHEMA_BYTES),
    ],
    ids=["anyOf-20k", "deep", "bytes"],
)
def test_a_schema_over_a_limit_is_a_400_naming_the_limit(server_url, schema, limit, maximum):
    answer = _chat(server_url, _schema_format(schema))
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "schema_too_large"
    assert error["details"]["limit"] == limit and error["details"]["max"] == maximum
    assert f"{limit}={maximum}" in error["message"]
    assert _chat(server_url, max_tokens=2).status_code == 200  # nothing else was lost


class Held:
    """Holds every call of ``original`` until ``release`` is set; counts the calls that entered."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.release = threading.Event()
        self.entered = 0
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.entered += 1
        assert self.release.wait(60), "the test never released the held call"
        return self.original(*args, **kwargs)


def _unique_schema() -> dict[str, Any]:
    return {**SCHEMA, "description": uuid.uuid4().hex}  # never a grammar-cache hit


@pytest.mark.parametrize("stage", ["check", "compile"])
def test_the_server_answers_while_a_schema_is_checked_or_compiled(server_url, monkeypatch, stage):
    if stage == "check":
        held = Held(structured._checked_schema)
        monkeypatch.setattr(structured, "_checked_schema", held)
    else:
        held = Held(GrammarCompiler.compile)
        monkeypatch.setattr(GrammarCompiler, "compile", lambda compiler, fmt: held(compiler, fmt))
    schema = _unique_schema()
    with ThreadPoolExecutor(1) as pool:
        try:
            pending = pool.submit(_chat, server_url, _schema_format(schema))
            assert wait_until(lambda: held.entered == 1, timeout_s=60)
            health = httpx.get(f"{server_url}/health", timeout=30)
            plain = _chat(server_url, max_tokens=2)
            # Both answered while the schema request was still held in its check or compile.
            assert not pending.done()
        finally:
            held.release.set()
        answer = pending.result(timeout=120)
    assert health.status_code == 200 and health.json()["status"] == "healthy"
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 2
    assert answer.status_code == 200
    jsonschema.validate(json.loads(answer.json()["choices"][0]["message"]["content"]), schema)


def test_many_schemas_at_once_wait_for_each_other_not_for_other_requests(server_url, monkeypatch):
    held = Held(structured._checked_schema)
    monkeypatch.setattr(structured, "_checked_schema", held)
    count = structured.SCHEMA_WORKERS + 2
    with ThreadPoolExecutor(count) as pool:
        try:
            pending = [pool.submit(_chat, server_url, _schema_format(_unique_schema())) for _ in range(count)]
            assert wait_until(lambda: held.entered == structured.SCHEMA_WORKERS, timeout_s=60)
            plain = _chat(server_url, max_tokens=2)
            health = httpx.get(f"{server_url}/health", timeout=30)
            # Only the schema threads took any: the others wait for them, not the other requests.
            assert held.entered == structured.SCHEMA_WORKERS
            assert not any(p.done() for p in pending)
        finally:
            held.release.set()
        answers = [p.result(timeout=120) for p in pending]
    assert plain.status_code == 200 and health.status_code == 200
    assert [a.status_code for a in answers] == [200] * count
    assert held.entered == count


def test_a_cut_answer_is_a_422(server_url):
    answer = httpx.post(
        f"{server_url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "thinking": False,
            "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        },
    )
    assert answer.status_code == 422 and answer.json()["error"]["code"] == "structured_output_invalid"


def test_remote_client_against_our_server_is_constrained(server_url):
    with RemoteClient(server_url) as client:
        result = client.generate("Pick.", response_schema=SCHEMA, thinking=False, temperature=0, max_output_tokens=40)
    jsonschema.validate(result.parsed, SCHEMA)
    assert result.metadata["structured"]["mode"] == "constrained"

    async def main():
        async with AsyncRemoteClient(server_url) as client:
            return await client.generate(
                "Pick.", response_schema=SCHEMA, thinking=False, temperature=0, max_output_tokens=40
            )

    again = asyncio.run(main())
    assert again.parsed == result.parsed


def _completion(content: str) -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
    }


def test_prompted_fallback_retries_with_the_schema_and_the_error():
    # A server that ignores response_format and answers in prose first: no real model here
    # answers in JSON without a grammar, so the server is scripted.
    seen: list[dict[str, Any]] = []
    answers = ["Sure! The color is red.", '```json\n{"color": "green", "count": 3}\n```']

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=_completion(answers.pop(0)))

    with RemoteClient("http://server", model="m", transport=httpx.MockTransport(handler)) as client:
        result = client.generate("Pick.", response_schema=SCHEMA, max_output_tokens=40)
    assert result.parsed == {"color": "green", "count": 3}
    assert result.metadata["structured"] == {
        "mode": "prompted",
        "schema_hash": result.metadata["structured"]["schema_hash"],
        "name": "StructuredOutput",
        "attempts": 2,
    }
    assert seen[0]["response_format"]["json_schema"]["schema"] == SCHEMA
    retry_system = seen[1]["messages"][0]
    assert (
        retry_system["role"] == "system"
        and '"color"' in retry_system["content"]
        and "not JSON" in retry_system["content"]
    )


@pytest.mark.slow
def test_prompted_fallback_against_abstractcore_gives_up_after_the_retries(dense_model):
    pytest.importorskip("abstractcore.endpoint.app")
    from abstractcore import create_llm as core_create_llm
    from abstractcore.endpoint.app import create_app as core_create_app

    llm = core_create_llm("mlx", model=dense_model, mlx_batching=True)
    try:
        with (
            serve_in_thread(core_create_app(provider_instance=llm)) as url,
            RemoteClient(url, structured_retries=1) as client,
        ):
            with pytest.raises(StructuredOutputInvalid) as info:
                client.generate("Pick.", response_schema=SCHEMA, thinking=False, temperature=0, max_output_tokens=8)
    finally:
        llm.unload_model(llm.model)
    assert info.value.details["mode"] == "prompted" and info.value.details["attempts"] == 2
