"""Sibling prediction over real graph shapes: start pins, literals, concat/format, no-op flags,
and branches that depend on earlier answers."""

from __future__ import annotations

import pytest

from abstractruntime_mlx.nodes import ProviderRegistry
from abstractruntime_mlx.runtime_plugin import FlowIndex, build_pack, run_flow
from abstractruntime_mlx.runtime_plugin.prefetch.prediction import Unpredictable, plan_payload, resolve_payload
from abstractruntime_mlx.testing import tiny_model


def sequence_flow(*, final_config: dict | None = None, first_pins: dict | None = None) -> dict:
    """Shaped like the public examples: a sequence of LLM calls over start-node inputs (one
    wired straight in, one through a concat with a literal, one through a format node), then a
    call that combines the earlier answers."""
    start_out = [
        {"id": "exec-out", "type": "execution"},
        {"id": "query", "type": "string"},
        {"id": "seed", "type": "number"},
    ]
    nodes = [
        {"id": "start", "type": "on_flow_start", "data": {"outputs": start_out, "pinDefaults": {"seed": 5}}},
        {
            "id": "seq",
            "type": "sequence",
            "data": {"outputs": [{"id": f"then:{i}", "type": "execution"} for i in range(4)]},
        },
        {"id": "intro", "type": "literal_string", "data": {"literalValue": "Answer briefly:"}},
        {
            "id": "ask",
            "type": "concat",
            "data": {
                "inputs": [{"id": "a", "type": "string"}, {"id": "b", "type": "string"}],
                "concatConfig": {"separator": "\\n"},
            },
        },
        {"id": "fmt", "type": "format", "data": {"pinDefaults": {"template": "Topic: {q}", "values": {"q": "caches"}}}},
        {
            "id": "merge",
            "type": "concat",
            "data": {"inputs": [{"id": "a", "type": "string"}, {"id": "b", "type": "string"}]},
        },
        {
            "id": "end",
            "type": "on_flow_end",
            "data": {"inputs": [{"id": "exec-in", "type": "execution"}, {"id": "response", "type": "string"}]},
        },
    ]
    editor_defaults = {
        "provider": "mlx",
        "model": "vendor/some-model",
        "include_context": False,
        "max_output_tokens": 8,
    }
    for i, pins in enumerate([first_pins or {}, {}, {}]):
        data = {
            "effectConfig": dict(editor_defaults),
            "pinDefaults": {"system": "Be terse.", "include_context": False, **pins},
        }
        nodes.append({"id": f"m{i}", "type": "llm_call", "data": data})
    nodes.append(
        {
            "id": "final",
            "type": "llm_call",
            "data": {"effectConfig": {"provider": "mlx", "max_output_tokens": 8, **(final_config or {})}},
        }
    )
    edges = [
        {"source": "start", "sourceHandle": "exec-out", "target": "seq", "targetHandle": "exec-in"},
        {"source": "intro", "sourceHandle": "value", "target": "ask", "targetHandle": "a"},
        {"source": "start", "sourceHandle": "query", "target": "ask", "targetHandle": "b"},
        {"source": "start", "sourceHandle": "query", "target": "m0", "targetHandle": "prompt"},
        {"source": "ask", "sourceHandle": "result", "target": "m1", "targetHandle": "prompt"},
        {"source": "fmt", "sourceHandle": "result", "target": "m2", "targetHandle": "prompt"},
        {"source": "m0", "sourceHandle": "response", "target": "merge", "targetHandle": "a"},
        {"source": "m1", "sourceHandle": "response", "target": "merge", "targetHandle": "b"},
        {"source": "merge", "sourceHandle": "result", "target": "final", "targetHandle": "prompt"},
        {"source": "final", "sourceHandle": "response", "target": "end", "targetHandle": "response"},
    ]
    for i, target in enumerate(["m0", "m1", "m2", "final"]):
        edges.append({"source": "seq", "sourceHandle": f"then:{i}", "target": target, "targetHandle": "exec-in"})
        if target != "final":
            edges.append({"source": "start", "sourceHandle": "seed", "target": target, "targetHandle": "seed"})
    return {"id": "predict_seq", "entryNode": "start", "nodes": nodes, "edges": edges}


