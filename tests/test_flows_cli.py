"""Flows shaped like the AbstractFlow editor's examples, run through the CLI: routing of remote
providers onto the local model, subflows and agents as child runs, memory nodes with the
artifact store, emit_event, waits answered with ``runs resume``, a tick that raises, timers,
loop iterations in ``runs show``.

The flows under ``tests/flows/`` are our own, written for these tests in the editor's format
(provider ``lmstudio``, model ``qwen/qwen3-next-80b``, pins with ``pinDefaults``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.cli.run_cmd import EXIT_FAILED, EXIT_OK, EXIT_WAITING
from abstractruntime_mlx.errors import InvalidRequest
from abstractruntime_mlx.ledger import Ledger
from abstractruntime_mlx.nodes import default_registry
from abstractruntime_mlx.runtime_plugin import FlowBundle, Routing, network_tool_uses, parse_route
from abstractruntime_mlx.runtime_plugin.adapter.stores import LedgerRunStore
from abstractruntime_mlx.testing import tiny_model

FLOWS = Path(__file__).resolve().parent / "flows"


@pytest.fixture()
def ledger_path(tmp_path, monkeypatch, policy_file):
    path = tmp_path / "runs.sqlite"
    monkeypatch.setenv("ABSTRACTRUNTIME_MLX_LEDGER", str(path))
    yield path
    default_registry().close()


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory):
    """The tiny ``dense-long`` model (32k context), like the small models agents run on: a
    ReAct prompt (tool definitions, the turns so far) passes the ``dense`` model's 4096 tokens."""
    return str(tiny_model(tmp_path_factory.mktemp("agent-model") / "dense-long", kind="dense-long"))


def test_dense_long_is_the_dense_model_with_a_long_context(dense_model, agent_model):
    dense, long = (json.loads((Path(p) / "config.json").read_text()) for p in (dense_model, agent_model))
    assert (dense["max_position_embeddings"], long["max_position_embeddings"]) == (4096, 32768)
    assert {k: v for k, v in dense.items() if k != "max_position_embeddings"} == {
        k: v for k, v in long.items() if k != "max_position_embeddings"
    }
    assert (Path(dense_model) / "model.safetensors").read_bytes() == (
        Path(agent_model) / "model.safetensors"
    ).read_bytes()


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_error(capsys, pattern, *argv):
    """The command fails with exit 1 and exactly one ``error:`` line on stderr, matching ``pattern``."""
    code, out, err = cli(capsys, *argv)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(lines) == 1, (code, out, err)
    assert re.search(pattern, lines[0]), lines[0]


def run_json(capsys, *argv):
    code, out, err = cli(capsys, "run", *argv, "--json")
    return code, json.loads(out)[0], err


def steps_of(ledger_path: Path, run_id: str):
    with Ledger(f"sqlite:///{ledger_path}") as ledger:
        return ledger.run_steps(run_id)


# -- routing --------------------------------------------------------------------------


def test_routing_rule_order():
    routing = Routing.build(
        default_model="/m/default",
        serve_all=True,
        routes=["lmstudio=mlx:/m/studio", "lmstudio/big=mlx:/m/big", "openai=http://127.0.0.1:9/v1/"],
    )
    exact = routing.decide("lmstudio", "big")
    assert (exact.provider, exact.model, exact.base_url, exact.rule) == (
        "mlx",
        "/m/big",
        None,
        "--route lmstudio/big=mlx:/m/big",
    )
    assert routing.decide("LMStudio", "small").model == "/m/studio"
    remote = routing.decide("openai", "gpt-4o")
    assert (remote.base_url, remote.model) == ("http://127.0.0.1:9/v1", "gpt-4o")
    anything = routing.decide("anthropic", "claude")
    assert (anything.provider, anything.model, anything.rule) == ("mlx", "/m/default", "--model")
    explicit = routing.decide("lmstudio", "big", explicit_base_url="http://127.0.0.1:8")
    assert explicit.base_url == "http://127.0.0.1:8" and explicit.rule == "node base_url"
    assert explicit.to_metadata()["asked"] == {"provider": "lmstudio", "model": "big"}

    plain = Routing.build(default_model="/m/default", serve_all=False)
    assert plain.decide(None, None).model == "/m/default"
    assert plain.decide("mlx", "/m/own").model == "/m/own"
    with pytest.raises(InvalidRequest, match="--route lmstudio=mlx:MODEL"):
        plain.decide("lmstudio", "qwen")


