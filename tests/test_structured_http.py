"""Structured output over HTTP: ``response_format`` at our server, the remote client against it
(constrained) and against servers that do not constrain (prompted, validated, retried), and a
flow whose next node reads a field of the structured answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI
from test_server_harness import serve_in_thread

from abstractruntime_mlx.errors import StructuredOutputInvalid
from abstractruntime_mlx.remote_client import AsyncRemoteClient, RemoteClient
from abstractruntime_mlx.server import create_app

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
        json={"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "max_tokens": 40, "thinking": False},
    ).json()
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize(
    ("response_format", "status", "code"),
    [
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": 5}}}}}, 400, "invalid_response_schema"),
        ({"type": "yaml"}, 400, "invalid_request"),
        ("json", 400, "invalid_request"),
    ],
)
def test_bad_response_format_is_a_400_naming_it(server_url, response_format, status, code):
    answer = httpx.post(f"{server_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "response_format": response_format})
    assert answer.status_code == status
    assert answer.json()["error"]["code"] == code
    assert httpx.get(f"{server_url}/health").status_code == 200


def test_a_cut_answer_is_a_422(server_url):
    answer = httpx.post(
        f"{server_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "thinking": False, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
    )
    assert answer.status_code == 422 and answer.json()["error"]["code"] == "structured_output_invalid"


def test_remote_client_against_our_server_is_constrained(server_url):
    with RemoteClient(server_url) as client:
        result = client.generate("Pick.", response_schema=SCHEMA, thinking=False, temperature=0, max_output_tokens=40)
    jsonschema.validate(result.parsed, SCHEMA)
    assert result.metadata["structured"]["mode"] == "constrained"

    async def main():
        async with AsyncRemoteClient(server_url) as client:
            return await client.generate("Pick.", response_schema=SCHEMA, thinking=False, temperature=0, max_output_tokens=40)

    again = asyncio.run(main())
    assert again.parsed == result.parsed


def _completion(content: str) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}


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
    assert result.metadata["structured"] == {"mode": "prompted", "schema_hash": result.metadata["structured"]["schema_hash"], "name": "StructuredOutput", "attempts": 2}
    assert seen[0]["response_format"]["json_schema"]["schema"] == SCHEMA
    retry_system = seen[1]["messages"][0]
    assert retry_system["role"] == "system" and '"color"' in retry_system["content"] and "not JSON" in retry_system["content"]


def test_prompted_fallback_against_abstractcore_gives_up_after_the_retries(dense_model):
    pytest.importorskip("abstractcore.endpoint.app")
    from abstractcore import create_llm as core_create_llm
    from abstractcore.endpoint.app import create_app as core_create_app

    llm = core_create_llm("mlx", model=dense_model, mlx_batching=True)
    try:
        with serve_in_thread(core_create_app(provider_instance=llm)) as url, RemoteClient(url, structured_retries=1) as client:
            with pytest.raises(StructuredOutputInvalid) as info:
                client.generate("Pick.", response_schema=SCHEMA, thinking=False, temperature=0, max_output_tokens=8)
    finally:
        llm.unload_model(llm.model)
    assert info.value.details["mode"] == "prompted" and info.value.details["attempts"] == 2
