"""Phase events read back through AbstractRuntime's own ledger interfaces, shaped as the records
the host writes itself when it stores ``abstract.progress`` in its own stores."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from abstractruntime import Runtime, WorkflowRegistry
from abstractruntime.storage.in_memory import InMemoryLedgerStore, InMemoryRunStore
from abstractruntime.visualflow_compiler import compile_visualflow

from abstractruntime_mlx.ledger import sqlite_url
from abstractruntime_mlx.runtime_plugin import build_pack, run_flow
from abstractruntime_mlx.runtime_plugin.hosting.host import drive

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fanout.json"
IDENTITY = {"run_id", "workflow_id", "node_id", "step_id", "idempotency_key", "attempt"}


def is_progress(record: dict[str, Any]) -> bool:
    effect = record.get("effect") or {}
    return effect.get("type") == "emit_event" and (effect.get("payload") or {}).get("name") == "abstract.progress"


def assert_host_order(records: list[dict[str, Any]]) -> None:
    """Every progress record sits between the STARTED and the terminal record of its LLM step."""
    where = {(r["step_id"], r["status"]): i for i, r in enumerate(records) if not is_progress(r)}
    for i, record in enumerate(records):
        if not is_progress(record):
            continue
        step_id = record["effect"]["payload"]["payload"]["step_id"]
        assert where[(step_id, "started")] < i < where[(step_id, "completed")]


@pytest.fixture()
def flow() -> dict[str, Any]:
    return json.loads(EXAMPLE.read_text())


def test_host_apis_see_every_phase_event_in_order(tmp_path, flow, dense_model, policy_file, registry):
    pack = build_pack(sqlite_url(tmp_path / "ledger.db"), model=str(dense_model), registry=registry)
    try:
        runtime = pack.runtime()
        observed: list[dict[str, Any]] = []
        unsubscribe = runtime.subscribe_ledger(observed.append)  # the host's observer API
        [result] = run_flow(flow, pack=pack)
        unsubscribe()
        assert result.status == "completed"
        run_id = result.run_id

        records = runtime.get_ledger(run_id)  # AbstractRuntime's LedgerStore.list
        progress = [r for r in records if is_progress(r)]
        rows = pack.ledger.node_timeline(run_id)  # our queryable columns, kept
        assert len(rows) > 0 and len(progress) == len(rows)
        assert [r["idempotency_key"] for r in progress] == [row.idempotency_key for row in rows]
        assert_host_order(records)

        started = {r["step_id"]: r for r in records if r["status"] == "started"}
        for record, row in zip(progress, rows):
            payload = record["effect"]["payload"]["payload"]
            assert record["effect"]["payload"]["scope"] == "run"
            assert record["result"] == {"emitted": True, "name": "abstract.progress", "payload": payload}
            llm_step = started[payload["step_id"]]
            assert payload["run_id"] == run_id and payload["workflow_id"] == "mlx_fanout"
            assert payload["node_id"] == record["node_id"] == llm_step["node_id"] == row.node_id
            assert payload["idempotency_key"] == llm_step["idempotency_key"]
            assert payload["attempt"] == llm_step["attempt"]
            # the first call on a model that is not resident yet records its load first
            assert payload["kind"] == ("load" if row.phase == "load" else "llm") and payload["phase"] == row.phase
            assert re.fullmatch(rf"system:progress:{payload['step_id']}:[0-9a-f]{{12}}", record["idempotency_key"])
        assert {r["effect"]["payload"]["payload"]["phase"] for r in progress} >= {"prefill", "complete"}
        assert {r["node_id"] for r in progress} == {"plain", "mtp2", "inherit", "think"}

        # paging as AbstractRuntime's SqliteLedgerStore.list_after pages: same records, same order
        paged: list[dict[str, Any]] = []
        cursor = 0
        while True:
            page, cursor = pack.ledger_store.list_after(run_id=run_id, after=cursor, limit=7)
            if not page:
                break
            paged.extend(page)
        assert paged == records
        assert pack.ledger_store.last_record(run_id) == records[-1]

        # observers saw every record of the run, progress records included
        mine = [r for r in observed if r.get("run_id") == run_id]
        assert sorted(r["idempotency_key"] for r in mine if is_progress(r)) == sorted(
            r["idempotency_key"] for r in progress
        )
        assert len(mine) == len(records)
    finally:
        pack.close()


def test_records_have_the_shape_the_host_writes_itself(tmp_path, flow, dense_model, policy_file, registry):
    """The same flow with the host's own stores (the handler forwards to its progress channel)
    and with ours: the progress records have the same fields, identity and key form."""
    host_pack = build_pack(model=str(dense_model), sibling_batching=False, registry=registry)  # no ledger of ours
    try:
        host_pack.flows.register(flow)
        runtime = Runtime(
            run_store=InMemoryRunStore(),
            ledger_store=InMemoryLedgerStore(),
            effect_handlers=host_pack.effect_handlers(),
        )
        spec = compile_visualflow(flow)
        workflows = WorkflowRegistry()
        workflows.register(spec)
        state = drive(runtime, workflows, runtime.start(workflow=spec))
        host_records = [r for r in runtime.get_ledger(state.run_id) if is_progress(r)]
    finally:
        host_pack.close()
    pack = build_pack(
        sqlite_url(tmp_path / "ledger.db"), model=str(dense_model), sibling_batching=False, registry=registry
    )
    try:
        [result] = run_flow(flow, pack=pack)
        ours = [r for r in pack.runtime().get_ledger(result.run_id) if is_progress(r)]
    finally:
        pack.close()
    assert host_records and ours
    theirs_by_node: dict[str, list[dict[str, Any]]] = {}
    for record in host_records:
        theirs_by_node.setdefault(record["node_id"], []).append(json.loads(json.dumps(record, default=str)))
    mine_by_node: dict[str, list[dict[str, Any]]] = {}
    for record in ours:
        mine_by_node.setdefault(record["node_id"], []).append(record)
    assert set(mine_by_node) == set(theirs_by_node) == {"plain", "mtp2", "inherit", "think"}
    pattern = r"system:progress:[0-9a-f-]{36}:[0-9a-f]{12}"
    for node_id, theirs_list in theirs_by_node.items():
        mine_list = mine_by_node[node_id]
        # mid-generation cadence events are timed; the first (prefill) and last (complete) are not
        for mine, theirs in ((mine_list[0], theirs_list[0]), (mine_list[-1], theirs_list[-1])):
            assert set(mine) == set(theirs)
            assert set(mine["effect"]) == set(theirs["effect"])
            assert set(mine["result"]) == set(theirs["result"])
            assert mine["status"] == theirs["status"] == "completed"
            assert mine["attempt"] == theirs["attempt"]
            mine_payload, their_payload = mine["effect"]["payload"], theirs["effect"]["payload"]
            assert {k: v for k, v in mine_payload.items() if k != "payload"} == {
                k: v for k, v in their_payload.items() if k != "payload"
            }
            assert set(mine_payload["payload"]) & IDENTITY == set(their_payload["payload"]) & IDENTITY == IDENTITY
            assert re.fullmatch(pattern, mine["idempotency_key"]) and re.fullmatch(pattern, theirs["idempotency_key"])
            stable = ("kind", "phase", "prompt_tokens", "generated_tokens", "final")
            assert {k: mine_payload["payload"].get(k) for k in stable} == {
                k: their_payload["payload"].get(k) for k in stable
            }