@pytest.mark.parametrize(
    "bad", ["lmstudio", "=mlx:/m", "lmstudio=", "lmstudio/=mlx:/m", "lmstudio=ollama:/m", "lmstudio=mlx:"]
)
def test_bad_routes_are_refused(bad):
    with pytest.raises(InvalidRequest, match="route"):
        parse_route(bad)


def test_model_serves_a_flow_that_names_a_remote_provider(ledger_path, capsys, dense_model):
    code, out, err = cli(capsys, "run", FLOWS / "routed.json")
    assert code == EXIT_FAILED
    # `check` (run first) names the node and says how to route it; nothing runs.
    assert "node provider 'lmstudio' is not served here" in err and "--route lmstudio=mlx:MODEL" in err and "ask" in err
    assert not ledger_path.exists() or not Ledger(f"sqlite:///{ledger_path}").list_runs()

    code, result, _ = run_json(capsys, FLOWS / "routed.json", "--model", dense_model)
    assert code == EXIT_OK and result["status"] == "completed"
    route = result["nodes"][0]["result"]["metadata"]["route"]
    assert route == {
        "asked": {"provider": "lmstudio", "model": "qwen/qwen3-next-80b"},
        "served": {"provider": "mlx", "model": dense_model},
        "rule": "--model",
    }
    # The ledger keeps both: the step record holds the same metadata.
    [llm_step] = [
        s for s in steps_of(ledger_path, result["run_id"]) if s.effect_type == "llm_call" and s.status == "completed"
    ]
    assert llm_step.record["result"]["metadata"]["route"]["asked"]["provider"] == "lmstudio"


def test_route_flag_and_config_file(ledger_path, capsys, dense_model, tmp_path):
    code, result, _ = run_json(
        capsys, FLOWS / "routed.json", "--route", f"lmstudio/qwen/qwen3-next-80b=mlx:{dense_model}"
    )
    assert code == EXIT_OK
    assert (
        result["nodes"][0]["result"]["metadata"]["route"]["rule"]
        == f"--route lmstudio/qwen/qwen3-next-80b=mlx:{dense_model}"
    )

    config = tmp_path / "run.json"
    config.write_text(json.dumps({"routes": {"lmstudio": f"mlx:{dense_model}"}}))
    code, result, _ = run_json(capsys, FLOWS / "routed.json", "--config", config)
    assert code == EXIT_OK
    assert result["nodes"][0]["result"]["metadata"]["route"]["rule"] == f"--route lmstudio=mlx:{dense_model}"

    config.write_text(json.dumps({"routes": {"lmstudio": "ollama:x"}}))
    assert_error(capsys, "mlx:MODEL", "run", str(FLOWS / "routed.json"), "--config", str(config))
    config.write_text(json.dumps({"rutes": {}}))
    assert_error(capsys, "unknown keys", "run", str(FLOWS / "routed.json"), "--config", str(config))
    assert_error(capsys, "--route", "run", str(FLOWS / "routed.json"), "--route", "lmstudio=nowhere")


# -- subflows and agents ----------------------------------------------------------------


