"""Code node results are bounded in bytes (``--max-code-result-mib``): a result just under the
limit runs, one just over fails the run with ``code_result_limit`` naming the node; a result
larger than ``INLINE_RESULT_BYTES`` is kept as an artifact, not in the ledger's rows, and a
later code node gets the value back. Real code nodes through the real host."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from abstractruntime.storage.artifacts import FileArtifactStore

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.runtime_plugin import DriveLimits, run_flow
from abstractruntime_mlx.runtime_plugin.hosting.code_sandbox import INLINE_RESULT_BYTES, is_result_ref, read_bounded
from test_run_limits import END, START, cli, code_flow, wire, write

MIB = 1024 * 1024


def string_of(n_bytes: int, char: str = "x") -> str:
    """A body returning a string whose JSON (quotes included) is ``n_bytes`` long in UTF-8."""
    per = len(char.encode("utf-8"))
    assert (n_bytes - 2) % per == 0
    return f"return {char!r} * {(n_bytes - 2) // per}"


def code_node(node_id: str, body: str) -> dict[str, object]:
    return {
        "id": node_id,
        "type": "code",
        "data": {
            "codeBody": body,
            "inputs": [{"id": "exec-in", "type": "execution"}, {"id": "x", "type": "any"}],
            "outputs": [{"id": "exec-out", "type": "execution"}, {"id": "output", "type": "any"}],
        },
    }


def pipeline(first: str, second: str) -> dict[str, object]:
    """start -> make (first) -> use (second, x = make's output) -> end (result = use's output)."""
    end = {**END, "data": {"inputs": [{"id": "exec-in", "type": "execution"}, {"id": "result", "type": "any"}]}}
    return {
        "id": "pipeline",
        "entryNode": "start",
        "nodes": [START, code_node("make", first), code_node("use", second), end],
        "edges": [
            wire("start", "make"),
            wire("make", "use"),
            wire("use", "end"),
            {"source": "make", "sourceHandle": "output", "target": "use", "targetHandle": "x"},
            {"source": "use", "sourceHandle": "output", "target": "end", "targetHandle": "result"},
        ],
    }


def ledger_bytes(ledger: Path) -> bytes:
    """The ledger database and its write-ahead log, as on disk."""
    return b"".join(p.read_bytes() for p in (ledger, ledger.with_name(ledger.name + "-wal")) if p.exists())


def test_a_result_just_under_the_limit_is_kept_as_an_artifact_not_in_rows(tmp_path, policy_file):
    ledger = tmp_path / "l.sqlite"
    (run,) = run_flow(code_flow(string_of(MIB)), ledger_url=str(ledger), limits=DriveLimits(max_code_result_mib=1))
    assert run.status == "completed"
    ref = run.output["result"]
    assert is_result_ref(ref) and ref["size_bytes"] == MIB
    artifact = FileArtifactStore(tmp_path / "l.sqlite.artifacts").load(ref["$artifact"])
    assert artifact is not None and artifact.metadata.run_id == run.run_id
    assert json.loads(artifact.content) == "x" * (MIB - 2)
    assert b"x" * 4096 not in ledger_bytes(ledger)  # the rows hold the reference only


def test_a_result_just_over_the_limit_fails_the_run_naming_the_node(cli_env, capsys, tmp_path, dense_model):
    flow = write(tmp_path, code_flow(string_of(MIB + 1)))
    code, out, _ = cli(capsys, "run", flow, "--model", dense_model, "--max-code-result-mib", "1", "--json")
    (run,) = json.loads(out)
    assert code == 1 and run["status"] == "failed"
    assert run["error"].startswith("[code_result_limit] node 'crunch': ")
    assert "--max-code-result-mib" in run["error"]
    assert [f["error"][:19] for f in run["failures"]] == ["[code_result_limit]"]


def test_the_limit_counts_utf8_bytes_not_characters(tmp_path, policy_file):
    ledger = str(tmp_path / "l.sqlite")
    fits = "return 'é' * 1000"  # 2002 bytes of JSON
    (ok,) = run_flow(code_flow(fits), ledger_url=ledger, limits=DriveLimits(max_code_result_mib=1))
    assert (ok.status, ok.output["result"]) == ("completed", "é" * 1000)
    # 700 000 characters fit in 1 MiB, their 1 400 002 bytes do not.
    (over,) = run_flow(code_flow("return 'é' * 700000"), ledger_url=ledger, limits=DriveLimits(max_code_result_mib=1))
    assert over.status == "failed" and over.error.startswith("[code_result_limit] node 'crunch': ")


def test_a_small_result_stays_inline_and_a_later_code_node_gets_a_large_one_back(tmp_path, policy_file):
    ledger = str(tmp_path / "l.sqlite")
    big = "return list(range(100000))"  # about 600 KB of JSON: an artifact
    (run,) = run_flow(pipeline(big, "return [len(x), x[0], x[-1], sum(x)]"), ledger_url=ledger)
    assert run.status == "completed"
    assert run.output["result"] == [100000, 0, 99999, sum(range(100000))]  # the value, not the reference
    small = "return list(range(10))"
    (inline,) = run_flow(pipeline(small, "return x"), ledger_url=ledger)
    assert inline.output["result"] == list(range(10))
    assert len(json.dumps(list(range(100000)))) > INLINE_RESULT_BYTES > len(json.dumps(list(range(10))))


def test_the_result_limit_is_a_flag_of_run_and_runs_resume(cli_env, capsys, tmp_path, dense_model):
    for command in (["run"], ["runs", "resume"]):
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
        assert done.value.code == 0
        assert "--max-code-result-mib MIB size of the JSON of one code node call's result" in out
        assert "fails with code_result_limit (default 64)" in out
    code, _, err = cli(
        capsys, "run", write(tmp_path, code_flow("return 1")), "--model", dense_model, "--max-code-result-mib", "0"
    )
    assert code == 1 and "max_code_result_mib must be an integer >= 1" in err


WRITER = "import os, sys\nchunk = b'y' * (1 << 20)\nfor _ in range(int(sys.argv[1])):\n    os.write(1, chunk)\n"


def test_the_bounded_reader_stops_past_its_limit_and_reads_to_the_end_within_it():
    over = subprocess.Popen([sys.executable, "-c", WRITER, "64"], stdout=subprocess.PIPE)
    try:
        assert over.stdout is not None
        got = read_bounded(over.stdout.fileno(), deadline=time.monotonic() + 60, max_bytes=2 * MIB)
        assert got.outcome == "over" and 2 * MIB < got.size <= 3 * MIB  # 64 MiB were on their way
        assert over.poll() is None  # the writer is left blocked: the caller ends it
    finally:
        over.kill()
        over.wait()
    within = subprocess.Popen([sys.executable, "-c", WRITER, "2"], stdout=subprocess.PIPE)
    assert within.stdout is not None
    got = read_bounded(within.stdout.fileno(), deadline=time.monotonic() + 60, max_bytes=2 * MIB)
    assert within.wait() == 0 and (got.outcome, bytes(got.data)) == ("eof", b"y" * (2 * MIB))


def test_the_bounded_reader_gives_up_at_its_deadline():
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert silent.stdout is not None
        got = read_bounded(silent.stdout.fileno(), deadline=time.monotonic() + 0.2, max_bytes=MIB)
        assert (got.outcome, got.size) == ("timeout", 0)
    finally:
        silent.kill()
        silent.wait()
