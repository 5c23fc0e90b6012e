"""Prefix reuse in flows: node and run-level keys, ledger rows, ``runs show``, the example flow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.ledger import Ledger
from abstractruntime_mlx.runtime_plugin.adapter.handler import request_from_payload

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "multiturn.json"


def test_key_levels_node_first_then_run():
    payload = {"prompt": "hi", "messages": [], "params": {"prompt_cache_key": "from-params"}}
    run_vars = {"_runtime": {"prompt_cache_key": "from-run"}}
    assert (
        request_from_payload(payload, run_vars, node_config={"prompt_cache_key": "from-config"}).prompt_cache_key
        == "from-params"
    )
    payload["params"] = {}
    assert (
        request_from_payload(payload, run_vars, node_config={"prompt_cache_key": "from-config"}).prompt_cache_key
        == "from-config"
    )
    payload["params"] = {"prompt_cache_binding": {"key": "bound"}}
    assert request_from_payload(payload, run_vars).prompt_cache_key == "bound"
    payload["params"] = {"prompt_cache_binding": "bound-str"}
    assert request_from_payload(payload, run_vars).prompt_cache_key == "bound-str"
    payload["params"] = {}
    assert request_from_payload(payload, run_vars).prompt_cache_key == "from-run"
    assert request_from_payload(payload, {}).prompt_cache_key is None


def run_json(capsys, flow, *extra):
    code = main(["run", str(flow), "--json", *extra])
    out, _ = capsys.readouterr()
    assert code == 0, out
    (run,) = json.loads(out[out.index("[") :])
    return {n["node_id"]: n["result"] for n in run["nodes"]}, run["run_id"]


@pytest.mark.slow
def test_example_multiturn_flow_reuses_its_conversation(cli_env, capsys, tmp_path, dense_model):
    nodes, run_id = run_json(capsys, EXAMPLE, "--model", dense_model)
    assert [nodes[n]["metadata"]["prompt_cache"]["outcome"] for n in ("turn1", "turn2", "turn3")] == [
        "miss",
        "hit",
        "hit",
    ]
    for name in ("turn2", "turn3"):
        cache = nodes[name]["metadata"]["prompt_cache"]
        assert cache["key"] == "multiturn-demo"
        assert nodes[name]["usage"]["cached_input_tokens"] == cache["cached_tokens"] > 0
        # everything of the previous call's prompt but the last block was restored
        previous = nodes["turn1" if name == "turn2" else "turn2"]["usage"]["prompt_tokens"]
        assert cache["cached_tokens"] >= previous - 24
        assert cache["cached_tokens"] + cache["fed_tokens"] == nodes[name]["usage"]["prompt_tokens"]
    # greedy identity: the same flow without keys gives the same answers
    plain_flow = json.loads(EXAMPLE.read_text())
    for node in plain_flow["nodes"]:
        node["data"].get("effectConfig", {}).pop("prompt_cache_key", None)
    plain_path = tmp_path / "plain.json"
    plain_path.write_text(json.dumps(plain_flow))
    plain, _ = run_json(capsys, plain_path, "--model", dense_model, "--var", "_runtime.prompt_cache=false")
    for name in ("turn1", "turn2", "turn3"):
        assert plain[name]["content"] == nodes[name]["content"]
        assert "prompt_cache" not in plain[name]["metadata"]

    # each node's ledger rows carry its cached / fed split
    with Ledger(f"sqlite:///{cli_env}") as ledger:
        rows = [r for r in ledger.node_timeline(run_id) if r.node_id == "turn3" and r.phase == "complete"]
    assert rows and rows[-1].cached_tokens == nodes["turn3"]["metadata"]["prompt_cache"]["cached_tokens"]
    assert rows[-1].fed_tokens == nodes["turn3"]["metadata"]["prompt_cache"]["fed_tokens"]

    code = main(["runs", "show", run_id[:8]])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "prompt cache: key=multiturn-demo miss" in out
    assert out.count("prompt cache: key=multiturn-demo hit") == 2


def test_run_level_key_applies_to_every_node(cli_env, capsys, tmp_path, dense_model):
    flow = json.loads(EXAMPLE.read_text())
    for node in flow["nodes"]:
        node["data"].get("effectConfig", {}).pop("prompt_cache_key", None)
    path = tmp_path / "runlevel.json"
    path.write_text(json.dumps(flow))
    nodes, _ = run_json(capsys, path, "--model", dense_model, "--var", "_runtime.prompt_cache_key=run-key")
    assert {nodes[n]["metadata"]["prompt_cache"]["key"] for n in ("turn1", "turn2", "turn3")} == {"run-key"}
    assert nodes["turn3"]["metadata"]["prompt_cache"]["outcome"] == "hit"
