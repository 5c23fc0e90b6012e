"""nodes: control precedence (value + deciding level), client choice, phase events into the ledger."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from abstractruntime_mlx.controls import UNSET, ControlLevel, SpeculationControl
from abstractruntime_mlx.errors import InvalidControls, InvalidRequest
from abstractruntime_mlx.ledger import Ledger, NodeKey, ProgressEvent
from abstractruntime_mlx.nodes import LLMNode, NodeRequest, ProgressRoute, ProviderRegistry, resolve_node_controls
from abstractruntime_mlx.testing import tiny_model

MTP3 = {"mode": "native_mtp", "num_draft_tokens": 3}
MTP4 = SpeculationControl(mode="native_mtp", num_draft_tokens=4, require_acceleration=False)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # A private copy: its resident engine never clashes with other test modules' options.
    return str(tiny_model(tmp_path_factory.mktemp("nodes") / "dense", kind="dense", seed=0))


@pytest.fixture()
def ledger(tmp_path):
    with Ledger(f"sqlite:///{tmp_path}/ledger.sqlite") as led:
        yield led


# -- precedence (pure) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_kwargs", "provider", "policy", "expected", "source"),
    [
        ({}, UNSET, MTP4, MTP4.to_wire(), "policy"),
        ({}, MTP3, MTP4, {**MTP3, "require_acceleration": False}, "provider"),
        # a partial provider default inherits the policy's depth (one merge rule at every level)
        ({}, {"require_acceleration": True}, MTP4, {**MTP4.to_wire(), "require_acceleration": True}, "provider"),
        (
            {"run_speculation": {"num_draft_tokens": 5}},
            MTP3,
            MTP4,
            {**MTP3, "num_draft_tokens": 5, "require_acceleration": False},
            "run",
        ),
        ({"speculation": False, "run_speculation": MTP3}, MTP3, MTP4, False, "call"),
        (
            {"speculation": {"num_draft_tokens": 2}, "run_speculation": False},
            UNSET,
            MTP4,
            {"mode": "native_mtp", "num_draft_tokens": 2, "require_acceleration": False},
            "call",
        ),
        ({"run_speculation": False}, MTP3, MTP4, False, "run"),
        ({}, False, MTP4, False, "provider"),
        ({}, UNSET, UNSET, False, "off"),
    ],
)
def test_speculation_precedence(request_kwargs, provider, policy, expected, source):
    controls = resolve_node_controls(
        NodeRequest(**request_kwargs),
        provider_default=None if provider is UNSET else ControlLevel.parse(speculation=provider),
        policy=None if policy is UNSET else ControlLevel(speculation=policy),
    )
    assert controls.speculation.to_wire() == expected
    assert controls.sources["speculation"] == source


def test_verified_default_when_nothing_is_said():
    controls = resolve_node_controls(NodeRequest(), verified_default=True)
    assert controls.to_metadata()["speculation"] == {
        "mode": "native_mtp",
        "num_draft_tokens": 2,
        "require_acceleration": False,
    }
    assert controls.sources["speculation"] == "verified_default"


def test_thinking_precedence():
    assert resolve_node_controls(NodeRequest(thinking="high", run_thinking=False)).to_metadata()["thinking"] == "high"
    run = resolve_node_controls(NodeRequest(run_thinking="low"))
    assert (run.thinking, run.sources["thinking"]) == ("low", "run")
    off = resolve_node_controls(NodeRequest(thinking=False, run_thinking="low"))
    assert (off.thinking, off.sources["thinking"]) == (False, "call")
    none = resolve_node_controls(NodeRequest())
    assert (none.thinking, none.sources["thinking"]) == (None, "model_default")


def test_invalid_controls_name_the_level():
    with pytest.raises(InvalidControls) as info:
        resolve_node_controls(NodeRequest(run_speculation={"depth": 2}))
    assert "_runtime.speculation" in str(info.value)


# -- local node ------------------------------------------------------------------------------


def test_node_records_every_phase_event_and_flushes(model, registry, ledger, policy_file):
    node = LLMNode(ledger=ledger, registry=registry, default_model=model)
    try:
        seen: list[dict] = []
        key = NodeKey("run-1", "ask", workflow_id="wf", step_id="step-1", attempt=1)
        result = node.run(
            NodeRequest(prompt="hello", speculation=False, run_thinking="low", sampling=GREEDY, max_output_tokens=8),
            key=key,
            on_progress=seen.append,
        )
        # flushed before returning: the rows are readable at once
        rows = ledger.node_timeline("run-1", "ask")
        assert [r.phase for r in rows] == [e["phase"] for e in seen]
        assert rows[0].phase == "prefill" and rows[-1].phase == "complete" and rows[-1].final
        assert len(rows) == result.num_progress_events == result.generation.metadata["progress"]["events"]
        body = result.to_runtime_result()
        assert body["metadata"]["controls"] == {
            "speculation": False,
            "speculation_source": "call",
            "thinking": "low",
            "thinking_source": "run",
        }
        assert body["metadata"]["speculation"]["source"] == "call"
        assert body["metadata"]["speculation"]["used"] is False
        assert body["metadata"]["client"] == {"kind": "local", "concurrency": "concurrent"}
        assert body["provider"] == "mlx" and body["usage"]["completion_tokens"] > 0
        assert body["metadata"]["execution"]["mode"]
    finally:
        node.close()


def test_speculation_reason_names_the_deciding_level(model, registry, policy_file):
    from abstractruntime_mlx.policy import set_default_speculation

    set_default_speculation("output.text", "off", policy_file)
    node = LLMNode(registry=registry, default_model=model)
    body = node.run(NodeRequest(prompt="x", sampling=GREEDY, max_output_tokens=8)).to_runtime_result()
    assert body["metadata"]["controls"]["speculation_source"] == "policy"
    assert body["metadata"]["speculation"]["reason"] == "disabled_by_policy"


def test_same_model_shares_one_resident_provider(model, registry):
    node_a = LLMNode(registry=registry, default_model=model)
    node_b = LLMNode(registry=registry, default_model=model)
    assert node_a.registry.local(model, {}).provider is node_b.registry.local(model, {}).provider


def test_concurrent_nodes_batch_on_one_model(model, registry, policy_file):
    node = LLMNode(registry=registry, default_model=model)
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(
                lambda i: node.run(
                    NodeRequest(prompt=f"q{i}", speculation=False, sampling=GREEDY, max_output_tokens=8)
                ),
                range(4),
            )
        )
    assert max(r.generation.metadata["execution"]["peak_batch_size"] for r in results) > 1


def test_unbatched_provider_is_serialized_per_model(model, policy_file):
    registry = ProviderRegistry()
    try:
        node = LLMNode(registry=registry, default_model=model, provider_options={"mlx_batching": False})
        active, peak, lock = [0], [0], threading.Lock()
        entry = registry.local(model, {"mlx_batching": False})
        assert entry.lock is not None
        original = entry.provider.generate_request

        def counting(*args, **kwargs):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            try:
                return original(*args, **kwargs)
            finally:
                with lock:
                    active[0] -= 1

        entry.provider.generate_request = counting
        with ThreadPoolExecutor(3) as pool:
            results = list(
                pool.map(
                    lambda i: node.run(NodeRequest(prompt=f"q{i}", sampling=GREEDY, max_output_tokens=8)), range(3)
                )
            )
        assert peak[0] == 1
        assert {r.concurrency for r in results} == {"serialized"}
    finally:
        registry.close()


def test_buffered_route_attaches_with_original_times(model, registry, ledger, policy_file):
    node = LLMNode(ledger=ledger, registry=registry, default_model=model)
    try:
        route = ProgressRoute(buffer=True)
        result = node.execute(
            node.prepare(NodeRequest(prompt="early", sampling=GREEDY, max_output_tokens=8)), route=route
        )
        assert ledger.node_timeline("run-2") == []  # nothing written while buffered
        key = NodeKey("run-2", "later", step_id="s", attempt=1)
        replayed: list[dict] = []
        handed = route.attach(ledger=ledger, writer=node.writer, key=key, callback=replayed.append)
        rows = ledger.node_timeline("run-2", "later")
        assert handed == len(rows) == result.num_progress_events == len(replayed)
        assert rows[0].created_at <= rows[-1].created_at
        # idempotent: writing the same events again stores nothing new
        again = [ProgressEvent(key, r.event, r.idempotency_key, time.time()) for r in rows]
        assert ledger.append_progress(again) == 0
        assert len(ledger.node_timeline("run-2")) == handed
    finally:
        node.close()


def test_fingerprint_covers_the_whole_request(model, registry, policy_file):
    node = LLMNode(registry=registry, default_model=model)
    base = node.prepare(NodeRequest(prompt="a", sampling=GREEDY, max_output_tokens=8))
    assert node.prepare(NodeRequest(prompt="a", sampling=GREEDY, max_output_tokens=8)).fingerprint == base.fingerprint
    assert node.prepare(NodeRequest(prompt="b", sampling=GREEDY, max_output_tokens=8)).fingerprint != base.fingerprint
    assert (
        node.prepare(NodeRequest(prompt="a", run_speculation=False, sampling=GREEDY, max_output_tokens=8)).fingerprint
        != base.fingerprint
    )


def test_unknown_provider_and_missing_model_are_refused(model, registry):
    with pytest.raises(InvalidRequest, match="provider"):
        LLMNode(registry=registry, default_model=model).prepare(NodeRequest(prompt="x", provider="openai"))
    with pytest.raises(InvalidRequest, match="no model"):
        LLMNode(registry=registry).prepare(NodeRequest(prompt="x"))


def test_remote_request_sends_only_node_or_run_speculation():
    node = LLMNode()
    inherit = node.prepare(NodeRequest(prompt="x", base_url="http://127.0.0.1:1/"))
    assert inherit.request.speculation is None and inherit.client_kind == "remote"
    assert not inherit.speculation_sent
    off = node.prepare(NodeRequest(prompt="x", base_url="http://127.0.0.1:1", run_speculation=False))
    assert off.request.speculation == SpeculationControl.off() and off.controls.sources["speculation"] == "run"
    assert off.request.run == ControlLevel()  # the wire has one level: the run's word travels as the call's
    assert off.base_url == "http://127.0.0.1:1"


def test_a_node_call_is_resolved_once_at_the_node(model, registry, policy_file):
    """The provider runs the controls the node resolved (and recorded), not a second reading:
    a policy changed between the two would otherwise make the record and the run disagree."""
    from abstractruntime_mlx.policy import set_default_speculation

    set_default_speculation("output.text", "off", policy_file)
    node = LLMNode(registry=registry, default_model=model)
    prepared = node.prepare(NodeRequest(prompt="x", sampling=GREEDY, max_output_tokens=8))
    assert prepared.request.resolved == prepared.controls
    assert prepared.controls.speculation == SpeculationControl.off()
    set_default_speculation("output.text", 3, policy_file)  # after the node resolved
    body = node.execute(prepared).to_runtime_result()
    assert body["metadata"]["controls"]["speculation_source"] == "policy"
    assert body["metadata"]["speculation"]["reason"] == "disabled_by_policy"
    # a call prepared now sees the new policy
    assert (
        node.prepare(NodeRequest(prompt="x", sampling=GREEDY, max_output_tokens=8)).controls.speculation
        != SpeculationControl.off()
    )
