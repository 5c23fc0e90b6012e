"""Schema migrations, tested on a ledger written by the first release's schema (revision 0001),
committed as ``fixtures/ledger-rev1.sqlite`` (two runs of examples/fanout.json), on SQLite and,
when ``LEDGER_TEST_URL`` is set, on PostgreSQL (the same rows copied into a revision-0001 schema)."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import shutil
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import MetaData, Table, create_engine, select, text
from sqlalchemy.engine import make_url

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.ledger import SCHEMA_REVISION, Ledger, LedgerSchemaError, NodeKey, ProgressEvent, sqlite_url
from abstractruntime_mlx.ledger.keys import progress_idempotency_key
from abstractruntime_mlx.ledger.models import Base
from abstractruntime_mlx.ledger.schema import MIGRATIONS_DIR

FIXTURE = Path(__file__).parent / "fixtures" / "ledger-rev1.sqlite"
PG_URL = os.environ.get("LEDGER_TEST_URL")
REV1_TABLES = ("runs", "steps", "progress", "ledger_seq_heads")


def fixture_rows(table: str) -> list[dict[str, Any]]:
    with sqlite3.connect(FIXTURE) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(row) for row in conn.execute(f"SELECT * FROM {table} ORDER BY 1")]  # noqa: S608


def alembic(connection: Any) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def _utc(value: Any) -> Any:
    return value.replace(tzinfo=dt.UTC) if isinstance(value, dt.datetime) and value.tzinfo is None else value


def _copy_fixture_into(url: str) -> None:
    """A revision-0001 schema made by the migrations, holding the fixture's rows."""
    source = create_engine(sqlite_url(FIXTURE))
    target = create_engine(url)
    try:
        with target.begin() as conn:
            command.upgrade(alembic(conn), "0001")
        with source.connect() as src, target.begin() as dst:
            for name in REV1_TABLES:
                rows = [
                    {k: _utc(v) for k, v in row._mapping.items()}
                    for row in src.execute(select(Table(name, MetaData(), autoload_with=src)))
                ]
                dst.execute(Table(name, MetaData(), autoload_with=dst).insert(), rows)
            for name in ("steps", "progress"):
                dst.execute(
                    text(f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), (SELECT max(id) FROM {name}))")
                )
    finally:
        source.dispose()
        target.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def old_ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a ledger at revision 0001 holding the fixture's runs."""
    if request.param == "sqlite":
        path = tmp_path / "ledger.sqlite"
        shutil.copy(FIXTURE, path)
        yield sqlite_url(path)
        return
    if not PG_URL:
        pytest.skip("LEDGER_TEST_URL is not set")
    schema = f"mig_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = (
        make_url(PG_URL).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)
    )
    try:
        _copy_fixture_into(url)
        yield url
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def revision_of(url: str) -> str:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return str(MigrationContext.configure(conn).get_current_revision() or "legacy")
    finally:
        engine.dispose()


def test_an_older_ledger_is_refused_with_the_command_and_left_alone(old_ledger):
    before = revision_of(old_ledger)
    with pytest.raises(LedgerSchemaError, match="ledger upgrade") as info:
        Ledger(old_ledger)
    assert info.value.details["found"] == "0001" and info.value.details["supported"] == SCHEMA_REVISION
    assert "abstractruntime-mlx ledger upgrade" in info.value.details["command"]
    assert revision_of(old_ledger) == before  # nothing was changed


def test_upgrade_keeps_every_row_and_presents_host_records(old_ledger):
    old_steps = fixture_rows("steps")
    old_progress = fixture_rows("progress")
    with Ledger(old_ledger, upgrade=True) as ledger:
        assert ledger.upgraded_from == "0001"
        assert ledger.schema_revision() == SCHEMA_REVISION and ledger.schema_version() == 2
        runs = ledger.list_runs()
        assert {r.run_id for r in runs} == {row["run_id"] for row in old_steps}
        total_steps = total_progress = 0
        for run in runs:
            steps = ledger.run_steps(run.run_id)
            progress = ledger.node_timeline(run.run_id)
            total_steps += len(steps)
            total_progress += len(progress)
            # one sequence per run, no gaps, every progress row after its LLM step's STARTED record
            seqs = sorted([s.seq for s in steps] + [p.seq for p in progress])
            assert seqs == list(range(1, len(seqs) + 1))
            records = ledger.list_records(run.run_id)
            assert len(records) == len(seqs)
            position = {(r["step_id"], r["status"]): i for i, r in enumerate(records)}
            for i, record in enumerate(records):
                if ((record.get("effect") or {}).get("payload") or {}).get("name") == "abstract.progress":
                    llm_step = record["effect"]["payload"]["payload"]["step_id"]
                    assert position[(llm_step, "started")] < i < position[(llm_step, "completed")]
            # the step records themselves are untouched, in their old order
            assert [s.step_id for s in steps] == [r["step_id"] for r in old_steps if r["run_id"] == run.run_id]
        assert (total_steps, total_progress) == (len(old_steps), len(old_progress))
        # keys are rewritten the way new keys are made: a re-delivered old event is recognised
        old = old_progress[0]
        key = NodeKey(
            old["run_id"],
            old["node_id"],
            workflow_id=old["workflow_id"],
            step_id=old["step_id"],
            attempt=old["attempt"],
        )
        event = {"kind": "llm", "phase": old["phase"], "event_index": old["event_index"]}
        assert progress_idempotency_key(key, event) in {p.idempotency_key for p in ledger.node_timeline(old["run_id"])}
        assert ledger.append_progress([ProgressEvent(key, event, progress_idempotency_key(key, event), 0.0)]) == 0
        # and the sequence continues after the last record
        last = len(ledger.list_records(old["run_id"]))
        next_seq = ledger.append_step(
            {"run_id": old["run_id"], "step_id": "new", "node_id": "x", "status": "completed", "attempt": 1}
        )
        assert next_seq == last + 1
    # the migrated schema is exactly the one a fresh ledger gets
    engine = create_engine(old_ledger)
    try:
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        engine.dispose()


