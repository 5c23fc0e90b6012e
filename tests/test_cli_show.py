"""``runs show``: the LLM-call table (controls with their deciding level) and the per-call timeline."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from pathlib import Path
from typing import Any

from abstractruntime_mlx.cli.show_view import calls_table, calls_timeline
from abstractruntime_mlx.inspection import run_view
from abstractruntime_mlx.ledger import Ledger, NodeKey, ProgressEvent, sqlite_url


def _event(key: NodeKey, at: float, **event: Any) -> ProgressEvent:
    return ProgressEvent(key=key, event={"kind": "llm", **event}, idempotency_key=f"p:{uuid.uuid4().hex}", created_at=at)


def _completed(run_id: str, step_id: str, node_id: str, controls: dict[str, Any], mode: str) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC).isoformat()
    return {
        "run_id": run_id, "step_id": step_id, "node_id": node_id, "status": "completed", "attempt": 1,
        "effect": {"type": "llm_call", "payload": {"prompt": "p"}},
        "result": {"content": "x", "metadata": {"controls": controls, "execution": {"mode": mode, "peak_batch_size": 2, "queue_s": 0.2},
                                                "speculation": {"accepted_tokens": 6.0, "drafted_tokens": 8}}},
        "started_at": now, "ended_at": now,
    }


def test_loop_iterations_are_separate_rows_and_bars_with_control_sources(tmp_path: Path) -> None:
    t0 = time.time()
    created = dt.datetime.fromtimestamp(t0, dt.UTC).isoformat()
    with Ledger(sqlite_url(tmp_path / "l.sqlite")) as ledger:
        ledger.save_run({"run_id": "r", "workflow_id": "loop", "status": "completed", "created_at": created, "updated_at": created, "vars": {}})
        controls = {"speculation": {"mode": "native_mtp", "num_draft_tokens": 2}, "speculation_source": "run", "thinking": False, "thinking_source": "node"}
        # The node "ask" runs twice (a loop), "judge" once in between.
        for i, (node, step, start) in enumerate((("ask", "s1", 0.0), ("judge", "s2", 1.0), ("ask", "s3", 2.0))):
            key = NodeKey("r", node, workflow_id="loop", step_id=step, attempt=1)
            ledger.append_progress([
                _event(key, t0 + start, phase="prefill", prompt_tokens=100, elapsed_s=0.0, event_index=0),
                _event(key, t0 + start + 0.4, phase="generate", prompt_tokens=100, generated_tokens=1, ttft_s=0.4, elapsed_s=0.4, event_index=1),
                _event(key, t0 + start + 0.9, phase="complete", final=True, prompt_tokens=100, generated_tokens=16, tokens_per_second=30.0, finish_reason="stop", elapsed_s=0.9, event_index=2),
            ])
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

    flow = {"nodes": [{"id": "a", "data": {"label": "Ask the user"}}, {"id": "b", "data": {}}, {"data": {"label": "no id"}}, "junk"]}
    assert node_labels({"vars": {"_runtime": {"mlx_pack": {"flow": flow}}}}) == {"a": "Ask the user", "b": "b"}
    for state in ({}, {"vars": None}, {"vars": {"_runtime": "x"}}, {"vars": {"_runtime": {"mlx_pack": {"flow": {"nodes": None}}}}}):
        assert node_labels(state) == {}