def test_subflows_run_as_child_runs_shown_nested(ledger_path, capsys, dense_model):
    code, result, _ = run_json(capsys, FLOWS / "parent.json", "--model", dense_model)
    assert code == EXIT_OK, result
    assert result["status"] == "completed" and len(result["children"]) == 2
    assert {n["run_id"] for n in result["nodes"]} == set(result["children"])
    assert set(result["output"]) >= {"first", "second"}
    with Ledger(f"sqlite:///{ledger_path}") as ledger:
        children = [ledger.get_run(c) for c in result["children"]]
    assert all(
        c.parent_run_id == result["run_id"] and c.workflow_id == "t_child" and c.status == "completed" for c in children
    )

    code, out, _ = cli(capsys, "runs", "show", result["run_id"][:8])
    assert code == 0
    assert out.count("    child run ") == 2 and "workflow t_child" in out


def test_missing_subflow_is_one_error_line(ledger_path, capsys, dense_model, tmp_path):
    lone = tmp_path / "parent.json"
    lone.write_text((FLOWS / "parent.json").read_text())
    assert_error(
        capsys,
        "subflow 't_child' used by node 'sub' of flow 't_parent' was not found",
        "run",
        str(lone),
        "--model",
        dense_model,
    )
    code, result, _ = run_json(capsys, lone, "--model", dense_model, "--flows-dir", FLOWS)
    assert code == EXIT_OK and result["status"] == "completed"


@pytest.mark.slow
def test_agent_runs_on_the_hosts_react_workflow_with_our_llm_handler(ledger_path, capsys, agent_model):
    code, result, _ = run_json(capsys, FLOWS / "agent.json", "--model", agent_model)
    assert code == EXIT_OK, result
    [child] = result["children"]
    with Ledger(f"sqlite:///{ledger_path}") as ledger:
        assert ledger.get_run(child).workflow_id == "visual_react_agent_t_agent_agent"
    assert result["nodes"] and all(n["run_id"] == child for n in result["nodes"])
    assert all(n["result"]["metadata"]["route"]["asked"]["provider"] == "lmstudio" for n in result["nodes"])
    assert "Agent configuration error" not in json.dumps(result["output"])


@pytest.mark.slow
def test_agent_without_provider_or_model_runs_on_the_run_default(ledger_path, capsys, agent_model):
    code, result, _ = run_json(capsys, FLOWS / "agent_bare.json", "--model", agent_model)
    assert code == EXIT_OK and not result["failures"], result
    assert result["nodes"] and all(
        n["result"]["metadata"]["route"]["served"]["model"] == agent_model for n in result["nodes"]
    )


@pytest.mark.slow
def test_agent_inside_a_subflow_inherits_the_run_default(ledger_path, capsys, agent_model):
    code, result, _ = run_json(capsys, FLOWS / "agent_in_sub.json", "--model", agent_model)
    assert code == EXIT_OK and not result["failures"], result
    subflow_run, agent_run = result["children"]
    assert result["nodes"] and all(n["run_id"] == agent_run for n in result["nodes"])
    assert all(n["result"]["metadata"]["route"]["served"]["model"] == agent_model for n in result["nodes"])
    with Ledger(f"sqlite:///{ledger_path}") as ledger:
        runtime_ns = ledger.load_run(subflow_run)["vars"]["_runtime"]
    assert (runtime_ns["provider"], runtime_ns["model"]) == ("mlx", agent_model)


def test_network_tools_are_refused_unless_allowed():
    flow = json.loads((FLOWS / "agent.json").read_text())
    flow["nodes"][1]["data"]["agentConfig"]["tools"] = ["list_files", "web_search"]
    assert network_tool_uses(FlowBundle.resolve(flow)) == [("t_agent", "agent", "web_search")]


def test_network_tool_flow_fails_before_running(ledger_path, capsys, dense_model, tmp_path):
    flow = json.loads((FLOWS / "agent.json").read_text())
    flow["nodes"][1]["data"]["agentConfig"]["tools"] = ["fetch_url"]
    path = tmp_path / "web.json"
    path.write_text(json.dumps(flow))
    assert_error(
        capsys,
        r"node 'agent'.*uses 'fetch_url'.*--allow-network-tools.*\[network_tool\]",
        "run",
        str(path),
        "--model",
        dense_model,
    )
    assert not ledger_path.exists() or not Ledger(f"sqlite:///{ledger_path}").list_runs()


