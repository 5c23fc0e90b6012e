"""Tool calls and reasoning over HTTP, with the tiny random-weight model behind the real server
and the official ``openai`` SDK: ``tool_choice`` forced by the grammar gives a valid call even
from random weights; streams carry ``delta.tool_calls`` and ``delta.reasoning_content``, per
answer when ``n`` asks for several, with the logprobs of every token and each answer's
``stop_reason``; the Responses API takes function tools with the logprobs ``include``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI

from abstractruntime_mlx.server import create_app
from test_server_harness import serve_in_thread

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}},
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CHOICE = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server_url(dense_model):
    from abstractruntime_mlx import create_llm

    llm = create_llm("mlx", model=dense_model, mlx_batching=True, speculation=False)
    with serve_in_thread(create_app(llm)) as url:
        yield url
    llm.unload_model()


@pytest.fixture()
def client(server_url):
    return OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0)


def _stream_calls(chunks: list[Any]) -> tuple[dict[int, dict[str, str]], str, str, list[str]]:
    """The calls a stream sent (accumulated per index as OpenAI clients do), its content,
    reasoning and finish reasons."""
    calls: dict[int, dict[str, str]] = {}
    content, reasoning, finishes = [], [], []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content.append(delta.content or "")
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        for call in delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            if call.id:
                slot["id"] = call.id
            if call.function and call.function.name:
                slot["name"] = call.function.name
            if call.function and call.function.arguments:
                slot["arguments"] += call.function.arguments
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    return calls, "".join(content), "".join(reasoning), finishes


def test_a_named_tool_choice_gives_a_valid_call_even_from_random_weights(client, dense_model):
    completion = client.chat.completions.create(
        model=dense_model,
        messages=USER,
        tools=TOOLS,
        tool_choice=WEATHER_CHOICE,
        max_tokens=60,
        temperature=0,
        extra_body={"thinking": False},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert not choice.message.content
    structured = completion.model_extra["abstractcore"]["structured"]
    assert structured["mode"] == "tool_call" and structured["format"] == "hermes" and structured["complete"] is True


def test_required_calls_one_of_the_tools_and_a_stream_sends_the_same_call(client, dense_model):
    kwargs: dict[str, Any] = dict(
        model=dense_model,
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=60,
        temperature=0,
        extra_body={"thinking": False},
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    (call,) = whole.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER if call.function.name == "get_weather" else TIME)

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    calls, content, _, finishes = _stream_calls(chunks)
    assert finishes == ["tool_calls"]
    assert list(calls) == [0]
    assert calls[0]["id"].startswith("call_")
    # The same greedy tokens: the same call, and none of its text in delta.content.
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == (
        call.function.name,
        json.loads(call.function.arguments),
    )
    assert "tool_call" not in content and content.strip() == ""


def test_thinking_then_a_forced_call_separates_reasoning_whole_and_streamed(client, dense_model):
    kwargs: dict[str, Any] = dict(
        model=dense_model,
        messages=USER,
        tools=TOOLS,
        tool_choice=WEATHER_CHOICE,
        max_tokens=120,
        temperature=0,
        extra_body={"thinking": True},
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    # The prompt opens the think block; the grammar closes it at half the budget, then forces the call.
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and whole.message.model_extra["reasoning"] == reasoning
    assert "</think>" not in reasoning and "tool_call" not in reasoning
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls[0].function.name == "get_weather"

    calls, content, streamed_reasoning, finishes = _stream_calls(
        list(client.chat.completions.create(stream=True, **kwargs))
    )
    assert streamed_reasoning.strip() == reasoning
    assert calls[0]["arguments"] == whole.message.tool_calls[0].function.arguments
    assert "think" not in content and finishes == ["tool_calls"]


def test_tool_choice_none_offers_no_tools_and_reads_no_calls(server_url, dense_model):
    offered = httpx.post(
        f"{server_url}/v1/chat/completions",
        json={
            "messages": USER,
            "tools": TOOLS,
            "tool_choice": "none",
            "max_tokens": 8,
            "temperature": 0,
            "thinking": False,
        },
        timeout=60,
    ).json()
    bare = httpx.post(
        f"{server_url}/v1/chat/completions",
        json={"messages": USER, "max_tokens": 8, "temperature": 0, "thinking": False},
        timeout=60,
    ).json()
    # No tools reach the template: the same prompt, so the same greedy answer as without tools.
    assert offered["choices"][0]["message"] == bare["choices"][0]["message"]
    assert offered["usage"]["prompt_tokens"] == bare["usage"]["prompt_tokens"]
    assert offered["choices"][0]["finish_reason"] == "length" and "tool_calls" not in offered["choices"][0]["message"]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}},
            "tool_choice.function.name",
        ),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"parameters": WEATHER}}]}, "tools.0.function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
        ({"tools": "get_weather"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tools_and_tool_choice_are_a_typed_400(server_url, fields, field):
    answer = httpx.post(
        f"{server_url}/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **fields}, timeout=30
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "invalid_tools" and error["details"]["field"] == field


def test_parameters_that_cannot_compile_are_a_typed_400(server_url):
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 5}}}},
        }
    ]
    answer = httpx.post(
        f"{server_url}/v1/chat/completions",
        json={"messages": USER, "tools": tools, "tool_choice": "required", "max_tokens": 4},
        timeout=30,
    )
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_tools"


# --------------------------------------------------------------------------- /v1/responses

RESPONSES_TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "description": "Time in a zone", "parameters": TIME},
]


def test_responses_function_call_whole_and_streamed(client, dense_model):
    kwargs: dict[str, Any] = dict(
        model=dense_model,
        input="What is the weather in Paris?",
        tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
        extra_body={"thinking": False},
    )
    response = client.responses.create(**kwargs)
    assert response.status == "completed"
    (item,) = response.output
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), WEATHER)
    assert [t.name for t in response.tools] == ["get_weather", "get_time"]

    kinds: list[str] = []
    arguments: list[str] = []
    final = None
    with client.responses.create(stream=True, **kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                arguments.append(event.delta)
            if event.type == "response.completed":
                final = event.response
    assert "response.output_text.delta" not in kinds
    assert kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    assert "".join(arguments) == item.arguments  # the same greedy call
    assert final is not None and [o.type for o in final.output] == ["function_call"]
    assert final.output[0].arguments == item.arguments


def test_responses_carry_earlier_calls_and_their_results(client, dense_model, server_url):
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris", "unit": "celsius"}',
    }
    result = {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21"}
    asked = {"role": "user", "content": "What is the weather in Paris?"}
    with_results = client.responses.create(
        model=dense_model,
        input=[asked, call, result],
        tools=RESPONSES_TOOLS,
        max_output_tokens=4,
        temperature=0,
        extra_body={"thinking": False},
    )
    # The same conversation on the chat route: the same prompt, token for token.
    chat = httpx.post(
        f"{server_url}/v1/chat/completions",
        json={
            "messages": [
                asked,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": call["name"], "arguments": call["arguments"]},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
            ],
            "tools": TOOLS,
            "max_tokens": 4,
            "temperature": 0,
            "thinking": False,
        },
        timeout=60,
    ).json()
    assert with_results.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert with_results.output_text == chat["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
        (
            {"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "launch"}},
            "tool_choice.function.name",
        ),
    ],
)
def test_responses_bad_tools_are_a_typed_400(server_url, fields, field):
    answer = httpx.post(f"{server_url}/v1/responses", json={"input": "x", "max_output_tokens": 4, **fields}, timeout=30)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "invalid_tools" and answer.json()["error"]["details"]["field"] == field


# --------------------------------------------------------------------------- with n and logprobs


def _per_answer(chunks: list[Any]) -> dict[int, list[Any]]:
    """A stream's chunks split by their answer's index (each answer read as a stream of its own)."""
    out: dict[int, list[Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            out.setdefault(choice.index, []).append(
                type(chunk)(**{**chunk.model_dump(), "choices": [choice.model_dump()]})
            )
    return out


def test_each_streamed_answer_has_its_own_reasoning_calls_and_logprobs(client, dense_model):
    kwargs: dict[str, Any] = dict(
        model=dense_model,
        messages=USER,
        tools=TOOLS,
        tool_choice=WEATHER_CHOICE,
        max_tokens=120,
        temperature=0,
        n=2,
        logprobs=True,
        extra_body={"thinking": True},
    )
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    answers = _per_answer(chunks)
    assert sorted(answers) == [0, 1]
    for index, pieces in answers.items():
        choice = whole.choices[index]
        calls, content, reasoning, finishes = _stream_calls(pieces)
        assert finishes == ["tool_calls"] and choice.finish_reason == "tool_calls"
        assert reasoning.strip() == choice.message.model_extra["reasoning_content"]
        assert list(calls) == [0] and calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments
        assert "tool_call" not in content and "think" not in content
        streamed = [
            e.token for p in pieces for c in p.choices if c.logprobs is not None for e in c.logprobs.content or []
        ]
        # Every token's entry reaches the stream (thinking and call text included), in order.
        assert streamed == [e.token for e in choice.logprobs.content]
    assert whole.usage.completion_tokens == sum(len(c.logprobs.content) for c in whole.choices)


def test_a_finished_choice_carries_its_logprobs_and_stop_reason(client, dense_model):
    kwargs: dict[str, Any] = dict(
        model=dense_model, messages=USER, max_tokens=12, temperature=0, extra_body={"thinking": False}
    )
    text = client.chat.completions.create(**kwargs).choices[0].message.content or ""
    stop = text[2:5]
    cut = client.chat.completions.create(stop=[stop], logprobs=True, n=2, **kwargs)
    for choice in cut.choices:
        assert choice.finish_reason == "stop" and (choice.model_extra or {})["stop_reason"] == stop
        assert choice.message.content == text[: text.index(stop)]
        # The tokens that made the stop string are listed, though the text ends before it.
        assert "".join(e.token for e in choice.logprobs.content).startswith(choice.message.content + stop)
    chunks = list(client.chat.completions.create(stop=[stop], logprobs=True, n=2, stream=True, **kwargs))
    ends = sorted(
        (c.index, c.finish_reason, (c.model_extra or {}).get("stop_reason"))
        for k in chunks
        for c in k.choices
        if c.finish_reason
    )
    # Each answer's own terminal chunk names what ended it, the one that ends first too.
    assert ends == [(0, "stop", stop), (1, "stop", stop)]


def test_responses_take_function_tools_and_include_logprobs_together(client, dense_model):
    asked: dict[str, Any] = dict(
        model=dense_model,
        input="What is the weather in Paris?",
        tools=RESPONSES_TOOLS,
        max_output_tokens=6,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        extra_body={"thinking": False},
    )
    answer = client.responses.create(**asked)
    assert [t.name for t in answer.tools] == ["get_weather", "get_time"]
    (message,) = [o for o in answer.output if o.type == "message"]
    part = message.content[0]
    assert "".join(e.token for e in part.logprobs) == part.text and len(part.logprobs) == answer.usage.output_tokens
    assert all(len(e.top_logprobs) == 2 for e in part.logprobs)
    deltas: list[str] = []
    with client.responses.create(stream=True, **asked) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.extend(e.token for e in event.logprobs)
    assert deltas == [e.token for e in part.logprobs]
    forced = client.responses.create(
        **{**asked, "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 60}
    )
    assert [o.type for o in forced.output] == ["function_call"] and forced.output[0].name == "get_weather"
