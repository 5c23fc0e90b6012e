"""``POST /v1/messages`` (Anthropic's Messages API) with the official ``anthropic`` client against
the real server on 127.0.0.1: the tiny random-weight model for what a call gives (greedy
identity with the chat route, usage, the prefix cache, streams), the scripted provider for
what the model cannot be made to do (tool calls, a failure after the first byte)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from abstractruntime_mlx.errors import UpstreamError
from abstractruntime_mlx.results import GenerationResult
from abstractruntime_mlx.server import create_app
from test_server_call_path import sse_records
from test_server_harness import FakeProvider, png_bytes, serve_in_thread

KEY = "sk-test-key"
PNG_B64 = base64.b64encode(png_bytes()).decode()
TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "The weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


@pytest.fixture(scope="module")
def url(dense_model: str) -> Iterator[str]:
    from abstractruntime_mlx import create_llm

    llm = create_llm("mlx", model=dense_model, mlx_batching=True, speculation=False)
    try:
        with serve_in_thread(
            create_app(llm, api_key=KEY, stream_interval_ms=0, aliases={"claude-tiny": llm.model})
        ) as base:
            yield base
    finally:
        llm.unload_model()


@pytest.fixture(scope="module")
def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)


def _chat_text(url: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "thinking": False}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_a_message_is_the_chat_routes_greedy_answer(url: str, client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="claude-tiny",
        max_tokens=6,
        temperature=0,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}],
        thinking={"type": "disabled"},
    )
    chat = _chat_text(url, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}], 6)
    assert message.type == "message" and message.role == "assistant"
    assert message.model == "claude-tiny" or message.model == chat["model"]
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat["choices"][0]["message"]["content"]  # type: ignore[union-attr]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
    cached = message.usage.cache_read_input_tokens or 0
    assert message.usage.input_tokens + cached == chat["usage"]["prompt_tokens"]


def test_the_prefix_cache_shows_as_cache_read_tokens(client: anthropic.Anthropic) -> None:
    conversation: list[Any] = [{"role": "user", "content": "Tell me a long story about a tiny model " * 8}]
    keyed: dict[str, Any] = {"prompt_cache_key": "story"}  # this server's control, through the SDK's extra_body
    first = client.messages.create(
        model="claude-tiny", max_tokens=2, temperature=0, messages=conversation, extra_body=keyed
    )
    again = client.messages.create(
        model="claude-tiny", max_tokens=2, temperature=0, messages=conversation, extra_body=keyed
    )
    total = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert (again.usage.cache_read_input_tokens or 0) > 0
    assert again.usage.input_tokens + (again.usage.cache_read_input_tokens or 0) == total
    assert again.usage.input_tokens < total


def test_a_stream_adds_up_to_the_non_streamed_message(client: anthropic.Anthropic) -> None:
    request: dict[str, Any] = {
        "model": "claude-tiny",
        "max_tokens": 5,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Count to three"}],
        "thinking": {"type": "disabled"},
    }
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 5
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == whole.usage.input_tokens + (
        whole.usage.cache_read_input_tokens or 0
    )


def test_stop_sequences_end_the_answer(client: anthropic.Anthropic) -> None:
    request: dict[str, Any] = {
        "model": "claude-tiny",
        "max_tokens": 12,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Go"}],
        "thinking": {"type": "disabled"},
    }
    free = client.messages.create(**request).content[0].text  # type: ignore[union-attr]
    stop = free[2:4] if len(free) >= 4 else free[-1:]
    assert stop
    cut = client.messages.create(**request, stop_sequences=["\x00never", stop])
    assert cut.content[0].text == free[: free.index(stop)]  # type: ignore[union-attr]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    with client.messages.stream(**request, stop_sequences=[stop]) as stream:
        deltas = [event for event in stream if event.type == "message_delta"]
        streamed = stream.get_final_message()
    assert [(d.delta.stop_reason, d.delta.stop_sequence) for d in deltas] == [("stop_sequence", stop)]
    assert streamed.content[0].text == cut.content[0].text  # type: ignore[union-attr]
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop
    capped = client.messages.create(**{**request, "max_tokens": 1}, stop_sequences=["\x00never"])
    assert capped.stop_reason == "max_tokens" and capped.stop_sequence is None


@pytest.mark.parametrize(
    ("body", "status", "code", "error_type"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request", "invalid_request_error"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video", "data": "x"}]}]},
            400,
            "invalid_request",
            "invalid_request_error",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
            },
            400,
            "invalid_request",
            "invalid_request_error",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            400,
            "invalid_request",
            "invalid_request_error",
        ),
        (
            {"max_tokens": 4, "model": "claude-opus-4", "messages": [{"role": "user", "content": "hi"}]},
            404,
            "model_not_found",
            "not_found_error",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "not base64!"},
                            }
                        ],
                    }
                ],
            },
            400,
            "native_media_invalid",
            "invalid_request_error",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": PNG_B64}}
                        ],
                    }
                ],
            },
            400,
            "native_media_invalid",
            "invalid_request_error",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}],
                    }
                ],
            },
            400,
            "native_media_invalid",
            "invalid_request_error",
        ),
        (
            {"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
            400,
            "invalid_controls",
            "invalid_request_error",
        ),
        (
            {"max_tokens": 4, "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "hi"}]},
            400,
            "invalid_tools",
            "invalid_request_error",
        ),
        (
            {
                "max_tokens": 4,
                "tools": TOOLS,
                "tool_choice": {"type": "tool", "name": "get_time"},
                "messages": [{"role": "user", "content": "hi"}],
            },
            400,
            "invalid_tools",
            "invalid_request_error",
        ),
        (
            {
                "max_tokens": 4,
                "tools": TOOLS,
                "tool_choice": {"type": "tool"},
                "messages": [{"role": "user", "content": "hi"}],
            },
            400,
            "invalid_request",
            "invalid_request_error",
        ),
        (
            {
                "max_tokens": 4,
                "tools": TOOLS,
                "tool_choice": {"type": "sometimes"},
                "messages": [{"role": "user", "content": "hi"}],
            },
            400,
            "invalid_request",
            "invalid_request_error",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]},
            400,
            "invalid_request",
            "invalid_request_error",
        ),
    ],
    ids=[
        "no-max_tokens",
        "unknown-block",
        "tool_use-in-user",
        "text-without-text",
        "unknown-model",
        "bad-base64",
        "wrong-image-type",
        "url-image",
        "max_tokens-0",
        "tool_choice-any-without-tools",
        "tool_choice-unknown-tool",
        "tool_choice-tool-without-name",
        "tool_choice-unknown-type",
        "system-role",
    ],
)
def test_bad_requests_are_anthropic_errors(
    url: str, body: dict[str, Any], status: int, code: str, error_type: str
) -> None:
    answer = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert answer.status_code == status, answer.text
    payload = answer.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == error_type and payload["error"]["code"] == code
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]


def test_the_client_raises_typed_errors(url: str, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model="claude-tiny",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}],
        )  # type: ignore[list-item]
    wrong = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model="claude-tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0)
    assert (
        bearer.messages.create(
            model="claude-tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
        ).usage.output_tokens
        == 1
    )


# --------------------------------------------------------------------------- scripted provider


CALL_TEXTS = ("Checking.", '<tool_call>\n{"name": "get_weather", "arguments"', ': {"city": "Paris"}}\n</tool', "_call>")


class ToolCallingProvider(FakeProvider):
    """Answers every non-streamed call with one parsed tool call, as the provider reports them;
    streams the text of that call in the model's format, in pieces."""

    def __init__(self) -> None:
        super().__init__(texts=CALL_TEXTS)

    async def agenerate_request(self, request: Any, *, stream: bool = False) -> Any:
        result = await super().agenerate_request(request, stream=stream)
        if stream:
            return result
        assert isinstance(result, GenerationResult)
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
        }
        return GenerationResult(
            content="", finish_reason="tool_calls", usage=result.usage, metadata=result.metadata, tool_calls=[call]
        )