# -- memory, events, waits ----------------------------------------------------------------


def test_memory_note_uses_a_durable_artifact_store_beside_the_ledger(ledger_path, capsys, dense_model):
    code, result, _ = run_json(capsys, FLOWS / "memory.json", "--model", dense_model)
    assert code == EXIT_OK, result
    store = ledger_path.with_name(ledger_path.name + ".artifacts")
    assert result["output"]["note_id"]
    assert any(store.rglob("*.meta")) or any(store.rglob("*.bin"))


def test_emit_event_works_on_the_ledger_run_store(ledger_path, capsys, dense_model):
    code, result, _ = run_json(capsys, FLOWS / "emit.json", "--model", dense_model)
    assert code == EXIT_OK and result["status"] == "completed", result


def test_list_due_wait_until(tmp_path):
    from abstractruntime.core.models import RunState, RunStatus, WaitReason, WaitState

    with Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}") as ledger:
        store = LedgerRunStore(ledger)
        for run_id, until in (
            ("late", "2030-01-01T00:00:00+00:00"),
            ("due", "2020-01-01T00:00:00+00:00"),
            ("earlier", "2019-01-01T00:00:00+00:00"),
        ):
            run = RunState.new(workflow_id="w", entry_node="n", run_id=run_id)
            run.status = RunStatus.WAITING
            run.waiting = WaitState(reason=WaitReason.UNTIL, wait_key=f"until:{run_id}", until=until)
            store.save(run)
        assert [r.run_id for r in store.list_due_wait_until(now_iso="2025-01-01T00:00:00+00:00")] == ["earlier", "due"]
        assert [r.run_id for r in store.list_due_wait_until(now_iso="2025-01-01T00:00:00+00:00", limit=1)] == [
            "earlier"
        ]
        with pytest.raises(ValueError):
            store.list_due_wait_until(now_iso="soon")


def test_ask_user_waits_shows_its_question_and_resumes(ledger_path, capsys, dense_model):
    code, result, _ = run_json(capsys, FLOWS / "ask.json", "--model", dense_model)
    assert code == EXIT_WAITING and result["status"] == "waiting"
    assert result["waiting"]["reason"] == "user" and result["waiting"]["prompt"] == "Which topic?"
    run_id = result["run_id"]

    code, out, _ = cli(capsys, "runs", "show", run_id[:8])
    assert (
        "waiting at node 'ask_user' (ask) for user" in out
        and "prompt: 'Which topic?'" in out
        and "--answer TEXT" in out
    )

    assert_error(capsys, "waits for an answer", "runs", "resume", run_id)
    assert_error(capsys, "waits for an answer", "runs", "resume", run_id, "--event", "go")
    code, out, _ = cli(capsys, "runs", "resume", run_id[:8], "--answer", "caches", "--json")
    resumed = json.loads(out)[0]
    assert code == EXIT_OK and resumed["status"] == "completed"
    [node] = resumed["nodes"]
    assert node["result"]["usage"]["prompt_tokens"] > 0
    assert_error(capsys, "only a waiting or interrupted run", "runs", "resume", run_id, "--answer", "again")


@pytest.mark.slow
def test_timer_is_kept_while_running_and_left_waiting_past_the_limit(ledger_path, capsys, dense_model):
    code, result, _ = run_json(capsys, FLOWS / "timer.json", "--model", dense_model)
    assert code == EXIT_OK and result["status"] == "completed" and result["wall_s"] >= 0.9

    code, result, _ = run_json(capsys, FLOWS / "timer.json", "--model", dense_model, "--max-timer-wait", "0")
    assert code == EXIT_WAITING and result["waiting"]["reason"] == "until"
    code, out, _ = cli(capsys, "runs", "resume", result["run_id"], "--json")
    assert code == EXIT_OK and json.loads(out)[0]["status"] == "completed"


# -- failures -----------------------------------------------------------------------------