def test_migrated_keys_follow_the_host_form(old_ledger):
    old = {row["id"]: row for row in fixture_rows("progress")}
    with Ledger(old_ledger, upgrade=True) as ledger:
        rows = [p for run in ledger.list_runs() for p in ledger.node_timeline(run.run_id)]
    assert len(rows) == len(old)
    expected = {
        f"system:progress:{row['step_id']}:{hashlib.sha256(row['idempotency_key'].encode()).hexdigest()[:12]}"
        for row in old.values()
    }
    assert {row.idempotency_key for row in rows} == expected


def test_downgrade_restores_the_first_revision(tmp_path):
    path = tmp_path / "ledger.sqlite"
    shutil.copy(FIXTURE, path)
    Ledger(sqlite_url(path), upgrade=True).close()
    engine = create_engine(sqlite_url(path))
    try:
        with engine.begin() as conn:
            command.downgrade(alembic(conn), "0001")
    finally:
        engine.dispose()
    with sqlite3.connect(path) as conn:
        for table in ("steps", "progress"):
            for (run_id,) in conn.execute(f"SELECT DISTINCT run_id FROM {table}"):  # noqa: S608
                seqs = [s for (s,) in conn.execute(f"SELECT seq FROM {table} WHERE run_id=? ORDER BY seq", (run_id,))]  # noqa: S608
                assert seqs == list(range(1, len(seqs) + 1))
        assert conn.execute("SELECT value FROM ledger_meta WHERE key='schema_version'").fetchone() == ("1",)
    with Ledger(sqlite_url(path), upgrade=True) as ledger:  # and up again
        assert ledger.upgraded_from == "0001"


def test_cli_status_and_upgrade(tmp_path, capsys):
    path = tmp_path / "ledger.sqlite"
    shutil.copy(FIXTURE, path)
    assert main(["ledger", "status", str(path)]) == 0
    assert "revision: 0001 (this release: 0002)" in capsys.readouterr().out
    assert main(["runs", "list", "--ledger", str(path)]) == 1
    assert "abstractruntime-mlx ledger upgrade" in capsys.readouterr().err
    assert main(["ledger", "upgrade", str(path)]) == 0
    assert "upgraded from revision 0001 to 0002" in capsys.readouterr().out
    assert main(["ledger", "upgrade", str(path)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert main(["runs", "list", "--ledger", str(path)]) == 0
    assert main(["ledger", "upgrade", str(tmp_path / "absent.sqlite")]) == 1
    assert "no ledger at" in capsys.readouterr().err
    assert not (tmp_path / "absent.sqlite").exists()


def test_the_upgrade_command_named_by_a_read_only_view_works_as_printed(tmp_path, capsys):
    """``runs list`` opens the file read-only (``file:PATH?mode=ro``); the command it prints
    names the plain URL that ``ledger upgrade`` opens for writing, quoted for the shell."""
    import shlex

    path = tmp_path / "my runs" / "ledger.sqlite"
    path.parent.mkdir()
    shutil.copy(FIXTURE, path)
    assert main(["runs", "list", "--ledger", str(path)]) == 1
    err = capsys.readouterr().err
    assert "[ledger_error]" in err and "file%3A" not in err and "mode=ro" not in err
    command = err.split("`")[1]
    assert command == f"abstractruntime-mlx ledger upgrade {shlex.quote(sqlite_url(path))}"
    assert main(shlex.split(command)[1:]) == 0
    assert "upgraded from revision 0001 to 0002" in capsys.readouterr().out
    assert main(["runs", "list", "--ledger", str(path)]) == 0
    listed = capsys.readouterr().out
    for run in fixture_rows("runs"):
        assert run["run_id"] in listed  # every run recorded before the upgrade is still there
