"""CLI: run / runs list / runs show / runs replay, and a run killed with SIGKILL then resumed."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.cli.run_cmd import parse_vars
from abstractruntime_mlx.ledger import Ledger

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fanout.json"


def cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_parse_vars_nests_and_decodes_json():
    assert parse_vars(["topic=caches", "n=3", "_runtime.speculation=false", "_runtime.thinking=low"]) == {
        "topic": "caches",
        "n": 3,
        "_runtime": {"speculation": False, "thinking": "low"},
    }
    with pytest.raises(SystemExit):
        parse_vars(["novalue"])


@pytest.mark.slow
def test_run_list_show_replay_with_the_embedded_model(cli_env, capsys):
    code, out, _ = cli(capsys, "run", str(EXAMPLE), "--runs", "3")
    assert code == 0, out
    assert out.count("mlx_fanout  completed") == 3
    assert "speculation: off (from call)" in out
    assert "speculation: native_mtp(depth=2) (from call)" in out
    assert "thinking: high (from call)" in out
    assert "sibling batch: prefetched, launched by plain" in out
    assert "3/3 runs completed" in out
    assert (Path(os.environ["XDG_CACHE_HOME"]) / "abstractruntime-mlx" / "tiny-hybrid-mtp" / "config.json").exists()
    assert cli_env.exists()

    code, out, _ = cli(capsys, "runs", "list")
    assert code == 0
    with Ledger(f"sqlite:///{cli_env}") as ledger:
        run_ids = [r.run_id for r in ledger.list_runs()]
    assert len(run_ids) == 3 and all(run_id in out for run_id in run_ids)

    code, out, _ = cli(capsys, "runs", "show", run_ids[0][:8], "--events")
    assert code == 0
    for needle in ("steps", "llm_call", "phase timeline", "phase events", "prefill", "complete", "plain", "think"):
        assert needle in out

    code, out, _ = cli(capsys, "runs", "replay", run_ids[0])
    assert code == 0 and "replayed from the ledger" in out and "speculation: off (from call)" in out


def test_run_vars_model_and_json(cli_env, capsys, tmp_path):
    from abstractruntime_mlx.testing import tiny_model

    model = str(tiny_model(tmp_path / "other", kind="dense", seed=1))
    code, out, _ = cli(
        capsys,
        "run",
        str(EXAMPLE),
        "--model",
        model,
        "--var",
        "_runtime.speculation=false",
        "--var",
        "_runtime.thinking=low",
        "--no-sibling-batching",
        "--json",
    )
    assert code == 0
    (run,) = json.loads(out)
    nodes = {n["node_id"]: n["result"] for n in run["nodes"]}
    assert {r["model"] for r in nodes.values()} == {model}
    inherit = nodes["inherit"]["metadata"]["controls"]
    assert inherit == {"speculation": False, "speculation_source": "run", "thinking": "low", "thinking_source": "run"}
    assert nodes["mtp2"]["metadata"]["controls"]["speculation_source"] == "call"
    assert "sibling_batch" not in nodes["mtp2"]["metadata"]


@pytest.mark.slow
def test_unknown_run_id_is_reported(cli_env, capsys):
    cli(capsys, "run", str(EXAMPLE))
    code, out, err = cli(capsys, "runs", "show", "does-not-exist")
    assert code == 1 and out == ""
    assert err.startswith("error: [run_not_found] no run 'does-not-exist'")


SLOW_FLOW = {
    "id": "slow_chain",
    "entryNode": "start",
    "nodes": [
        {"id": "start", "type": "on_flow_start", "data": {}},
        {
            "id": "first",
            "type": "llm_call",
            "data": {
                "effectConfig": {"provider": "mlx", "temperature": 0, "max_output_tokens": 8},
                "pinDefaults": {"prompt": "One."},
            },
        },
        {
            "id": "second",
            "type": "llm_call",
            "data": {
                "effectConfig": {"provider": "mlx", "temperature": 0, "max_output_tokens": 8},
                "pinDefaults": {"prompt": "Two."},
            },
        },
        {
            "id": "slow",
            "type": "llm_call",
            "data": {
                "effectConfig": {"provider": "mlx", "temperature": 0, "max_output_tokens": 1200, "speculation": False},
                "pinDefaults": {"prompt": "Write a long story."},
            },
        },
        {
            "id": "end",
            "type": "on_flow_end",
            "data": {"inputs": [{"id": "exec-in", "type": "execution"}, {"id": "story", "type": "string"}]},
        },
    ],
    "edges": [
        {"source": "start", "sourceHandle": "exec-out", "target": "first", "targetHandle": "exec-in"},
        {"source": "first", "sourceHandle": "exec-out", "target": "second", "targetHandle": "exec-in"},
        {"source": "second", "sourceHandle": "exec-out", "target": "slow", "targetHandle": "exec-in"},
        {"source": "slow", "sourceHandle": "exec-out", "target": "end", "targetHandle": "exec-in"},
        {"source": "slow", "sourceHandle": "response", "target": "end", "targetHandle": "story"},
    ],
}


@pytest.mark.slow
def test_sigkill_mid_run_then_resume(cli_env, capsys, tmp_path, dense_model):
    flow = tmp_path / "slow.json"
    flow.write_text(json.dumps(SLOW_FLOW))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "abstractruntime_mlx.cli.main",
            "run",
            str(flow),
            "--model",
            dense_model,
            "--ledger",
            str(cli_env),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        started = False
        while time.monotonic() < deadline and proc.poll() is None:
            if cli_env.exists():
                with sqlite3.connect(cli_env, timeout=5) as db:
                    try:
                        started = (
                            db.execute("SELECT 1 FROM steps WHERE node_id = 'slow' AND status = 'started'").fetchone()
                            is not None
                        )
                    except sqlite3.OperationalError:
                        started = False  # tables not created yet
            if started:
                break
            time.sleep(0.02)
        assert started, "the slow node never started"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()

    with sqlite3.connect(cli_env) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    with Ledger(f"sqlite:///{cli_env}") as ledger:
        (summary,) = ledger.list_runs()
        assert summary.status == "running"
        before = ledger.run_steps(summary.run_id)
        done = {s.node_id for s in before if s.status == "completed" and s.effect_type == "llm_call"}
        assert done == {"first", "second"}
        assert [r.phase for r in ledger.node_timeline(summary.run_id, "first")][-1] == "complete"
        run_id = summary.run_id

    code, out, _ = cli(capsys, "runs", "show", run_id)
    assert code == 0 and "running at node 'slow'; if no process drives it any more, it was interrupted" in out
    assert f"runs resume {run_id}" in out

    code, out, _ = cli(capsys, "runs", "replay", run_id)
    assert code == 0, out
    assert "resuming" in out and "completed" in out
    with Ledger(f"sqlite:///{cli_env}") as ledger:
        steps = ledger.run_steps(run_id)
        started = [s.node_id for s in steps if s.status == "started" and s.effect_type == "llm_call"]
        assert started.count("first") == 1 and started.count("second") == 1  # not redone
        assert started.count("slow") == 2  # interrupted attempt + the resumed one
        assert ledger.get_run(run_id).status == "completed"
        assert [r.phase for r in ledger.node_timeline(run_id, "slow")][-1] == "complete"
