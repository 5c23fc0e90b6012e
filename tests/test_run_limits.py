"""Runs end: check refuses execution cycles and recursive subflows; run stops a run past its step,
depth or wall-clock limit, and a code node past its time or memory limit, with a typed code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.runtime_plugin import DriveLimits, run_flow
from abstractruntime_mlx.runtime_plugin.check import check_flow
from abstractruntime_mlx.runtime_plugin.check.cycles import always_run, exec_cycles, subflow_cycles

FLOWS = Path(__file__).parent / "flows"


def wire(source: str, target: str, handle: str = "exec-out", **extra: object) -> dict[str, object]:
    return {"source": source, "sourceHandle": handle, "target": target, "targetHandle": "exec-in", **extra}


def set_var(node_id: str) -> dict[str, object]:
    return {"id": node_id, "type": "set_var", "data": {"pinDefaults": {"name": node_id, "value": 1}}}


START = {"id": "start", "type": "on_flow_start", "data": {}}
END = {"id": "end", "type": "on_flow_end", "data": {}}

CYCLE = {
    "id": "cycle",
    "entryNode": "start",
    "nodes": [START, set_var("a"), set_var("b")],
    "edges": [wire("start", "a"), wire("a", "b"), wire("b", "a")],
}

SPIN = {  # a while loop whose condition never turns false: check lets it through, limits stop it
    "id": "spin",
    "entryNode": "start",
    "nodes": [
        START,
        {"id": "forever", "type": "while", "data": {"pinDefaults": {"condition": True}}},
        set_var("tick"),
        END,
    ],
    "edges": [wire("start", "forever"), wire("forever", "tick", "loop"), wire("forever", "end", "done")],
}


def subflow(flow_id: str, calls: str) -> dict[str, object]:
    return {
        "id": flow_id,
        "entryNode": "start",
        "nodes": [START, {"id": f"call_{calls}", "type": "subflow", "data": {"subflowId": calls}}, END],
        "edges": [wire("start", f"call_{calls}"), wire(f"call_{calls}", "end")],
    }


def code_flow(body: str) -> dict[str, object]:
    return {
        "id": "code",
        "entryNode": "start",
        "nodes": [
            START,
            {
                "id": "crunch",
                "type": "code",
                "data": {
                    "codeBody": body,
                    "inputs": [{"id": "exec-in", "type": "execution"}, {"id": "x", "type": "number"}],
                    "outputs": [{"id": "exec-out", "type": "execution"}, {"id": "output", "type": "any"}],
                    "pinDefaults": {"x": 2},
                },
            },
            {
                "id": "end",
                "type": "on_flow_end",
                "data": {"inputs": [{"id": "exec-in", "type": "execution"}, {"id": "result", "type": "any"}]},
            },
        ],
        "edges": [
            wire("start", "crunch"),
            wire("crunch", "end"),
            {"source": "crunch", "sourceHandle": "output", "target": "end", "targetHandle": "result"},
        ],
    }


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, flow: dict[str, object]) -> str:
    path = tmp_path / f"{flow['id']}.json"
    path.write_text(json.dumps(flow), encoding="utf-8")
    return str(path)


# -- check: cycles and recursion ----------------------------------------------------------


def test_exec_cycle_is_refused_naming_its_nodes(dense_model):
    report = check_flow(CYCLE, model=dense_model)
    (problem,) = report.errors
    assert (problem.code, problem.node_id) == ("exec_cycle", "a")
    assert "'a' -> 'b' -> 'a'" in problem.message


def test_loop_bodies_and_limited_wires_bound_a_cycle():
    assert exec_cycles(json.loads((FLOWS / "loop.json").read_text())) == []
    assert exec_cycles(SPIN) == []
    body_back_to_loop = {**SPIN, "edges": [*SPIN["edges"], wire("tick", "forever")]}
    assert exec_cycles(body_back_to_loop) == []
    limited = {**CYCLE, "edges": [wire("start", "a"), wire("a", "b"), wire("b", "a", data={"loopLimit": {"max": 3}})]}
    assert exec_cycles(limited) == []
    # From the loop's done back into the loop restarts the whole loop forever.
    restart = {
        **SPIN,
        "edges": [
            wire("start", "forever"),
            wire("forever", "tick", "loop"),
            wire("forever", "end", "done"),
            wire("end", "forever"),
        ],
    }
    assert exec_cycles(restart) == [["end", "forever"]]
    assert exec_cycles({**CYCLE, "edges": [wire("start", "a"), wire("a", "a")]}) == [["a"]]


def test_recursive_subflows_are_found_directly_and_through_others():
    assert subflow_cycles([("root", "n1", "s"), ("s", "n2", "s")]) == [[("s", "n2")]]
    assert subflow_cycles([("root", "n1", "a"), ("a", "n2", "b"), ("b", "n3", "a")]) == [[("a", "n2"), ("b", "n3")]]
    assert subflow_cycles([("root", "n1", "a"), ("root", "n2", "a"), ("a", "n3", "b")]) == []


def test_check_and_run_refuse_a_cycle_and_a_recursive_subflow(cli_env, capsys, tmp_path, dense_model):
    cycle = write(tmp_path, CYCLE)
    code, out, _ = cli(capsys, "check", cycle, "--model", dense_model, "--json")
    assert code == 1 and [(p["code"], p["node_id"]) for p in json.loads(out)["problems"]] == [("exec_cycle", "a")]

    write(tmp_path, subflow("inner", "outer"))
    outer = write(tmp_path, subflow("outer", "inner"))
    code, out, _ = cli(capsys, "check", outer, "--model", dense_model, "--json")
    (problem,) = json.loads(out)["problems"]
    assert code == 1 and (problem["code"], problem["node_id"]) == ("recursive_subflow", "call_inner")
    assert "'outer' (node 'call_inner') -> 'inner' (node 'call_outer') -> 'outer'" in problem["message"]

    for flow, expected in ((cycle, "[exec_cycle]"), (outer, "[recursive_subflow]")):
        code, out, err = cli(capsys, "run", flow, "--model", dense_model)
        assert code == 1 and out == "" and expected in err
    assert not cli_env.exists()  # refused before the ledger was opened


def test_recursion_behind_a_condition_is_a_warning(dense_model):
    """A flow that calls itself only on one branch of an ``if`` (the editor's recursive agent
    examples count their iterations down that way) is let through with a warning."""
    guarded = {
        "id": "guarded",
        "entryNode": "start",
        "nodes": [
            START,
            {"id": "more", "type": "if", "data": {"pinDefaults": {"condition": False}}},
            {"id": "again", "type": "subflow", "data": {"subflowId": "guarded"}},
            END,
        ],
        "edges": [wire("start", "more"), wire("more", "again", "true"), wire("more", "end", "false")],
    }
    assert always_run(guarded) == {"start", "more"}
    report = check_flow(guarded, model=dense_model)
    assert report.ok and [(p.code, p.severity) for p in report.problems if p.code == "recursive_subflow"] == [
        ("recursive_subflow", "warning")
    ]
    # the same call on every run is refused
    (problem,) = check_flow(subflow("loops", "loops"), model=dense_model).errors
    assert problem.code == "recursive_subflow" and "without end" in problem.message


# -- run: steps, depth, wall clock ----------------------------------------------------------


def test_run_past_its_step_limit_fails_at_the_node(cli_env, capsys, tmp_path, dense_model):
    code, out, _ = cli(capsys, "run", write(tmp_path, SPIN), "--model", dense_model, "--max-steps", "40", "--json")
    (run,) = json.loads(out)
    assert code == 1 and run["status"] == "failed"
    assert run["error"].startswith("[step_limit] node '")
    assert any(f["error"].startswith("[step_limit]") for f in run["failures"])


@pytest.mark.slow
def test_run_past_its_wall_clock_limit_fails(cli_env, capsys, tmp_path, dense_model):
    code, out, _ = cli(
        capsys,
        "run",
        write(tmp_path, SPIN),
        "--model",
        dense_model,
        "--max-steps",
        "100000000",
        "--max-wall-s",
        "1",
        "--json",
    )
    (run,) = json.loads(out)
    assert code == 1 and run["status"] == "failed" and run["error"].startswith("[wall_time_limit] node '")


def test_a_self_recursive_subflow_stops_at_the_depth_limit(tmp_path, policy_file):
    # run_flow runs no check: the depth limit alone has to stop it.
    (result,) = run_flow(
        subflow("again", "again"), ledger_url=str(tmp_path / "l.sqlite"), limits=DriveLimits(max_depth=3)
    )
    assert result.status == "failed"
    assert "[depth_limit] node 'start': node 'call_again' of 'again' starts a run 4 levels deep" in str(result.error)
    assert len(result.children) == 4


def test_limits_out_of_range_are_refused(cli_env, capsys, tmp_path, dense_model):
    code, _, err = cli(capsys, "run", write(tmp_path, SPIN), "--model", dense_model, "--max-steps", "0")
    assert code == 1 and "max_steps must be an integer >= 1" in err
    code, _, err = cli(capsys, "run", write(tmp_path, SPIN), "--model", dense_model, "--max-code-s", "nan")
    assert code == 1 and "max_code_s must be > 0" in err


# -- code nodes ----------------------------------------------------------------------------


def test_code_nodes_still_run_and_report_their_errors(tmp_path, policy_file):
    (ok,) = run_flow(code_flow("return x * 21"), ledger_url=str(tmp_path / "l.sqlite"))
    assert (ok.status, ok.output) == ("completed", {"result": 42, "success": True})
    (boom,) = run_flow(code_flow('raise ValueError("boom")'), ledger_url=str(tmp_path / "l.sqlite"))
    assert [(f.node_id, f.error) for f in boom.failures] == [("crunch", "Runtime error: boom")]
    (refused,) = run_flow(code_flow("import os\nreturn os.getpid()"), ledger_url=str(tmp_path / "l.sqlite"))
    assert "import of 'os' is not allowed in the sandbox" in refused.failures[0].error


@pytest.mark.slow
def test_a_code_node_that_never_returns_ends_with_the_time_limit(cli_env, capsys, tmp_path, dense_model):
    code, out, _ = cli(
        capsys,
        "run",
        write(tmp_path, code_flow("while True:\n    pass")),
        "--model",
        dense_model,
        "--max-code-s",
        "1",
        "--json",
    )
    (run,) = json.loads(out)
    assert code == 1 and run["status"] == "failed"
    assert run["error"].startswith("[code_time_limit] node 'crunch': ")
    assert [f["error"][:17] for f in run["failures"]] == ["[code_time_limit]"]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is enforced by Linux only")
def test_a_code_node_past_its_memory_limit_fails_with_the_memory_error(cli_env, capsys, tmp_path, dense_model):
    body = "data = 'x' * (1024 * 1024 * 1024)\nreturn len(data)"
    code, out, _ = cli(
        capsys, "run", write(tmp_path, code_flow(body)), "--model", dense_model, "--max-code-mib", "256", "--json"
    )
    (run,) = json.loads(out)
    assert code == 1 and run["status"] == "failed"
    assert run["error"].startswith("[code_memory_limit] node 'crunch': ")
    # The same body under a limit it fits in runs.
    code, out, _ = cli(
        capsys, "run", write(tmp_path, code_flow(body)), "--model", dense_model, "--max-code-mib", "2048", "--json"
    )
    assert code == 0 and json.loads(out)[0]["output"]["result"] == 1024 * 1024 * 1024


def test_the_compiler_still_calls_create_code_handler():
    """``code_sandbox.install`` replaces this one name of the host's compiler."""
    from abstractruntime.visualflow_compiler.visual import executor

    from abstractruntime_mlx.runtime_plugin.hosting import code_sandbox

    code_sandbox.install()
    assert getattr(executor.create_code_handler, "_runs_in_child", False)
    source = Path(executor.__file__).read_text(encoding="utf-8")
    assert "handlers[key] = create_code_handler(code, function_name, permissions=permissions)" in source
