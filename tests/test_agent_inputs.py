"""On Flow Start values reach an Agent node's task and a subflow's LLM node, of every pin kind,
through the real host (compiler, ReAct workflow, runtime) and our handler.

What the first LLM call received is read back from the ledger's STARTED record of that call,
as the handler reads it (``request_from_payload``: the host's per-second stamp removed).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import pytest

from abstractruntime_mlx.ledger import sqlite_url
from abstractruntime_mlx.runtime_plugin import FlowHost, build_pack, run_flow
from abstractruntime_mlx.runtime_plugin.adapter.payload import request_from_payload
from abstractruntime_mlx.runtime_plugin.hosting import host_shims

# A value of each On Flow Start pin kind, and the text the host makes of it for a prompt
# (``str(value)``, the same for an llm_call's prompt and an agent's task).
KINDS = {
    "string": ("What is a TTL cache?", "What is a TTL cache?"),
    "number": (4.5, "4.5"),
    "int": (42, "42"),
    "boolean": (True, "True"),
    "object": ({"a": 1, "b": [1, 2]}, "{'a': 1, 'b': [1, 2]}"),
    "array": ([1, "x"], "[1, 'x']"),
}


def pin(pin_id: str, kind: str) -> dict[str, object]:
    return {"id": pin_id, "type": kind}


EXEC_IN, EXEC_OUT = pin("exec-in", "execution"), pin("exec-out", "execution")


def node(node_id: str, node_type: str, inputs=(), outputs=(), **data: object) -> dict[str, object]:
    return {
        "id": node_id,
        "type": node_type,
        "position": {"x": 0, "y": 0},
        "data": {"nodeType": node_type, "label": node_type, "inputs": list(inputs), "outputs": list(outputs), **data},
    }


def edge(source: str, source_pin: str, target: str, target_pin: str) -> dict[str, object]:
    return {
        "id": f"{source}-{source_pin}-{target}-{target_pin}",
        "source": source,
        "sourceHandle": source_pin,
        "target": target,
        "targetHandle": target_pin,
    }


def start_node(kind: str) -> dict[str, object]:
    return node("start", "on_flow_start", outputs=[EXEC_OUT, pin("value", kind)])


def agent_flow(
    kind: str, task_pin: str = "task", *, wired: bool = True, defaults: Mapping[str, object] | None = None
) -> dict[str, object]:
    """On Flow Start ``value`` -> an Agent's ``task_pin`` (one ReAct iteration, no tools)."""
    agent = node(
        "agent",
        "agent",
        inputs=[EXEC_IN, pin(task_pin, "string"), pin("max_iterations", "number")],
        outputs=[EXEC_OUT, pin("result", "object")],
        agentConfig={"tools": []},
        pinDefaults={"max_iterations": 1, **(defaults or {})},
    )
    edges = [edge("start", "exec-out", "agent", "exec-in")]
    if wired:
        edges.append(edge("start", "value", "agent", task_pin))
    return {"id": f"agent_{kind}", "name": "agent", "nodes": [start_node(kind), agent], "edges": edges}


def llm_flow(kind: str, flow_id: str) -> dict[str, object]:
    """On Flow Start ``value`` -> an llm_call's ``prompt``."""
    llm = node(
        "llm",
        "llm_call",
        inputs=[EXEC_IN, pin("prompt", "string")],
        outputs=[EXEC_OUT, pin("response", "string")],
        effectConfig={"max_output_tokens": 2, "temperature": 0},
    )
    return {
        "id": flow_id,
        "name": "llm",
        "nodes": [start_node(kind), llm],
        "edges": [edge("start", "exec-out", "llm", "exec-in"), edge("start", "value", "llm", "prompt")],
    }


def parent_flow(kind: str) -> dict[str, object]:
    """On Flow Start ``value`` -> a subflow's ``value`` pin (the child's On Flow Start)."""
    sub = node("sub", "subflow", inputs=[EXEC_IN, pin("value", kind)], outputs=[EXEC_OUT], subflowId=f"child_{kind}")
    return {
        "id": f"parent_{kind}",
        "name": "parent",
        "nodes": [start_node(kind), sub],
        "edges": [edge("start", "exec-out", "sub", "exec-in"), edge("start", "value", "sub", "value")],
    }


@pytest.fixture()
def pack(tmp_path, dense_model, policy_file, registry):
    pack = build_pack(
        sqlite_url(tmp_path / "runs.sqlite"), model=dense_model, sibling_batching=False, registry=registry
    )
    yield pack
    pack.close()


def first_call(pack, run_id: str):
    """The request the first LLM call of ``run_id`` received, as the handler read it."""
    state = pack.run_store.load(run_id)
    for step in pack.ledger.run_steps(run_id):
        if step.effect_type == "llm_call" and step.status == "started":
            return request_from_payload(step.record["effect"]["payload"], state.vars)
    raise AssertionError(f"run {run_id} made no LLM call")


def start_agent(pack, flow: Mapping[str, object], value: object):
    """Start ``flow`` and tick it until its agent's child run exists (no LLM call yet):
    the runtime, the registry and the child run's id."""
    host = FlowHost.for_flow(pack, flow)
    runtime, registry = host.runtime()
    run_id = runtime.start(workflow=registry.get(flow["id"]), vars={"value": value})
    state = runtime.tick(workflow=registry.get(flow["id"]), run_id=run_id)
    child = state.waiting.details["sub_run_id"]
    return runtime, registry, child


