"""`check`: every problem of a flow in one report, naming node and field; `run` refuses such flows."""

from __future__ import annotations

import copy
import http.server
import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.errors import InvalidFlow
from abstractruntime_mlx.runtime_plugin.adapter.routing import RemotePolicy
from abstractruntime_mlx.runtime_plugin.check import check_flow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fanout.json"


@pytest.fixture()
def fanout() -> dict[str, Any]:
    return json.loads(EXAMPLE.read_text())


def node(flow: dict[str, Any], node_id: str) -> dict[str, Any]:
    return next(n for n in flow["nodes"] if n["id"] == node_id)


def codes(report) -> list[tuple[str, str | None, str | None]]:
    return [(p.code, p.node_id, p.field) for p in report.errors]


def test_the_example_flow_is_clean(fanout, dense_model):
    report = check_flow(fanout, model=str(dense_model))
    assert report.ok and report.problems == ()


def test_every_problem_in_one_report_naming_node_and_field(fanout, dense_model):
    fanout["edges"][1]["target"] = "plian"  # typo for plain
    node(fanout, "mtp2")["data"]["effectConfig"]["speculation"] = {"mode": "native_mtp", "num_draft_tokens": "two"}
    node(fanout, "inherit")["data"]["effectConfig"]["speculaton"] = False
    node(fanout, "think")["type"] = "llm_cal"
    report = check_flow(fanout, vars={"_runtime": {"speculaton": False}}, model=str(dense_model))
    assert not report.ok
    found = codes(report)
    assert ("edge_to_missing_node", None, "edges[1].target") in found
    assert ("unreachable_node", "plain", None) in found
    assert ("invalid_controls", "mtp2", "nodes[3].data.effectConfig.speculation.num_draft_tokens") in found
    assert ("unknown_config_key", "inherit", "nodes[4].data.effectConfig.speculaton") in found
    assert ("unknown_node_type", "think", "nodes[5].type") in found
    assert ("unknown_runtime_key", None, "vars._runtime.speculaton") in found
    assert len(found) == 6
    text = report.render()
    assert "did you mean 'plain'?" in text
    assert "did you mean 'speculation'?" in text
    assert "did you mean 'llm_call'?" in text
    assert "not runnable (6 errors" in text
    with pytest.raises(InvalidFlow) as caught:
        report.raise_for_problems()
    assert caught.value.code == "invalid_flow"
    assert len(caught.value.details["problems"]) == 6


def test_labels_are_named(fanout, dense_model):
    node(fanout, "plain")["data"]["label"] = "Plain answer"
    node(fanout, "plain")["data"]["effectConfig"]["thinking"] = "loud"
    (problem,) = check_flow(fanout, model=str(dense_model)).errors
    assert (problem.node_id, problem.label, problem.field) == (
        "plain",
        "Plain answer",
        "nodes[2].data.effectConfig.thinking",
    )
    assert problem.render().startswith("error: node 'plain' (Plain answer) nodes[2].data.effectConfig.thinking:")


@pytest.mark.parametrize(
    "config, field",
    [
        ({"speculation": {"mode": "native_mtp", "num_draft_token": 2}}, "speculation.num_draft_token"),
        ({"speculation": "fast"}, "speculation"),
        ({"temperature": -1}, "temperature"),
        ({"seed": "7"}, "seed"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"maxOutputTokens": "many"}, "maxOutputTokens"),
    ],
)
def test_controls_our_validation_refuses(fanout, dense_model, config, field):
    node(fanout, "inherit")["data"]["effectConfig"].update(config)
    (problem,) = check_flow(fanout, model=str(dense_model)).errors
    assert (problem.code, problem.node_id, problem.field) == (
        "invalid_controls",
        "inherit",
        f"nodes[4].data.effectConfig.{field}",
    )


def test_did_you_mean_for_a_speculation_key(fanout, dense_model):
    node(fanout, "inherit")["data"]["effectConfig"]["speculation"] = {"num_draft_token": 2}
    (problem,) = check_flow(fanout, model=str(dense_model)).errors
    assert "did you mean 'num_draft_tokens'?" in problem.message


def test_values_the_host_accepts_are_not_flagged(fanout, dense_model):
    config = node(fanout, "inherit")["data"]["effectConfig"]
    config.update(seed=-1, maxOutputTokens=16, include_context=False, structured_output_fallback=True)
    node(fanout, "inherit")["data"]["pinDefaults"]["thinking"] = "low"
    runtime = {"speculation": {"mode": "native_mtp", "num_draft_tokens": 3}, "thinking": "auto", "stream": False}
    assert check_flow(fanout, vars={"_runtime": runtime}, model=str(dense_model)).problems == ()