BRACES = 'template=Answer as JSON like {"a": 1} about {topic}'
"""A format template with literal braces, given as a run variable: the run fails at the node
(``check`` flags such a template when the flow file holds it, see test_check)."""


def test_exception_inside_a_tick_fails_the_run_with_node_and_error(ledger_path, capsys, dense_model):
    code, out, err = cli(capsys, "run", FLOWS / "braces.json", "--model", dense_model, "--var", BRACES)
    assert code == EXIT_FAILED
    # The error once, on one line, the node named by its label; nothing more on stderr.
    [error_line] = [line for line in (out + err).splitlines() if "KeyError" in line]
    assert error_line.startswith("  node failed: 'llm_call' (llm): ") and err == ""
    assert "1 failed; 1 node failure" in out
    with Ledger(f"sqlite:///{ledger_path}") as ledger:
        [run] = ledger.list_runs()
        assert run.status == "failed"
        assert any(s.status == "failed" and s.node_id == "llm" for s in ledger.run_steps(run.run_id))
    assert_error(capsys, "is failed; only a waiting or interrupted run can be resumed", "runs", "resume", run.run_id)


def test_a_node_failure_in_a_completed_run_exits_non_zero(ledger_path, capsys, dense_model):
    # The compiler records a data node that raised (here: literal braces in a format
    # template) as the run's flow error and completes; the summary counts it.
    code, out, _ = cli(capsys, "run", FLOWS / "braces_end.json", "--model", dense_model, "--var", BRACES)
    assert code == EXIT_FAILED
    assert (
        "node failed: 'on_flow_end' (end)" in out and "1/1 runs completed, 0 waiting, 0 failed; 1 node failure" in out
    )
    assert [line for line in out.splitlines() if line.strip().startswith(("error:", "node failed:"))] == [
        line for line in out.splitlines() if "node failed:" in line
    ]  # printed once


def test_loop_iterations_are_drawn_separately(ledger_path, capsys, dense_model):
    code, result, _ = run_json(capsys, FLOWS / "loop.json", "--model", dense_model)
    assert code == EXIT_OK and len(result["nodes"]) == 3
    code, out, _ = cli(capsys, "runs", "show", result["run_id"])
    timeline = out.split("phase timeline", 1)[1]
    assert all(f"llm_call #{i}" in timeline for i in (1, 2, 3))  # the label (unique in the flow), then the visit


# -- structured output -------------------------------------------------------------------


def test_structured_llm_call_feeds_the_next_node_a_field_of_its_answer(ledger_path, capsys, dense_model):
    code, result, _ = run_json(capsys, FLOWS / "structured.json", "--model", dense_model)
    assert code == EXIT_OK and result["status"] == "completed"
    answer = json.loads(result["output"]["response"])
    schema = json.loads((FLOWS / "structured.json").read_text())["nodes"][1]["data"]["pinDefaults"]["response_schema"]
    assert set(answer) == set(schema["required"]) and answer["color"] in schema["properties"]["color"]["enum"]
    assert result["output"]["color"] == answer["color"]  # break_object read data.color
    [llm_step] = [s for s in steps_of(ledger_path, result["run_id"]) if s.node_id == "llm" and s.status == "completed"]
    assert llm_step.record["result"]["data"] == answer
    assert llm_step.record["result"]["metadata"]["structured"]["mode"] == "constrained"


def test_a_wait_on_a_host_channel_names_the_key_to_send():
    from abstractruntime.core.models import WaitReason, WaitState

    from abstractruntime_mlx.runtime_plugin.hosting.waits import wait_info

    assert wait_info(WaitState(reason=WaitReason.EVENT, wait_key="evt:session:s1:done"))["event"] == "done"
    assert wait_info(WaitState(reason=WaitReason.EVENT, wait_key="abstract.ask"))["event"] == "abstract.ask"


