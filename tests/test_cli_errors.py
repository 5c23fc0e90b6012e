"""CLI failure handling: one ``error: [code] message`` line and never a traceback, for typed
errors, bad input, an unwritable path and a disk that fills up mid-run; ``models tiny`` and
``runs`` refusing what they should; ``run`` against a server defaulting to its model."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from abstractruntime_mlx import create_llm
from abstractruntime_mlx.cli.ledger_location import open_for_inspection
from abstractruntime_mlx.cli.main import error_line, main
from abstractruntime_mlx.errors import LedgerError, LedgerNotFound, QueueFull
from abstractruntime_mlx.ledger import Ledger
from abstractruntime_mlx.nodes import default_registry
from abstractruntime_mlx.server import create_app
from abstractruntime_mlx.testing.tiny import read_marker
from test_server_harness import serve_in_thread

SRC = Path(__file__).resolve().parents[1] / "src"


def one_node_flow(path: Path, node_type: str = "llm_call") -> Path:
    flow = {
        "id": "one",
        "entryNode": "start",
        "nodes": [
            {"id": "start", "type": "on_flow_start", "data": {}},
            {
                "id": "ask",
                "type": node_type,
                "data": {
                    "effectConfig": {"provider": "mlx", "temperature": 0, "max_output_tokens": 3},
                    "pinDefaults": {"prompt": "hi"},
                },
            },
            {"id": "end", "type": "on_flow_end", "data": {}},
        ],
        "edges": [
            {"source": "start", "sourceHandle": "exec-out", "target": "ask", "targetHandle": "exec-in"},
            {"source": "ask", "sourceHandle": "exec-out", "target": "end", "targetHandle": "exec-in"},
        ],
    }
    path.write_text(json.dumps(flow))
    return path


def cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy_file: Any) -> Any:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("ABSTRACTRUNTIME_MLX_LEDGER", str(tmp_path / "runs.sqlite"))
    yield tmp_path
    default_registry().close()


# --------------------------------------------------------------------------- the error line


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (QueueFull("busy"), "error: [queue_full] busy"),
        (
            OSError(28, "No space left on device", "/data/l.sqlite"),
            "error: [io_error] No space left on device: '/data/l.sqlite'",
        ),
        (ValueError("bad flow"), "error: [invalid_request] bad flow"),
        (SystemExit("error: --runs must be >= 1"), "error: [invalid_request] --runs must be >= 1"),
    ],
)
def test_error_line_has_a_code_for_every_failure(exc: BaseException, line: str) -> None:
    assert error_line(exc) == line


def test_an_unexpected_exception_is_one_line_naming_the_debug_switch() -> None:
    line = error_line(KeyError("x"))
    assert line.startswith("error: [internal_error] KeyError:") and "ABSTRACTRUNTIME_MLX_DEBUG=1" in line


def test_unknown_node_type_is_one_error_line(cli_env: Path, capsys: Any) -> None:
    flow = one_node_flow(cli_env / "bad.json", node_type="no_such_node")
    code, out, err = cli(capsys, "run", str(flow))
    assert code == 1 and "Traceback" not in out + err
    assert "no_such_node" in err and "no_such_node" not in out


def test_unwritable_ledger_path_is_one_error_line(cli_env: Path, capsys: Any) -> None:
    blocker = cli_env / "file"
    blocker.write_text("not a directory")
    flow = one_node_flow(cli_env / "flow.json")
    code, out, err = cli(capsys, "run", str(flow), "--ledger", str(blocker / "ledger.sqlite"))
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.strip().splitlines() == [err.strip()] and err.startswith("error: [ledger_error] ")


def test_unwritable_model_directory_is_an_io_error(tmp_path: Path, capsys: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, out, err = cli(capsys, "models", "tiny", str(blocker / "model"), "--kind", "dense")
    assert code == 1 and out == ""
    assert err.startswith("error: [io_error] ") and "Traceback" not in err


@pytest.mark.slow
def test_disk_full_mid_run_is_one_error_line_and_nothing_on_stdout(tmp_path: Path, dense_model: str) -> None:
    """A real write failure: the process may write files of at most 100 KiB (RLIMIT_FSIZE),
    so the ledger opens and then fails while the runs are being recorded."""
    flow = one_node_flow(tmp_path / "flow.json")

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (100 * 1024, 100 * 1024))

    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONDONTWRITEBYTECODE": "1"}
    argv = [sys.executable, "-m", "abstractruntime_mlx.cli.main", "run", str(flow), "--runs", "4"]
    argv += ["--model", dense_model, "--ledger", str(tmp_path / "ledger.sqlite")]
    done = subprocess.run(argv, preexec_fn=limit_file_size, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 1
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: [ledger_error] ") and "I/O error" in last


@pytest.mark.slow
def test_no_transformers_banner(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    argv = [
        sys.executable,
        "-m",
        "abstractruntime_mlx.cli.main",
        "models",
        "tiny",
        str(tmp_path / "m"),
        "--kind",
        "dense",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "PyTorch" not in done.stdout + done.stderr


# --------------------------------------------------------------------------- models tiny


def test_models_tiny_refuses_a_non_empty_directory_unless_forced(tmp_path: Path, capsys: Any) -> None:
    target = tmp_path / "m"
    assert cli(capsys, "models", "tiny", str(target), "--kind", "dense")[0] == 0
    assert cli(capsys, "models", "tiny", str(target), "--kind", "dense")[0] == 0  # the same model: kept

    code, out, err = cli(capsys, "models", "tiny", str(target), "--kind", "vision")
    assert code == 1 and out == ""
    assert err.startswith("error: [invalid_request] ") and "--force" in err and "'dense'" in err
    assert read_marker(target)["kind"] == "dense"

    assert cli(capsys, "models", "tiny", str(target), "--kind", "vision", "--force")[0] == 0
    assert read_marker(target)["kind"] == "vision"

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("keep me")
    code, _, err = cli(capsys, "models", "tiny", str(foreign), "--kind", "dense")
    assert code == 1 and "no tiny model" in err
    assert (foreign / "todo.txt").read_text() == "keep me"


# --------------------------------------------------------------------------- runs


@pytest.mark.parametrize(
    "argv",
    [
        ["runs", "list", "--ledger", "LEDGER"],
        ["runs", "show", "abc", "--ledger", "LEDGER"],
        ["runs", "replay", "abc", "--ledger", "LEDGER"],
        ["runs", "resume", "abc", "--answer", "yes", "--ledger", "LEDGER"],
        ["runs", "web", "--port", "0", "--ledger", "LEDGER"],
        ["ledger", "status", "LEDGER"],
        ["ledger", "upgrade", "LEDGER"],
    ],
)
def test_every_command_on_a_missing_ledger_says_ledger_not_found_and_creates_nothing(
    tmp_path: Path, capsys: Any, argv: list[str]
) -> None:
    missing = tmp_path / "nowhere" / "ledger.sqlite"
    code, out, err = cli(capsys, *(str(missing) if a == "LEDGER" else a for a in argv))
    assert code == 1 and out == ""
    assert err.startswith(f"error: [ledger_not_found] no ledger at {missing}")
    assert not missing.parent.exists()


def test_runs_list_rejects_an_unknown_status(tmp_path: Path, capsys: Any) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["runs", "list", "--ledger", str(tmp_path / "l.sqlite"), "--status", "done"])
    assert caught.value.code == 2
    assert "invalid choice: 'done'" in capsys.readouterr().err


def test_inspection_opens_the_ledger_read_only(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "ledger" / "l.sqlite"
    Ledger(f"sqlite:///{path}").close()
    with open_for_inspection(f"sqlite:///{path}") as ledger:
        assert ledger.list_runs() == []
        with pytest.raises(LedgerError, match="readonly"):
            ledger.save_run({"run_id": "r1", "workflow_id": "w", "status": "running"})
    path.chmod(0o444)
    path.parent.chmod(0o555)
    try:
        code, out, err = cli(capsys, "runs", "list", "--ledger", str(path))
        assert code == 0, err
        assert out.splitlines() == [f"ledger: sqlite:///{path}", "no runs"]
    finally:
        path.parent.chmod(0o755)
        path.chmod(0o644)


# --------------------------------------------------------------------------- run against a server


def test_run_against_a_server_uses_its_model_without_model_flag(cli_env: Path, capsys: Any, dense_model: str) -> None:
    llm = create_llm("mlx", model=dense_model)
    try:
        with serve_in_thread(create_app(llm)) as url:
            flow = one_node_flow(cli_env / "flow.json")
            code, out, err = cli(capsys, "run", str(flow), "--var", f"_runtime.base_url={url}", "--json")
    finally:
        llm.unload_model(llm.model)
    assert code == 0, err
    (run,) = json.loads(out)
    assert run["status"] == "completed"
    assert run["nodes"][0]["result"]["model"] == dense_model


def test_serve_refuses_a_model_root_that_is_not_a_directory(tmp_path: Path, capsys: Any) -> None:
    code, out, err = cli(capsys, "serve", "--model-root", str(tmp_path / "missing"), "--port", "1")
    assert code == 1 and out == ""
    assert err.strip() == f"error: [invalid_request] --model-root '{tmp_path / 'missing'}' is not a directory"


def _foreign_sqlite(path: Path) -> bytes:
    """A SQLite file of someone else's (one table of its own, no ledger): its bytes."""
    import sqlite3

    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
        conn.execute("INSERT INTO notes (text) VALUES ('mine')")
    conn.close()
    return path.read_bytes()