def test_run_level_controls_are_validated(fanout, dense_model):
    report = check_flow(
        fanout, vars={"_runtime": {"speculation": {"mode": "turbo"}, "stream": "yes"}}, model=str(dense_model)
    )
    assert [(p.code, p.field) for p in report.errors] == [
        ("invalid_controls", "vars._runtime.speculation.mode"),
        ("invalid_controls", "vars._runtime.stream"),
    ]


def test_models_and_providers(fanout, dense_model, tmp_path):
    node(fanout, "plain")["data"]["effectConfig"]["model"] = str(tmp_path / "missing-model")
    node(fanout, "think")["data"]["effectConfig"].update(provider="lmstudio", model="qwen/qwen3-next-80b")
    report = check_flow(fanout, model=str(dense_model))
    assert codes(report) == [
        ("model_not_found", "plain", "nodes[2].data.effectConfig.model"),
        ("provider_not_served", "think", "nodes[5].data.effectConfig.provider"),
    ]
    # --model serves every LLM node on one local model: both problems go away
    assert check_flow(fanout, model=str(dense_model), force_model=True).ok
    missing = check_flow(fanout, model=str(tmp_path / "nope"), force_model=True)
    assert {(p.code, p.field) for p in missing.errors} == {("model_not_found", "--model")}
    assert len(missing.errors) == 4  # one per LLM node, looked up once


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_remote_base_url_that_does_not_answer(fanout, dense_model):
    dead = f"http://127.0.0.1:{_free_port()}"
    allowed = RemotePolicy.build(urls=[dead])  # the user's own --var _runtime.base_url
    report = check_flow(
        fanout, vars={"_runtime": {"base_url": dead}}, model=str(dense_model), remote=allowed, probe_remote=True
    )
    assert {(p.code, p.field) for p in report.errors} == {("remote_unreachable", "vars._runtime.base_url")}
    assert len(report.errors) == 4
    assert check_flow(fanout, vars={"_runtime": {"base_url": dead}}, remote=allowed).ok  # nothing contacted by default


@pytest.mark.slow
def test_remote_base_url_that_answers(fanout):
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            asked.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        node(fanout, "plain")["data"]["effectConfig"]["base_url"] = url
        report = check_flow(
            fanout, vars={"_runtime": {"base_url": url}}, remote=RemotePolicy.build(True), probe_remote=True
        )
    finally:
        server.shutdown()
        server.server_close()
    assert report.ok, report.render()
    assert asked == ["/health"]  # one probe per server


def test_compiler_refusals_are_reported(fanout, dense_model):
    fanout["edges"].append({"source": "fanout", "sourceHandle": "after", "target": "end", "targetHandle": "exec-in"})
    (problem,) = check_flow(fanout, model=str(dense_model)).errors
    assert problem.code == "compile_error"
    assert "unsupported execution outputs" in problem.message and "after" in problem.message


