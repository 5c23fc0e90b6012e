"""Anthropic and Ollama streams against their non-streamed answers, with the official ``anthropic``
and ``ollama`` clients, the tiny random-weight model behind the real server: the same greedy
request gives the same blocks (thinking, text, forced tool calls) whether streamed or not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import ollama
import pytest

from abstractruntime_mlx.server import create_app
from test_server_harness import serve_in_thread

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER},
    {"name": "get_time", "description": "Time in a zone", "input_schema": TIME},
]
USER: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base_url(dense_model: str) -> Iterator[str]:
    from abstractruntime_mlx import create_llm

    llm = create_llm("mlx", model=dense_model, mlx_batching=True, speculation=False)
    try:
        with serve_in_thread(create_app(llm, stream_interval_ms=0, aliases={"tiny": llm.model})) as url:
            yield url
    finally:
        llm.unload_model()


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0)


def _blocks(message: anthropic.types.Message) -> list[dict[str, Any]]:
    """The message's blocks; tool_use ids are per answer, so only their shape is kept."""
    out = []
    for block in message.content:
        dumped = block.model_dump(exclude_none=True)
        if dumped["type"] == "tool_use":
            assert dumped.pop("id").startswith("call_")
        out.append(dumped)
    return out


def _check_event_order(events: list[Any]) -> None:
    """Blocks open at consecutive indices, each started, given deltas, stopped, one at a time."""
    open_index: int | None = None
    num_started = 0
    for event in events:
        if event.type == "content_block_start":
            assert open_index is None and event.index == num_started
            open_index, num_started = event.index, num_started + 1
        elif event.type == "content_block_delta":
            assert event.index == open_index
        elif event.type == "content_block_stop":
            assert event.index == open_index
            open_index = None
    assert open_index is None


CASES: list[tuple[str, dict[str, Any], list[str], str]] = [
    ("plain", {"thinking": {"type": "disabled"}}, ["text"], "max_tokens"),
    ("thinking-cut-off", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, ["thinking", "text"], "max_tokens"),
    ("tools-auto", {"thinking": {"type": "disabled"}, "tools": TOOLS}, ["text"], "max_tokens"),
    (
        "any",
        {"thinking": {"type": "disabled"}, "tools": TOOLS, "tool_choice": {"type": "any"}},
        ["tool_use"],
        "tool_use",
    ),
    (
        "thinking-then-named-tool",
        {
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "get_weather"},
        },
        ["thinking", "tool_use"],
        "tool_use",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("fields", "kinds", "stop"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_an_anthropic_stream_adds_up_to_the_same_blocks(
    claude: anthropic.Anthropic, fields: dict[str, Any], kinds: list[str], stop: str
) -> None:
    request: dict[str, Any] = {"model": "tiny", "max_tokens": 100, "temperature": 0, "messages": USER, **fields}
    whole = claude.messages.create(**request)
    with claude.messages.stream(**request) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert [b.type for b in whole.content] == kinds
    assert whole.stop_reason == stop and streamed.stop_reason == stop
    assert _blocks(streamed) == _blocks(whole)
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    _check_event_order(events)
    for block in whole.content:
        if block.type == "tool_use":
            jsonschema.validate(block.input, WEATHER if block.name == "get_weather" else TIME)
            if "tool" in str(fields.get("tool_choice")):
                assert block.name == "get_weather"
        if block.type == "thinking":
            assert block.thinking and "think>" not in block.thinking
    # A tool_use block goes out whole: one input_json_delta holding all of its input.
    tool_deltas = [
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert [json.loads(d) for d in tool_deltas] == [b["input"] for b in _blocks(whole) if b["type"] == "tool_use"]


@pytest.fixture(scope="module")
def llama(base_url: str) -> ollama.Client:
    return ollama.Client(host=base_url)


OLLAMA_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}} for t in TOOLS
]


@pytest.mark.parametrize("think", [False, True], ids=["think-off", "think-on"])
@pytest.mark.parametrize("tools", [None, OLLAMA_TOOLS], ids=["no-tools", "tools"])
def test_an_ollama_chat_stream_adds_up_to_the_answer(
    llama: ollama.Client, dense_model: str, think: bool, tools: Any
) -> None:
    request: dict[str, Any] = {
        "model": dense_model,
        "messages": USER,
        "think": think,
        "tools": tools,
        "options": {"num_predict": 24, "temperature": 0},
    }
    whole = llama.chat(stream=False, **request)
    lines = list(llama.chat(stream=True, **request))
    assert [line.done for line in lines] == [False] * (len(lines) - 1) + [True]
    content = "".join(line.message.content or "" for line in lines)
    thinking = "".join(line.message.thinking or "" for line in lines)
    assert content == whole.message.content
    assert thinking.strip() == (whole.message.thinking or "")
    # The tiny model's prompt opens the think block and its answer never closes it: all thinking.
    assert bool(thinking) is think and bool(content) is not think
    assert lines[-1].eval_count == whole.eval_count == 24
