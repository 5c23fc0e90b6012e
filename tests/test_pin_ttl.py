"""A node's pin TTL from the flow's graph (``runtime_plugin/prefetch/pin_ttl.py``): how long a
run waits before it comes back to a node, and the pin the runtime sends for it."""

from __future__ import annotations

import math

import pytest

from abstractruntime_mlx.runtime_plugin import FlowIndex
from abstractruntime_mlx.runtime_plugin.prefetch.pin_ttl import return_wait_s
from abstractruntime_mlx.runtime_plugin.prefetch.prompt_cache import (
    DEFAULT_AGENT_PIN_TTL_S,
    MAX_PIN_TTL_S,
    WAIT_PIN_TTL_S,
    RunCacheHints,
)


def flow(*chain: str | tuple[str, dict[str, object]], back_to: str | None = None, wired: str | None = None):
    """start -> chain... (each ``type`` or ``(type, data)``, ids n1, n2, ...) -> end, and an
    execution edge from the last node back to ``back_to`` when given."""
    nodes = [{"id": "start", "type": "on_flow_start"}, {"id": "end", "type": "on_flow_end"}]
    ids = []
    for i, item in enumerate(chain, 1):
        node_type, data = item if isinstance(item, tuple) else (item, {})
        nodes.append({"id": f"n{i}", "type": node_type, "data": data})
        ids.append(f"n{i}")
    path = ["start", *ids, "end"]
    edges = [{"source": a, "target": b, "targetHandle": "exec-in"} for a, b in zip(path, path[1:])]
    if back_to is not None:
        edges.append({"source": ids[-1], "target": back_to, "targetHandle": "exec-in"})
    if wired is not None:
        edges.append({"source": "start", "target": wired, "sourceHandle": "seconds", "targetHandle": "duration"})
    return {"id": "f", "nodes": nodes, "edges": edges}


def timer(duration: object, unit: str | None = None) -> tuple[str, dict[str, object]]:
    data: dict[str, object] = {"pinDefaults": {"duration": duration}}
    if unit is not None:
        data["effectConfig"] = {"durationType": unit}
    return "wait_until", data


@pytest.mark.parametrize(
    "graph, node, expected",
    [
        (flow("llm_call", "ask_user", back_to="n1"), "n1", math.inf),  # a chat loop: a person answers
        (flow("agent", "wait_event", back_to="n1"), "n1", math.inf),
        (flow("llm_call", timer(5), back_to="n1"), "n1", 5.0),
        (flow("llm_call", timer(2, "minutes"), timer(30), back_to="n1"), "n1", 150.0),  # the way back's timers add
        (flow("llm_call", timer(1, "hours"), back_to="n1"), "n1", 3600.0),
        (flow("llm_call", timer(5), back_to="n1", wired="n2"), "n1", math.inf),  # its duration comes at run time
        (flow("llm_call", timer("soon"), back_to="n1"), "n1", math.inf),
        (flow("llm_call", timer(1, "timestamp"), back_to="n1"), "n1", math.inf),
        (flow("llm_call", "ask_user", "llm_call"), "n1", None),  # never comes back
        (flow("llm_call", "llm_call", back_to="n1"), "n1", None),  # comes back without a wait
        (flow("llm_call", "ask_user", "llm_call", back_to="n3"), "n1", None),  # the wait is not on its loop
        (flow("llm_call", "ask_user", "llm_call", back_to="n2"), "n3", math.inf),
    ],
)
def test_return_wait(graph, node, expected):
    assert return_wait_s(graph, node) == expected
    assert FlowIndex(graph).return_wait_s(node) == expected


def test_the_ttl_of_each_kind_of_wait():
    hints = RunCacheHints()
    assert hints.ttl_for(None) == DEFAULT_AGENT_PIN_TTL_S  # an agent's turns
    assert hints.ttl_for(math.inf) == WAIT_PIN_TTL_S
    assert hints.ttl_for(30.0) == DEFAULT_AGENT_PIN_TTL_S + 30.0
    assert hints.ttl_for(10 * 3600.0) == MAX_PIN_TTL_S
    assert RunCacheHints(pin_ttl_s=5000).ttl_for(math.inf) == 5000  # never shorter than the agent's


def test_a_chat_loops_key_is_pinned_across_the_wait(make_llm, dense_model):
    """On the real provider: after the call of an ``llm_call`` node its run comes back to through
    ``ask_user`` the key is pinned for ``WAIT_PIN_TTL_S``; after one that never comes back, not;
    the run's end releases the pin."""
    llm = make_llm(dense_model, mlx_batching=True)
    hints = RunCacheHints()
    index = FlowIndex(flow("llm_call", "ask_user", back_to="n1"))
    hints.before_call(llm, "run-1", "n1", {"run-1/n1": 0})
    ttl = hints.after_call("run-1", "n1", "run-1/n1", agent=False, return_wait_s=index.return_wait_s("n1"))
    assert ttl == WAIT_PIN_TTL_S
    assert llm.get_prompt_cache_stats()["eviction"]["pins"] == 1
    hints.finish_run("run-1")
    assert llm.get_prompt_cache_stats()["eviction"]["pins"] == 0

    straight = FlowIndex(flow("llm_call", "ask_user", "llm_call"))
    hints.before_call(llm, "run-2", "n1", {"run-2/n1": 0})
    assert hints.after_call("run-2", "n1", "run-2/n1", agent=False, return_wait_s=straight.return_wait_s("n1")) is None
    assert llm.get_prompt_cache_stats()["eviction"]["pins"] == 0