def test_start_pins_literals_and_string_nodes_are_computed():
    flow = sequence_flow()
    run_vars = {"query": "What is a cache?"}
    payloads = {n: resolve_payload(plan_payload(flow, n), run_vars) for n in ("m0", "m1", "m2")}
    assert payloads["m0"]["prompt"] == "What is a cache?"
    assert payloads["m1"]["prompt"] == "Answer briefly:\nWhat is a cache?"  # the separator's escape decoded
    assert payloads["m2"]["prompt"] == "Topic: caches"
    for payload in payloads.values():
        assert payload["system_prompt"] == "Be terse."
        assert payload["params"] == {
            "temperature": 0.7,
            "seed": 5,
            "max_output_tokens": 8,
        }  # default temperature, seed from the start pin's default
        assert payload["model"] == "vendor/some-model"
    assert resolve_payload(plan_payload(flow, "m0"), {"query": "q", "seed": 9})["params"]["seed"] == 9
    index = FlowIndex(flow)
    assert [c.node_id for c in index.later_siblings("m0")] == ["m1", "m2"]
    assert "llm_call node 'm0'" in index.unpredictable["final"]  # depends on earlier answers


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"first_pins": {"include_context": True}}, "include_context"),
        ({"first_pins": {"tools": ["x"]}}, "tools"),
    ],
)
def test_inputs_that_change_the_request_stay_unpredictable(change, reason):
    flow = sequence_flow(**change)
    with pytest.raises(Unpredictable, match=reason):
        plan_payload(flow, "m0")
    assert reason in FlowIndex(flow).unpredictable["m0"]


def test_a_value_from_a_variable_node_is_not_guessed():
    flow = sequence_flow()
    flow["nodes"].append({"id": "var", "type": "get_var", "data": {"pinDefaults": {"name": "x"}}})
    flow["edges"] = [e for e in flow["edges"] if not (e["target"] == "m2" and e["targetHandle"] == "prompt")]
    flow["edges"].append({"source": "var", "sourceHandle": "value", "target": "m2", "targetHandle": "prompt"})
    assert "get_var node 'var'" in FlowIndex(flow).unpredictable["m2"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_model(tmp_path_factory.mktemp("predict") / "dense", kind="dense", seed=0))


def test_predicted_siblings_batch_and_answer_the_same(model, tmp_path, policy_file):
    flow = sequence_flow()
    run_vars = {"query": "What is a cache?", "seed": 11}
    registry = ProviderRegistry()
    try:
        outputs = {}
        for batching in (False, True):
            with build_pack(
                tmp_path / f"{batching}.sqlite",
                model=model,
                force_model=True,
                registry=registry,
                sibling_batching=batching,
            ) as pack:
                (result,) = run_flow(flow, vars=run_vars, pack=pack)
                stats = pack.prefetcher.stats
            assert result.status == "completed", result.error
            outputs[batching] = {n.node_id: n.result for n in result.nodes}
    finally:
        registry.close()
    plain, batched = outputs[False], outputs[True]
    # seeded sampled rows: the same tokens whether prefetched into a shared batch or not
    assert all(r["content"] for r in plain.values())
    assert {n: r["content"] for n, r in batched.items()} == {n: r["content"] for n, r in plain.items()}
    assert batched["m0"]["metadata"]["sibling_batch"]["launched"] == ["m1", "m2"]
    for node_id in ("m1", "m2"):
        assert batched[node_id]["metadata"]["sibling_batch"]["used"] is True
        assert batched[node_id]["metadata"]["execution"]["mode"] == "continuous"
    assert "sibling_batch" not in batched["final"]["metadata"]
    assert max(r["metadata"]["execution"]["peak_batch_size"] for r in batched.values()) == 3
    assert stats.used == 2 and stats.mismatched == 0


def test_steps_to_llm_nodes_counts_execution_edges():
    from abstractruntime_mlx.runtime_plugin.prefetch.prediction import steps_to_llm_nodes

    def edge(a, b, handle="exec-out"):
        return {"source": a, "sourceHandle": handle, "target": b, "targetHandle": "exec-in"}

    flow = {
        "nodes": [
            {"id": "start", "type": "on_flow_start"},
            {"id": "plan", "type": "agent"},
            {"id": "fan", "type": "parallel"},
            {"id": "left", "type": "llm_call"},
            {"id": "right", "type": "llm_call"},
            {"id": "tool", "type": "code"},
            {"id": "review", "type": "agent"},
            {"id": "end", "type": "on_flow_end"},
        ],
        "edges": [
            edge("start", "plan"),
            edge("plan", "fan"),
            edge("fan", "left", "branch:0"),
            edge("fan", "right", "branch:1"),
            edge("left", "tool"),
            edge("tool", "review"),
            edge("review", "plan", "retry"),
            edge("review", "end"),
            {
                "source": "left",
                "sourceHandle": "response",
                "target": "review",
                "targetHandle": "prompt",
            },  # data: no step
        ],
    }
    assert steps_to_llm_nodes(flow, "start") == {"plan": 1, "left": 3, "right": 3, "review": 5}
    assert steps_to_llm_nodes(flow, "review") == {"plan": 1, "left": 3, "right": 3, "review": 5}
    assert steps_to_llm_nodes(flow, "end") == {}