def editor_shaped_flow() -> dict[str, Any]:
    """A flow as the AbstractFlow editor saves it: declared pins (snapshots that can lag behind the
    host), labels, a decoration node, a trigger chain `run` does not fire, an unwired data node."""

    def pins(*ids: str, exec_pin: str | None = None) -> list[dict[str, Any]]:
        out = [{"id": exec_pin, "label": "", "type": "execution"}] if exec_pin else []
        return out + [{"id": i, "label": i, "type": "string"} for i in ids]

    return {
        "id": "editor-shaped",
        "name": "editor shaped",
        "entryNode": "node-1",
        "nodes": [
            {
                "id": "node-1",
                "type": "on_flow_start",
                "data": {"label": "On Flow Start", "outputs": pins("topic", exec_pin="exec-out")},
            },
            {
                "id": "node-2",
                "type": "llm_call",
                "data": {
                    "label": "LLM Call",
                    "inputs": pins("prompt", exec_pin="exec-in"),
                    "outputs": pins("response", exec_pin="exec-out"),
                    "effectConfig": {"provider": "mlx", "temperature": 0},
                },
            },
            {
                "id": "node-3",
                "type": "agent",
                "data": {
                    "label": "Agent",
                    "inputs": pins("task", exec_pin="exec-in"),
                    "outputs": pins("result", exec_pin="exec-out"),
                    "agentConfig": {"provider": "mlx", "max_iterations": 2},
                },
            },
            {
                "id": "node-4",
                "type": "on_flow_end",
                "data": {"label": "On Flow End", "inputs": pins("answer", "ok", exec_pin="exec-in")},
            },
            {"id": "node-5", "type": "literal_string", "data": {"label": "Note", "literalValue": "scratch"}},
            {
                "id": "node-6",
                "type": "on_event",
                "data": {"label": "On Event", "outputs": pins("payload", exec_pin="exec-out")},
            },
            {
                "id": "node-7",
                "type": "answer_user",
                "data": {"label": "Answer", "inputs": pins("message", exec_pin="exec-in")},
            },
        ],
        "edges": [
            {"source": "node-1", "sourceHandle": "exec-out", "target": "node-2", "targetHandle": "exec-in"},
            {"source": "node-1", "sourceHandle": "topic", "target": "node-2", "targetHandle": "prompt"},
            {"source": "node-2", "sourceHandle": "exec-out", "target": "node-3", "targetHandle": "exec-in"},
            {"source": "node-2", "sourceHandle": "response", "target": "node-3", "targetHandle": "task"},
            {"source": "node-3", "sourceHandle": "exec-out", "target": "node-4", "targetHandle": "exec-in"},
            {"source": "node-3", "sourceHandle": "result", "target": "node-4", "targetHandle": "answer"},
            # the agent's `success` output exists in the host though the saved pins predate it
            {"source": "node-3", "sourceHandle": "success", "target": "node-4", "targetHandle": "ok"},
            {"source": "node-6", "sourceHandle": "exec-out", "target": "node-7", "targetHandle": "exec-in"},
            {"source": "node-6", "sourceHandle": "payload", "target": "node-7", "targetHandle": "message"},
        ],
    }


def test_editor_shaped_valid_flow_passes_with_warnings_only(dense_model):
    report = check_flow(editor_shaped_flow(), model=str(dense_model))
    assert report.ok, report.render()
    assert {(p.code, p.node_id) for p in report.warnings} == {
        ("edge_to_missing_pin", "node-3"),
        ("unreachable_node", "node-6"),
        ("unreachable_node", "node-7"),
    }


def test_unreadable_documents(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    (problem,) = check_flow(bad).problems
    assert problem.code == "invalid_document" and "not valid JSON" in problem.message
    (problem,) = check_flow(tmp_path / "absent.json").problems
    assert "no flow file" in problem.message
    report = check_flow({"nodes": [{"id": "a", "type": "on_flow_start"}, {"id": "a", "type": "on_flow_end"}]})
    assert {(p.code, p.field) for p in report.errors} == {
        ("invalid_document", "id"),
        ("duplicate_node_id", "nodes[1].id"),
    }


# --------------------------------------------------------------------------------------- CLI


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_check_command(cli_env, capsys, tmp_path, fanout, dense_model):
    code, out, _ = cli(capsys, "check", str(EXAMPLE), "--model", str(dense_model))
    assert code == 0 and "ok (0 errors, 0 warnings)" in out
    fanout["edges"][1]["target"] = "plian"
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(fanout))
    code, out, _ = cli(capsys, "check", str(broken), "--var", "_runtime.speculaton=false", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False and report["errors"] == 3
    assert {p["code"] for p in report["problems"]} == {
        "edge_to_missing_node",
        "unreachable_node",
        "unknown_runtime_key",
    }


def test_run_refuses_a_flow_with_problems_and_writes_nothing(cli_env, capsys, tmp_path, fanout):
    node(fanout, "mtp2")["data"]["effectConfig"]["speculation"] = {"num_draft_tokens": "two"}
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(fanout))
    code, out, err = cli(capsys, "run", str(broken))
    assert code == 1
    assert out == ""
    assert "node 'mtp2' nodes[3].data.effectConfig.speculation.num_draft_tokens" in err
    assert not cli_env.exists()  # the ledger was never opened


def test_check_several_flows_summarises(cli_env, capsys, tmp_path, fanout, dense_model):
    fanout["nodes"][2]["type"] = "llm_cal"
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(fanout))
    code, out, _ = cli(capsys, "check", str(EXAMPLE), str(broken), "--model", str(dense_model))
    assert code == 1
    assert out.rstrip().endswith("1 of 2 flows can run")
    code, out, _ = cli(capsys, "check", str(EXAMPLE), str(broken), "--model", str(dense_model), "--json")
    assert [r["ok"] for r in json.loads(out)] == [True, False]


