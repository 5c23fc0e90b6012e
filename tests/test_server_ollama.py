"""Ollama's API (``/api/*``) with the official ``ollama`` client against the real server on
127.0.0.1: the tiny random-weight model for what a call gives (greedy identity with the chat
route, counts, NDJSON streams, options, keep-alive on the pool), the scripted provider for
images and tool calls."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import pytest

from abstractruntime_mlx.results import GenerationResult
from abstractruntime_mlx.server import ModelSpec, create_app
from test_server_harness import FakeProvider, png_bytes, serve_in_thread

KEY = "ollama-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PNG_B64 = base64.b64encode(png_bytes()).decode()


@pytest.fixture(scope="module")
def url(dense_model: str) -> Iterator[str]:
    """Serves the tiny model as ``tiny`` (loaded on first request, unloaded when told)."""
    app = create_app(
        api_key=KEY,
        stream_interval_ms=0,
        models=[ModelSpec("tiny", dense_model, {"speculation": False})],
        aliases={"tiny:latest": "tiny"},
    )
    with serve_in_thread(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> ollama.Client:
    return ollama.Client(host=url, headers=AUTH)


def _chat_route(url: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "thinking": False}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_chat_is_the_chat_routes_greedy_answer_with_counts(url: str, client: ollama.Client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    answer = client.chat(
        model="tiny:latest", messages=messages, stream=False, think=False, options={"temperature": 0, "num_predict": 5}
    )
    chat = _chat_route(url, messages, 5)
    assert answer.message.role == "assistant"
    assert answer.message.content == chat["choices"][0]["message"]["content"]
    assert answer.done is True
    assert answer.done_reason == {"length": "length", "stop": "stop"}[chat["choices"][0]["finish_reason"]]
    assert answer.eval_count == chat["usage"]["completion_tokens"]
    assert answer.prompt_eval_count == chat["usage"]["prompt_tokens"]
    assert answer.model == "tiny"
    for name in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(answer, name), int) and getattr(answer, name) >= 0, name
    assert answer.total_duration >= answer.load_duration  # type: ignore[operator]


def test_a_chat_stream_is_ndjson_adding_up_to_the_answer(url: str, client: ollama.Client) -> None:
    request: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Count"}],
        "think": False,
        "options": {"temperature": 0, "num_predict": 6},
    }
    whole = client.chat(**request, stream=False)
    parts = list(client.chat(**request, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason
    with httpx.stream("POST", f"{url}/api/chat", json=request, headers=AUTH, timeout=60) as raw:
        assert raw.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in raw.iter_lines() if line]
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])


def test_generate_is_one_user_turn_and_options_map(url: str, client: ollama.Client) -> None:
    answer = client.generate(
        model="tiny",
        prompt="Say hi",
        system="Be brief.",
        stream=False,
        think=False,
        options={"temperature": 0, "num_predict": 4, "seed": 7, "num_ctx": 2048},
    )
    chat = _chat_route(url, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}], 4)
    assert answer.response == chat["choices"][0]["message"]["content"]
    assert answer.eval_count == chat["usage"]["completion_tokens"] <= 4
    streamed = list(
        client.generate(
            model="tiny",
            prompt="Say hi",
            system="Be brief.",
            stream=True,
            think=False,
            options={"temperature": 0, "num_predict": 4},
        )
    )
    assert "".join(p.response for p in streamed) == answer.response
    free = client.generate(
        model="tiny", prompt="Go", stream=False, think=False, options={"temperature": 0, "num_predict": 12}
    ).response
    stop = free[2:4] if len(free) >= 4 else free[-1:]
    cut = client.generate(
        model="tiny",
        prompt="Go",
        stream=False,
        think=False,
        options={"temperature": 0, "num_predict": 12, "stop": [stop]},
    ).response
    assert cut == free[: free.index(stop)]


def test_format_json_gives_a_json_object(client: ollama.Client) -> None:
    answer = client.chat(
        model="tiny",
        messages=[{"role": "user", "content": "JSON please"}],
        stream=False,
        think=False,
        format="json",
        options={"num_predict": 40},
    )
    assert isinstance(json.loads(answer.message.content or ""), dict)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    answer = client.generate(
        model="tiny", prompt="Verdict?", stream=False, think=False, format=schema, options={"num_predict": 40}
    )
    assert isinstance(json.loads(answer.response)["ok"], bool)


def test_keep_alive_loads_lists_and_unloads_on_the_pool(client: ollama.Client) -> None:
    client.generate(model="tiny", keep_alive=0)  # unloaded
    assert client.ps().models == []
    loaded = client.generate(model="tiny", keep_alive="5m")
    assert loaded.done_reason == "load" and loaded.done
    (resident,) = client.ps().models
    assert resident.model == "tiny" and resident.expires_at is not None and resident.size and resident.size > 0
    client.chat(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        stream=False,
        keep_alive=-1,
        options={"num_predict": 1},
    )
    assert client.ps().models[0].expires_at is None  # no idle unload
    assert client.generate(model="tiny", keep_alive=0).done_reason == "unload"
    assert client.ps().models == []
    assert [m.model for m in client.list().models] == ["tiny"]


def test_a_stop_option_ends_the_answer_with_done_reason_stop(client: ollama.Client) -> None:
    messages = [{"role": "user", "content": "Go"}]
    options: dict[str, Any] = {"temperature": 0, "num_predict": 12}
    free = client.chat(model="tiny", messages=messages, stream=False, think=False, options=options)
    text = free.message.content or ""
    assert free.done_reason == "length" and len(text) >= 6, text
    stop = text[2:5]
    cut = client.chat(model="tiny", messages=messages, stream=False, think=False, options={**options, "stop": [stop]})
    assert cut.message.content == text[: text.index(stop)] and cut.done_reason == "stop"
    lines = list(
        client.chat(model="tiny", messages=messages, stream=True, think=False, options={**options, "stop": [stop]})
    )
    assert "".join(line.message.content or "" for line in lines) == cut.message.content
    assert [(line.done, line.done_reason) for line in lines][-1] == (True, "stop")
    generated = client.generate(
        model="tiny", prompt="Go", stream=False, think=False, options={**options, "stop": [stop]}
    )
    assert generated.response == cut.message.content and generated.done_reason == "stop"


def test_show_and_version(client: ollama.Client) -> None:
    shown = client.show("tiny:latest")
    assert shown.details is not None and shown.details.format == "mlx"
    assert shown.capabilities == ["completion"]
    assert isinstance(httpx.get(f"{client._client.base_url}/api/version", headers=AUTH).json()["version"], str)


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        (
            "/api/chat",
            {"model": "llama3:8b", "messages": [{"role": "user", "content": "hi"}], "stream": False},
            404,
            "model_not_found",
        ),
        ("/api/generate", {"model": "llama3:8b", "prompt": "hi", "stream": False}, 404, "model_not_found"),
        ("/api/show", {"model": "llama3:8b"}, 404, "model_not_found"),
        (
            "/api/chat",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi", "images": ["not base64!"]}]},
            400,
            "native_media_invalid",
        ),
        (
            "/api/chat",
            {
                "model": "tiny",
                "messages": [
                    {"role": "user", "content": "hi", "images": [base64.b64encode(b"plain text, no image").decode()]}
                ],
            },
            400,
            "native_media_invalid",
        ),
        (
            "/api/generate",
            {"model": "tiny", "prompt": "hi", "images": [PNG_B64[:-4] + "!!!!"]},
            400,
            "native_media_invalid",
        ),
        ("/api/chat", {"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_request"),
        ("/api/chat", {"model": "tiny", "messages": []}, 400, "invalid_request"),
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request"),
        (
            "/api/chat",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": {"temperature": "hot"}},
            400,
            "invalid_request",
        ),
        (
            "/api/chat",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "format": "yaml"},
            400,
            "invalid_request",
        ),
        (
            "/api/chat",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "keep_alive": "soon"},
            400,
            "invalid_request",
        ),
        ("/api/generate", {"model": "tiny", "prompt": "hi", "raw": True}, 400, "invalid_request"),
        ("/api/generate", {"model": "tiny", "prompt": "hi", "options": {"num_predict": 0}}, 400, "invalid_controls"),
    ],
    ids=[
        "chat-unknown-model",
        "generate-unknown-model",
        "show-unknown-model",
        "bad-base64",
        "not-an-image",
        "broken-png",
        "bad-role",
        "no-messages",
        "no-model",
        "bad-option",
        "bad-format",
        "bad-keep_alive",
        "raw",
        "num_predict-0",
    ],
)
def test_bad_requests_are_ollama_errors(url: str, path: str, body: dict[str, Any], status: int, code: str) -> None:
    answer = httpx.post(url + path, json=body, headers=AUTH, timeout=60)
    assert answer.status_code == status, answer.text
    payload = answer.json()
    assert isinstance(payload["error"], str) and payload["error"] and payload["code"] == code


def test_the_client_raises_response_errors(url: str, client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="llama3:8b", messages=[{"role": "user", "content": "hi"}], stream=False)
    assert missing.value.status_code == 404 and "llama3:8b" in missing.value.error
    with pytest.raises(ollama.ResponseError) as denied:
        ollama.Client(host=url).list()
    assert denied.value.status_code == 401 and "API key" in denied.value.error


# --------------------------------------------------------------------------- scripted provider


class ToolCallingProvider(FakeProvider):
    """Answers every non-streamed call with one parsed tool call, as the provider reports them;
    streams the text of that call in the model's format, in pieces."""

    def __init__(self) -> None:
        super().__init__(
            texts=(
                "Checking.",
                '<tool_call>\n{"name": "get_weather", "arguments"',
                ': {"city": "Paris"}}\n</tool',
                "_call>",
            )
        )

    async def agenerate_request(self, request: Any, *, stream: bool = False) -> Any:
        result = await super().agenerate_request(request, stream=stream)
        if stream:
            return result
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
        }
        return GenerationResult(
            content="", finish_reason="tool_calls", usage=result.usage, metadata=result.metadata, tool_calls=[call]
        )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture()
