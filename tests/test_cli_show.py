"""``runs show``: the LLM-call table (controls with their deciding level), the per-call timeline,
and the same information as JSON."""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from pathlib import Path
from typing import Any

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.cli.runs_cmd import format_wait
from abstractruntime_mlx.cli.show_view import calls_table, calls_timeline
from abstractruntime_mlx.inspection import run_view
from abstractruntime_mlx.ledger import Ledger, NodeKey, ProgressEvent, sqlite_url


def _event(key: NodeKey, at: float, **event: Any) -> ProgressEvent:
    return ProgressEvent(
        key=key, event={"kind": "llm", **event}, idempotency_key=f"p:{uuid.uuid4().hex}", created_at=at
    )


def _completed(run_id: str, step_id: str, node_id: str, controls: dict[str, Any], mode: str) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC).isoformat()
    return {
        "run_id": run_id,
        "step_id": step_id,
        "node_id": node_id,
        "status": "completed",
        "attempt": 1,
        "effect": {"type": "llm_call", "payload": {"prompt": "p"}},
        "result": {
            "content": "x",
            "metadata": {
                "controls": controls,
                "execution": {"mode": mode, "peak_batch_size": 2, "queue_s": 0.2},
                "speculation": {"accepted_tokens": 6.0, "drafted_tokens": 8},
            },
        },
        "started_at": now,
        "ended_at": now,
    }


def test_loop_iterations_are_separate_rows_and_bars_with_control_sources(tmp_path: Path) -> None:
    t0 = time.time()
    created = dt.datetime.fromtimestamp(t0, dt.UTC).isoformat()
    with Ledger(sqlite_url(tmp_path / "l.sqlite")) as ledger:
        ledger.save_run(
            {
                "run_id": "r",
                "workflow_id": "loop",
                "status": "completed",
                "created_at": created,
                "updated_at": created,
                "vars": {},
            }
        )
        controls = {
            "speculation": {"mode": "native_mtp", "num_draft_tokens": 2},
            "speculation_source": "run",
            "thinking": False,
            "thinking_source": "node",
        }
        # The node "ask" runs twice (a loop), "judge" once in between.
        for i, (node, step, start) in enumerate((("ask", "s1", 0.0), ("judge", "s2", 1.0), ("ask", "s3", 2.0))):
            key = NodeKey("r", node, workflow_id="loop", step_id=step, attempt=1)
            ledger.append_progress(
                [
                    _event(key, t0 + start, phase="prefill", prompt_tokens=100, elapsed_s=0.0, event_index=0),
                    _event(
                        key,
                        t0 + start + 0.4,
                        phase="generate",
                        prompt_tokens=100,
                        generated_tokens=1,
                        ttft_s=0.4,
                        elapsed_s=0.4,
                        event_index=1,
                    ),
                    _event(
                        key,
                        t0 + start + 0.9,
                        phase="complete",
                        final=True,
                        prompt_tokens=100,
                        generated_tokens=16,
                        tokens_per_second=30.0,
                        finish_reason="stop",
                        elapsed_s=0.9,
                        event_index=2,
                    ),
                ]
            )
            ledger.append_step(_completed("r", step, node, controls, "cohort" if i != 1 else "exclusive"))
        view = run_view(ledger, "r")
    assert view is not None
    table = calls_table(view)
    rows = [line for line in table.splitlines() if line.startswith(("ask", "judge"))]
    assert [r.split()[0] for r in rows] == ["ask", "judge", "ask"] and "#1" in rows[0] and "#2" in rows[2]
    assert "speculation native_mtp(depth=2) ← run" in table and "thinking off ← node" in table
    assert "exclusive" in rows[1] and "75%" in rows[0] and "400ms" in rows[0]
    timeline = calls_timeline(view, width=30)
    bars = [line for line in timeline.splitlines() if "|" in line]
    assert len(bars) == 3
    first, second, third = (b.split("|")[1] for b in bars)
    # Each bar has its queue, prefill and generation cells, in that order, in its own time slot.
    for bar in (first, second, third):
        assert bar.index("·") < bar.index("░") < bar.index("█")
    assert first.rindex("█") < second.index("·") and second.rindex("█") < third.index("·")


