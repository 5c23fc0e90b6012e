"""The ledger store: schema lifecycle, runs, step records, progress rows, queries, errors.

Every test runs on a real SQLite file; the ones taking ``ledger_url`` also run on PostgreSQL
when ``LEDGER_TEST_URL`` is set (they use fresh run ids, so a shared database is fine).
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import re
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from abstractruntime_mlx.errors import LedgerError
from abstractruntime_mlx.ledger import (
    SCHEMA_REVISION,
    SCHEMA_VERSION,
    DuplicateEvent,
    Ledger,
    LedgerSchemaError,
    NodeKey,
    ProgressEvent,
    host_progress_key,
    progress_idempotency_key,
    sqlite_url,
    wrap_db_errors,
)


@pytest.fixture
def ledger(ledger_url: str) -> Iterator[Ledger]:
    store = Ledger(ledger_url)
    yield store
    store.close()


@pytest.fixture
def sqlite_ledger(tmp_path: Path) -> Iterator[Ledger]:
    store = Ledger(sqlite_url(tmp_path / "ledger.db"))
    yield store
    store.close()


def _rid() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"


def _run(run_id: str, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "run_id": run_id,
        "workflow_id": "wf",
        "status": "running",
        "current_node": "start",
        "vars": {"x": 1},
        "waiting": None,
        "output": None,
        "error": None,
        "created_at": "2026-01-01T00:00:00+00:00",
        "updated_at": "2026-01-01T00:00:01+00:00",
        "actor_id": None,
        "session_id": "sess",
        "parent_run_id": None,
    }
    base.update(over)
    return base


def _step(run_id: str, step_id: str, status: str = "started", **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "run_id": run_id,
        "step_id": step_id,
        "node_id": "llm",
        "status": status,
        "effect": {"type": "llm_call", "payload": {"prompt": "hi"}, "result_key": None},
        "result": None,
        "error": None,
        "started_at": "2026-01-01T00:00:01+00:00",
        "ended_at": None,
        "actor_id": None,
        "session_id": None,
        "attempt": 1,
        "idempotency_key": f"key-{step_id}",
        "prev_hash": None,
        "record_hash": None,
        "signature": None,
    }
    base.update(over)
    return base


def _event(index: int, phase: str = "generate", **over: Any) -> dict[str, Any]:
    event: dict[str, Any] = {"kind": "llm", "phase": phase, "event_index": index}
    event.update(over)
    return event


def _progress(key: NodeKey, events: list[dict[str, Any]]) -> list[ProgressEvent]:
    return [ProgressEvent(key, e, progress_idempotency_key(key, e), 1_767_225_600.0 + i) for i, e in enumerate(events)]


# -- schema lifecycle -------------------------------------------------------------------


def test_fresh_path_creates_schema_and_parent_directory(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "ledger.db"
    with Ledger(sqlite_url(path)) as store:
        assert store.schema_version() == SCHEMA_VERSION
        assert store.dialect_name == "sqlite"
    with sqlite3.connect(path) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"runs", "steps", "progress", "ledger_meta", "ledger_seq_heads"} <= tables
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT value FROM ledger_meta WHERE key='schema_version'").fetchone()[0] == "2"
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(SCHEMA_REVISION,)]


def test_existing_path_reopens_and_reads_back(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "ledger.db")
    key = NodeKey("r1", "llm", workflow_id="wf", step_id="s1", attempt=1)
    with Ledger(url) as first:
        first.save_run(_run("r1"))
        first.append_step(_step("r1", "s1"))
        first.append_progress(_progress(key, [_event(0, "prefill", prompt_tokens=10)]))
    with Ledger(url) as second:  # create_all is idempotent; the version matches
        assert second.load_run("r1") == _run("r1")
        assert second.list_steps("r1") == [_step("r1", "s1")]
        [row] = second.node_timeline("r1")
        assert (row.seq, row.phase, row.prompt_tokens) == (2, "prefill", 10)  # steps and progress share seq
        # the sequence continues where it stopped
        assert second.append_step(_step("r1", "s2")) == 3
        second.append_progress(_progress(key, [_event(1)]))
        assert [r.seq for r in second.node_timeline("r1")] == [2, 4]


def test_newer_schema_revision_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    Ledger(sqlite_url(path)).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num='9999'")
    with pytest.raises(
        LedgerSchemaError, match="schema revision '9999', which this abstractruntime-mlx does not know"
    ) as info:
        Ledger(sqlite_url(path))
    assert info.value.code == "ledger_error"
    assert info.value.details == {"found": "9999", "supported": SCHEMA_REVISION}
    # a database from before revision markers, with a schema_version nobody knows
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE alembic_version")
        conn.execute("UPDATE ledger_meta SET value='99' WHERE key='schema_version'")
    with pytest.raises(LedgerSchemaError, match="schema_version '99' has no revision marker"):
        Ledger(sqlite_url(path))


def test_foreign_tables_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "abstractruntime.db"
    with sqlite3.connect(path) as conn:  # e.g. AbstractRuntime's own SqliteDatabase file
        conn.execute("CREATE TABLE runs (run_id TEXT PRIMARY KEY, run_json TEXT NOT NULL)")
    with pytest.raises(LedgerSchemaError, match=r"tables \['runs'\] exist but were not created"):
        Ledger(sqlite_url(path))


def test_memory_sqlite_is_refused() -> None:
    with pytest.raises(LedgerError, match="in-memory"):
        Ledger("sqlite://")


def test_unknown_driver_is_a_ledger_error() -> None:
    with pytest.raises(LedgerError, match="open ledger"):
        Ledger("nosuchdb://user@host/db")


@pytest.mark.skipif(importlib.util.find_spec("pg8000") is not None, reason="pg8000 is installed")
def test_missing_driver_is_a_ledger_error() -> None:
    with pytest.raises(LedgerError, match="driver is not installed"):
        Ledger("postgresql+pg8000://user@127.0.0.1:1/db")


def test_closed_ledger_refuses_use(tmp_path: Path) -> None:
    store = Ledger(sqlite_url(tmp_path / "l.db"))
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.load_run("r1")


# -- runs -------------------------------------------------------------------------------


def test_runs_save_load_create_if_absent(ledger: Ledger) -> None:
    rid = _rid()
    assert ledger.load_run(rid) is None
    stored, created = ledger.create_run_if_absent(_run(rid))
    assert created and stored == _run(rid)
    stored, created = ledger.create_run_if_absent(_run(rid, vars={"x": 2}))  # never overwrites
    assert not created and stored["vars"] == {"x": 1}
    ledger.save_run(_run(rid, status="completed", updated_at="2026-01-01T00:00:42+00:00", output={"a": 1}))
    assert ledger.load_run(rid) == _run(
        rid, status="completed", updated_at="2026-01-01T00:00:42+00:00", output={"a": 1}
    )
    detail = ledger.get_run(rid)
    assert detail is not None
    assert detail.status == "completed" and detail.duration_s == 42.0 and detail.session_id == "sess"
    assert detail.created_at == dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def test_list_run_states_filters(ledger: Ledger) -> None:
    parent, child, waiting = _rid(), _rid(), _rid()
    wf = f"wf-{uuid.uuid4().hex[:6]}"
    ledger.save_run(_run(parent, workflow_id=wf))
    ledger.save_run(_run(child, workflow_id=wf, parent_run_id=parent, updated_at="2026-01-02T00:00:00Z"))
    ledger.save_run(_run(waiting, workflow_id=wf, status="waiting", waiting={"reason": "user", "wait_key": "k"}))
    ids = [r["run_id"] for r in ledger.list_run_states(workflow_id=wf)]
    assert ids[0] == child and set(ids) == {parent, child, waiting}
    assert [r["run_id"] for r in ledger.list_run_states(parent_run_id=parent)] == [child]
    assert [r["run_id"] for r in ledger.list_run_states(workflow_id=wf, wait_reason="user")] == [waiting]
    assert [r["run_id"] for r in ledger.list_run_states(workflow_id=wf, status="waiting")] == [waiting]
    assert len(ledger.list_run_states(workflow_id=wf, limit=1)) == 1


# -- steps ------------------------------------------------------------------------------


def test_steps_append_in_order_and_round_trip(ledger: Ledger) -> None:
    rid = _rid()
    records = [
        _step(rid, "a"),
        _step(rid, "a", "completed", result={"text": "ok"}, ended_at="2026-01-01T00:00:03+00:00"),
        _step(rid, "b", node_id="other", effect=None, idempotency_key=None, extra_field={"new": True}),
    ]
    assert [ledger.append_step(r) for r in records] == [1, 2, 3]
    assert ledger.list_steps(rid) == records  # unknown fields survive
    assert ledger.last_step(rid) == records[-1]
    assert ledger.list_steps(_rid()) == []
    rows = ledger.run_steps(rid)
    assert [(r.seq, r.step_id, r.status, r.effect_type) for r in rows] == [
        (1, "a", "started", "llm_call"),
        (2, "a", "completed", "llm_call"),
        (3, "b", "started", None),
    ]
    assert rows[1].duration_s == 2.0 and rows[1].record == records[1]


def test_find_completed_result(ledger: Ledger) -> None:
    rid = _rid()
    ledger.append_step(_step(rid, "s1", idempotency_key="k"))
    assert ledger.find_completed_result(rid, "k") is None  # only STARTED
    ledger.append_step(_step(rid, "s1", "failed", idempotency_key="k", error="boom"))
    ledger.append_step(_step(rid, "s2", idempotency_key="k", attempt=2))
    ledger.append_step(_step(rid, "s2", "completed", idempotency_key="k", attempt=2, result={"n": 1}))
    ledger.append_step(_step(rid, "s3", "completed", idempotency_key="k", result={"n": 2}))
    assert ledger.find_completed_result(rid, "k") == {"n": 1}  # oldest completed wins
    assert ledger.find_completed_result(rid, "") is None
    assert ledger.find_completed_result(_rid(), "k") is None


def test_retried_step_append_is_stored_once(ledger: Ledger) -> None:
    rid = _rid()
    record = _step(rid, "s1", "completed", result={"text": "x"})
    assert ledger.append_step(_step(rid, "s1")) == 1
    assert ledger.append_step(record) == 2
    assert ledger.append_step(record) == 2  # the same record again: no new row, same seq
    assert ledger.append_step(_step(rid, "s2")) == 3  # no gap
    assert [r["status"] for r in ledger.list_steps(rid)] == ["started", "completed", "started"]


def test_step_record_needs_identity(ledger: Ledger) -> None:
    with pytest.raises(ValueError, match="run_id"):
        ledger.append_step(_step("", "s1"))
    with pytest.raises(ValueError, match="step_id"):
        ledger.append_step(_step(_rid(), ""))


@pytest.mark.slow
def test_per_run_seq_is_atomic_under_concurrent_appends(ledger_url: str) -> None:
    """8 threads over 2 independent Ledger instances (two engines, as two processes would)."""
    stores = [Ledger(ledger_url), Ledger(ledger_url)]
    rid = _rid()
    threads_n, per_thread = 8, 40
    seqs: dict[int, list[int]] = {t: [] for t in range(threads_n)}
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads_n)

    def worker(t: int) -> None:
        try:
            barrier.wait()
            for i in range(per_thread):
                seqs[t].append(stores[t % 2].append_step(_step(rid, f"t{t}-{i}")))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    try:
        assert not errors, errors
        for t in range(threads_n):
            assert seqs[t] == sorted(seqs[t])  # each appender sees its own appends in order
        all_seqs = sorted(s for values in seqs.values() for s in values)
        assert all_seqs == list(range(1, threads_n * per_thread + 1))  # unique, dense
        listed = stores[0].list_steps(rid)
        assert len(listed) == threads_n * per_thread
        for t in range(threads_n):  # append order within one thread is list order
            mine = [r["step_id"] for r in listed if r["step_id"].startswith(f"t{t}-")]
            assert mine == [f"t{t}-{i}" for i in range(per_thread)]
    finally:
        for store in stores:
            store.close()


# -- progress rows ----------------------------------------------------------------------


def test_progress_absent_keys_are_null(ledger: Ledger) -> None:
    rid = _rid()
    key = NodeKey(rid, "llm", workflow_id="wf", step_id="s1", attempt=1)
    full = {
        "kind": "llm",
        "phase": "complete",
        "prompt_tokens": 12,
        "cached_tokens": 4,
        "fed_tokens": 8,
        "generated_tokens": 30,
        "prefill_processed_tokens": 8,
        "ttft_s": 0.25,
        "tokens_per_second": 42.5,
        "prefill_tokens_per_second": 300,
        "prompt_tokens_per_second": 310.0,
        "elapsed_s": 1.5,
        "event_index": 2,
        "final": True,
        "finish_reason": "stop",
    }
    sparse = {"kind": "llm", "phase": "prefill", "prompt_tokens": 12, "event_index": 0}
    odd = {"kind": "llm", "phase": "generate", "generated_tokens": "many", "final": 1, "event_index": 1}
    assert ledger.append_progress(_progress(key, [sparse, odd, full])) == 3
    first, second, third = ledger.node_timeline(rid)
    assert first.event == sparse and first.prompt_tokens == 12
    for name in (
        "cached_tokens",
        "fed_tokens",
        "generated_tokens",
        "prefill_processed_tokens",
        "ttft_s",
        "tokens_per_second",
        "prefill_tokens_per_second",
        "elapsed_s",
        "final",
        "finish_reason",
    ):
        assert getattr(first, name) is None, name
    # a value of the wrong type projects to NULL; the event keeps it
    assert second.generated_tokens is None and second.final is None and second.event == odd
    assert (third.ttft_s, third.tokens_per_second, third.prefill_tokens_per_second) == (0.25, 42.5, 300.0)
    assert (third.final, third.finish_reason, third.generated_tokens) == (True, "stop", 30)
    assert (third.workflow_id, third.step_id, third.attempt) == ("wf", "s1", 1)
    assert third.event == full and third.created_at.tzinfo is not None


def test_progress_idempotency_key_twice_is_one_row(ledger: Ledger) -> None:
    rid = _rid()
    key = NodeKey(rid, "llm", step_id="s1", attempt=1)
    batch = _progress(key, [_event(0), _event(1)])
    assert ledger.append_progress(batch) == 2
    assert ledger.append_progress(batch) == 0  # the whole batch retried
    assert ledger.append_progress(batch[:1] + batch[:1] + _progress(key, [_event(2)])[:1]) == 1
    explicit = ProgressEvent(key, _event(7), f"my-key-{rid}", 0.0)
    assert ledger.append_progress([explicit, explicit]) == 1
    rows = ledger.node_timeline(rid)
    assert [r.seq for r in rows] == [1, 2, 3, 4]  # no gaps left by skipped duplicates
    assert [r.idempotency_key for r in rows][-1] == f"my-key-{rid}"


def test_default_progress_key() -> None:
    with_step = NodeKey("r", "n", step_id="s", attempt=2)
    # AbstractRuntime's form, system:progress:<step_id>:<12 hex>, deterministic for a known event
    key = progress_idempotency_key(with_step, _event(3))
    assert key == progress_idempotency_key(with_step, _event(3))
    assert re.fullmatch(r"system:progress:s:[0-9a-f]{12}", key)
    assert key == host_progress_key("s", "progress:r:s:2:generate:3")
    assert progress_idempotency_key(with_step, _event(3, "prefill")) != progress_idempotency_key(with_step, _event(3))
    # without a step id (or an event index) events cannot be told apart: never deduplicated
    no_step = NodeKey("r", "n")
    assert progress_idempotency_key(no_step, _event(3)) != progress_idempotency_key(no_step, _event(3))
    assert progress_idempotency_key(no_step, _event(3)).startswith("system:progress:r:")
    with pytest.raises(ValueError, match="run_id"):
        NodeKey("", "n")


def test_node_timeline_orders_by_seq_and_filters(ledger: Ledger) -> None:
    rid = _rid()
    a = NodeKey(rid, "a", step_id="sa", attempt=1)
    b = NodeKey(rid, "b", step_id="sb", attempt=1)
    ledger.append_progress(_progress(a, [_event(0)]) + _progress(b, [_event(0)]) + _progress(a, [_event(1)]))
    assert [(r.seq, r.node_id) for r in ledger.node_timeline(rid)] == [(1, "a"), (2, "b"), (3, "a")]
    assert [r.seq for r in ledger.node_timeline(rid, "a")] == [1, 3]
    assert ledger.node_timeline(rid, "nope") == []


def test_list_runs_and_get_run(ledger: Ledger) -> None:
    wf = f"wf-{uuid.uuid4().hex[:6]}"
    old, new = _rid(), _rid()
    ledger.save_run(_run(old, workflow_id=wf, status="completed", updated_at="2099-01-01T00:00:10+00:00"))
    ledger.save_run(
        _run(
            new,
            workflow_id=wf,
            created_at="2099-01-02T00:00:00+00:00",
            updated_at="2099-01-02T00:00:02.500000+00:00",
        )
    )
    for step_id, node in (("1", "a"), ("2", "b"), ("3", "a")):
        ledger.append_step(_step(new, step_id, node_id=node))
    ledger.append_progress(_progress(NodeKey(new, "a", step_id="1"), [_event(0), _event(1)]))
    runs = [r for r in ledger.list_runs(limit=1000) if r.workflow_id == wf]
    assert [r.run_id for r in runs] == [new, old]
    top = runs[0]
    assert (top.status, top.duration_s, top.node_count, top.progress_count) == ("running", 2.5, 2, 2)
    assert (runs[1].node_count, runs[1].progress_count) == (0, 0)
    completed = [r.run_id for r in ledger.list_runs(limit=1000, status="completed")]
    assert old in completed and new not in completed
    assert len(ledger.list_runs(limit=1)) == 1
    detail = ledger.get_run(new)
    assert detail is not None and detail.step_count == 3 and detail.state["run_id"] == new
    assert ledger.get_run(_rid()) is None


# -- errors -----------------------------------------------------------------------------


def test_wrap_db_errors_maps_and_chains(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "l.db")
    Ledger(url).close()
    engine = create_engine(url)
    try:
        with pytest.raises(DuplicateEvent) as dup, engine.begin() as conn, wrap_db_errors("insert meta"):
            conn.execute(text("INSERT INTO ledger_meta (key, value) VALUES ('schema_version', '1')"))
        assert isinstance(dup.value, LedgerError) and dup.value.__cause__ is not None
        assert str(dup.value).startswith("insert meta: duplicate key")
        with pytest.raises(LedgerError) as other, engine.begin() as conn, wrap_db_errors("select"):
            conn.execute(text("SELECT * FROM no_such_table"))
        assert not isinstance(other.value, DuplicateEvent)
        assert "no such table" in str(other.value)
        with pytest.raises(LedgerError, match="integrity error") as nn, engine.begin() as conn, wrap_db_errors("nn"):
            conn.execute(text("INSERT INTO ledger_meta (key, value) VALUES ('k', NULL)"))
        assert not isinstance(nn.value, DuplicateEvent)
    finally:
        engine.dispose()


def test_database_errors_surface_as_ledger_errors(sqlite_ledger: Ledger, tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        conn.execute("DROP TABLE steps")
    with pytest.raises(LedgerError, match="append step s1 of run r1: database error") as info:
        sqlite_ledger.append_step(_step("r1", "s1"))
    assert info.value.__cause__ is not None
