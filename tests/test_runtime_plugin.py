"""runtime_plugin against the real abstractruntime 0.13: VisualFlow runs, precedence, ledger rows,
idempotency, concurrency, sibling-branch batching, stores, entry point."""

from __future__ import annotations

import copy
import dataclasses
import json
import socket
import threading
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from abstractruntime.core.models import EffectType, RunState, RunStatus, StepRecord
from abstractruntime.core.run_identity import RunIdentityConflict
from abstractruntime.visualflow_compiler import compile_visualflow

from abstractruntime_mlx.ledger import Ledger
from abstractruntime_mlx.nodes import ProviderRegistry
from abstractruntime_mlx.policy import set_default_speculation
from abstractruntime_mlx.runtime_plugin import (
    FlowIndex,
    LedgerRunStore,
    LedgerStepStore,
    build_pack,
    build_runtime,
    pack_of,
    register,
    resume_run,
    run_flow,
)
from abstractruntime_mlx.runtime_plugin.prefetch import catalog as catalog_module
from abstractruntime_mlx.testing import tiny_model

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fanout.json"


def fanout(nodes: dict[str, dict], *, flow_id: str = "fan", collect: bool = True) -> dict:
    """A parallel node with one llm_call branch per entry of ``nodes`` ({id: effectConfig+pins})."""
    ids = list(nodes)
    flow_nodes = [
        {"id": "start", "type": "on_flow_start", "data": {}},
        {
            "id": "par",
            "type": "parallel",
            "data": {
                "outputs": [{"id": f"then:{i}", "type": "execution"} for i in range(len(ids))]
                + [{"id": "completed", "type": "execution"}]
            },
        },
    ]
    edges = [{"source": "start", "sourceHandle": "exec-out", "target": "par", "targetHandle": "exec-in"}]
    for i, node_id in enumerate(ids):
        spec = dict(nodes[node_id])
        pins = spec.pop("pins", {"prompt": f"Say something about {node_id}."})
        config = {"provider": "mlx", "temperature": 0, "max_output_tokens": 8, **spec}
        flow_nodes.append({"id": node_id, "type": "llm_call", "data": {"effectConfig": config, "pinDefaults": pins}})
        edges.append({"source": "par", "sourceHandle": f"then:{i}", "target": node_id, "targetHandle": "exec-in"})
    end_inputs = [{"id": "exec-in", "type": "execution"}] + (
        [{"id": n, "type": "string"} for n in ids] if collect else []
    )
    flow_nodes.append({"id": "end", "type": "on_flow_end", "data": {"inputs": end_inputs}})
    edges.append({"source": "par", "sourceHandle": "completed", "target": "end", "targetHandle": "exec-in"})
    if collect:
        edges += [{"source": n, "sourceHandle": "response", "target": "end", "targetHandle": n} for n in ids]
    return {"id": flow_id, "entryNode": "start", "nodes": flow_nodes, "edges": edges}


PRECEDENCE_FLOW = fanout(
    {
        "n_off": {"speculation": False, "thinking": False},
        "n_mtp": {"speculation": {"mode": "native_mtp", "num_draft_tokens": 2}},
        "n_inherit": {},
        "n_think": {"thinking": "high"},
    },
    flow_id="precedence",
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_model(tmp_path_factory.mktemp("plugin") / "dense", kind="dense", seed=0))


@pytest.fixture()
def ledger_url(tmp_path):
    return f"sqlite:///{tmp_path}/ledger.sqlite"


def controls_by_node(result):
    return {n.node_id: n.result["metadata"]["controls"] for n in result.nodes}


def run_once(flow, ledger_url, model, registry, *, vars=None, **pack_options):
    pack = build_pack(ledger_url, model=model, registry=registry, **pack_options)
    try:
        (result,) = run_flow(flow, vars=vars, pack=pack)
    finally:
        pack.close()
    assert result.status == "completed", result.error
    return result


# -- precedence through a real VisualFlow run ---------------------------------------------


