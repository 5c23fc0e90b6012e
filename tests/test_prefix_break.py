"""Cache-miss attribution: where a keyed prompt broke its key's previous prompt, through the
real provider (both lanes), a flow run's ledger, ``runs show`` (text and JSON) and the inspector."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.engine.cache.prefix_break import PrefixBreak, attribute
from abstractruntime_mlx.engine.model.chat import prepare_conversation, render_prompt
from abstractruntime_mlx.ledger import Ledger
from abstractruntime_mlx.runtime_plugin import node_outcomes
from abstractruntime_mlx.server.inspector import create_inspector_app

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "multiturn.json"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name} tool: " + "reads the project's files. " * 3,
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }
    for name in ("search", "fetch", "write")
]


def transcript(*, clock="2024-05-01 10:00:00", result_format="json", first_ask="Find the cache docs for me please."):
    """An agent's transcript: system prompt with a clock, a tool call, its result, a reply, a new turn."""
    result = (
        json.dumps({"hits": 3, "top": "docs/prompt-cache.md"})
        if result_format == "json"
        else "hits=3 top=docs/prompt-cache.md"
    )
    return [
        {"role": "system", "content": f"Current time: {clock}. You are a careful agent. " + "Answer briefly. " * 10},
        {"role": "user", "content": first_ask},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "search", "arguments": {"q": "cache"}}}
            ],
        },
        {"role": "tool", "content": result, "tool_call_id": "c1"},
        {"role": "assistant", "content": "Found it in the docs folder."},
        {"role": "user", "content": "Now summarise it in two lines."},
    ]


# (name, second call's messages, second call's tools, expected attribution)
MUTATIONS = [
    (
        "timestamp in the system prompt",
        transcript(clock="2024-05-01 10:00:07"),
        TOOLS,
        {"segment": "message", "message_index": 0, "role": "system"},
    ),
    ("tools reordered", transcript(), TOOLS[::-1], {"segment": "tools"}),
    (
        "tool result format changed",
        transcript(result_format="kv"),
        TOOLS,
        {"segment": "message", "message_index": 3, "role": "tool"},
    ),
    (
        "earlier user turn edited",
        transcript(first_ask="Find the prompt cache docs for me please."),
        TOOLS,
        {"segment": "message", "message_index": 1, "role": "user"},
    ),
]