def agent_first_call(pack, flow: Mapping[str, object], value: object):
    """The agent's task as its child run holds it, and its first LLM call's request
    (the child is ticked through ``init`` and ``reason`` only: one LLM call)."""
    runtime, registry, child = start_agent(pack, flow, value)
    task = runtime.get_state(child).vars["context"]["task"]
    runtime.tick(workflow=registry.get(runtime.get_state(child).workflow_id), run_id=child, max_steps=2)
    return task, first_call(pack, child)


def user_turn(request) -> str:
    """The agent's user turn without the host's one-iteration budget note."""
    [message] = [m for m in request.messages if m["role"] == "user"]
    return message["content"].split("\n\n[budget]", 1)[0].strip()


# -- the host bug the shim works around ---------------------------------------------------


def test_the_host_still_drops_an_agent_task_pin(pack, monkeypatch):
    """abstractruntime's agent input handler reads only ``prompt``: compiled as written, a
    value wired into ``task`` arrives empty. When this fails the host reads ``task`` itself:
    remove ``host_shims``' agent task shim and narrow ``HOST_RANGE``."""
    assert host_shims.host_needs_shim()  # the installed host is in the shim's range
    monkeypatch.setattr(host_shims, "host_needs_shim", lambda version=None: False)
    runtime, _registry, child = start_agent(pack, agent_flow("string"), "What is a TTL cache?")
    assert runtime.get_state(child).vars["context"]["task"] == ""


def test_the_shim_is_pinned_to_the_host_range():
    assert [host_shims.host_needs_shim(v) for v in ("0.12.9", "0.13.0", "0.13.7", "0.14.0", "1.0")] == [
        False,
        True,
        True,
        False,
        False,
    ]


def test_the_shim_renames_only_what_the_host_cannot_read():
    flow = agent_flow("string", defaults={"prompt": "unused"})
    flow["edges"].append(edge("other", "value", "agent", "prompt"))
    shaped = host_shims.compile_ready(flow, apply=True)
    agent = shaped["nodes"][1]["data"]
    assert [e["targetHandle"] for e in shaped["edges"]] == ["exec-in", "prompt"]
    assert [e["source"] for e in shaped["edges"]] == ["start", "start"]  # task wins over the second prompt input
    assert [p["id"] for p in agent["inputs"]] == ["exec-in", "prompt", "max_iterations"] and "prompt" not in agent[
        "pinDefaults"
    ]
    assert (
        flow["edges"][1]["targetHandle"] == "task" and flow["nodes"][1]["data"]["inputs"][1]["id"] == "task"
    )  # untouched
    assert host_shims.compile_ready(flow, apply=False) == flow
    prompt_flow = agent_flow("string", "prompt")
    assert host_shims.compile_ready(prompt_flow, apply=True) == prompt_flow


# -- every pin kind, into an agent and into a subflow -----------------------------------


@pytest.mark.slow
def test_on_flow_start_values_of_every_kind_reach_an_agents_first_llm_call(pack):
    """``task`` and ``prompt`` pins, wired, and a ``task`` pin default: the child run's
    ``context.task`` and the first call's user turn are the value's text. The agents run at
    once (one engine batch); each is ticked through its first LLM call only."""
    cases = [(kind, "task") for kind in KINDS] + [("string", "prompt"), ("int", "prompt")]
    lock = threading.Lock()

    def one(case: tuple[str, str]):
        kind, task_pin = case
        with lock:  # compiling is not what this measures; keep it off the engine's threads
            flow = agent_flow(kind, task_pin)
            flow["id"] = f"agent_{kind}_{task_pin}"
        return agent_first_call(pack, flow, KINDS[kind][0])

    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        got = list(pool.map(one, cases))
    for (kind, task_pin), (task, request) in zip(cases, got, strict=True):
        expected = KINDS[kind][1]
        assert (task, user_turn(request), request.prompt) == (expected, expected, ""), (kind, task_pin)


@pytest.mark.slow
def test_a_task_pin_default_reaches_the_agent(pack):
    flow = agent_flow("string", wired=False, defaults={"task": "Explain LRU."})
    task, request = agent_first_call(pack, flow, None)
    assert (task, user_turn(request)) == ("Explain LRU.", "Explain LRU.")


@pytest.mark.parametrize("kind", list(KINDS))
def test_on_flow_start_values_of_every_kind_reach_a_subflows_llm_call(pack, tmp_path, kind):
    value, expected = KINDS[kind]
    (tmp_path / f"child_{kind}.json").write_text(json.dumps(llm_flow(kind, f"child_{kind}")))
    [result] = run_flow(parent_flow(kind), vars={"value": value}, pack=pack, flows_dir=tmp_path)
    assert result.status == "completed" and len(result.children) == 1, result
    [child] = result.children
    assert pack.run_store.load(child).vars["value"] == value
    assert first_call(pack, child).prompt.strip() == expected

    # The same value straight into an llm_call's prompt: the same text.
    [direct] = run_flow(llm_flow(kind, f"direct_{kind}"), vars={"value": value}, pack=pack)
    assert first_call(pack, direct.run_id).prompt.strip() == expected
