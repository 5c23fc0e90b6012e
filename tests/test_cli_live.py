"""Live phase progress of ``run``: the plain and rich renderers and the ledger follower."""

from __future__ import annotations

import datetime as dt
import io
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from abstractruntime_mlx.cli.live import LiveRuns, PlainRenderer, pick_mode, runs_table
from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.inspection import run_view
from abstractruntime_mlx.ledger import Ledger, NodeKey, ProgressEvent, sqlite_url

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fanout.json"


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


def _run(run_id: str, status: str = "running") -> dict[str, Any]:
    return {
        "run_id": run_id,
        "workflow_id": "wf",
        "status": status,
        "created_at": _now(),
        "updated_at": _now(),
        "vars": {},
    }


def _event(key: NodeKey, **event: Any) -> ProgressEvent:
    return ProgressEvent(
        key=key, event={"kind": "llm", **event}, idempotency_key=f"p:{uuid.uuid4().hex}", created_at=time.time()
    )


def _step(run_id: str, step_id: str, node_id: str, status: str, result: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "step_id": step_id,
        "node_id": node_id,
        "status": status,
        "attempt": 1,
        "effect": {
            "type": "llm_call",
            "payload": {"prompt": "hi", "params": {"speculation": {"mode": "native_mtp", "num_draft_tokens": 2}}},
        },
        "result": result,
        "started_at": _now(),
        "ended_at": _now() if status == "completed" else None,
    }


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_pick_mode() -> None:
    assert pick_mode(True, FakeTTY()) == "off"
    assert pick_mode(False, FakeTTY()) == "rich"
    assert pick_mode(False, io.StringIO()) == "plain"


def test_plain_lines_one_per_phase_change(tmp_path: Path) -> None:
    with Ledger(sqlite_url(tmp_path / "l.sqlite")) as ledger:
        ledger.save_run(_run("r1"))
        ledger.append_step(_step("r1", "s1", "ask", "started"))
        key = NodeKey("r1", "ask", workflow_id="wf", step_id="s1", attempt=1)
        out = io.StringIO()
        renderer = PlainRenderer(out)

        def lines() -> list[str]:
            view = run_view(ledger, "r1")
            assert view is not None
            before = out.getvalue()
            renderer.update([view])
            return out.getvalue()[len(before) :].splitlines()

        assert lines() == ["[r1] run r1 wf running"]
        ledger.append_progress([_event(key, phase="prefill", prompt_tokens=5642, elapsed_s=0.0, event_index=0)])
        assert lines() == ["[r1] ask  prefill  0 / 5,642 prompt tokens"]
        # More prefill: not a phase change. Prefill then first token between two polls: one line, the change.
        ledger.append_progress(
            [
                _event(
                    key,
                    phase="prefill",
                    prompt_tokens=5642,
                    prefill_processed_tokens=2100,
                    cached_tokens=1024,
                    elapsed_s=0.4,
                    event_index=1,
                ),
                _event(
                    key,
                    phase="generate",
                    execution_mode="cohort",
                    prompt_tokens=5642,
                    cached_tokens=1024,
                    generated_tokens=1,
                    ttft_s=0.9,
                    elapsed_s=0.9,
                    event_index=2,
                ),
            ]
        )
        assert lines() == ["[r1] ask  generate  first token after 900ms  cache hit 1,024 tokens"]
        view = run_view(ledger, "r1")
        assert view is not None and view.calls[0].lane == "cohort"  # known from the events before the result
        assert lines() == []  # nothing moved
        ledger.append_progress(
            [
                _event(
                    key,
                    phase="complete",
                    final=True,
                    prompt_tokens=5642,
                    cached_tokens=1024,
                    generated_tokens=64,
                    tokens_per_second=48.5,
                    finish_reason="stop",
                    elapsed_s=2.2,
                    event_index=3,
                )
            ]
        )
        assert lines() == []  # the call's end is told once its result is recorded
        result = {
            "content": "x",
            "finish_reason": "stop",
            "metadata": {
                "execution": {"mode": "cohort", "queue_s": 0.01},
                "speculation": {"used": True, "accepted_tokens": 30.0, "drafted_tokens": 40},
            },
        }
        ledger.append_step(_step("r1", "s1", "ask", "completed", result))
        ledger.save_run(_run("r1", status="completed"))
        assert lines() == [
            "[r1] ask  completed  lane cohort  prompt 5,642  cache hit 1,024  "
            "generated 64  48.5 tok/s  mtp acceptance 75%  finish stop",
            "[r1] run completed",
        ]