def test_node_labels_come_from_the_stored_flow() -> None:
    from abstractruntime_mlx.inspection import node_labels

    flow = {
        "nodes": [
            {"id": "a", "data": {"label": "Ask the user"}},
            {"id": "b", "data": {}},
            {"data": {"label": "no id"}},
            "junk",
        ]
    }
    assert node_labels({"vars": {"_runtime": {"mlx_pack": {"flow": flow}}}}) == {"a": "Ask the user", "b": "b"}
    for state in (
        {},
        {"vars": None},
        {"vars": {"_runtime": "x"}},
        {"vars": {"_runtime": {"mlx_pack": {"flow": {"nodes": None}}}}},
    ):
        assert node_labels(state) == {}


# ----------------------------------------------------------------- control characters in ids

ESCAPES = "\x1b[2J\x1b]0;owned\x07\x9b31m\x7f"
"""Clear the screen, set the window title, a C1 CSI, DEL: what a flow's ids must not do to a terminal."""


def _raw_controls(text: str) -> list[str]:
    return [c for c in text if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0)]


def test_every_view_escapes_control_characters_of_flow_and_node_ids(
    tmp_path: Path, monkeypatch: Any, capsys: Any, dense_model: str
) -> None:
    from abstractruntime_mlx.nodes import default_registry

    monkeypatch.setenv("ABSTRACTCORE_CONFIG_FILE", str(tmp_path / "abstractcore.json"))
    ledger = tmp_path / "runs.sqlite"
    flow_id, node_id = "flow" + ESCAPES, "ask" + ESCAPES
    flow = {
        "id": flow_id,
        "entryNode": "start",
        "nodes": [
            {"id": "start", "type": "on_flow_start", "data": {}},
            {
                "id": node_id,
                "type": "llm_call",
                "data": {
                    "effectConfig": {"provider": "mlx", "temperature": 0, "max_output_tokens": 3},
                    "pinDefaults": {"prompt": "hi"},
                },
            },
            {"id": "end", "type": "on_flow_end", "data": {}},
        ],
        "edges": [
            {"source": "start", "sourceHandle": "exec-out", "target": node_id, "targetHandle": "exec-in"},
            {"source": node_id, "sourceHandle": "exec-out", "target": "end", "targetHandle": "exec-in"},
        ],
    }
    path = tmp_path / "flow.json"
    path.write_text(json.dumps(flow))
    shown = {}
    try:
        for name, argv in (
            ("run", ["run", str(path), "--model", dense_model, "--ledger", str(ledger)]),
            ("list", ["runs", "list", "--ledger", str(ledger)]),
            ("show", ["runs", "show", "--events", "--ledger", str(ledger), "RUN_ID"]),
            ("replay", ["runs", "replay", "--ledger", str(ledger), "RUN_ID"]),
            ("error", ["runs", "show", "--ledger", str(ledger), "absent" + ESCAPES]),
        ):
            if "RUN_ID" in argv:
                with Ledger(sqlite_url(ledger)) as opened:
                    argv[argv.index("RUN_ID")] = opened.list_runs()[0].run_id
            code = main(argv)
            out, err = capsys.readouterr()
            assert code == (1 if name == "error" else 0), err
            shown[name] = out + err
        flow["nodes"][1]["data"]["effectConfig"]["speculaton"] = False  # a problem naming the node
        path.write_text(json.dumps(flow))
        assert main(["check", str(path), "--model", dense_model]) == 1
        shown["check"] = capsys.readouterr().out
        assert main(["run", str(path), "--model", dense_model, "--ledger", str(ledger)]) == 1
        shown["refused run"] = capsys.readouterr().err
    finally:
        default_registry().close()
    for name, text in shown.items():
        assert _raw_controls(text) == [], name
    for name in ("run", "show", "replay", "check", "refused run"):
        assert "ask\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\x7f" in shown[name], name
    assert "flow\\x1b[2J" in shown["list"]  # the list clips the workflow column
    # Nothing is lost: the run completed and every view still tells it.
    assert " completed" in shown["run"] and " completed " in shown["list"] and "completed" in shown["show"]
    assert "error: [run_not_found] no run 'absent\\x1b" in shown["error"]