def test_subflows_and_network_tools(tmp_path, fanout, dense_model):
    fanout["nodes"].append({"id": "sub", "type": "subflow", "data": {"label": "Helper", "subflowId": "helper"}})
    fanout["edges"].append({"source": "sub", "sourceHandle": "exec-out", "target": "end", "targetHandle": "exec-in"})
    path = tmp_path / "parent.json"
    path.write_text(json.dumps(fanout))
    (problem,) = [p for p in check_flow(path, model=str(dense_model)).errors if p.code == "subflow_not_found"]
    assert problem.node_id == "sub" and "'helper'" in problem.message
    helper = {
        "id": "helper",
        "entryNode": "s",
        "nodes": [
            {"id": "s", "type": "on_flow_start", "data": {}},
            {"id": "ag", "type": "agent", "data": {"agentConfig": {"provider": "mlx", "tools": ["web_search"]}}},
        ],
        "edges": [{"source": "s", "sourceHandle": "exec-out", "target": "ag", "targetHandle": "exec-in"}],
    }
    (tmp_path / "helper.json").write_text(json.dumps(helper))
    report = check_flow(path, model=str(dense_model))
    assert [(p.code, p.node_id) for p in report.errors if p.code != "unreachable_node"] == [("network_tool", None)]
    assert "'web_search'" in report.errors[-1].message and "subflow 'helper', node 'ag'" in report.errors[-1].message
    allowed = check_flow(path, model=str(dense_model), allow_network_tools=True)
    assert not [p for p in allowed.errors if p.code in ("network_tool", "subflow_not_found")]


def test_check_command_takes_routes(cli_env, capsys, tmp_path, fanout, dense_model):
    node(fanout, "think")["data"]["effectConfig"].update(provider="lmstudio", model="qwen/qwen3-next-80b")
    routed = tmp_path / "routed.json"
    routed.write_text(json.dumps(fanout))
    code, out, _ = cli(capsys, "check", str(routed), "--json")
    assert code == 1 and [p["code"] for p in json.loads(out)["problems"]] == ["provider_not_served"]
    code, out, _ = cli(capsys, "check", str(routed), "--route", f"lmstudio=mlx:{dense_model}")
    assert code == 0, out


def test_knowledge_graph_memory_is_refused_with_the_node_named(tmp_path, fanout, dense_model):
    # An llm_call that recalls from KG memory, and a KG node: both need a memory service.
    llm = next(n for n in fanout["nodes"] if n["type"] == "llm_call")
    llm["data"].setdefault("pinDefaults", {})["use_kg_memory"] = True
    fanout["nodes"].append({"id": "kg", "type": "memory_kg_query", "data": {"label": "KG"}})
    path = tmp_path / "kg.json"
    path.write_text(json.dumps(fanout))
    report = check_flow(path, model=str(dense_model))
    assert sorted(p.node_id for p in report.errors if p.code == "kg_memory") == sorted([llm["id"], "kg"])
    assert "knowledge-graph memory" in next(p.message for p in report.errors if p.code == "kg_memory")


@pytest.mark.parametrize("index", ["²", "٣", "x"])
def test_a_branch_handle_not_in_ascii_digits_is_an_edge_problem(cli_env, capsys, tmp_path, fanout, dense_model, index):
    """``"²".isdigit()`` is true yet ``int("²")`` raises: ``then:²`` used to pass ``check`` and then
    fail inside ``run``. A branch is ``then:N`` with N in ASCII digits."""
    handle = f"then:{index}"
    node(fanout, "fanout")["data"]["outputs"][1]["id"] = handle
    fanout["edges"][2]["sourceHandle"] = handle
    report = check_flow(fanout, model=str(dense_model))
    assert codes(report) == [("invalid_edge", "fanout", "edges[2].sourceHandle")]
    assert "ASCII digits" in report.errors[0].message
    broken = tmp_path / "branch.json"
    broken.write_text(json.dumps(fanout))
    code, out, err = cli(capsys, "run", str(broken))
    assert code == 1 and out == ""
    assert "[invalid_edge]" in err and "edges[2].sourceHandle" in err
    assert not cli_env.exists()  # refused before the ledger was opened
    # the other branches, in ASCII digits, are still fine
    node(fanout, "fanout")["data"]["outputs"][1]["id"] = fanout["edges"][2]["sourceHandle"] = "then:1"
    assert check_flow(fanout, model=str(dense_model)).ok


