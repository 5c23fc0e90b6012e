"""A run stores the hash and the path of the flow it started from; when the file changed since,
`runs replay` and `runs resume` say what changed and continue the graph the run started with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.ledger import Ledger, sqlite_url
from abstractruntime_mlx.nodes import default_registry
from abstractruntime_mlx.runtime_plugin.hosting.flowdiff import flow_drift, flow_hash
from abstractruntime_mlx.runtime_plugin.hosting.flows import stored_flow, stored_options

FLOWS = Path(__file__).resolve().parent / "flows"


@pytest.fixture()
def ledger_path(tmp_path, monkeypatch, policy_file):
    path = tmp_path / "runs.sqlite"
    monkeypatch.setenv("ABSTRACTRUNTIME_MLX_LEDGER", str(path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    yield path
    default_registry().close()


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def stored_vars(ledger_path: Path, run_id: str) -> dict:
    with Ledger(sqlite_url(ledger_path)) as ledger:
        detail = ledger.get_run(run_id)
    assert detail is not None
    return detail.state["vars"]


def test_resume_after_the_flow_file_changed_says_what_changed(ledger_path, capsys, tmp_path, dense_model):
    flow_file = tmp_path / "ask.json"
    shutil.copy(FLOWS / "ask.json", flow_file)
    original = json.loads(flow_file.read_text())
    code, out, _ = cli(capsys, "run", flow_file, "--model", dense_model, "--json")
    [result] = json.loads(out)
    assert result["status"] == "waiting"
    run_id = result["run_id"]
    pack_vars = stored_vars(ledger_path, run_id)["_runtime"]["mlx_pack"]
    assert pack_vars["flow_hash"] == flow_hash(original)
    assert pack_vars["source"] == str(flow_file.resolve())
    run_vars = stored_vars(ledger_path, run_id)
    assert flow_drift(stored_flow(run_vars), stored_options(run_vars)) is None  # unchanged file: nothing to say

    edited = json.loads(flow_file.read_text())
    llm = next(n for n in edited["nodes"] if n["id"] == "llm")
    llm["data"]["effectConfig"]["temperature"] = 0.9
    edited["nodes"] = [n for n in edited["nodes"] if n["id"] != "end"]
    edited["edges"] = [e for e in edited["edges"] if "end" not in (e["source"], e["target"])]
    flow_file.write_text(json.dumps(edited))

    code, _, err = cli(capsys, "runs", "replay", run_id, "--no-resume")
    assert f"the flow file {flow_file.resolve()} changed since run {run_id} started" in err
    assert "node 'llm' (llm_call): data.effectConfig.temperature 0 -> 0.9" in err
    assert "node 'end' (on_flow_end) removed" in err and "the run is shown as it ran" in err

    code, out, err = cli(capsys, "runs", "resume", run_id, "--answer", "caches", "--json")
    assert "node 'end' (on_flow_end) removed" in err and "resuming the graph the run started with" in err
    [resumed] = json.loads(out)
    assert code == 0 and resumed["status"] == "completed"  # on the stored graph, `end` included
    [node] = resumed["nodes"]
    assert node["node_id"] == "llm"


def test_replay_compares_with_a_file_given_explicitly(ledger_path, capsys, tmp_path, dense_model):
    code, out, _ = cli(capsys, "run", FLOWS / "ask.json", "--model", dense_model, "--json")
    run_id = json.loads(out)[0]["run_id"]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads((FLOWS / "ask.json").read_text()), "entryNode": "ask"}))
    _, _, err = cli(capsys, "runs", "replay", run_id, "--no-resume", "--flow", other)
    assert 'entryNode "start" -> "ask"' in err
    _, _, err = cli(capsys, "runs", "replay", run_id, "--no-resume", "--flow", tmp_path / "gone.json")
    assert "the file no longer exists" in err
