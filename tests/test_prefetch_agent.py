"""Prefetch of an agent node's prefix: when an LLM call finishes (an agent's turn included), an
``agent`` node it enables gets its first request up to the task (the ReAct system prompt with
the node's ``system`` pin, its tools) warmed under the key its first call derives, built by the
host's own ReAct nodes; counted by that call as ``prefetched_tokens``, with the same answer.
Real MLX, the tiny dense model with a long context."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from abstractruntime_mlx.nodes import ProviderRegistry
from abstractruntime_mlx.runtime_plugin import build_pack, run_flow
from abstractruntime_mlx.runtime_plugin.prefetch.agent_prefix import child_vars
from abstractruntime_mlx.runtime_plugin.prefetch.catalog import FlowIndex
from abstractruntime_mlx.runtime_plugin.prefetch.prediction import (
    Unpredictable,
    plan_agent_inputs,
    resolve_agent_inputs,
)
from abstractruntime_mlx.testing import tiny_model

FLOWS = Path(__file__).parent / "flows"
WRITER = "You write one short line. " + "Use plain words only. " * 20
CRITIC = "You judge what the writer wrote. " + "Say what is wrong with it, in one line. " * 14
# Between the agents: the time a real flow spends outside the model, when the engine is idle.
PAUSE = "s = 0\nfor i in range(2000000):\n    s += i\nreturn s"


def agents_flow() -> dict[str, object]:
    """tests/flows/two_agents.json with a system pin per agent, greedy, and a code node between
    them; the critic's task is the writer's answer (known only once the writer is done)."""
    flow = json.loads((FLOWS / "two_agents.json").read_text())
    nodes = {n["id"]: n for n in flow["nodes"]}
    for node_id, system in (("writer", WRITER), ("critic", CRITIC)):
        data = nodes[node_id]["data"]
        data["agentConfig"]["temperature"] = 0
        data["pinDefaults"]["system"] = system
        data["inputs"].append({"id": "system", "type": "string"})
    del nodes["critic"]["data"]["pinDefaults"]["task"]
    flow["nodes"].append(
        {
            "id": "pause",
            "type": "code",
            "data": {
                "codeBody": PAUSE,
                "inputs": [{"id": "exec-in", "type": "execution"}],
                "outputs": [{"id": "exec-out", "type": "execution"}, {"id": "output", "type": "any"}],
            },
        }
    )
    edges = [e for e in flow["edges"] if not (e["source"] == "writer" and e["target"] == "critic")]
    edges += [
        {"source": "writer", "sourceHandle": "exec-out", "target": "pause", "targetHandle": "exec-in"},
        {"source": "pause", "sourceHandle": "exec-out", "target": "critic", "targetHandle": "exec-in"},
        {"source": "writer", "sourceHandle": "response", "target": "critic", "targetHandle": "task"},
    ]
    flow["edges"] = edges
    return flow


def test_an_agent_prefix_is_its_system_pin_tools_and_model_not_its_task():
    flow = agents_flow()
    template = plan_agent_inputs(flow, "critic")  # its task is wired from the writer: not needed
    inputs, config = resolve_agent_inputs(template, {})
    assert inputs == {"system": CRITIC} and config["tools"] == []
    vars = child_vars(inputs, config, {"_runtime": {"prompt_cache": {"namespace": "n"}}})
    runtime = vars["_runtime"]
    assert (runtime["provider"], runtime["model"]) == ("lmstudio", "qwen/qwen3-next-80b")
    assert runtime["system_prompt_extra"] == CRITIC and runtime["allowed_tools"] == []
    assert runtime["prompt_cache"] == {"namespace": "n"} and vars["context"] == {"task": "", "messages": []}
    # the system prompt wired from another node, parent context, a run skills block: not predicted
    wired = copy.deepcopy(flow)
    wired["edges"].append(
        {"source": "writer", "sourceHandle": "response", "target": "critic", "targetHandle": "system"}
    )
    with pytest.raises(Unpredictable, match="input from agent node 'writer'"):
        plan_agent_inputs(wired, "critic")
    with_context = copy.deepcopy(flow)
    with_context["nodes"][2]["data"]["agentConfig"]["include_context"] = True
    with pytest.raises(Unpredictable, match="include_context"):
        plan_agent_inputs(with_context, "critic")
    with pytest.raises(Unpredictable, match="skills_block"):
        child_vars(inputs, config, {"_runtime": {"skills_block": "x"}})
    no_model = {**config, "provider": "", "model": ""}
    with pytest.raises(Unpredictable, match="AbstractCore"):
        child_vars(inputs, no_model, {})
    assert child_vars(inputs, no_model, {"_runtime": {"provider": "mlx", "model": "m"}})["_runtime"]["model"] == "m"


def test_an_agent_without_its_react_workflow_is_not_warmed():
    with pytest.raises(Unpredictable, match="no ReAct workflow"):
        FlowIndex(agents_flow()).prefix_call("critic", {})


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory):
    """A context long enough for the ReAct system prompt (thousands of tokens on the tiny tokenizer)."""
    return str(tiny_model(tmp_path_factory.mktemp("agent-model") / "dense-long", kind="dense-long"))


def run_agents(model, tmp_path, *, prefix_warm: bool):
    registry = ProviderRegistry()  # a fresh resident model: its prefix cache starts empty
    try:
        with build_pack(
            tmp_path / f"agents-{prefix_warm}.sqlite",
            model=model,
            force_model=True,
            registry=registry,
            prefix_warm=prefix_warm,
        ) as pack:
            warm = pack.handler.cache_hints.warm
            warmed_keys = []

            def record(target, request):
                warmed_keys.append(request.prompt_cache_key)
                return warm(target, request)

            pack.handler.cache_hints.warm = record
            (result,) = run_flow(agents_flow(), pack=pack, session_id="s-agents")
            assert result.status == "completed", result.error
            turns = {}  # agent node -> its one turn (its ReAct run's workflow id ends with the node id)
            for node in result.nodes:
                if node.node_id == "reason":
                    workflow_id = str(pack.ledger.load_run(node.run_id)["workflow_id"])
                    turns[workflow_id.rsplit("_", 1)[-1]] = node.result
        assert sorted(turns) == ["critic", "writer"]
        # every warm (one per call of the writer's run) went under the key the critic's first call derived
        assert set(warmed_keys) == ({turns["critic"]["metadata"]["prompt_cache"]["key"]} if prefix_warm else set())
        return turns["writer"], turns["critic"]
    finally:
        registry.close()


@pytest.mark.slow
def test_the_next_agent_prefix_is_warmed_and_its_answer_is_the_same(agent_model, tmp_path, policy_file):
    (writer, critic) = run_agents(agent_model, tmp_path, prefix_warm=True)
    (plain_writer, plain_critic) = run_agents(agent_model, tmp_path, prefix_warm=False)
    (warm,) = writer["metadata"]["prefix_warm"]
    assert warm["node_id"] == "critic" and warm["prefix_only"] is True and warm["queued"] is True
    cache = critic["metadata"]["prompt_cache"]
    assert cache["prefetched_tokens"] > 0 and cache["prefetched_tokens"] <= cache["cached_tokens"]
    assert "prefix_warm" not in critic["metadata"]  # nothing after the critic
    assert "prefix_warm" not in plain_writer["metadata"]
    assert "prefetched_tokens" not in plain_critic["metadata"]["prompt_cache"]
    assert writer["content"] == plain_writer["content"] and critic["content"] == plain_critic["content"]


@pytest.mark.slow
def test_an_llm_call_warms_the_agent_it_enables(agent_model, tmp_path, policy_file):
    """The same from a flow's own ``llm_call`` node: the agent's prefix is warmed from the flow run."""
    flow = agents_flow()
    flow["nodes"][1] = {
        "id": "writer",
        "type": "llm_call",
        "data": {
            "effectConfig": {"provider": "mlx", "temperature": 0.0, "max_output_tokens": 6},
            "pinDefaults": {"system": WRITER, "prompt": "Name a colour.", "include_context": False},
        },
    }
    registry = ProviderRegistry()
    try:
        with build_pack(tmp_path / "llm.sqlite", model=agent_model, force_model=True, registry=registry) as pack:
            (result,) = run_flow(flow, pack=pack, session_id="s-llm")
            assert result.status == "completed", result.error
        nodes = {n.node_id: n.result for n in result.nodes}
    finally:
        registry.close()
    (warm,) = nodes["writer"]["metadata"]["prefix_warm"]
    assert warm["node_id"] == "critic" and warm["prefix_only"] is True and warm["queued"] is True
    assert nodes["reason"]["metadata"]["prompt_cache"]["prefetched_tokens"] > 0
