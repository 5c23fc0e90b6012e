"""Ctrl-C during ``run``: the run is marked ``interrupted`` in the ledger, ``runs show`` says how
to continue it, and ``runs resume`` finishes it without redoing the nodes that had completed.

A real ``abstractruntime-mlx run`` process on the tiny model, stopped with SIGINT once the ledger
shows its first LLM calls completed (a loop of 40 calls, so there is always work left)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.ledger import Ledger, sqlite_url

FLOWS = Path(__file__).resolve().parent / "flows"


def _long_loop(tmp_path: Path) -> Path:
    flow = json.loads((FLOWS / "loop.json").read_text())
    for node in flow["nodes"]:
        if node["id"] == "each":
            node["data"]["pinDefaults"]["items"] = [f"item {i}" for i in range(40)]
        if node["id"] == "llm":
            node["data"]["effectConfig"]["max_output_tokens"] = 48
    path = tmp_path / "long_loop.json"
    path.write_text(json.dumps(flow))
    return path


def _completed_calls(url: str) -> int:
    with Ledger(url) as ledger:
        runs = ledger.list_runs()
        if not runs:
            return 0
        return sum(
            1 for s in ledger.run_steps(runs[0].run_id) if s.effect_type == "llm_call" and s.status == "completed"
        )


@pytest.mark.slow
def test_ctrl_c_marks_the_run_interrupted_and_resume_finishes_it(
    tmp_path: Path, dense_model: str, capsys: pytest.CaptureFixture[str], policy_file: Path
) -> None:
    ledger = tmp_path / "runs.sqlite"
    url = sqlite_url(ledger)
    env = {**os.environ, "ABSTRACTCORE_CONFIG_FILE": str(policy_file)}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "abstractruntime_mlx.cli.main",
            "run",
            str(_long_loop(tmp_path)),
            "--model",
            dense_model,
            "--ledger",
            str(ledger),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job may inherit SIGINT ignored
    )
    try:
        deadline = time.monotonic() + 120
        while not (ledger.exists() and _completed_calls(url) >= 2):
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "the run never reached its second LLM call"
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err
    with Ledger(url) as opened:
        (run,) = opened.list_runs()
    done_before = _completed_calls(url)
    assert run.status == "interrupted" and 2 <= done_before < 40
    assert err.strip().splitlines() == [
        f"interrupted: run {run.run_id} (t_loop); continue: abstractruntime-mlx runs resume {run.run_id}"
    ]

    assert main(["runs", "show", run.run_id[:8], "--ledger", str(ledger)]) == 0
    shown = capsys.readouterr().out
    assert f"    abstractruntime-mlx runs resume {run.run_id}" in shown.splitlines() and "status interrupted" in shown
    assert main(["runs", "list", "--status", "interrupted", "--ledger", str(ledger), "--json"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)] == [run.run_id]

    assert main(["runs", "resume", run.run_id, "--ledger", str(ledger), "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["status"] == "completed" and len(result["nodes"]) == 40
    with Ledger(url) as opened:
        steps = opened.run_steps(run.run_id)
    completed = [s for s in steps if s.effect_type == "llm_call" and s.status == "completed"]
    started = [s for s in steps if s.effect_type == "llm_call" and s.status == "started"]
    # The calls completed before Ctrl-C were not run again: 40 completed calls in all; only the
    # one cut off mid-call started twice.
    assert len(completed) == 40 and len(started) <= 41


def test_resuming_an_unknown_run_is_run_not_found_in_the_library_as_in_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from abstractruntime_mlx.errors import RunNotFound
    from abstractruntime_mlx.runtime_plugin import resume_run

    url = sqlite_url(tmp_path / "runs.sqlite")
    Ledger(url).close()
    with pytest.raises(RunNotFound) as caught:
        resume_run("nope", ledger_url=url)
    assert caught.value.code == "run_not_found"
    assert main(["runs", "resume", "nope", "--ledger", str(tmp_path / "runs.sqlite")]) == 1
    assert capsys.readouterr().err.startswith("error: [run_not_found] no run 'nope'")