@pytest.fixture()
def tool_server() -> Iterator[tuple[anthropic.Anthropic, ToolCallingProvider]]:
    fake = ToolCallingProvider()
    with serve_in_thread(create_app(fake, stream_interval_ms=0)) as base:
        yield anthropic.Anthropic(base_url=base, api_key="none", max_retries=0), fake


def test_tool_calls_are_tool_use_blocks_and_history_reaches_the_template(
    tool_server: tuple[anthropic.Anthropic, ToolCallingProvider],
) -> None:
    client, fake = tool_server
    history: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And Rome?"},
            ],
        },
    ]
    message = client.messages.create(
        model="fake-model", max_tokens=8, tools=TOOLS, messages=history, system="Use tools."
    )
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["tool_use"]
    block = message.content[0]
    assert (
        block.type == "tool_use"
        and block.name == "get_weather"
        and block.input == {"city": "Paris"}
        and block.id == "call_1"
    )
    call = fake.calls[-1]
    assert call["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather of a city",
                "parameters": TOOLS[0]["input_schema"],
            },
        }
    ]
    assert [m["role"] for m in call["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assistant, tool, user = call["messages"][2:]
    assert assistant["content"] == "Checking."
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert tool == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert user["content"] == "And Rome?"


def test_a_stream_with_tools_streams_the_text_then_the_tool_use_block(
    tool_server: tuple[anthropic.Anthropic, ToolCallingProvider],
) -> None:
    client, fake = tool_server
    with client.messages.stream(
        model="fake-model", max_tokens=8, tools=TOOLS, messages=[{"role": "user", "content": "Weather?"}]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert fake.calls[-1]["stream"] is True  # streamed as it is generated, the call read from the text
    kinds = [(e.type, getattr(e, "index", None)) for e in events if e.type.startswith(("message", "content_block"))]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]
    tool_start = next(e for e in events if e.type == "content_block_start" and e.index == 1)
    assert tool_start.content_block.type == "tool_use" and tool_start.content_block.name == "get_weather"  # type: ignore[union-attr]
    assert tool_start.content_block.id.startswith("call_")  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Checking."  # type: ignore[union-attr]
    assert final.content[1].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert final.usage.output_tokens == 4 and final.usage.cache_read_input_tokens == 2 and final.usage.input_tokens == 3


def test_tool_choice_none_offers_no_tools(tool_server: tuple[anthropic.Anthropic, ToolCallingProvider]) -> None:
    client, fake = tool_server
    client.messages.create(
        model="fake-model",
        max_tokens=4,
        tools=TOOLS,
        tool_choice={"type": "none"},
        messages=[{"role": "user", "content": "hi"}],
    )
    assert "tools" not in fake.calls[-1]


def test_an_image_block_reaches_the_provider_as_bytes(
    tool_server: tuple[anthropic.Anthropic, ToolCallingProvider],
) -> None:
    client, fake = tool_server
    image: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}
    client.messages.create(
        model="fake-model",
        max_tokens=4,
        messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}],
    )
    assert fake.calls[-1]["media"] == [png_bytes()]
    assert fake.calls[-1]["messages"][-1] == {"role": "user", "content": "What is it?"}