def test_a_response_schema_in_effect_config_is_read_by_no_one_and_check_says_so(
    ledger_path, capsys, tmp_path, dense_model
):
    """Only the host's ``response_schema`` pin (wired or ``pinDefaults``) asks an llm_call for a
    structured answer: the host's compiler and this pack never read ``effectConfig.response_schema``,
    so ``check`` reports it (docs/structured-output.md says the same)."""
    from abstractruntime_mlx.runtime_plugin import run_flow

    flow = json.loads((FLOWS / "structured.json").read_text())
    data = flow["nodes"][1]["data"]
    data["effectConfig"]["response_schema"] = data["pinDefaults"].pop("response_schema")
    path = tmp_path / "schema_in_config.json"
    path.write_text(json.dumps(flow))
    code, out, _ = cli(capsys, "check", path, "--model", dense_model)
    assert code == 1 and "nodes[1].data.effectConfig.response_schema" in out and "[unknown_config_key]" in out
    # Run anyway (the Python API does not check): the node answers free text, unconstrained.
    (result,) = run_flow(path, ledger_url=f"sqlite:///{ledger_path}", model=dense_model, force_model=True)
    [llm_step] = [s for s in steps_of(ledger_path, result.run_id) if s.node_id == "llm" and s.status == "completed"]
    assert llm_step.record["result"].get("data") is None
    assert "structured" not in llm_step.record["result"]["metadata"]


@pytest.mark.slow
def test_prompts_the_host_slimmed_are_shown_in_full_and_the_run_tree_is_nested(ledger_path, capsys, agent_model):
    from abstractruntime_mlx.inspection import run_view

    code, result, _ = run_json(capsys, FLOWS / "agent.json", "--model", agent_model)
    assert code == EXIT_OK, result
    root, [child] = result["run_id"], result["children"]
    with Ledger(f"sqlite:///{ledger_path}") as ledger:
        # The host keeps the agent's system prompt in the STARTED record only; the terminal
        # record carries a `$slim` marker in its place.
        ended = [s for s in ledger.run_steps(child) if s.effect_type == "llm_call" and s.status == "completed"]
        assert any("$slim" in json.dumps(s.record["effect"]) for s in ended)
        views = [run_view(ledger, run_id).as_dict() for run_id in (root, child)]
    calls = views[1]["calls"]
    assert calls and all(c["system_prompt"] and "ReAct" in c["system_prompt"] for c in calls)
    shown = [cli(capsys, "runs", "show", root, *flag)[1] for flag in ((), ("--json",), ("--events",))]
    assert not any("$slim" in text for text in [*shown, json.dumps(views)])

    # runs list: the agent's run is under its root, not a row of its own.
    code, out, _ = cli(capsys, "runs", "list")
    assert code == 0 and f"└ {child}" in out and out.count(child) == 1
    code, out, _ = cli(capsys, "runs", "list", "--json")
    [row] = json.loads(out)
    assert row["run_id"] == root and [c["run_id"] for c in row["children"]] == [child]
    code, out, _ = cli(capsys, "runs", "list", "--flat")
    assert f"└ {child}" not in out and child in out

    # runs show ROOT counts the child's calls, each naming the child run.
    shown_json = json.loads(shown[1])
    tree = shown_json["tree_calls"]
    assert tree["calls"] == len(calls) and {c["run_id"] for c in tree["by_call"]} == {child}
    assert tree["generated_tokens"] == sum(c["generated_tokens"] for c in calls)
    assert "llm calls of this run and its child runs" in shown[0] and child[:8] in shown[0]


def test_a_slimmed_prompt_without_its_started_record_says_so():
    from abstractruntime_mlx.inspection import payload_text

    marker = {"$slim": {"v": 1, "kind": "started_payload_field", "field": "prompt", "sha256": "0" * 64, "bytes": 2715}}
    assert payload_text({"prompt": marker}, "prompt", {}) == "prompt not kept by the host (2,715 bytes)"
    assert (
        payload_text({"prompt": marker}, "prompt", {"prompt": "edited"}) == "prompt not kept by the host (2,715 bytes)"
    )
    assert payload_text({"prompt": "hi"}, "prompt", {}) == "hi"
