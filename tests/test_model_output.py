"""Reading reasoning and tool calls out of model text (``model_output``), whole and streamed.

The strings are answers real models wrote for "What is the weather in Paris?" with a
``get_weather(city)`` tool offered (decoded with their markup tokens kept)."""

from __future__ import annotations

import json
import random

import pytest

from abstractruntime_mlx.model_output import (
    ContentPiece,
    OutputSplitter,
    ReasoningPiece,
    ToolCallPiece,
    parse_output,
    parse_tool_calls,
    split_reasoning,
    tool_format_of,
)
from abstractruntime_mlx.testing.chat_template import CHAT_TEMPLATE

QWEN3 = (
    "<think>\nThe user wants the current weather in Paris. I have a get_weather tool that takes a city. "
    'I\'ll call it.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
QWEN3_TWO = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}\n</tool_call>'
)
HERMES_2_PRO = '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>'
LLAMA_31_TAG = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>'
LLAMA_32_BARE = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TWO = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
)
MISTRAL_V3 = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
WITH_PREAMBLE = (
    'Let me check that for you.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.mark.parametrize(
    ("text", "names", "content"),
    [
        (QWEN3, ["get_weather"], ""),
        (QWEN3_TWO, ["get_weather", "get_weather"], ""),
        (HERMES_2_PRO, ["get_weather"], ""),
        (LLAMA_31_TAG, ["get_weather"], ""),
        (LLAMA_32_BARE, ["get_weather"], ""),
        (LLAMA_TWO, ["get_weather", "get_time"], ""),
        (MISTRAL_V3, ["get_weather"], ""),
        (MISTRAL_V11, ["get_weather"], ""),
        (WITH_PREAMBLE, ["get_weather"], "Let me check that for you."),
    ],
)
def test_each_format_parses_to_the_same_calls(text, names, content):
    parsed = parse_output(text, tools=True)
    assert [c.name for c in parsed.tool_calls] == names
    assert json.loads(parsed.tool_calls[0].arguments) == {"city": "Paris"}
    assert parsed.content == content
    wire = parsed.tool_calls[0].to_openai()
    assert wire["type"] == "function" and str(wire["id"]).startswith("call_")


def test_reasoning_is_separated_and_calls_only_when_tools_were_offered():
    parsed = parse_output(QWEN3, tools=True)
    assert parsed.reasoning is not None and parsed.reasoning.startswith("The user wants")
    untouched = parse_output(QWEN3, tools=False)
    assert untouched.tool_calls == () and untouched.content.startswith("<tool_call>")
    # The prompt opened the block: the text before </think> is reasoning.
    assert split_reasoning("weighing it up\n</think>\n\nParis is sunny.") == ("Paris is sunny.", "weighing it up")
    # A block the model opened and the cap cut: all reasoning, no answer.
    assert split_reasoning("<think>\nstill thinking") == ("", "still thinking")
    assert split_reasoning("plain answer") == ("plain answer", None)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by the output cap
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '{"city": "Paris"}',  # JSON, but not a call
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": 3}]',
    ],
)
def test_text_that_is_not_a_whole_call_stays_the_answer(text):
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == text


def test_formats_of_templates():
    assert tool_format_of(CHAT_TEMPLATE) == "hermes"
    assert tool_format_of("{{ bos_token }}<|start_header_id|>system<|end_header_id|>{{ '<|python_tag|>' }}") == "llama3"
    assert tool_format_of("{%- if message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | tojson }}") == "mistral"
    assert tool_format_of(None) == "hermes"


def _split_in_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, at = [], 0
    while at < len(text):
        size = rng.randint(1, 7)
        pieces.append(text[at : at + size])
        at += size
    return pieces


def _stream(text: str, *, tools: bool, seed: int, reasoning_open: bool = False) -> list[object]:
    splitter = OutputSplitter(tools=tools, reasoning_open=reasoning_open)
    out: list[object] = []
    for piece in _split_in_pieces(text, seed):
        out.extend(splitter.feed(piece))
    out.extend(splitter.finish())
    return out


@pytest.mark.parametrize(
    "text",
    [QWEN3, QWEN3_TWO, HERMES_2_PRO, LLAMA_31_TAG, LLAMA_32_BARE, LLAMA_TWO, MISTRAL_V3, MISTRAL_V11, WITH_PREAMBLE],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_stream_adds_up_to_the_whole_answer(text, seed):
    pieces = _stream(text, tools=True, seed=seed)
    whole = parse_output(text, tools=True)
    calls = [p for p in pieces if isinstance(p, ToolCallPiece)]
    assert [p.call for p in calls] == list(whole.tool_calls)
    assert [p.index for p in calls] == list(range(len(whole.tool_calls)))
    assert len({p.call_id for p in calls}) == len(calls)
    content = "".join(p.text for p in pieces if isinstance(p, ContentPiece))
    assert content.strip() == whole.content
    assert "tool_call" not in content and "TOOL_CALLS" not in content and "python_tag" not in content
    reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningPiece))
    assert reasoning.strip() == (whole.reasoning or "")


def test_a_stream_sends_a_call_once_its_json_is_complete_and_never_its_text():
    splitter = OutputSplitter(tools=True)
    assert splitter.feed("Checking. <tool") == [ContentPiece("Checking. ")]
    assert splitter.feed('_call>\n{"name": "get_weather", "arguments": {"city": ') == []
    (piece,) = splitter.feed('"Paris"}}')
    assert isinstance(piece, ToolCallPiece) and piece.index == 0 and piece.call.name == "get_weather"
    assert splitter.feed("\n</tool_call>") == [] and splitter.finish() == []
    assert splitter.num_calls == 1


def test_a_stream_whose_prompt_opened_the_think_block():
    pieces = _stream("weighing Paris\n</think>\n\nIt is sunny.", tools=False, seed=3, reasoning_open=True)
    assert "".join(p.text for p in pieces if isinstance(p, ReasoningPiece)).strip() == "weighing Paris"
    assert "".join(p.text for p in pieces if isinstance(p, ContentPiece)) == "It is sunny."
    # Without tools nothing is withheld: a brace is text.
    plain = _stream('{"name": "get_weather"}', tools=False, seed=4)
    assert "".join(p.text for p in plain if isinstance(p, ContentPiece)) == '{"name": "get_weather"}'