@pytest.mark.slow
def test_node_beats_run_beats_provider_beats_policy(model, registry, ledger_url, policy_file):
    set_default_speculation("output.text", 4, policy_file)

    policy_only = controls_by_node(run_once(PRECEDENCE_FLOW, ledger_url, model, registry))
    assert policy_only["n_inherit"]["speculation_source"] == "policy"
    assert policy_only["n_inherit"]["speculation"]["num_draft_tokens"] == 4
    assert policy_only["n_off"] == {
        "speculation": False,
        "speculation_source": "call",
        "thinking": False,
        "thinking_source": "call",
    }
    assert (
        policy_only["n_mtp"]["speculation"]["num_draft_tokens"] == 2
        and policy_only["n_mtp"]["speculation_source"] == "call"
    )

    provider = controls_by_node(
        run_once(
            PRECEDENCE_FLOW,
            ledger_url,
            model,
            registry,
            provider_options={"speculation": {"mode": "native_mtp", "num_draft_tokens": 3}},
        )
    )
    assert provider["n_inherit"]["speculation_source"] == "provider"
    assert provider["n_inherit"]["speculation"]["num_draft_tokens"] == 3

    run_vars = {"_runtime": {"speculation": {"mode": "native_mtp", "num_draft_tokens": 5}, "thinking": "low"}}
    run_level = controls_by_node(
        run_once(
            PRECEDENCE_FLOW,
            ledger_url,
            model,
            registry,
            vars=run_vars,
            provider_options={"speculation": {"mode": "native_mtp", "num_draft_tokens": 3}},
        )
    )
    assert (
        run_level["n_inherit"]["speculation"]["num_draft_tokens"] == 5
        and run_level["n_inherit"]["speculation_source"] == "run"
    )
    assert run_level["n_inherit"]["thinking"] == "low" and run_level["n_inherit"]["thinking_source"] == "run"
    # Off at the node beats MTP at the run; the node's own depth beats the run's depth.
    assert run_level["n_off"]["speculation"] is False and run_level["n_off"]["speculation_source"] == "call"
    assert run_level["n_off"]["thinking"] is False
    assert (
        run_level["n_mtp"]["speculation"]["num_draft_tokens"] == 2
        and run_level["n_mtp"]["speculation_source"] == "call"
    )
    assert run_level["n_think"]["thinking"] == "high" and run_level["n_think"]["thinking_source"] == "call"

    run_off = controls_by_node(
        run_once(PRECEDENCE_FLOW, ledger_url, model, registry, vars={"_runtime": {"speculation": False}})
    )
    assert run_off["n_inherit"] == {**run_off["n_inherit"], "speculation": False, "speculation_source": "run"}
    assert run_off["n_mtp"]["speculation"]["mode"] == "native_mtp"


def test_effective_value_and_level_are_in_the_ledger(model, registry, ledger_url, policy_file):
    result = run_once(PRECEDENCE_FLOW, ledger_url, model, registry, vars={"_runtime": {"speculation": False}})
    with Ledger(ledger_url) as ledger:
        completed = [
            s for s in ledger.run_steps(result.run_id) if s.effect_type == "llm_call" and s.status == "completed"
        ]
        assert {s.node_id for s in completed} == {"n_off", "n_mtp", "n_inherit", "n_think"}
        for step in completed:
            meta = step.record["result"]["metadata"]
            assert meta["speculation"]["source"] == meta["controls"]["speculation_source"]
        inherit = next(s for s in completed if s.node_id == "n_inherit").record["result"]["metadata"]
        assert inherit["speculation"]["reason"] == "disabled_for_this_run"


# -- ledger rows ---------------------------------------------------------------------------


def test_rows_for_every_phase_event_of_every_node(model, registry, ledger_url, policy_file):
    for batching in (True, False):
        result = run_once(EXAMPLE, ledger_url, model, registry, sibling_batching=batching)
        with Ledger(ledger_url) as ledger:
            rows = ledger.node_timeline(result.run_id)
            all_steps = ledger.run_steps(result.run_id)
        steps = {s.node_id: s for s in all_steps if s.effect_type == "llm_call" and s.status == "completed"}
        # no abstract.progress step records: the events live in the progress table only
        assert not any("system:progress:" in (s.idempotency_key or "") for s in all_steps)
        assert set(steps) == {"plain", "mtp2", "inherit", "think"}
        for node in result.nodes:
            mine = [r for r in rows if r.node_id == node.node_id]
            assert len(mine) == node.result["metadata"]["progress"]["events"] >= 3
            assert [r.event_index for r in mine] == list(range(len(mine)))
            assert mine[0].phase == "prefill" and mine[-1].phase == "complete"
            # rows belong to the node's own LLM_CALL step and attempt
            assert {r.step_id for r in mine} == {steps[node.node_id].step_id}
            assert {r.attempt for r in mine} == {1}