def test_rich_table_shows_each_call_with_bar_and_figures(tmp_path: Path) -> None:
    from rich.console import Console

    with Ledger(sqlite_url(tmp_path / "l.sqlite")) as ledger:
        for run_id in ("run-a", "run-b"):
            ledger.save_run(_run(run_id))
            key = NodeKey(run_id, "summarize", workflow_id="wf", step_id=f"s-{run_id}", attempt=1)
            ledger.append_progress(
                [
                    _event(
                        key,
                        phase="prefill",
                        prompt_tokens=4000,
                        prefill_processed_tokens=1000,
                        cached_tokens=512,
                        elapsed_s=0.2,
                        event_index=0,
                    )
                ]
            )
        views = [v for v in (run_view(ledger, "run-a"), run_view(ledger, "run-b")) if v is not None]
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(runs_table(views))
    text = console.export_text()
    assert text.count("summarize") == 2 and "run-a" in text and "run-b" in text
    assert "1,000/4,000" in text and "512" in text and "prefill" in text


def test_follower_shows_only_runs_started_since(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "l.sqlite")
    with Ledger(url) as ledger:
        ledger.save_run(_run("before", status="completed"))
        since = dt.datetime.now(dt.UTC)
        out = io.StringIO()
        with LiveRuns(url, since=since, mode="plain", out=out, poll_s=0.05) as live:
            ledger.save_run(_run("after"))
        assert [v.summary.run_id for v in live.views] == ["after"]
    assert "before" not in out.getvalue() and "[after] run after wf running" in out.getvalue()


def test_off_mode_writes_nothing(tmp_path: Path) -> None:
    out = io.StringIO()
    with LiveRuns(sqlite_url(tmp_path / "l.sqlite"), since=dt.datetime.now(dt.UTC), mode="off", out=out):
        pass
    assert out.getvalue() == "" and not (tmp_path / "l.sqlite").exists()


