"""Runs resume anywhere: ``runs resume --all-running`` takes over the runs whose coordinator is
gone and refuses those a live coordinator still drives.

Two coordinators are two real processes on one ledger (SQLite always; PostgreSQL, where the run
lock is an advisory lock, when ``LEDGER_TEST_URL`` is set): the first, ``run --runs 2``, is
frozen (SIGSTOP) once every run finished its first LLM node and started its second, so it holds
its runs without moving; the second is refused; then the first is SIGKILLed and the second
resumes both runs. Verdicts come from exit codes, the JSON printed and the ledger's steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text

from abstractruntime_mlx.ledger import Ledger
from abstractruntime_mlx.runtime_plugin.hosting.takeover import interrupted_roots
from test_run_harness import slow_chain, stop_outside_a_write

pytestmark = pytest.mark.slow

RUNS = 2
FLOW = slow_chain("takeover_chain", slow_tokens=1500)


def cli(ledger_url: str, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "abstractruntime_mlx.cli.main", *argv, "--ledger", ledger_url],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def takeover(ledger_url: str) -> tuple[int, list[dict[str, object]], str]:
    proc = cli(ledger_url, "runs", "resume", "--all-running", "--json")
    out, err = proc.communicate(timeout=300)
    return proc.returncode, json.loads(out) if out.strip() else [], err


def llm_starts(ledger_url: str, run_id: str) -> list[str]:
    with Ledger(ledger_url) as ledger:
        return sorted(
            s.node_id for s in ledger.run_steps(run_id) if s.effect_type == "llm_call" and s.status == "started"
        )


def steps_of(ledger_url: str, run_ids: list[str]) -> list[tuple[str, int, str, str]]:
    with Ledger(ledger_url) as ledger:
        return [(r, s.seq, s.node_id, s.status) for r in run_ids for s in ledger.run_steps(r)]


def started_second_nodes(ledger_url: str, earlier: set[str]) -> list[str] | None:
    """The new runs, once each has its first node completed and its second started."""
    with Ledger(ledger_url) as ledger:
        runs = [r.run_id for r in ledger.list_runs(limit=100, status="running") if r.run_id not in earlier]
        if len(runs) < RUNS:
            return None
        for run_id in runs:
            steps = {(s.node_id, s.status) for s in ledger.run_steps(run_id)}
            if not {("first", "completed"), ("slow", "started")} <= steps:
                return None
    return runs


@pytest.fixture()
def own_ledger(ledger_url):
    """The ledger URL, on PostgreSQL a database of this test's own: ``--all-running`` takes over
    every interrupted run of a ledger, and other tests leave killed runs in the shared one."""
    if not ledger_url.startswith("postgresql"):
        Ledger(ledger_url).close()  # the ledger exists: takeover never creates one
        yield ledger_url
        return
    url = make_url(ledger_url)
    name = f"takeover_{os.getpid()}_{time.monotonic_ns()}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_a_second_coordinator_refuses_held_runs_then_takes_over_after_the_first_dies(
    own_ledger, dense_model, policy_file, tmp_path
):
    ledger_url = own_ledger
    flow = tmp_path / "chain.json"
    flow.write_text(json.dumps(FLOW))
    with Ledger(ledger_url) as ledger:
        earlier = {r.run_id for r in ledger.list_runs(limit=100_000)}
        assert not (set(interrupted_roots(ledger)) - earlier)

    first = cli(
        ledger_url,
        "run",
        str(flow),
        "--runs",
        str(RUNS),
        "--model",
        dense_model,
        "--artifacts",
        str(tmp_path / "artifacts"),
    )
    try:
        deadline = time.monotonic() + 120
        runs = None
        while runs is None and first.poll() is None and time.monotonic() < deadline:
            runs = started_second_nodes(ledger_url, earlier)
            time.sleep(0.01)
        assert runs is not None, first.communicate(timeout=60)
        sqlite_file = make_url(ledger_url).database if ledger_url.startswith("sqlite") else None
        stop_outside_a_write(
            first, Path(sqlite_file) if sqlite_file else None
        )  # alive, holding its runs' locks, doing nothing

        before = steps_of(ledger_url, runs)
        code, outcomes, err = takeover(ledger_url)
        assert code == 0, err
        mine = {o["run_id"]: o for o in outcomes if o["run_id"] in runs}
        assert set(mine) == set(runs)
        for o in mine.values():
            assert o["takeover"] == "held" and o["status"] is None
            assert o["error"]["code"] == "run_locked"  # type: ignore[index]
        assert steps_of(ledger_url, runs) == before  # refused before anything ran

        first.kill()  # SIGKILL, stopped or not
        assert first.wait(30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate(timeout=60)

    # A lock on PostgreSQL goes when the server sees the dead client's socket closed: a moment later.
    deadline = time.monotonic() + 30
    while True:
        code, outcomes, err = takeover(ledger_url)
        mine = {o["run_id"]: o for o in outcomes if o["run_id"] in runs}
        if not any(o["takeover"] == "held" for o in mine.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert code == 0, err
    assert set(mine) == set(runs)
    for run_id, o in mine.items():
        assert (o["takeover"], o["status"]) == ("resumed", "completed"), o
        assert llm_starts(ledger_url, run_id) == [
            "first",
            "slow",
            "slow",
        ]  # first reused; slow: killed attempt + resume

    code, outcomes, err = takeover(ledger_url)  # nothing is left to take over
    assert code == 0 and not [o for o in outcomes if o["run_id"] in runs], (outcomes, err)


def test_the_command_names_what_it_needs(tmp_path, policy_file):
    ledger = tmp_path / "runs.sqlite"
    done = subprocess.run(
        [sys.executable, "-m", "abstractruntime_mlx.cli.main", "runs", "resume", "--ledger", str(ledger)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and done.stderr.startswith(
        "error: [invalid_request] runs resume needs a RUN_ID, or --all-running"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "abstractruntime_mlx.cli.main",
            "runs",
            "resume",
            "--all-running",
            "--ledger",
            str(ledger),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and done.stderr.startswith("error: [ledger_not_found]")
    Ledger(f"sqlite:///{ledger}").close()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "abstractruntime_mlx.cli.main",
            "runs",
            "resume",
            "--all-running",
            "--answer",
            "A",
            "--ledger",
            str(ledger),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "--answer and --event are for one waiting run" in done.stderr
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "abstractruntime_mlx.cli.main",
            "runs",
            "resume",
            "--all-running",
            "--ledger",
            str(ledger),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.startswith("no interrupted run to take over"), done.stderr