@pytest.mark.slow
def test_runs_web_refuses_a_file_that_is_not_a_ledger_and_leaves_it_alone(tmp_path: Path) -> None:
    """The real command: it opens the ledger read-only, so it never creates tables in the file."""
    path = tmp_path / "notes.sqlite"
    before = _foreign_sqlite(path)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    cmd = [sys.executable, "-m", "abstractruntime_mlx.cli.main", "runs", "web", "--ledger", str(path), "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1, done.stderr
    assert (
        done.stderr.startswith("error: [ledger_not_found] ") and "is not an abstractruntime-mlx ledger" in done.stderr
    )
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.sqlite"]


def test_read_only_views_refuse_a_file_that_is_not_a_ledger(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "notes.sqlite"
    before = _foreign_sqlite(path)
    for argv in (["runs", "list"], ["runs", "show", "r1"], ["runs", "replay", "r1"]):
        code, out, err = cli(capsys, *argv, "--ledger", str(path))
        assert (code, out) == (1, "")
        assert err.startswith("error: [ledger_not_found] ") and str(path) in err
    with pytest.raises(LedgerNotFound):
        open_for_inspection(f"sqlite:///{path}")
    assert path.read_bytes() == before
    # A ledger is still opened read-only as before, and an empty SQLite file is no ledger either.
    ledger_path = tmp_path / "ledger.sqlite"
    Ledger(f"sqlite:///{ledger_path}").close()
    assert cli(capsys, "runs", "list", "--ledger", str(ledger_path))[1].splitlines()[-1] == "no runs"
    (tmp_path / "empty.sqlite").touch()
    assert cli(capsys, "runs", "list", "--ledger", str(tmp_path / "empty.sqlite"))[0] == 1
    assert (tmp_path / "empty.sqlite").read_bytes() == b""


# --------------------------------------------------------------------------- a reader that leaves


def _ledger_with_runs(path: Path, count: int) -> Path:
    with Ledger(f"sqlite:///{path}") as ledger:
        for i in range(count):
            ledger.save_run({"run_id": f"r{i:05d}", "workflow_id": "w", "status": "completed"})
    return path


@pytest.mark.slow
def test_a_reader_that_leaves_mid_output_ends_the_command_quietly(tmp_path: Path) -> None:
    """``runs list | head -1`` with more lines than a pipe holds: the command is still writing
    when the reader closes, so the write fails; no error line, status 141 as SIGPIPE gives."""
    ledger = _ledger_with_runs(tmp_path / "l.sqlite", 3000)  # ~300 KiB of lines, a pipe holds 64 KiB
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    argv = [
        sys.executable,
        "-m",
        "abstractruntime_mlx.cli.main",
        "runs",
        "list",
        "--limit",
        "3000",
        "--ledger",
        str(ledger),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"ledger: ")
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141
    assert stderr == b""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "status"),
    [
        (["--help"], 0),  # argparse drops a help text it cannot write
        (["runs", "list"], 141),
        (["runs", "show", "r00000"], 141),
        (["runs", "show", "r00000", "--events"], 141),
    ],
)
def test_a_reader_gone_before_the_output_ends_the_command_quietly(tmp_path: Path, argv: list[str], status: int) -> None:
    """The reader closed its end before the command starts: output that fits in stdout's buffer
    fails only when it is flushed, which must be as quiet as a failed write."""
    ledger = _ledger_with_runs(tmp_path / "l.sqlite", 1)
    env = {**os.environ, "PYTHONPATH": str(SRC), "ABSTRACTRUNTIME_MLX_LEDGER": str(ledger)}
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "abstractruntime_mlx.cli.main", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=env,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (status, b"")