def fake_server() -> Iterator[tuple[ollama.Client, ToolCallingProvider]]:
    fake = ToolCallingProvider()
    with serve_in_thread(create_app(fake, stream_interval_ms=0)) as base:
        yield ollama.Client(host=base), fake


def test_tool_calls_and_history_reach_the_template(fake_server: tuple[ollama.Client, ToolCallingProvider]) -> None:
    client, fake = fake_server
    history: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        {"role": "user", "content": "And Rome?"},
    ]
    final = client.chat(model="fake-model", messages=history, tools=TOOLS, stream=False)
    assert final.done
    (call,) = final.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert fake.calls[-1]["stream"] is False
    sent = fake.calls[-1]
    assert sent["tools"] == TOOLS
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "tool", "user"]
    assert sent["messages"][1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert sent["messages"][2]["name"] == "get_weather"


def test_images_reach_the_provider_as_bytes(fake_server: tuple[ollama.Client, ToolCallingProvider]) -> None:
    client, fake = fake_server
    client.chat(
        model="fake-model", messages=[{"role": "user", "content": "What is it?", "images": [PNG_B64]}], stream=False
    )
    assert fake.calls[-1]["media"] == [png_bytes()]
    assert fake.calls[-1]["messages"][-1] == {"role": "user", "content": "What is it?"}
    client.generate(model="fake-model", prompt="And this?", images=[png_bytes()], stream=False)
    assert fake.calls[-1]["media"] == [png_bytes()]


def test_a_chat_stream_with_tools_sends_the_call_on_the_line_where_it_completes(
    fake_server: tuple[ollama.Client, ToolCallingProvider],
) -> None:
    client, fake = fake_server
    lines = list(
        client.chat(model="fake-model", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, stream=True)
    )
    assert fake.calls[-1]["stream"] is True  # streamed as it is generated, the call read from the text
    assert [line.done for line in lines] == [False, False, True]
    text, called, done = lines
    assert text.message.content == "Checking." and not text.message.tool_calls
    (call,) = called.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert called.message.content == "" and "tool_call" not in "".join(line.message.content or "" for line in lines)
    assert done.message.content == "" and not done.message.tool_calls and done.eval_count == 4