def prompt_ids(model, messages, tools):
    """The prompt's token ids as the provider renders them (the model's own tokenizer and template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    text = render_prompt(tokenizer, prepare_conversation(messages), tools=tools, thinking=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def ask(llm, messages, tools, key):
    return llm.generate(
        "", messages=messages, tools=tools, prompt_cache_key=key, thinking=False, temperature=0, max_output_tokens=4
    )


@pytest.mark.slow
@pytest.mark.parametrize("batching", [True, False], ids=["native", "serialized"])
def test_each_mutation_names_the_message_it_broke(make_llm, dense_model, batching):
    llm = make_llm(dense_model, mlx_batching=batching)
    before = transcript()
    base = prompt_ids(dense_model, before, TOOLS)
    for name, messages, tools, expected in MUTATIONS:
        first = ask(llm, before, TOOLS, name)
        assert "prefix_break" not in first.metadata["prompt_cache"]  # the key's first turn: nothing to break
        second = ask(llm, messages, tools, name)
        brk = second.metadata["prompt_cache"]["prefix_break"]
        assert {k: brk.get(k) for k in expected} == expected, name
        ids = prompt_ids(dense_model, messages, tools)
        shared = next(i for i, (a, b) in enumerate(zip(base, ids)) if a != b)
        assert brk["token"] == shared, name
        assert brk["expected_tokens"] == first.usage["prompt_tokens"] == len(base)
        assert brk["reused_tokens"] == second.usage["cached_input_tokens"] <= shared
        assert brk["previous"] != brk["current"] and 0 < len(brk["current"]) <= 40 and len(brk["context"]) <= 40


def test_a_continuing_conversation_records_no_break(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    messages = transcript()[:2]
    first = ask(llm, messages, TOOLS, "chat")
    messages = [*messages, {"role": "assistant", "content": first.content}, {"role": "user", "content": "And then?"}]
    second = ask(llm, messages, TOOLS, "chat")
    assert second.metadata["prompt_cache"]["outcome"] == "hit"
    assert "prefix_break" not in second.metadata["prompt_cache"]
    # the same conversation sent again extends nothing and breaks nothing either
    assert "prefix_break" not in ask(llm, messages, TOOLS, "chat").metadata["prompt_cache"]
    # a prompt sharing nothing with the key's previous one broke at its first token
    unrelated = [{"role": "user", "content": "Something else entirely, " * 6}]
    other = ask(llm, unrelated, None, "chat")
    brk = other.metadata["prompt_cache"]["prefix_break"]
    assert other.metadata["prompt_cache"]["outcome"] == "miss"
    assert brk["token"] <= 2 and brk["reused_tokens"] == 0  # only the turn opener is shared
    assert (brk["segment"], brk["message_index"], brk["role"]) == ("message", 0, "user")


def test_async_calls_attribute_too(make_llm, dense_model):
    import asyncio

    llm = make_llm(dense_model, mlx_batching=True)
    name, messages, tools, expected = MUTATIONS[2]

    async def two_turns():
        await llm.agenerate(
            "", messages=transcript(), tools=TOOLS, prompt_cache_key="async", thinking=False, max_output_tokens=2
        )
        return await llm.agenerate(
            "", messages=messages, tools=tools, prompt_cache_key="async", thinking=False, max_output_tokens=2
        )

    brk = asyncio.run(two_turns()).metadata["prompt_cache"]["prefix_break"]
    assert {k: brk.get(k) for k in expected} == expected


def test_a_template_that_refuses_partial_conversations_says_so(dense_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(dense_model)
    # a template that needs a user turn (as some do): the first message alone cannot be rendered
    tokenizer.chat_template = (
        "{%- if messages | selectattr('role', 'equalto', 'user') | list | length == 0 -%}"
        "{{- raise_exception('No user query found in messages.') -}}{%- endif -%}" + tokenizer.chat_template
    )
    messages = prepare_conversation(transcript())
    text = render_prompt(tokenizer, messages, thinking=False)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    out = attribute(
        PrefixBreak(token=10, reused_tokens=0, expected_tokens=len(ids), previous_ids=tuple(ids[10:20])),
        prompt_ids=ids,
        text=text,
        conversation=messages,
        tokenizer=tokenizer,
        tools=None,
        thinking=False,
    )
    assert out["segment"] == "unknown" and "No user query found" in out["reason"]
    assert "message_index" not in out and out["token"] == 10


def test_a_flow_run_records_the_break_in_its_ledger_and_runs_show(cli_env, capsys, tmp_path, dense_model):
    """turn2's system prompt gains a clock (message 0); turn3's history holds an edited second
    question (message 3: what turn2 was asked is not what the context remembers)."""
    flow = json.loads(EXAMPLE.read_text())
    nodes = {n["id"]: n for n in flow["nodes"]}
    system = nodes["turn2"]["data"]["pinDefaults"]["system"]
    nodes["turn2"]["data"]["pinDefaults"]["system"] = "Current time: 10:00:07. " + system
    nodes["turn3"]["data"]["pinDefaults"]["system"] = "Current time: 10:00:07. " + system
    nodes["remember2q"]["data"]["pinDefaults"]["content"] = "Question 2: when does a prefix cache save time?"
    path = tmp_path / "mutating.json"
    path.write_text(json.dumps(flow))

    code = main(["run", str(path), "--json", "--model", dense_model])
    out, _ = capsys.readouterr()
    assert code == 0, out
    (run,) = json.loads(out[out.index("[") :])
    results = {n["node_id"]: n["result"] for n in run["nodes"]}
    assert "prefix_break" not in results["turn1"]["metadata"]["prompt_cache"]
    turn2 = results["turn2"]["metadata"]["prompt_cache"]["prefix_break"]
    turn3 = results["turn3"]["metadata"]["prompt_cache"]["prefix_break"]
    assert (turn2["segment"], turn2["message_index"], turn2["role"]) == ("message", 0, "system")
    assert (turn3["segment"], turn3["message_index"], turn3["role"]) == ("message", 3, "user")

    # the ledger's call record holds it
    with Ledger(f"sqlite:///{cli_env}") as ledger:
        recorded = {n.node_id: n for n in node_outcomes(ledger, run["run_id"])}
    assert recorded["turn3"].result["metadata"]["prompt_cache"]["prefix_break"] == turn3

    code = main(["runs", "show", run["run_id"], "--json"])
    shown, _ = capsys.readouterr()
    assert code == 0
    calls = {c["node_id"]: c for c in json.loads(shown)["calls"]}
    assert calls["turn1"]["prefix_break"] is None
    assert calls["turn2"]["prompt_cache"]["prefix_break"] == turn2
    assert calls["turn2"]["prefix_break"].startswith(
        f"prefix broke at message 0 (system prompt), token {turn2['token']:,}"
    )
    assert calls["turn3"]["prefix_break"].startswith(f"prefix broke at message 3 (user turn), token {turn3['token']:,}")

    code = main(["runs", "show", run["run_id"]])
    text, _ = capsys.readouterr()
    assert code == 0
    assert f"prefix broke at message 3 (user turn), token {turn3['token']:,}; reused {turn3['reused_tokens']:,}" in text
    assert text.count("prefix broke at message 0 (system prompt)") == 2  # the node line and the call's input

    # the web inspector's run view carries the same sentence its page shows
    with TestClient(create_inspector_app(f"sqlite:///{cli_env}"), base_url="http://inspector") as client:
        view = client.get(f"/api/runs/{run['run_id']}").json()
    assert {c["node_id"]: c["prefix_break"] for c in view["calls"]} == {n: calls[n]["prefix_break"] for n in calls}