def test_progress_goes_to_the_runtime_channel_when_the_store_is_not_ours(model, registry, tmp_path, policy_file):
    from abstractruntime import Runtime
    from abstractruntime.storage import InMemoryLedgerStore, InMemoryRunStore

    handlers = register(model=model, registry=registry)  # no ledger: the host's stores record everything
    ledger_store = InMemoryLedgerStore()
    runtime = Runtime(run_store=InMemoryRunStore(), ledger_store=ledger_store, effect_handlers=handlers)
    spec = compile_visualflow(fanout({"a": {}}))
    run_id = runtime.start(workflow=spec, vars={})
    state = runtime.tick(workflow=spec, run_id=run_id)
    assert state.status == RunStatus.COMPLETED
    records = ledger_store.list(run_id)
    progress = [r for r in records if (r.get("effect") or {}).get("payload", {}).get("name") == "abstract.progress"]
    assert [p["result"]["payload"]["phase"] for p in progress][0] == "prefill"
    assert progress[-1]["result"]["payload"]["phase"] == "complete"
    handlers[EffectType.LLM_CALL].prefetcher.close()


# -- idempotency ---------------------------------------------------------------------------


class CrashAfterEffect(Exception):
    pass


def test_crash_between_effect_and_checkpoint_reuses_the_result(model, registry, ledger_url, policy_file):
    """The LLM node completed and its COMPLETED record landed, but the checkpoint save did not:
    the next tick reuses the recorded result (no second call, no duplicate rows)."""
    flow = fanout({"only": {}}, flow_id="crashy")
    pack = build_pack(ledger_url, model=model, registry=registry)
    try:
        pack.flows.register(flow)
        spec = compile_visualflow(flow)
        calls = []
        original = pack.node.execute
        pack.node.execute = lambda *a, **k: calls.append(1) or original(*a, **k)

        class FlakyRunStore(LedgerRunStore):
            armed = True

            def save(self, run):
                if self.armed and (run.vars.get("_temp", {}).get("effects", {}).get("only")):
                    self.armed = False
                    raise CrashAfterEffect
                super().save(run)

        from abstractruntime import Runtime

        flaky = Runtime(
            run_store=FlakyRunStore(pack.ledger), ledger_store=pack.ledger_store, effect_handlers=pack.effect_handlers()
        )
        run_id = flaky.start(workflow=spec, vars={})
        with pytest.raises(CrashAfterEffect):
            flaky.tick(workflow=spec, run_id=run_id)
        rows_before = len(pack.ledger.node_timeline(run_id))
        assert len(calls) == 1 and rows_before >= 3

        state = pack.runtime().tick(workflow=compile_visualflow(flow), run_id=run_id)
        assert state.status == RunStatus.COMPLETED
        assert len(calls) == 1  # reused, not called again
        assert len(pack.ledger.node_timeline(run_id)) == rows_before
        steps = pack.ledger.run_steps(run_id)
        assert (
            sum(1 for s in steps if s.node_id == "only" and s.status == "completed" and s.effect_type == "llm_call")
            == 1
        )
        trace = state.vars["_runtime"]["node_traces"]["only"]["steps"][-1]
        assert trace["reused_prior_result"] is True
    finally:
        pack.close()


def test_step_store_is_append_only_and_idempotent(tmp_path):
    with Ledger(f"sqlite:///{tmp_path}/l.sqlite") as ledger:
        store = LedgerStepStore(ledger)
        run = RunState.new(workflow_id="wf", entry_node="n")
        record = StepRecord.start(run=run, node_id="n", effect=None, idempotency_key="k1")
        store.append(record)
        store.append(record)  # a retried append
        record.finish_success({"content": "x"})
        store.append(record)
        assert [r["status"] for r in store.list(run.run_id)] == ["started", "completed"]
        assert store.find_completed_result(run.run_id, "k1") == {"content": "x"}
        assert store.find_completed_result(run.run_id, "nope") is None


def test_run_store_round_trip_and_create_if_absent(tmp_path):
    with Ledger(f"sqlite:///{tmp_path}/l.sqlite") as ledger:
        store = LedgerRunStore(ledger)
        run = RunState.new(workflow_id="wf", entry_node="n", vars={"x": [1, 2]}, session_id="s")
        created, fresh = store.create_if_absent(run)
        assert fresh and created is run
        again, fresh = store.create_if_absent(copy.deepcopy(run))
        assert not fresh and again.vars == {"x": [1, 2]}
        other = copy.deepcopy(run)
        other.session_id = "another"
        with pytest.raises(RunIdentityConflict):
            store.create_if_absent(other)
        run.status = RunStatus.COMPLETED
        store.save(run)
        assert store.load(run.run_id).status == RunStatus.COMPLETED
        assert [r.run_id for r in store.list_runs(status=RunStatus.COMPLETED)] == [run.run_id]
        assert store.load("missing") is None


# -- concurrency and sibling batching --------------------------------------------------------