@pytest.mark.slow
def test_run_prints_phase_lines_when_not_a_terminal_and_pure_json_with_json(
    cli_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Strict by default (nodes inherit require_acceleration): optional MTP beside the plain
    # branch would run target-only (deferred under load), showing no acceptance.
    assert main(["run", str(EXAMPLE), "--runs", "2", "--speculation", '{"require_acceleration": true}']) == 0
    out = capsys.readouterr().out
    phase_lines = [line for line in out.splitlines() if line.startswith("[")]
    for node in ("plain", "mtp2", "inherit", "think"):
        assert sum(f"] {node}  prefill" in line for line in phase_lines) == 2
        assert sum(f"] {node}  generate  first token after" in line for line in phase_lines) == 2
        assert sum(f"] {node}  completed  lane " in line for line in phase_lines) == 2
    assert sum(line.endswith("] run completed") for line in phase_lines) == 2
    assert any("mtp acceptance" in line for line in phase_lines)
    assert main(["run", str(EXAMPLE), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["status"] == "completed"


def test_rich_mode_leaves_the_final_table(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "l.sqlite")
    out = FakeTTY()
    with Ledger(url) as ledger:
        with LiveRuns(url, since=dt.datetime.now(dt.UTC), mode="rich", out=out, poll_s=0.05):
            ledger.save_run(_run("rich-run"))
            key = NodeKey("rich-run", "summarize", workflow_id="wf", step_id="s1", attempt=1)
            ledger.append_progress(
                [
                    _event(
                        key,
                        phase="prefill",
                        prompt_tokens=5642,
                        prefill_processed_tokens=2100,
                        elapsed_s=0.3,
                        event_index=0,
                    )
                ]
            )
    text = out.getvalue()
    assert "summarize" in text and "2,100/5,642" in text and "rich-run" in text


# ----------------------------------------------------------------- a run tree at 80 columns

LABEL = "Summarise the chapter carefully"
"""A label long enough that a name cut to fit would show; used by two nodes of the flow."""


def _tree_ledger(path: Path) -> Ledger:
    """A root run (its flow stored as ``run`` stores it, two nodes sharing a label, one of them in
    a loop) waiting on a running subflow run, which has one LLM call in prefill."""
    ledger = Ledger(sqlite_url(path))
    flow = {
        "id": "tree",
        "nodes": [{"id": "node-4", "data": {"label": LABEL}}, {"id": "node-7", "data": {"label": LABEL}}],
        "edges": [],
    }
    root = _run("root-run") | {
        "status": "waiting",
        "workflow_id": "tree",
        "waiting": {
            "reason": "subworkflow",
            "wait_key": "subworkflow:child-run",
            "details": {"sub_run_id": "child-run"},
        },
        "vars": {
            "_runtime": {
                "mlx_pack": {
                    "flow": flow,
                    "subflows": {"t_child": {"id": "t_child", "nodes": [{"id": "sum", "data": {"label": "Sum up"}}]}},
                }
            }
        },
    }
    ledger.save_run(root)
    for i, (node, step) in enumerate((("node-4", "a1"), ("node-4", "a2"), ("node-7", "b1"))):
        key = NodeKey("root-run", node, workflow_id="tree", step_id=step, attempt=1)
        ledger.append_progress(
            [
                _event(
                    key,
                    phase="complete",
                    final=True,
                    prompt_tokens=1200 + i,
                    generated_tokens=32,
                    tokens_per_second=41.5,
                    elapsed_s=0.5,
                    event_index=0,
                )
            ]
        )
    ledger.save_run(_run("child-run") | {"workflow_id": "t_child", "parent_run_id": "root-run"})
    key = NodeKey("child-run", "sum", workflow_id="t_child", step_id="c1", attempt=1)
    ledger.append_progress(
        [_event(key, phase="prefill", prompt_tokens=4000, prefill_processed_tokens=1000, elapsed_s=0.2, event_index=0)]
    )
    return ledger


def test_rich_view_nests_child_runs_and_fits_80_columns_without_cutting_names(tmp_path: Path) -> None:
    from rich.console import Console

    with _tree_ledger(tmp_path / "l.sqlite") as ledger:
        views = [v for v in (run_view(ledger, "root-run"), run_view(ledger, "child-run")) if v is not None]
    console = Console(record=True, width=80, file=io.StringIO())
    console.print(runs_table(list(reversed(views)), width=80))
    lines = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines)
    titles = [line for line in lines if "run " in line and ("root-run"[:8] in line or "child-ru" in line)]
    assert titles[0].startswith("run root-run") and "running subflow t_child" in titles[0]
    assert titles[1].startswith("└ run child-ru") and "running" in titles[1]
    # Names too long for their cell wrap there, whole: label, short id (the label repeats), visit.
    header = next(line for line in lines if line.startswith("node "))
    node_column = " ".join(
        line[: header.index("phase")].strip() for line in lines[lines.index(header) + 2 : lines.index(titles[1])]
    )
    assert node_column == f"{LABEL} (node-4) #1 {LABEL} (node-4) #2 {LABEL} (node-7)"
    child_rows = [line for line in lines if "Sum up" in line]
    assert len(child_rows) == 1 and child_rows[0].startswith("  Sum up") and "1,000/4,000" in child_rows[0]


def test_plain_view_tells_child_runs_and_the_subflow_a_root_runs(tmp_path: Path) -> None:
    with _tree_ledger(tmp_path / "l.sqlite") as ledger:
        views = [v for v in (run_view(ledger, "child-run"), run_view(ledger, "root-run")) if v is not None]
    out = io.StringIO()
    PlainRenderer(out).update(views)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[root-run] run root-run tree running subflow t_child"
    assert f"[root-run] {LABEL} (node-4) #2  completed" in lines[2]
    assert "[child-ru] run child-run t_child (child of root-run) running" in lines


def test_runs_list_and_show_at_80_columns_cut_no_id_or_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    path = tmp_path / "l.sqlite"
    _tree_ledger(path).close()
    assert main(["runs", "list", "--ledger", str(path)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].startswith("ledger: ")  # a URL, printed whole
    assert all(len(line) <= 80 for line in listing[1:])
    assert any(line.startswith("root-run ") for line in listing) and any(
        line.startswith("└ child-run ") for line in listing
    )
    assert main(["runs", "show", "root-run", "--ledger", str(path)]) == 0
    shown = capsys.readouterr().out
    assert [line for line in shown.splitlines() if len(line) > 80] == []
    assert f"{LABEL} (node-4) #1" in shown and f"{LABEL} (node-4) #2" in shown and f"{LABEL} (node-7)" in shown
    assert "child run child-run" in shown and "Sum up" in shown


def test_run_warnings_print_one_line_each_once_per_flow(tmp_path: Path) -> None:
    from abstractruntime_mlx.cli.run_cmd import warnings_text
    from abstractruntime_mlx.runtime_plugin.check import CheckReport, Problem

    long_message = "a message\nthat spans lines " + "and goes on " * 30
    report = CheckReport(
        flow_id="f",
        source=None,
        problems=(
            Problem(
                "unreachable_node",
                "node has no wires; the host ignores it",
                node_id="n1",
                label="Note",
                severity="warning",
            ),
            Problem("edge_to_missing_pin", long_message, node_id="n2", severity="warning"),
        ),
    )
    seen = tmp_path / "cache" / "warned-flows"
    first = warnings_text(report, name="flow.json", flow_key="sha256:abc", seen_file=seen).splitlines()
    assert len(first) == 3 and all(len(line) <= 160 for line in first)
    assert first[0] == "warning: node 'n1' (Note): node has no wires; the host ignores it [unreachable_node]"
    assert first[1].startswith("warning: node 'n2': a message that spans lines") and first[1].endswith("…")
    assert "shown once per flow" in first[2] and "abstractruntime-mlx check flow.json" in first[2]
    again = warnings_text(report, name="flow.json", flow_key="sha256:abc", seen_file=seen)
    assert (
        again
        == "flow.json: 2 warnings, shown at its first run (`abstractruntime-mlx check flow.json` lists them in full)"
    )
    other = warnings_text(report, name="other.json", flow_key="sha256:def", seen_file=seen)
    assert len(other.splitlines()) == 3  # another flow's warnings are shown its first time too
