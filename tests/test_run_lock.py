"""One driver per run: the run lock itself (SQLite file lock, PostgreSQL advisory lock), the
drivers that take it (``run_flow``, ``resume_run``), and real CLI processes racing for one run:
two ``runs resume --answer`` at once, two ``runs replay`` after the original ``run`` was killed,
a ``runs replay`` while the original still holds the run.

Every verdict is an outcome read from the exit codes, the ``error: [code]`` lines and the ledger
(how many times a node started), never a duration."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.errors import LedgerError, RunLocked, RunLockUnsafe, RunNotResumable
from abstractruntime_mlx.ledger import Ledger, run_lock, sqlite_url
from abstractruntime_mlx.nodes import default_registry
from abstractruntime_mlx.runtime_plugin import resume_run, run_flow
from test_run_harness import slow_chain, stop_outside_a_write

FLOWS = Path(__file__).resolve().parent / "flows"
ASK = FLOWS / "ask.json"


def save_run(ledger: Ledger, run_id: str, *, parent: str | None = None, status: str = "running") -> None:
    now = "2026-01-01T00:00:00+00:00"
    ledger.save_run(
        {
            "run_id": run_id,
            "workflow_id": "demo",
            "status": status,
            "current_node": "n",
            "vars": {},
            "created_at": now,
            "updated_at": now,
            "parent_run_id": parent,
        }
    )


def fresh_id(name: str) -> str:
    return f"{name}-{os.getpid()}-{time.monotonic_ns()}"  # PostgreSQL tests share a database


# -- the lock ---------------------------------------------------------------------------


def test_a_second_driver_in_this_process_is_refused_until_the_first_lets_go(ledger_url):
    run_id = fresh_id("r")
    with Ledger(ledger_url) as ledger:
        with run_lock.acquire(ledger, run_id, command="first driver") as lock:
            assert lock.held and lock.run_id == run_id
            with pytest.raises(RunLocked) as info:
                run_lock.acquire(ledger, run_id, command="second driver")
            error = info.value
            assert error.code == "run_locked" and error.http_status == 409
            assert error.details["run_id"] == run_id and error.details["lock"] == lock.where
            holder = error.details["holder"]
            assert isinstance(holder, dict)
            if ledger.dialect_name == "sqlite":
                assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
                assert holder["command"] == "first driver"
                assert f"pid {os.getpid()} on host {socket.gethostname()} running `first driver`" in error.message
            else:
                assert (
                    holder["application_name"]
                    == f"abstractruntime-mlx pid={os.getpid()} host={socket.gethostname()} first driver"[:63]
                )
                assert str(holder["application_name"]) in error.message
            other = fresh_id("other")
            with run_lock.acquire(ledger, other):  # other runs are not affected
                pass
        assert not lock.held
        lock.release()  # twice is a no-op
        with run_lock.acquire(ledger, run_id):
            pass


def test_a_child_run_is_covered_by_its_roots_lock(ledger_url):
    root, child, grandchild = fresh_id("root"), fresh_id("child"), fresh_id("grandchild")
    with Ledger(ledger_url) as ledger:
        save_run(ledger, root)
        save_run(ledger, child, parent=root)
        save_run(ledger, grandchild, parent=child)
        assert run_lock.root_run_id(ledger, grandchild) == root
        with run_lock.acquire(ledger, root):
            for run_id in (child, grandchild):
                with pytest.raises(RunLocked) as info:
                    run_lock.acquire(ledger, run_id)
                assert info.value.details["run_id"] == root
        with run_lock.acquire(ledger, grandchild) as lock:
            assert lock.run_id == root
            with pytest.raises(RunLocked):
                run_lock.acquire(ledger, root)


HOLDER = textwrap.dedent(
    """
    import sys
    from abstractruntime_mlx.ledger import Ledger, run_lock
    with Ledger(sys.argv[1]) as ledger:
        lock = run_lock.acquire(ledger, sys.argv[2], command="holder script")
    print("held", flush=True)
    sys.stdin.readline()  # hold until told, or killed
    lock.release()
    print("released", flush=True)
    """
)


def start_holder(url: str, run_id: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, run_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def acquire_once_released(ledger: Ledger, run_id: str) -> run_lock.RunLock:
    """The lock, once the dead holder's lock is gone. A file lock goes with the process; a
    PostgreSQL server ends the session when it reads the closed socket, a moment later."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return run_lock.acquire(ledger, run_id)
        except RunLocked:
            if ledger.dialect_name == "sqlite" or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.slow