def test_the_live_table_escapes_control_characters(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from abstractruntime_mlx.cli.live import runs_table

    t0 = time.time()
    created = dt.datetime.fromtimestamp(t0, dt.UTC).isoformat()
    with Ledger(sqlite_url(tmp_path / "l.sqlite")) as ledger:
        ledger.save_run(
            {
                "run_id": "r",
                "workflow_id": "w" + ESCAPES,
                "status": "running",
                "created_at": created,
                "updated_at": created,
                "vars": {},
            }
        )
        key = NodeKey("r", "n" + ESCAPES, workflow_id="w" + ESCAPES, step_id="s1", attempt=1)
        ledger.append_progress([_event(key, t0, phase="prefill", prompt_tokens=10, elapsed_s=0.0, event_index=0)])
        view = run_view(ledger, "r")
    assert view is not None and view.calls
    buffer = io.StringIO()
    Console(file=buffer, width=160, force_terminal=False, no_color=True).print(runs_table([view]))
    text = buffer.getvalue()
    assert _raw_controls(text) == []
    assert "w\\x1b[2J" in text and "n\\x1b[2J" in text


def _waiting_run_with_a_child(path: Path) -> None:
    """Run ``root`` waits for an answer after one LLM call (three phase events); ``child`` is its subflow run."""
    t0 = time.time()
    created = dt.datetime.fromtimestamp(t0, dt.UTC).isoformat()
    waiting = {"reason": "user", "prompt": "Go on?", "wait_key": "k1"}
    with Ledger(sqlite_url(path)) as ledger:
        ledger.save_run(
            {
                "run_id": "root",
                "workflow_id": "main",
                "status": "waiting",
                "created_at": created,
                "updated_at": created,
                "vars": {},
                "current_node": "confirm",
                "waiting": waiting,
            }
        )
        ledger.save_run(
            {
                "run_id": "child",
                "workflow_id": "sub",
                "status": "completed",
                "parent_run_id": "root",
                "created_at": created,
                "updated_at": created,
                "vars": {},
            }
        )
        key = NodeKey("root", "ask", workflow_id="main", step_id="s1", attempt=1)
        ledger.append_progress(
            [
                _event(key, t0, phase="prefill", prompt_tokens=100, elapsed_s=0.0, event_index=0),
                _event(
                    key,
                    t0 + 0.4,
                    phase="generate",
                    prompt_tokens=100,
                    generated_tokens=1,
                    ttft_s=0.4,
                    elapsed_s=0.4,
                    event_index=1,
                ),
                _event(
                    key,
                    t0 + 0.9,
                    phase="complete",
                    final=True,
                    prompt_tokens=100,
                    generated_tokens=16,
                    finish_reason="stop",
                    elapsed_s=0.9,
                    event_index=2,
                ),
            ]
        )
        ledger.append_step(_completed("root", "s1", "ask", {"thinking": False, "thinking_source": "node"}, "cohort"))


def test_runs_show_json_carries_what_the_text_shows(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "l.sqlite"
    _waiting_run_with_a_child(path)
    assert main(["runs", "show", "root", "--ledger", str(path), "--events"]) == 0
    text = capsys.readouterr().out
    assert main(["runs", "show", "root", "--ledger", str(path), "--events", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["run"]["run_id"], shown["run"]["workflow_id"], shown["run"]["status"]) == ("root", "main", "waiting")
    assert shown["waiting"]["prompt"] == "Go on?" and "Go on?" in text
    assert [s["node_id"] for s in shown["steps"]] == ["ask"]
    assert [(n["node_id"], n["result"]["content"]) for n in shown["nodes"]] == [("ask", "x")]
    assert [(c["node_id"], c["execution"]["mode"]) for c in shown["calls"]] == [("ask", "cohort")] and "cohort" in text
    assert [e["phase"] for e in shown["events"]] == ["prefill", "generate", "complete"]
    assert [(c["run"]["run_id"], c["children"]) for c in shown["children"]] == [
        ("child", [])
    ] and "child run child" in text
    assert main(["runs", "show", "root", "--ledger", str(path), "--json"]) == 0
    assert "events" not in json.loads(capsys.readouterr().out)


def test_resume_hints_name_the_real_run_and_event(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "l.sqlite"
    _waiting_run_with_a_child(path)
    assert main(["runs", "show", "ro", "--ledger", str(path)]) == 0
    assert "      abstractruntime-mlx runs resume root --answer TEXT" in capsys.readouterr().out.splitlines()
    # What `run` prints for a run whose subflow waits for an event: the root run's id, the event's name.
    event = {
        "reason": "event",
        "event": "approved",
        "run_id": "child-run",
        "node_id": "gate",
        "wait_key": "evt:session:s1:approved",
    }
    assert format_wait(event, "root-run").endswith("continue with: runs resume root-run --event approved[=JSON]")
    timer = {"reason": "until", "until": "2030-01-01T00:00:00Z", "run_id": "root-run", "node_id": "sleep"}
    assert format_wait(timer, "root-run").endswith("continue with: runs resume root-run")
