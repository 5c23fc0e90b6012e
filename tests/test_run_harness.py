"""Helpers shared by the run-lock and takeover tests (no tests here): the flow whose driver a
test stops or kills while its second LLM node runs, and stopping that driver between writes."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any


def slow_chain(flow_id: str, *, slow_tokens: int) -> dict[str, Any]:
    """A VisualFlow of two LLM nodes: ``first`` (8 tokens), then ``slow`` (up to ``slow_tokens``,
    speculation off), whose answer is the flow's output ``story``."""
    return {
        "id": flow_id,
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
                "id": "slow",
                "type": "llm_call",
                "data": {
                    "effectConfig": {
                        "provider": "mlx",
                        "temperature": 0,
                        "max_output_tokens": slow_tokens,
                        "speculation": False,
                    },
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
            {"source": "first", "sourceHandle": "exec-out", "target": "slow", "targetHandle": "exec-in"},
            {"source": "slow", "sourceHandle": "exec-out", "target": "end", "targetHandle": "exec-in"},
            {"source": "slow", "sourceHandle": "response", "target": "end", "targetHandle": "story"},
        ],
    }


def wait_until_stopped(pid: int) -> None:
    """Wait until every thread of ``pid`` is stopped (state ``T`` in ``/proc``)."""
    for _ in range(10_000):
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state in ("T", "t", "Z", "X") for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")


def stop_outside_a_write(proc: subprocess.Popen[Any], ledger: Path | None) -> None:
    """SIGSTOP ``proc`` at a moment it holds no write transaction on the SQLite file ``ledger``
    (a process stopped inside one keeps every other writer of the file waiting; it writes phase
    events all the time). ``None``: not SQLite, stop it at once."""
    for _ in range(1000):
        os.kill(proc.pid, signal.SIGSTOP)
        if ledger is None:
            return
        # kill() returns before the signal lands: probe only once the process is stopped, or it
        # may still open a write after the probe and be stopped inside it
        wait_until_stopped(proc.pid)
        db = sqlite3.connect(ledger, timeout=0, isolation_level=None)
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:  # stopped mid-write: let it finish, stop it again
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.005)
        finally:
            db.close()
    raise AssertionError("the process never paused outside a write")