def test_a_holder_in_another_process_is_named_and_its_death_releases_the_lock(ledger_url):
    run_id = fresh_id("r")
    proc = start_holder(ledger_url, run_id)
    try:
        with Ledger(ledger_url) as ledger:
            with pytest.raises(RunLocked) as info:
                run_lock.acquire(ledger, run_id)
            holder = info.value.details["holder"]
            assert isinstance(holder, dict)
            if ledger.dialect_name == "sqlite":
                assert (holder["pid"], holder["host"], holder["command"]) == (
                    proc.pid,
                    socket.gethostname(),
                    "holder script",
                )
            else:
                assert str(holder["application_name"]).startswith(f"abstractruntime-mlx pid={proc.pid} ")
            proc.kill()
            assert proc.wait(30) == -signal.SIGKILL
            with acquire_once_released(ledger, run_id) as lock:
                assert lock.held
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_a_holder_that_lets_go_leaves_the_lock_free(ledger_url):
    run_id = fresh_id("r")
    proc = start_holder(ledger_url, run_id)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "released"
    with Ledger(ledger_url) as ledger, run_lock.acquire(ledger, run_id):
        pass
    assert proc.wait(30) == 0


def test_the_lock_file_is_private_describes_its_holder_and_refuses_a_symlink(tmp_path):
    with Ledger(sqlite_url(tmp_path / "ledger.db")) as ledger:
        path = run_lock.lock_path(ledger.database_url, "r1")
        assert path.parent == tmp_path / "ledger.db.locks" and path.suffix == ".lock"
        with run_lock.acquire(ledger, "r1", command="run flow.json") as lock:
            assert lock.where == str(path)
            assert (path.parent.stat().st_mode & 0o777, path.stat().st_mode & 0o777) == (0o700, 0o600)
            written = json.loads(path.read_text())
            assert written == lock.holder and written["command"] == "run flow.json" and written["pid"] == os.getpid()
        assert path.read_text() == ""  # a gone holder is not described

        target = tmp_path / "elsewhere"
        target.write_text("keep")
        victim = run_lock.lock_path(ledger.database_url, "r2")
        victim.symlink_to(target)
        with pytest.raises(RunLockUnsafe, match="is a symlink") as info:
            run_lock.acquire(ledger, "r2")
        assert info.value.code == "run_lock_unsafe" and target.read_text() == "keep"