@pytest.mark.slow
def test_concurrent_runs_share_one_resident_model(model, registry, ledger_url, policy_file):
    pack = build_pack(ledger_url, model=model, registry=registry, sibling_batching=False)
    try:
        results = run_flow(EXAMPLE, runs=4, pack=pack)
    finally:
        pack.close()
    assert [r.status for r in results] == ["completed"] * 4
    assert len({r.run_id for r in results}) == 4
    peaks = [n.result["metadata"]["execution"]["peak_batch_size"] for r in results for n in r.nodes]
    assert max(peaks) > 1
    assert {r.output["plain"] for r in results} == {results[0].output["plain"]}  # greedy: same answer


def test_sibling_branches_batch_and_answer_the_same(model, registry, ledger_url, policy_file):
    plain = run_once(EXAMPLE, ledger_url, model, registry, sibling_batching=False)
    batched = run_once(EXAMPLE, ledger_url, model, registry, sibling_batching=True)
    assert batched.output == plain.output
    meta = {n.node_id: n.result["metadata"] for n in batched.nodes}
    assert meta["plain"]["sibling_batch"]["launched"] == ["mtp2", "inherit", "think"]
    for node_id in ("mtp2", "inherit", "think"):
        assert meta[node_id]["sibling_batch"]["used"] is True
        assert meta[node_id]["sibling_batch"]["trigger_node"] == "plain"
    assert max(m["execution"]["peak_batch_size"] for m in meta.values()) > 1
    assert max(n.result["metadata"]["execution"]["peak_batch_size"] for n in plain.nodes) == 1
    # controls are resolved per node exactly as without prefetch
    assert {n.node_id: n.result["metadata"]["controls"] for n in batched.nodes} == {
        n.node_id: n.result["metadata"]["controls"] for n in plain.nodes
    }


def test_a_changed_sibling_request_is_called_again(model, registry, ledger_url, policy_file, monkeypatch):
    original = FlowIndex.later_siblings

    def wrong_prediction(self, node_id):
        return [
            catalog_module.SiblingCall(c.node_id, c.branch, {**c.payload, "prompt": "a different prompt"}, c.config)
            for c in original(self, node_id)
        ]

    flow = fanout({"a": {}, "b": {}}, flow_id="mismatch")
    expected = run_once(flow, ledger_url, model, registry, sibling_batching=False).output
    monkeypatch.setattr(FlowIndex, "later_siblings", wrong_prediction)
    result = run_once(flow, ledger_url, model, registry)
    assert result.output == expected
    b = next(n for n in result.nodes if n.node_id == "b").result["metadata"]["sibling_batch"]
    assert b == {"role": "sibling", "trigger_node": "a", "used": False, "reason": "request_changed"}


@pytest.mark.slow
def test_prefetches_never_crowd_out_the_runtime_own_calls(tmp_path, policy_file):
    """A small engine (2 slots + 4 queue places) and 4 concurrent runs of 4 branches: prefetching
    every sibling would overflow the queue; the prefetcher takes only spare room, so no call
    fails (and no retry hides it: the kernel's one-attempt policy)."""
    small = str(tiny_model(tmp_path / "small-engine", kind="dense", seed=0))
    registry = ProviderRegistry()
    try:
        pack = build_pack(
            tmp_path / "l.sqlite",
            model=small,
            registry=registry,
            effect_policy=None,
            provider_options={"mlx_max_batch_size": 2, "mlx_max_queue_size": 4},
        )
        try:
            results = run_flow(EXAMPLE, runs=4, pack=pack)
            stats = pack.prefetcher.stats
        finally:
            pack.close()
        assert [r.status for r in results] == ["completed"] * 4, [r.error for r in results]
        assert stats.throttled > 0 and stats.launched > 0
    finally:
        registry.close()


def test_wired_or_unpredictable_siblings_are_not_prefetched():
    flow = fanout({"a": {}, "b": {"tools": ["x"]}, "c": {}, "d": {}}, flow_id="wired")
    flow["edges"].append({"source": "a", "sourceHandle": "response", "target": "c", "targetHandle": "prompt"})
    index = FlowIndex(flow)
    assert [c.node_id for c in index.later_siblings("a")] == ["d"]
    assert set(index.unpredictable) == {"b", "c"}
    assert index.later_siblings("d") == []


# -- ledger paths, builders, entry point -----------------------------------------------------


