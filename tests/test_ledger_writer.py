"""ProgressWriter: batching, flush guarantees, surfaced failures, and a SIGKILL mid-write."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from abstractruntime_mlx.errors import LedgerError
from abstractruntime_mlx.ledger import (
    Ledger,
    LedgerTimeout,
    LedgerWriteFailed,
    NodeKey,
    ProgressWriter,
    WriterState,
    sqlite_url,
)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "ledger.db"


@pytest.fixture
def ledger(db_path: Path) -> Iterator[Ledger]:
    store = Ledger(sqlite_url(db_path))
    yield store
    try:
        store.close(timeout_s=5)
    except LedgerError:
        pass  # tests that break the writer on purpose have already checked the error


def _event(index: int, phase: str = "generate") -> dict[str, Any]:
    return {"kind": "llm", "phase": phase, "generated_tokens": index, "event_index": index}


def _count_rows(db_path: Path, run_id: str, node_id: str | None = None) -> int:
    """Read through an independent connection (not the ledger's engine)."""
    with sqlite3.connect(db_path) as conn:
        if node_id is None:
            return int(conn.execute("SELECT COUNT(*) FROM progress WHERE run_id=?", (run_id,)).fetchone()[0])
        return int(
            conn.execute("SELECT COUNT(*) FROM progress WHERE run_id=? AND node_id=?", (run_id, node_id)).fetchone()[0]
        )


def test_flush_makes_rows_visible_to_another_connection(ledger: Ledger, db_path: Path) -> None:
    key = NodeKey("r1", "llm", workflow_id="wf", step_id="s1", attempt=1)
    with ledger.progress_writer() as writer:
        for i in range(500):
            writer.put(_event(i), key)
        writer.flush(key, timeout_s=10)
        assert _count_rows(db_path, "r1") == 500
        assert writer.pending == 0 and writer.committed == 500
    with sqlite3.connect(db_path) as conn:
        seqs = [row[0] for row in conn.execute("SELECT seq FROM progress WHERE run_id='r1' ORDER BY id")]
        indexes = [row[0] for row in conn.execute("SELECT event_index FROM progress WHERE run_id='r1' ORDER BY seq")]
    assert seqs == list(range(1, 501)) and indexes == list(range(500))


def test_flush_by_node_and_by_run(ledger: Ledger, db_path: Path) -> None:
    a = NodeKey("r1", "a", step_id="sa", attempt=1)
    b = NodeKey("r1", "b", step_id="sb", attempt=1)
    other = NodeKey("r2", "a", step_id="sc", attempt=1)
    writer = ledger.progress_writer()
    for i in range(200):
        writer.put(_event(i), a)
        writer.put(_event(i), other)
    writer.flush(a)
    assert _count_rows(db_path, "r1", "a") == 200  # everything of node a so far
    writer.put(_event(0), b)
    writer.flush("r1")
    assert _count_rows(db_path, "r1") == 201
    writer.flush()  # all of it
    assert _count_rows(db_path, "r2") == 200
    writer.flush(NodeKey("r9", "never"))  # nothing enqueued for it: returns at once
    writer.stop()


def test_writer_batches_into_few_transactions(ledger: Ledger, db_path: Path) -> None:
    inserts: list[int] = []

    def count(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if statement.startswith("INSERT INTO progress"):
            inserts.append(len(parameters) if executemany else 1)

    event.listen(ledger._engine, "before_cursor_execute", count)
    key = NodeKey("r1", "llm", step_id="s1", attempt=1)
    n = 5000
    with ledger.progress_writer(max_batch=1000) as writer:
        for i in range(n):
            writer.put(_event(i), key)
        writer.flush(timeout_s=30)
    assert sum(inserts) == n
    assert max(inserts) <= 1000
    assert len(inserts) < n / 10, f"{len(inserts)} statements for {n} rows"


def test_duplicate_events_through_the_writer_are_ignored(ledger: Ledger, db_path: Path) -> None:
    key = NodeKey("r1", "llm", step_id="s1", attempt=1)
    with ledger.progress_writer() as writer:
        keys = [writer.put(_event(i), key) for i in range(10)]
        writer.flush()
        for i in range(10):  # a retried node re-emits the same events
            assert writer.put(_event(i), key) == keys[i]
        writer.put({"phase": "complete"}, key, idempotency_key=keys[0])
        writer.flush()
        assert writer.healthy and writer.error is None
    assert _count_rows(db_path, "r1") == 10


def test_put_copies_the_event(ledger: Ledger) -> None:
    key = NodeKey("r1", "llm")
    reused = {"kind": "llm", "phase": "generate", "generated_tokens": 1}
    with ledger.progress_writer() as writer:
        writer.put(reused, key)
        reused["generated_tokens"] = 2
        writer.put(reused, key)
        writer.flush()
    assert [r.generated_tokens for r in ledger.node_timeline("r1")] == [1, 2]


def test_concurrent_producers(ledger: Ledger, db_path: Path) -> None:
    writer = ledger.progress_writer()
    n_threads, per_thread = 6, 300

    def produce(t: int) -> None:
        key = NodeKey("r1", f"node{t}", step_id=f"s{t}", attempt=1)
        for i in range(per_thread):
            writer.put(_event(i), key)
        writer.flush(key)
        assert _count_rows(db_path, "r1", f"node{t}") == per_thread

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    writer.stop()
    rows = ledger.node_timeline("r1")
    assert [r.seq for r in rows] == list(range(1, n_threads * per_thread + 1))
    for t in range(n_threads):
        assert [r.event_index for r in rows if r.node_id == f"node{t}"] == list(range(per_thread))


def test_two_writers_on_two_engines_share_one_run(ledger_url: str) -> None:
    """Two processes recording one run: seqs stay unique and dense, every row is readable."""
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    stores = [Ledger(ledger_url), Ledger(ledger_url)]
    writers = [store.progress_writer(max_batch=50) for store in stores]
    try:

        def produce(n: int) -> None:
            key = NodeKey(run_id, f"node{n}", step_id=f"s{n}", attempt=1)
            for i in range(400):
                writers[n].put(_event(i), key)
            writers[n].flush(key)

        threads = [threading.Thread(target=produce, args=(n,)) for n in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        rows = stores[1].node_timeline(run_id)
        assert [r.seq for r in rows] == list(range(1, 801))
        for n in range(2):
            assert [r.event_index for r in rows if r.node_id == f"node{n}"] == list(range(400))
    finally:
        for store in stores:
            store.close()


def test_linger_gathers_a_batch_but_flush_does_not_wait_for_it(ledger: Ledger, db_path: Path) -> None:
    key = NodeKey("r1", "llm", step_id="s1", attempt=1)
    writer = ledger.progress_writer(linger_s=30.0)
    for i in range(5):
        writer.put(_event(i), key)
    started = time.monotonic()
    writer.flush(key, timeout_s=10)
    assert time.monotonic() - started < 5
    assert _count_rows(db_path, "r1") == 5
    writer.stop()


def test_rows_commit_without_flush_within_the_linger(ledger: Ledger, db_path: Path) -> None:
    writer = ledger.progress_writer(linger_s=0.05)
    writer.put(_event(0), NodeKey("r1", "llm", step_id="s1", attempt=1))
    full = ledger.progress_writer(linger_s=30.0, max_batch=10)  # a full batch is written at once
    for i in range(10):
        full.put(_event(i), NodeKey("r2", "llm", step_id="s2", attempt=1))
    deadline = time.monotonic() + 5
    while (_count_rows(db_path, "r1"), _count_rows(db_path, "r2")) != (1, 10) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (_count_rows(db_path, "r1"), _count_rows(db_path, "r2")) == (1, 10)
    writer.stop()
    full.stop()


def test_lifecycle_misuse(ledger: Ledger) -> None:
    writer = ProgressWriter(ledger)
    with pytest.raises(RuntimeError, match="UNSTARTED"):
        writer.put(_event(0), NodeKey("r", "n"))
    writer.start()
    with pytest.raises(RuntimeError, match="cannot start"):
        writer.start()
    writer.stop()
    writer.stop()  # idempotent
    assert writer.state is WriterState.STOPPED and not writer.healthy
    with pytest.raises(RuntimeError, match="STOPPED"):
        writer.put(_event(0), NodeKey("r", "n"))
    writer.flush()  # nothing pending: fine after stop


def test_stop_drains_the_queue(ledger: Ledger, db_path: Path) -> None:
    writer = ledger.progress_writer()
    key = NodeKey("r1", "llm", step_id="s1", attempt=1)
    for i in range(2000):
        writer.put(_event(i), key)
    writer.stop(timeout_s=30)
    assert _count_rows(db_path, "r1") == 2000


def test_write_failure_is_surfaced_not_dropped(ledger: Ledger, db_path: Path) -> None:
    writer = ledger.progress_writer()
    key = NodeKey("r1", "llm", step_id="s1", attempt=1)
    writer.put(_event(0), key)
    writer.flush()
    with sqlite3.connect(db_path) as conn:  # a real fault: the table goes away under the writer
        conn.execute("DROP TABLE progress")
    for i in range(1, 4):
        writer.put(_event(i), key)
    with pytest.raises(LedgerWriteFailed) as info:
        writer.flush(timeout_s=10)
    failure = info.value
    assert failure.code == "ledger_error"
    assert failure.details["unwritten_rows"] == 3 and failure.details["committed_rows"] == 1
    assert isinstance(failure.__cause__, LedgerError) and "no such table" in str(failure.__cause__)
    assert writer.state is WriterState.FAILED and not writer.healthy
    assert isinstance(writer.error, LedgerError)
    with pytest.raises(LedgerWriteFailed):  # sticky: the next put raises too
        writer.put(_event(9), key)
    with pytest.raises(LedgerWriteFailed):
        writer.flush(key)
    with pytest.raises(LedgerWriteFailed):
        writer.stop()


def test_flush_timeout_while_the_database_is_locked(db_path: Path) -> None:
    store = Ledger(sqlite_url(db_path), busy_timeout_ms=20_000)
    key = NodeKey("r1", "llm", step_id="s1", attempt=1)
    writer = store.progress_writer()
    blocker = sqlite3.connect(db_path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        writer.put(_event(0), key)
        started = time.monotonic()
        with pytest.raises(LedgerTimeout, match="1 rows not yet committed"):
            writer.flush(timeout_s=0.3)
        assert time.monotonic() - started < 5
        assert writer.healthy  # still waiting on the lock, not failed
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    writer.flush(timeout_s=20)
    assert _count_rows(db_path, "r1") == 1
    store.close()


def test_ledger_close_stops_its_writers(db_path: Path) -> None:
    store = Ledger(sqlite_url(db_path))
    writer = store.progress_writer()
    for i in range(100):
        writer.put(_event(i), NodeKey("r1", "llm", step_id="s", attempt=1))
    store.close()
    assert writer.state is WriterState.STOPPED
    assert _count_rows(db_path, "r1") == 100


_CRASH_SCRIPT = textwrap.dedent(
    """
    import sys
    from abstractruntime_mlx.ledger import Ledger, NodeKey

    ledger = Ledger(sys.argv[1])
    writer = ledger.progress_writer()
    key = NodeKey("crash", "llm", workflow_id="wf", step_id="s", attempt=1)
    i = 0
    while True:
        for _ in range(100):
            writer.put({"kind": "llm", "phase": "generate", "generated_tokens": i, "event_index": i}, key)
            i += 1
        ledger.append_step({"run_id": "crash", "step_id": f"s{i}", "node_id": "llm", "status": "completed",
                            "effect": None, "result": {"i": i}, "attempt": 1})
        writer.flush(key)
        print(i, flush=True)  # every event below i and step s<i> are committed
    """
)


@pytest.mark.slow
def test_sigkill_mid_write_keeps_every_flushed_row(tmp_path: Path, db_path: Path) -> None:
    script = tmp_path / "writer_loop.py"
    script.write_text(_CRASH_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), sqlite_url(db_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    flushed: list[int] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while len(flushed) < 20 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            flushed.append(int(line))
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # mid-write: it was still putting and committing
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    assert len(flushed) >= 20, proc.stderr.read() if proc.stderr else ""
    last = flushed[-1]

    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with Ledger(sqlite_url(db_path)) as store:
        rows = store.node_timeline("crash")
        indexes = [r.event_index for r in rows]
        assert indexes[:last] == list(range(last))  # every flushed row, in order
        steps = store.run_steps("crash")
        # steps and progress rows share the run's sequence: together, no gaps
        assert sorted([r.seq for r in rows] + [s.seq for s in steps]) == list(range(1, len(rows) + len(steps) + 1))
        steps = {r["step_id"] for r in store.list_steps("crash")}
        assert {f"s{i}" for i in flushed} <= steps
