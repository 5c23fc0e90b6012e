"""`check` looks inside Agent nodes: model, provider route, controls and limits, as for llm_call
nodes, and wires into Agent inputs the host never reads."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.runtime_plugin.check.flow_check import AGENT_INPUT_PINS, check_flow

FLOWS = Path(__file__).resolve().parent / "flows"


@pytest.fixture()
def agent_flow() -> dict[str, Any]:
    """An Agent on ``lmstudio`` / ``qwen/qwen3-next-80b``, as the AbstractFlow examples write it."""
    return json.loads((FLOWS / "agent.json").read_text())


def agent(flow: dict[str, Any]) -> dict[str, Any]:
    return next(n for n in flow["nodes"] if n["type"] == "agent")


def errors(report) -> list[tuple[str, str | None, str | None]]:
    return [(p.code, p.node_id, p.field) for p in report.errors]


def warnings(report) -> list[tuple[str, str | None, str | None]]:
    return [(p.code, p.node_id, p.field) for p in report.warnings]


def test_an_agent_on_a_provider_not_served_here_is_an_error(agent_flow, dense_model):
    report = check_flow(agent_flow, model=dense_model)
    assert errors(report) == [("provider_not_served", "agent", "nodes[1].data.agentConfig.provider")]
    assert "'lmstudio' is not served here" in report.errors[0].message
    # run --model serves every node, agents included; --route serves the provider
    assert check_flow(agent_flow, model=dense_model, force_model=True).ok
    assert check_flow(agent_flow, model=dense_model, routes=[f"lmstudio=mlx:{dense_model}"]).ok


def test_an_agent_served_with_a_model_not_on_this_machine_is_an_error(agent_flow, tmp_path):
    missing = str(tmp_path / "DOES-NOT-EXIST")
    report = check_flow(agent_flow, model=missing, force_model=True)
    assert errors(report) == [("model_not_found", "agent", "--model")]
    routed = check_flow(agent_flow, model=None, routes=[f"lmstudio=mlx:{missing}"])
    assert [p.code for p in routed.errors] == ["model_not_found"]


def test_an_agent_naming_its_own_local_model(agent_flow, dense_model, tmp_path):
    config = agent(agent_flow)["data"]["agentConfig"]
    config.update(provider="mlx", model=str(tmp_path / "gone"))
    assert errors(check_flow(agent_flow, model=dense_model)) == [
        ("model_not_found", "agent", "nodes[1].data.agentConfig.model")
    ]
    config["model"] = dense_model
    assert check_flow(agent_flow, model=None).ok
    # no provider and no model: the run's default model (run_defaults), which must exist
    del config["provider"], config["model"]
    assert check_flow(agent_flow, model=dense_model).ok
    assert errors(check_flow(agent_flow, model=None)) == [("no_model", "agent", "nodes[1].data.agentConfig.model")]


def test_an_agents_pin_defaults_win_over_its_config(agent_flow, dense_model):
    agent(agent_flow)["data"]["pinDefaults"].update(provider="mlx", model=dense_model)
    assert check_flow(agent_flow, model=None).ok
    agent(agent_flow)["data"]["pinDefaults"]["provider"] = "openai"
    assert errors(check_flow(agent_flow, model=None)) == [
        ("provider_not_served", "agent", "nodes[1].data.pinDefaults.provider")
    ]


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("agentConfig", "speculation", {"num_draft_tokens": "two"}),
        ("agentConfig", "thinking", "loud"),
        ("agentConfig", "temperature", -1),
        ("agentConfig", "max_output_tokens", 0),
        ("agentConfig", "max_iterations", 0),
        ("pinDefaults", "max_iterations", "many"),
        ("pinDefaults", "max_out_tokens", -3),
        ("pinDefaults", "thinking", "loud"),
    ],
)
def test_an_agents_controls_and_limits_are_checked(agent_flow, dense_model, section, key, value):
    agent(agent_flow)["data"][section][key] = value
    report = check_flow(agent_flow, model=dense_model, force_model=True)
    assert [(p.code, p.node_id) for p in report.errors] == [("invalid_controls", "agent")]
    assert report.errors[0].field.startswith(f"nodes[1].data.{section}.{key}")


def test_a_wire_into_an_input_the_agent_never_reads_is_a_warning(agent_flow, dense_model):
    flow = copy.deepcopy(agent_flow)
    flow["edges"].append(
        {"id": "x", "source": "start", "sourceHandle": "topic", "target": "agent", "targetHandle": "questoin"}
    )
    flow["edges"].append(
        {"id": "y", "source": "start", "sourceHandle": "topic", "target": "agent", "targetHandle": "task"}
    )
    report = check_flow(flow, model=dense_model, force_model=True)
    assert report.ok
    unread = [w for w in warnings(report) if w[0] == "unread_input"]
    assert unread == [("unread_input", "agent", "edges[3].targetHandle")]
    # the pins the host passes on, "task" included (through host_shims), are not flagged
    assert {"task", "prompt", "system", "context", "max_iterations"} <= AGENT_INPUT_PINS


def test_check_command_on_an_agent_flow(cli_env, capsys, tmp_path, agent_flow):
    path = tmp_path / "agent.json"
    path.write_text(json.dumps(agent_flow))
    code = main(["check", str(path), "--model", str(tmp_path / "DOES-NOT-EXIST")])
    out, _ = capsys.readouterr()
    assert code == 1 and "[model_not_found]" in out and "node 'agent'" in out
    code = main(["check", str(path)])
    out, _ = capsys.readouterr()
    assert code == 1 and "[provider_not_served]" in out
    # run performs the same check first: it refuses before anything is written
    code = main(["run", str(path), "--model", str(tmp_path / "DOES-NOT-EXIST")])
    _, err = capsys.readouterr()
    assert code == 1 and "[model_not_found]" in err and not cli_env.exists()