def test_ledger_on_a_fresh_path_and_on_an_existing_one(model, registry, tmp_path, policy_file):
    path = tmp_path / "deep" / "er" / "runs.sqlite"
    first = run_once(fanout({"a": {}}), str(path), model, registry)
    assert path.exists()
    second = run_once(fanout({"a": {}}), f"sqlite:///{path}", model, registry)
    with Ledger(f"sqlite:///{path}") as ledger:
        assert {r.run_id for r in ledger.list_runs()} == {first.run_id, second.run_id}


def test_build_runtime_and_entry_point(model, registry, ledger_url, policy_file):
    (ep,) = [e for e in entry_points(group="abstractruntime.packs") if e.name == "mlx"]
    assert ep.load() is register
    runtime = build_runtime(ledger_url, model=model, registry=registry, mlx_batching=True)
    pack = pack_of(runtime)
    try:
        flow = fanout({"a": {}})
        pack.flows.register(flow)
        spec = compile_visualflow(flow)
        run_id = runtime.start(workflow=spec, vars={})
        state = runtime.tick(workflow=spec, run_id=run_id)
        assert state.status == RunStatus.COMPLETED and state.output["a"]
        assert pack.ledger.get_run(run_id).status == "completed"
    finally:
        pack.close()


def test_resume_of_a_finished_run_changes_nothing(model, registry, ledger_url, policy_file):
    result = run_once(fanout({"a": {}}), ledger_url, model, registry)
    again = resume_run(result.run_id, ledger_url=ledger_url)
    assert again.status == "completed" and [n.step_id for n in again.nodes] == [n.step_id for n in result.nodes]


# -- remote half -----------------------------------------------------------------------------


@pytest.fixture()
def server(model, registry):
    uvicorn = pytest.importorskip("uvicorn")
    from abstractruntime_mlx.server import create_app

    entry = registry.local(model, {})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(entry.provider), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, name="test-uvicorn")
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


def test_run_level_base_url_sends_nodes_to_a_remote_server(model, server, ledger_url, policy_file):
    remote_registry = ProviderRegistry()
    try:
        pack = build_pack(ledger_url, registry=remote_registry, allow_remote=[server.removeprefix("http://")])
        try:
            (result,) = run_flow(
                PRECEDENCE_FLOW, vars={"_runtime": {"base_url": server, "speculation": False}}, pack=pack
            )
        finally:
            pack.close()
        assert result.status == "completed", result.error
        meta = {n.node_id: n.result["metadata"] for n in result.nodes}
        assert {m["client"]["kind"] for m in meta.values()} == {"remote"}
        assert meta["n_inherit"]["controls"]["speculation_source"] == "run"
        assert meta["n_mtp"]["controls"]["speculation"]["num_draft_tokens"] == 2
        with Ledger(ledger_url) as ledger:
            assert len(ledger.node_timeline(result.run_id)) >= 4 * 3
    finally:
        remote_registry.close()


def test_example_flow_is_valid_json_with_per_node_controls():
    flow = json.loads(EXAMPLE.read_text())
    configs = {n["id"]: n["data"].get("effectConfig", {}) for n in flow["nodes"] if n["type"] == "llm_call"}
    assert configs["plain"]["speculation"] is False and configs["plain"]["thinking"] is False
    assert configs["mtp2"]["speculation"] == {"mode": "native_mtp", "num_draft_tokens": 2}
    assert "speculation" not in configs["inherit"] and "thinking" not in configs["inherit"]
    assert configs["think"]["thinking"] == "high"
    assert {n["type"] for n in flow["nodes"]} >= {"parallel", "on_flow_end"}


def test_pack_settings_are_build_packs_options_as_one_value(tmp_path: Path) -> None:
    from abstractruntime_mlx.runtime_plugin import PackSettings

    settings = PackSettings(
        model="/models/a",
        force_model=True,
        routes=["lmstudio=mlx:/models/b"],
        allow_remote=["10.0.0.2"],
        sibling_batching=False,
    )
    with pytest.raises(TypeError, match="not both"):
        build_pack(settings=settings, model="/models/c")
    pack = build_pack(settings=settings)
    try:
        assert pack.settings is settings and pack.handler.prefetcher is None
        stored = pack.resume_options()
        assert PackSettings.from_resume_options(stored) == dataclasses.replace(settings, provider_options=None)
        assert PackSettings.from_resume_options(stored, model="/models/new").model == "/models/new"
    finally:
        pack.close()
    runtime = build_runtime(str(tmp_path / "runs.sqlite"), model="/models/a", mlx_max_batch_size=2)
    try:
        assert pack_of(runtime).settings.model == "/models/a"
        assert pack_of(runtime).settings.provider_options == {"mlx_max_batch_size": 2}
    finally:
        pack_of(runtime).close()
