"""The real ``serve`` command in a subprocess on 127.0.0.1: the load shown on the terminal, one
access-log line per request (``--log-level info``), and ``--ledger`` recording the served calls
(read back through the ledger's query API)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from test_server_harness import start_serve

pytestmark = pytest.mark.slow


def test_serve_logs_loads_and_requests_and_records_them(dense_model: str, tmp_path: Path) -> None:
    from abstractruntime_mlx.ledger import Ledger, sqlite_url
    from abstractruntime_mlx.server.serve_ledger import session_run_id

    ledger_path = tmp_path / "served.sqlite"
    args = ["--model", f"tiny={dense_model}", "--log-level", "info", "--ledger", str(ledger_path)]
    proc, url = start_serve(args, tmp_path, stdout=subprocess.PIPE)
    try:
        with httpx.Client(base_url=url, timeout=60, headers={"X-Session-Affinity": "s-1"}) as http:
            ok = http.post(
                "/v1/chat/completions",
                json={"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
            )
            bad = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "echo": True, "logprobs": 1})
        assert ok.status_code == 200 and bad.status_code == 400
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err  # uvicorn shuts down, then re-raises the signal
    lines = err.splitlines()
    assert any(line.startswith(f"abstractruntime-mlx: loading {dense_model} (") for line in lines), err
    assert any(
        line.startswith(f"abstractruntime-mlx: loaded {dense_model} (") and line.endswith(" s") for line in lines
    ), err
    access = out.splitlines()  # uvicorn writes its access log on stdout
    assert any('"POST /v1/chat/completions HTTP/1.1" 200' in line for line in access), out
    assert any('"POST /v1/completions HTTP/1.1" 400' in line for line in access), out
    assert any("recording served calls in sqlite:///" in line for line in lines), err

    with Ledger(sqlite_url(ledger_path)) as ledger:
        run_id = session_run_id("s-1")
        steps = ledger.run_steps(run_id)
        assert [(s.node_id, s.status) for s in steps] == [("chat", "started"), ("chat", "completed")]
        assert steps[1].record["result"]["usage"]["completion_tokens"] == 3
        assert [r.phase for r in ledger.node_timeline(run_id)][-1] == "complete"
        assert ledger.get_run(run_id).session_id == "s-1"