def make_unsafe(path: Path, kind: str, other: Path) -> None:
    """Put a directory, a FIFO, a symlink to ``other`` or a hard link to ``other`` at ``path``."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "symlink":
        path.symlink_to(other)
    else:
        os.link(other, path)


UNSAFE = {"directory": "is a directory", "fifo": "is a FIFO", "symlink": "is a symlink", "hardlink": "has 2 hard links"}


@pytest.mark.parametrize("kind", sorted(UNSAFE))
def test_a_lock_file_that_is_not_a_private_regular_file_is_refused_untouched(tmp_path, kind):
    other = tmp_path / "precious.txt"
    other.write_text("keep me")
    with Ledger(sqlite_url(tmp_path / "ledger.db")) as ledger:
        path = run_lock.lock_path(ledger.database_url, "r1")
        make_unsafe(path, kind, other)
        with pytest.raises(RunLockUnsafe) as info:
            run_lock.acquire(ledger, "r1")
    assert info.value.code == "run_lock_unsafe" and info.value.http_status == 500
    assert info.value.details == {"run_id": "r1", "lock": str(path), "reason": UNSAFE[kind]}
    assert str(path) in info.value.message and UNSAFE[kind] in info.value.message
    assert other.read_text() == "keep me"  # never truncated, never written
    assert os.path.lexists(path)  # left as it was found


def test_runs_resume_through_a_hard_linked_lock_file_truncates_nothing(ask_run, ledger_url, tmp_path, capsys):
    if not ledger_url.startswith("sqlite"):
        pytest.skip("file locks are SQLite's")
    other = tmp_path / "precious.txt"
    other.write_text("keep me")
    with Ledger(ledger_url) as ledger:
        path = run_lock.lock_path(ledger.database_url, ask_run)
        if path.exists():
            path.unlink()  # the lock file run_flow left (emptied) is replaced by the link
        make_unsafe(path, "hardlink", other)
    code = main(["runs", "resume", ask_run, "--answer", "A", "--ledger", ledger_url])
    _, err = capsys.readouterr()
    assert code == 1 and "[run_lock_unsafe]" in err and "has 2 hard links" in err
    assert other.read_text() == "keep me"
    with Ledger(ledger_url) as ledger:
        assert ledger.get_run(ask_run).status == "waiting"
    assert llm_starts(ledger_url, ask_run) == 0


def test_a_lock_directory_that_is_a_symlink_or_a_file_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with Ledger(sqlite_url(tmp_path / "ledger.db")) as ledger:
        (tmp_path / "ledger.db.locks").symlink_to(elsewhere)
        with pytest.raises(LedgerError, match="is not a directory"):
            run_lock.acquire(ledger, "r1")
        (tmp_path / "ledger.db.locks").unlink()
        (tmp_path / "ledger.db.locks").write_text("")
        with pytest.raises(LedgerError, match="cannot create the run lock directory"):
            run_lock.acquire(ledger, "r1")
    assert list(elsewhere.iterdir()) == []


def test_the_advisory_key_is_a_signed_64_bit_hash_of_the_run_id():
    keys = {run_lock.advisory_key(f"run-{i}") for i in range(1000)}
    assert len(keys) == 1000 and all(-(2**63) <= k < 2**63 for k in keys)
    assert run_lock.advisory_key("run-1") == run_lock.advisory_key("run-1")


# -- the drivers take it ------------------------------------------------------------------


@pytest.fixture()
def ask_run(ledger_url, dense_model, policy_file, tmp_path):
    """A run of ``ask.json`` waiting for its answer."""
    [result] = run_flow(
        ASK, ledger_url=ledger_url, model=dense_model, force_model=True, artifacts_dir=tmp_path / "artifacts"
    )
    assert result.status == "waiting"
    yield result.run_id
    default_registry().close()


def llm_starts(ledger_url: str, run_id: str) -> int:
    with Ledger(ledger_url) as ledger:
        return sum(1 for s in ledger.run_steps(run_id) if s.effect_type == "llm_call" and s.status == "started")


def test_a_held_run_is_not_resumed_and_a_waiting_run_takes_one_answer(ledger_url, ask_run, dense_model):
    with Ledger(ledger_url) as ledger:
        before = len(ledger.run_steps(ask_run))
        with run_lock.acquire(ledger, ask_run, command="another driver"):
            with pytest.raises(RunLocked, match="another driver"):
                resume_run(ask_run, ledger_url=ledger_url, answer="A")
        assert len(ledger.run_steps(ask_run)) == before and ledger.get_run(ask_run).status == "waiting"

    done = resume_run(ask_run, ledger_url=ledger_url, answer="A")
    assert done.status == "completed" and llm_starts(ledger_url, ask_run) == 1

    for kwargs in ({"answer": "B"}, {"event": ("go", {})}, {"refuse_finished": True}):
        with pytest.raises(RunNotResumable) as info:
            resume_run(ask_run, ledger_url=ledger_url, **kwargs)
        assert info.value.code == "run_not_resumable" and info.value.details == {
            "run_id": ask_run,
            "status": "completed",
        }
    assert resume_run(ask_run, ledger_url=ledger_url).status == "completed"  # the library call returns it as it is
    assert llm_starts(ledger_url, ask_run) == 1


def test_run_flow_locks_the_run_before_it_exists(ledger_url, dense_model, policy_file, monkeypatch, tmp_path):
    """``run_flow`` takes the lock on the id it then starts the run with: a resume arriving at
    any point of the run (here: as the run is started) is refused."""
    seen: list[str] = []
    real_acquire = run_lock.acquire

    def spy(ledger, run_id, **kwargs):
        lock = real_acquire(ledger, run_id, **kwargs)
        seen.append(run_id)
        with pytest.raises(RunLocked):
            real_acquire(ledger, run_id)
        return lock

    monkeypatch.setattr(run_lock, "acquire", spy)
    try:
        [result] = run_flow(
            ASK, ledger_url=ledger_url, model=dense_model, force_model=True, artifacts_dir=tmp_path / "artifacts"
        )
    finally:
        default_registry().close()
    assert seen == [result.run_id]
    with Ledger(ledger_url) as ledger, real_acquire(ledger, result.run_id):
        pass  # let go when the run rested


# -- real processes racing ----------------------------------------------------------------


@pytest.fixture()
def cli_ledger(tmp_path, policy_file):
    return tmp_path / "runs.sqlite"


def cli_process(ledger: Path, *argv: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "abstractruntime_mlx.cli.main", *argv, "--ledger", str(ledger)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def error_code(err: str) -> str | None:
    lines = [line for line in err.splitlines() if line.startswith("error: [")]
    return lines[-1].split("]", 1)[0].removeprefix("error: [") if lines else None


def llm_steps(ledger: Path, run_id: str, status: str = "started") -> list:
    with Ledger(sqlite_url(ledger)) as db:
        return [s for s in db.run_steps(run_id) if s.effect_type == "llm_call" and s.status == status]


@pytest.mark.slow
def test_two_answers_at_once_one_drives_the_other_is_refused(cli_ledger, dense_model, tmp_path):
    try:
        waiting = run_flow(ASK, runs=5, ledger_url=sqlite_url(cli_ledger), model=dense_model, force_model=True)
    finally:
        default_registry().close()
    assert [r.status for r in waiting] == ["waiting"] * 5
    for round_, run_id in enumerate(r.run_id for r in waiting):
        racers = {
            answer: cli_process(cli_ledger, "runs", "resume", run_id, "--answer", answer, "--json")
            for answer in ("A", "B")
        }
        outcomes = {answer: finish(proc) for answer, proc in racers.items()}

        winners = [a for a, (code, _, _) in outcomes.items() if code == 0]
        assert len(winners) == 1, (round_, outcomes)
        [winner] = winners
        [loser] = set(outcomes) - {winner}
        code, out, err = outcomes[loser]
        assert code == 1 and out == "" and error_code(err) in ("run_locked", "run_not_resumable"), (round_, err)

        [started] = llm_steps(cli_ledger, run_id)  # the LLM node ran once, on the winner's answer
        assert (
            started.record["effect"]["payload"]["prompt"].splitlines()[-1] == winner
        )  # after the host's metadata line
        [completed] = llm_steps(cli_ledger, run_id, "completed")
        with Ledger(sqlite_url(cli_ledger)) as db:
            run = db.get_run(run_id)
        assert run.status == "completed"
        assert run.state["output"]["response"] == completed.record["result"]["content"]
        [printed] = json.loads(outcomes[winner][1])
        assert printed["output"] == run.state["output"]

    code, out, err = finish(cli_process(cli_ledger, "runs", "resume", run_id, "--answer", "C"))
    assert code == 1 and error_code(err) == "run_not_resumable" and len(llm_steps(cli_ledger, run_id)) == 1


SLOW_FLOW = slow_chain("slow_chain", slow_tokens=600)


def start_slow_run(ledger: Path, flow: Path, model: str) -> tuple[subprocess.Popen[str], str]:
    """``run`` the slow flow in a process and return it with the run id once its node 'slow' started."""
    query = "SELECT run_id FROM steps WHERE node_id = 'slow' AND status = 'started'"

    def started() -> set[str]:
        if not ledger.exists():
            return set()
        with sqlite3.connect(ledger, timeout=5) as db:
            try:
                return {row[0] for row in db.execute(query)}
            except sqlite3.OperationalError:
                return set()  # tables not created yet

    earlier = started()
    proc = cli_process(ledger, "run", str(flow), "--model", model)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        new = started() - earlier
        if new:
            [run_id] = new
            return proc, run_id
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"node 'slow' never started: {proc.communicate()}")


@pytest.mark.slow
def test_two_replays_after_the_driver_was_killed_resume_the_run_once(cli_ledger, dense_model, tmp_path):
    flow = tmp_path / "slow.json"
    flow.write_text(json.dumps(SLOW_FLOW))
    for round_ in range(3):
        proc, run_id = start_slow_run(cli_ledger, flow, dense_model)
        proc.kill()
        assert proc.wait(30) == -signal.SIGKILL
        proc.communicate()

        racers = [cli_process(cli_ledger, "runs", "replay", run_id) for _ in range(2)]
        outcomes = [finish(p) for p in racers]
        resumed = [o for o in outcomes if o[0] == 0 and "resuming" in o[1]]
        assert len(resumed) == 1, (round_, outcomes)
        [(code, out, err)] = [o for o in outcomes if o not in resumed]
        # The other one was refused, or started after the run had completed and only showed it.
        if code == 1:
            assert error_code(err) in ("run_locked", "run_not_resumable"), (round_, err)
        else:
            assert code == 0 and "replayed from the ledger" in out and "resuming" not in out, (round_, out, err)

        starts = [s.node_id for s in llm_steps(cli_ledger, run_id)]
        assert sorted(starts) == ["first", "slow", "slow"], (round_, starts)  # killed attempt + one resume
        with Ledger(sqlite_url(cli_ledger)) as db:
            assert db.get_run(run_id).status == "completed"


@pytest.mark.slow
def test_a_replay_while_the_driver_lives_is_refused_naming_it(cli_ledger, dense_model, tmp_path):
    flow = tmp_path / "slow.json"
    flow.write_text(json.dumps(SLOW_FLOW))
    proc, run_id = start_slow_run(cli_ledger, flow, dense_model)
    try:
        stop_outside_a_write(proc, cli_ledger)  # alive, holding the run, and not finishing it meanwhile
        code, out, err = finish(cli_process(cli_ledger, "runs", "replay", run_id))
        assert code == 1 and error_code(err) == "run_locked", err
        assert f"pid {proc.pid} on host {socket.gethostname()}" in err and f"run {flow}" in err
        code, _, err = finish(cli_process(cli_ledger, "runs", "resume", run_id))
        assert code == 1 and error_code(err) == "run_locked", err
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    code, out, err = finish(proc)
    assert code == 0, err
    assert sorted(s.node_id for s in llm_steps(cli_ledger, run_id)) == ["first", "slow"]