def test_a_failure_after_the_first_byte_is_an_error_event() -> None:
    fake = FakeProvider(texts=("Hel", "lo", "!"), error=UpstreamError("the step failed"), fail_after=1)
    with serve_in_thread(create_app(fake, stream_interval_ms=0)) as base:
        answer = httpx.post(
            f"{base}/v1/messages",
            json={"max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
    assert answer.status_code == 200
    records = sse_records(answer.text)
    names = [name for name, _ in records]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-1] == "error"
    error = json.loads(records[-1][1])
    assert (
        error["type"] == "error"
        and error["error"]["code"] == "upstream_error"
        and error["error"]["type"] == "api_error"
    )
    deltas = [json.loads(data)["delta"]["text"] for name, data in records if name == "content_block_delta"]
    assert "".join(deltas) == "Hel"


# --------------------------------------------------------------------------- count_tokens


def test_count_tokens_is_the_prompt_a_real_call_reports(url: str, client: anthropic.Anthropic) -> None:
    conversations: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": "Say hi"}]},
        {
            "system": [{"type": "text", "text": "Use tools."}],
            "tools": TOOLS,
            "thinking": {"type": "disabled"},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
            ],
        },
    ]
    counts = []
    for conversation in conversations:
        counted = client.messages.count_tokens(model="claude-tiny", **conversation)
        message = client.messages.create(model="claude-tiny", max_tokens=1, temperature=0, **conversation)
        assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
        counts.append(counted.input_tokens)
    assert counts[1] > counts[0] > 0
    without_tools = {k: v for k, v in conversations[1].items() if k != "tools"}
    assert client.messages.count_tokens(model="claude-tiny", **without_tools).input_tokens < counts[1]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "claude-tiny", "messages": []}, 400, "invalid_request"),
        ({"model": "claude-opus-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found"),
        (
            {
                "model": "claude-tiny",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}
                        ],
                    }
                ],
            },
            400,
            "native_media_invalid",
        ),
        (
            {"model": "claude-tiny", "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "hi"}]},
            400,
            "invalid_tools",
        ),
    ],
    ids=["no-messages", "unknown-model", "image", "tool_choice-any"],
)
def test_count_tokens_refuses_in_anthropics_shape(url: str, body: dict[str, Any], status: int, code: str) -> None:
    answer = httpx.post(f"{url}/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert answer.status_code == status, answer.text
    payload = answer.json()
    assert payload["type"] == "error" and payload["error"]["code"] == code


def test_count_tokens_on_a_provider_that_cannot_count_is_a_typed_error(
    tool_server: tuple[anthropic.Anthropic, ToolCallingProvider],
) -> None:
    client, fake = tool_server
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.count_tokens(model="fake-model", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["error"]["code"] == "token_count_unsupported"  # type: ignore[index]
    assert fake.calls == []  # nothing was generated