def test_a_prompt_cache_key_over_the_limit_is_a_check_problem(fanout, dense_model):
    from abstractruntime_mlx.request import MAX_PROMPT_CACHE_KEY_CHARS

    node(fanout, "plain")["data"]["effectConfig"]["prompt_cache_key"] = "k" * (MAX_PROMPT_CACHE_KEY_CHARS + 1)
    report = check_flow(fanout, vars={"_runtime": {"prompt_cache_key": "r" * 10_000}}, model=str(dense_model))
    assert codes(report) == [
        ("invalid_controls", None, "vars._runtime.prompt_cache_key"),
        ("invalid_controls", "plain", "nodes[2].data.effectConfig.prompt_cache_key"),
    ]
    node(fanout, "plain")["data"]["effectConfig"]["prompt_cache_key"] = "k" * MAX_PROMPT_CACHE_KEY_CHARS
    node(fanout, "mtp2")["data"]["effectConfig"]["prompt_cache_key"] = ""  # reuse off: not a key to check
    assert check_flow(fanout, model=str(dense_model)).ok


@pytest.mark.parametrize("depth", [70, 100_000])
def test_a_flow_nested_too_deep_is_a_clear_error_for_check_and_run(tmp_path, capsys, dense_model, depth):
    """Deeper than the interpreter can read (100k levels) or than any flow nests (70): a named
    problem from check, a one-line refusal from run; never an internal error."""
    from abstractruntime_mlx.runtime_plugin import load_flow

    path = tmp_path / "deep.json"
    path.write_text('{"id": "deep", "nodes": [], "edges": [], "x": ' + "[" * depth + "]" * depth + "}")
    code = main(["check", str(path), "--model", dense_model, "--json"])
    out, _ = capsys.readouterr()
    (problem,) = json.loads(out)["problems"]
    assert code == 1 and problem["code"] == "invalid_document" and "nests deeper than 64 levels" in problem["message"]
    with pytest.raises(ValueError, match="nests deeper than 64 levels"):
        load_flow(str(path))
    code = main(["run", str(path), "--model", dense_model])
    _, err = capsys.readouterr()
    assert code != 0 and "nests deeper than 64 levels" in err and "internal_error" not in err


# ----------------------------------------------------------------- format templates


def _format_flow(template: str, values: object, *, wired: str | None = None) -> dict:
    flow = copy.deepcopy(json.loads((Path(__file__).parent / "flows" / "braces.json").read_text()))
    flow["edges"] = [e for e in flow["edges"] if e["target"] != "fmt"]
    if wired is not None:
        flow["edges"].append({"source": "start", "sourceHandle": wired, "target": "fmt", "targetHandle": wired})
    flow["nodes"][1]["data"]["pinDefaults"] = {"template": template, "values": values}
    return flow


@pytest.mark.parametrize(
    ("template", "values", "wired", "problem"),
    [
        ('Answer as JSON like {"a": 1} about {topic}', {"topic": "t"}, None, '{"a": 1} is not a placeholder'),
        ("about {topic", {"topic": "t"}, None, "is not a format template"),
        ("a } alone", {}, None, "is not a format template"),
        ("about {topic} and {mood}", {"topic": "t"}, None, "reads 'mood', which its values do not have"),
        ('JSON like {{"a": 1}} about {topic} and {topic.upper} {items[0]}', {"topic": "t", "items": [1]}, None, None),
        ("about {mood}", {"topic": "t"}, "values", None),  # the values come on a wire: unknown here
        ('{"a": 1}', {}, "template", None),  # the template comes on a wire: unknown here
    ],
)
def test_format_templates_the_host_would_fail_on_are_errors(dense_model, template, values, wired, problem):
    report = check_flow(_format_flow(template, values, wired=wired), model=str(dense_model))
    found = [p for p in report.problems if p.code == "invalid_format_template"]
    if problem is None:
        assert found == []
    else:
        (one,) = found
        assert one.node_id == "fmt" and one.severity == "error" and problem in one.message
        assert (
            one.field == "nodes[1].data.pinDefaults.template"
            and "{{ and }}" in one.message
            or "KeyError" in one.message
        )
