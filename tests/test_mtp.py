"""Per-node MTP on a resident model: the head attached on first use (no reload), companion
heads, load-aware optional MTP, exact limits in cohorts, greedy parity at every depth."""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path

import pytest

from abstractruntime_mlx import artifacts, errors, get_execution_capabilities
from abstractruntime_mlx.controls import Sampling
from abstractruntime_mlx.engine.core.request import EngineRequest, ExecutionMode
from abstractruntime_mlx.engine.core.scheduler import group_key, take_compatible, target_only_key, under_load
from abstractruntime_mlx.engine.model import model as model_module
from abstractruntime_mlx.testing import companion_head_path, tiny_model
from test_call_harness import together

PROMPTS = ["Explain TTL caches.", "Explain LRU caches.", "What is a prefix cache?", "Why batch requests?"]
OPTIONAL = {"mode": "native_mtp", "num_draft_tokens": 2}
STRICT = {**OPTIONAL, "require_acceleration": True}


def strict(depth: int) -> dict:
    return {"mode": "native_mtp", "num_draft_tokens": depth, "require_acceleration": True}


@pytest.fixture(scope="module")
def companion_model(models_dir) -> Path:
    # A quantized-looking name, so the lookup that finds the head is the ``-MTP-`` insertion.
    return tiny_model(models_dir / "tiny-hybrid-4bit", kind="hybrid-companion", seed=0, mtp_alpha=0.05)


@pytest.fixture(scope="module")
def aligned_model(models_dir) -> str:
    """Every draft accepted (alpha 0): the most tokens a verify round can hand back at once."""
    return str(tiny_model(models_dir / "hybrid-a0", kind="hybrid-mtp", seed=0, mtp_alpha=0.0))


# -- the head attaches to the resident target ------------------------------------------------


@pytest.mark.slow
def test_head_attaches_once_on_the_worker_without_reloading(make_llm, hybrid_model, monkeypatch):
    llm = make_llm(hybrid_model, mlx_batching=True, speculation=False)
    loaded = llm._engine.loaded
    target = loaded.model
    assert loaded.drafter is None and not llm.speculation_ready() and llm.speculation_attachable()
    caps = get_execution_capabilities(hybrid_model, instance=llm)["speculation"]
    assert (caps["ready"], caps["reason"], caps["requires_reload"]) == (False, "mtp_head_attaches_on_first_use", False)

    threads: list[str] = []
    real_attach = model_module.LoadedModel.attach_drafter

    def attach(self):
        threads.append(threading.current_thread().name)
        return real_attach(self)

    monkeypatch.setattr(model_module.LoadedModel, "attach_drafter", attach)
    off = llm.generate(PROMPTS[0], thinking=False, max_output_tokens=12)
    first = llm.generate(PROMPTS[0], thinking=False, max_output_tokens=12, speculation=STRICT)
    spec = first.metadata["speculation"]
    assert spec["used"] is True and spec["source"] == "call"
    assert spec["head_attach_s"] >= 0 and spec["head_bytes"] == loaded.drafter_bytes > 0
    assert first.token_ids == off.token_ids
    assert threads == [f"abstractruntime-mlx:{Path(hybrid_model).name}"]  # on the model's worker, once

    again = llm.generate(PROMPTS[0], thinking=False, max_output_tokens=12, speculation=OPTIONAL)
    assert again.metadata["speculation"]["used"] is True and "head_attach_s" not in again.metadata["speculation"]
    assert threads == [threads[0]]
    # Same resident target, same weights: the head was added, nothing was reloaded.
    assert llm._engine.loaded is loaded and loaded.model is target and llm.speculation_ready()
    assert loaded.drafter_bytes < model_module.parameter_bytes(target) / 2  # the head, not a second target
    # A provider whose default is MTP shares the same resident target and head.
    other = make_llm(hybrid_model, mlx_batching=True, speculation=STRICT)
    assert other._resident is llm._resident
    assert other.generate(PROMPTS[0], thinking=False, max_output_tokens=12).token_ids == off.token_ids


def test_no_head_on_this_machine_strict_fails_optional_names_the_reason(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, speculation=False)
    with pytest.raises(errors.SpeculationUnavailable) as info:
        llm.generate(PROMPTS[0], max_output_tokens=2, speculation=STRICT)
    assert info.value.reason == "no_mtp_drafter_for_model"
    assert "abstractruntime-mlx models download" in info.value.message and "mtp_head=" in info.value.message
    optional = llm.generate(PROMPTS[0], max_output_tokens=2, speculation=OPTIONAL)
    assert optional.metadata["speculation"]["used"] is False
    assert optional.metadata["speculation"]["reason"] == "no_mtp_drafter_for_model"


def test_companion_head_found_by_lookup_and_named_with_mtp_head(make_llm, companion_model, hybrid_model):
    head = companion_head_path(companion_model)
    assert head.name == "tiny-hybrid-MTP-4bit" and artifacts.is_mtp_head(head)
    found = artifacts.detect_mtp(companion_model)
    assert found["embedded"] is False and found["config_mtp_layers"] == 1
    assert Path(found["companion_path"]).resolve() == head.resolve() and found["head_present"] is True
    caps = get_execution_capabilities(str(companion_model))["speculation"]
    assert caps["supported"] is True and caps["head_present"] is True
    assert caps["head_fingerprint"] == artifacts.model_fingerprint(head)
    assert caps["head_fingerprint"] != get_execution_capabilities(hybrid_model)["speculation"]["head_fingerprint"]

    llm = make_llm(str(companion_model), mlx_batching=True, speculation=False)
    off = llm.generate(PROMPTS[1], thinking=False, max_output_tokens=16)
    mtp = llm.generate(PROMPTS[1], thinking=False, max_output_tokens=16, speculation=STRICT)
    spec = mtp.metadata["speculation"]
    assert spec["used"] is True and Path(spec["drafter"]).resolve() == head.resolve() and "head_attach_s" in spec
    assert mtp.token_ids == off.token_ids
    # Naming the same head explicitly is the same target/head pair: one resident copy.
    named = make_llm(str(companion_model), mlx_batching=True, mtp_head=str(head), speculation=STRICT)
    assert named._resident is llm._resident
    # The same seed and alpha as the embedded kind: the same tokens and the same drafts.
    embedded = make_llm(hybrid_model, mlx_batching=True, speculation=STRICT)
    same = embedded.generate(PROMPTS[1], thinking=False, max_output_tokens=16)
    assert same.token_ids == mtp.token_ids
    assert same.metadata["speculation"]["accepted_tokens"] == spec["accepted_tokens"] > 0


def test_explicit_head_that_does_not_fit_is_reported_by_name(make_llm, dense_model, hybrid_model):
    """A head of another width: strict fails, optional runs target-only, both with the reason."""
    llm = make_llm(dense_model, mlx_batching=True, mtp_head=hybrid_model, speculation=False)
    with pytest.raises(errors.SpeculationUnavailable) as info:
        llm.generate(PROMPTS[0], max_output_tokens=2, speculation=STRICT)
    assert info.value.reason == "mtp_head_attach_failed"
    optional = llm.generate(PROMPTS[0], max_output_tokens=2, speculation=OPTIONAL)
    assert optional.metadata["speculation"]["reason"] == "mtp_head_attach_failed"
    assert optional.finish_reason == "length"


# -- load-aware optional MTP ------------------------------------------------------------------


def _request(i: int, draft: int = 0, *, required: bool = False, temperature: float | None = None) -> EngineRequest:
    return EngineRequest(
        request_id=f"r{i}",
        prompt_ids=[1, 2, 3],
        max_tokens=4,
        draft_tokens=draft,
        speculation_required=required and draft > 0,
        sampling=Sampling(temperature=temperature),
    )


@pytest.mark.parametrize(
    ("queue", "defers"),
    [
        ([(2, False)], False),  # alone: MTP
        ([(2, False), (0, False)], True),  # target-only work right behind it
        ([(2, False), (2, False)], False),  # only MTP work: a cohort
        ([(2, False), (3, False), (0, False)], True),  # another optional one defers with it
        ([(2, False), (2, True), (0, False)], False),  # a strict one behind it: the cohort they share
        ([(2, True), (0, False)], False),  # strict is never deferred
        ([(0, False), (2, False)], False),  # the head is target-only: nothing to defer
    ],
)
def test_optional_mtp_defers_only_when_target_only_work_waits(queue, defers):
    waiting = deque(_request(i, draft, required=req) for i, (draft, req) in enumerate(queue))
    key = under_load(waiting)
    if not defers:
        assert key is None
        return
    assert key is not None and key.mode == ExecutionMode.CONTINUOUS
    taken = take_compatible(waiting, key, 8)
    assert [r.request_id for r in taken] == [f"r{i}" for i in range(len(queue))]


def test_a_continuous_group_admits_optional_mtp_never_strict():
    plain, optional, required = _request(0), _request(1, 2), _request(2, 2, required=True)
    key = group_key(plain)
    assert key.admits(optional) and not key.admits(required)
    assert group_key(optional).mode == ExecutionMode.COHORT and target_only_key(optional) == key
    # Sampled optional MTP would run exclusive; under load it shares the batch (own sampler).
    sampled = _request(3, 2, temperature=0.7)
    assert group_key(sampled).mode == ExecutionMode.EXCLUSIVE and key.admits(sampled)
    assert under_load(deque([sampled, _request(4)])) == key
    assert under_load(deque([sampled, _request(4)]), sampled_exclusive=True) is None


@pytest.mark.slow
def test_optional_mtp_joins_the_batch_under_load_and_runs_mtp_alone(make_llm, hybrid_model):
    llm = make_llm(hybrid_model, mlx_batching=True, mlx_max_batch_size=4, speculation=False)
    reference = llm.generate(PROMPTS[1], thinking=False, max_output_tokens=12)
    running = llm.generate(PROMPTS[0], max_output_tokens=300, stream=True)
    next(running)  # target-only work is decoding
    events: list[dict] = []
    late = llm.generate(
        PROMPTS[1], thinking=False, max_output_tokens=12, speculation=OPTIONAL, on_progress=events.append
    )
    list(running)
    assert late.metadata["execution"]["mode"] == "continuous" and late.metadata["execution"]["peak_batch_size"] == 2
    spec = late.metadata["speculation"]
    assert spec["requested"] is True and spec["num_draft_tokens"] == 2 and spec["require_acceleration"] is False
    assert spec["used"] is False and spec["reason"] == "deferred_under_load"
    assert not {"rounds", "runtime", "drafter"} & set(spec)
    assert late.token_ids == reference.token_ids
    admitted = [e for e in events if "execution_mode" in e]
    assert admitted and admitted[-1]["phase"] == "complete"
    assert all(e["speculation_used"] is False and e["speculation_reason"] == "deferred_under_load" for e in admitted)

    alone_events: list[dict] = []
    alone = llm.generate(
        PROMPTS[1], thinking=False, max_output_tokens=12, speculation=OPTIONAL, on_progress=alone_events.append
    )
    assert alone.metadata["execution"]["mode"] == "cohort" and alone.metadata["speculation"]["used"] is True
    assert alone.metadata["speculation"]["rounds"] > 0 and alone.token_ids == reference.token_ids
    assert all(
        e["speculation_used"] is True and "speculation_reason" not in e for e in alone_events if "execution_mode" in e
    )


def test_strict_mtp_is_never_deferred(make_llm, hybrid_model):
    llm = make_llm(hybrid_model, mlx_batching=True, mlx_max_batch_size=4, speculation=False)
    running = llm.generate(PROMPTS[0], max_output_tokens=120, stream=True)
    next(running)
    required = llm.generate(PROMPTS[1], thinking=False, max_output_tokens=12, speculation=STRICT)
    list(running)
    assert required.metadata["execution"]["mode"] == "cohort"
    assert required.metadata["speculation"]["used"] is True and "reason" not in required.metadata["speculation"]


def test_optional_and_target_only_submitted_together_share_the_batch(make_llm, hybrid_model):
    # A long collection window: a cohort's head waits for company, and target-only company defers it.
    llm = make_llm(hybrid_model, mlx_batching=True, mlx_max_batch_size=4, mlx_batch_wait_ms=1000, speculation=False)
    results = together(
        llm,
        [
            {"prompt": PROMPTS[0], "thinking": False, "max_output_tokens": 10, "speculation": OPTIONAL},
            {"prompt": PROMPTS[1], "thinking": False, "max_output_tokens": 10},
        ],
    )
    optional, plain = results
    assert optional.metadata["speculation"]["reason"] == "deferred_under_load"
    assert optional.metadata["execution"]["mode"] == plain.metadata["execution"]["mode"] == "continuous"


# -- cohorts: exact limits, stop strings, parity --------------------------------------------


def test_cohort_keeps_exact_output_caps(make_llm, aligned_model):
    llm = make_llm(aligned_model, mlx_batching=True, mlx_max_batch_size=2, mlx_batch_wait_ms=1000, speculation=False)
    caps = (3, 11)
    off = [llm.generate(PROMPTS[i], thinking=False, max_output_tokens=n) for i, n in enumerate(caps)]
    for depth in (1, 3, 5):
        cohort = together(
            llm,
            [
                {"prompt": PROMPTS[i], "thinking": False, "max_output_tokens": n, "speculation": strict(depth)}
                for i, n in enumerate(caps)
            ],
        )
        for result, cap, reference in zip(cohort, caps, off):
            assert (
                result.metadata["execution"]["mode"] == "cohort"
                and result.metadata["execution"]["peak_batch_size"] == 2
            )
            assert result.usage["completion_tokens"] == len(result.token_ids) == cap
            assert result.finish_reason == "length" and result.token_ids == reference.token_ids
        assert cohort[1].metadata["speculation"]["accepted_tokens"] > 0


def test_cohort_stops_exactly_at_a_stop_string(make_llm, aligned_model):
    llm = make_llm(aligned_model, mlx_batching=True, mlx_max_batch_size=2, mlx_batch_wait_ms=1000, speculation=False)
    text = llm.generate(PROMPTS[0], thinking=False, max_output_tokens=24).content
    at = next(i for i in range(6, len(text) - 3) if text.find(text[i : i + 3]) == i)
    stop = text[at : at + 3]
    target_only = llm.generate(PROMPTS[0], thinking=False, max_output_tokens=24, stop=[stop])
    assert target_only.finish_reason == "stop" and target_only.content == text[:at]
    for depth in (2, 4):
        mtp, other = together(
            llm,
            [
                {
                    "prompt": PROMPTS[0],
                    "thinking": False,
                    "max_output_tokens": 24,
                    "stop": [stop],
                    "speculation": strict(depth),
                },
                {"prompt": PROMPTS[1], "thinking": False, "max_output_tokens": 24, "speculation": strict(depth)},
            ],
        )
        assert mtp.metadata["execution"]["mode"] == "cohort" and mtp.metadata["execution"]["peak_batch_size"] == 2
        assert mtp.finish_reason == "stop" and mtp.content == target_only.content
        assert (
            mtp.token_ids == target_only.token_ids
            and mtp.usage["completion_tokens"] == target_only.usage["completion_tokens"]
        )
        assert other.usage["completion_tokens"] == 24


# Depth 2 (the default) in the fast subset; the others are the same check, one model load each.
@pytest.mark.parametrize("depth", [2, *(pytest.param(depth, marks=pytest.mark.slow) for depth in (1, 3, 4, 5))])
def test_greedy_tokens_identical_with_mtp_on_and_off(make_llm, hybrid_model, depth):
    llm = make_llm(hybrid_model, mlx_batching=True, mlx_max_batch_size=2, mlx_batch_wait_ms=1000, speculation=False)
    off = [llm.generate(p, thinking=False, max_output_tokens=16).token_ids for p in PROMPTS[:2]]
    alone = llm.generate(PROMPTS[0], thinking=False, max_output_tokens=16, speculation=strict(depth))
    assert alone.metadata["speculation"]["num_draft_tokens"] == depth and alone.token_ids == off[0]
    cohort = together(
        llm,
        [{"prompt": p, "thinking": False, "max_output_tokens": 16, "speculation": strict(depth)} for p in PROMPTS[:2]],
    )
    assert [r.metadata["execution"]["peak_batch_size"] for r in cohort] == [2, 2]
    assert [r.token_ids for r in cohort] == off


# -- the same speculation forms at every edge -----------------------------------------------


@pytest.mark.parametrize(
    ("given", "wire"),
    [
        (2, {"mode": "native_mtp", "num_draft_tokens": 2}),
        ("3", {"mode": "native_mtp", "num_draft_tokens": 3}),
        ("off", False),
        (False, False),
        ("native_mtp", {"mode": "native_mtp"}),
        (
            '{"num_draft_tokens": 4, "require_acceleration": true}',
            {"mode": "native_mtp", "num_draft_tokens": 4, "require_acceleration": True},
        ),
        ({"mode": "native_mtp", "num_draft_tokens": 1}, {"mode": "native_mtp", "num_draft_tokens": 1}),
        ("inherit", None),
    ],
)
def test_speculation_option_forms(given, wire):
    from abstractruntime_mlx.controls import parse_speculation_option

    control = parse_speculation_option(given)
    assert (None if control is None else control.to_wire()) == wire


@pytest.mark.parametrize("bad", [0, -1, "0", "fast", "{not json", [2]])
def test_speculation_option_refusals(bad):
    from abstractruntime_mlx.controls import parse_speculation_option

    with pytest.raises(errors.InvalidControls):
        parse_speculation_option(bad, field="--speculation")


def test_run_and_serve_take_the_same_speculation_flag(dense_model):
    import argparse

    from abstractruntime_mlx.cli import run_cmd, serve_cmd

    flow = str(Path(__file__).resolve().parents[1] / "examples" / "fanout.json")
    for text, wire in (
        ("2", {"mode": "native_mtp", "num_draft_tokens": 2}),
        ("off", False),
        ('{"num_draft_tokens": 3}', {"mode": "native_mtp", "num_draft_tokens": 3}),
    ):
        parser = argparse.ArgumentParser()
        subparsers = parser.add_subparsers()
        run_cmd.add_parser(subparsers)
        serve_cmd.add_parser(subparsers)
        run = run_cmd.settings_from_args(
            parser.parse_args(["run", flow, "--model", dense_model, "--speculation", text])
        )
        assert run.provider_options["speculation"] == wire
        serve = serve_cmd.settings_from_args(
            parser.parse_args(["serve", "--model", dense_model, "--speculation", text]), environ={}
        )
        assert serve.options["speculation"] == wire
    parser = argparse.ArgumentParser()
    run_cmd.add_parser(parser.add_subparsers())
    assert (
        "speculation"
        not in run_cmd.settings_from_args(
            parser.parse_args(["run", flow, "--model", dense_model, "--speculation", "inherit"])
        ).provider_options
    )
    with pytest.raises(SystemExit, match="--speculation"):
        run_cmd.settings_from_args(parser.parse_args(["run", flow, "--model", dense_model, "--speculation", "0"]))


def test_models_load_takes_the_serve_forms(hybrid_model, policy_file):
    from starlette.testclient import TestClient

    from abstractruntime_mlx.server import create_app

    app = create_app(model_roots=[str(Path(hybrid_model).parent)])
    with TestClient(app) as client:
        loaded = client.post(
            "/acore/models/load", json={"model": hybrid_model, "speculation": 2, "options": {"mlx_batching": True}}
        )
        assert loaded.status_code == 200, loaded.json()
        assert app.state.pool.find(hybrid_model).provider.speculation_default() == {
            "mode": "native_mtp",
            "num_draft_tokens": 2,
        }
        same = client.post(
            "/acore/models/load", json={"model": hybrid_model, "options": {"mlx_batching": True, "speculation": "2"}}
        )
        assert same.status_code == 200 and same.json()["loaded_new"] is False
        other = client.post(
            "/acore/models/load", json={"model": hybrid_model, "options": {"mlx_batching": True, "speculation": 3}}
        )
        assert other.status_code == 409 and other.json()["error"]["code"] == "residency_conflict"
        both = client.post(
            "/acore/models/load", json={"model": hybrid_model, "speculation": 2, "options": {"speculation": "off"}}
        )
        assert both.status_code == 400 and "disagree" in both.json()["error"]["message"]
        bad = client.post("/acore/models/load", json={"model": hybrid_model, "speculation": 0})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_controls"
        chat = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
        )
        assert chat.status_code == 200 and chat.json()["abstractcore"]["speculation"]["used"] is True


# -- per-node MTP through a real VisualFlow run --------------------------------------------


def chain(nodes: dict[str, dict], *, flow_id: str = "chain") -> dict:
    """start -> one llm_call per entry of ``nodes`` ({id: effectConfig}), one after another -> end."""
    ids = list(nodes)
    flow_nodes = [{"id": "start", "type": "on_flow_start", "data": {}}]
    edges = []
    previous = "start"
    for node_id in ids:
        config = {"provider": "mlx", "temperature": 0, "max_output_tokens": 8, **nodes[node_id]}
        flow_nodes.append(
            {
                "id": node_id,
                "type": "llm_call",
                "data": {"effectConfig": config, "pinDefaults": {"prompt": f"Say something about {node_id}."}},
            }
        )
        edges.append({"source": previous, "sourceHandle": "exec-out", "target": node_id, "targetHandle": "exec-in"})
        previous = node_id
    flow_nodes.append(
        {"id": "end", "type": "on_flow_end", "data": {"inputs": [{"id": "exec-in", "type": "execution"}]}}
    )
    edges.append({"source": previous, "sourceHandle": "exec-out", "target": "end", "targetHandle": "exec-in"})
    return {"id": flow_id, "entryNode": "start", "nodes": flow_nodes, "edges": edges}


PER_NODE = chain(
    {
        "n_strict": {"speculation": strict(2)},
        "n_optional": {"speculation": {"mode": "native_mtp", "num_draft_tokens": 3}},
        "n_off": {"speculation": False},
        "n_inherit": {},
    }
)


def _run_flow(flow, model, tmp_path, **pack_options):
    from abstractruntime_mlx.ledger import Ledger
    from abstractruntime_mlx.nodes import ProviderRegistry
    from abstractruntime_mlx.runtime_plugin import build_pack, run_flow

    url = f"sqlite:///{tmp_path}/ledger-{len(list(tmp_path.iterdir()))}.sqlite"
    registry = ProviderRegistry()
    pack = build_pack(url, model=model, registry=registry, **pack_options)
    try:
        (result,) = run_flow(flow, pack=pack)
    finally:
        pack.close()
        registry.close()
    assert result.status == "completed", result.error
    with Ledger(url) as ledger:
        steps = {
            s.node_id: s.record["result"]["metadata"]
            for s in ledger.run_steps(result.run_id)
            if s.effect_type == "llm_call" and s.status == "completed"
        }
        rows = ledger.node_timeline(result.run_id)
    return steps, rows


@pytest.mark.parametrize(
    ("policy", "provider_options", "inherit_used", "inherit_reason"),
    [
        ("off", {}, False, "disabled_by_policy"),
        (2, {}, True, None),
        ("inherit", {}, True, None),  # no policy: the verified default (optional MTP)
        (None, {"speculation": False}, False, "disabled_by_provider_default"),  # provider default off
    ],
)
def test_per_node_mtp_whatever_the_policy_or_provider_default(
    hybrid_model, tmp_path, policy_file, policy, provider_options, inherit_used, inherit_reason
):
    from abstractruntime_mlx.policy import set_default_speculation

    if policy is not None:
        set_default_speculation("output.text", policy, policy_file)
    steps, rows = _run_flow(PER_NODE, hybrid_model, tmp_path, provider_options=provider_options)
    assert set(steps) == {"n_strict", "n_optional", "n_off", "n_inherit"}
    assert (
        steps["n_strict"]["speculation"]["used"] is True and steps["n_strict"]["speculation"]["num_draft_tokens"] == 2
    )
    assert (
        steps["n_optional"]["speculation"]["used"] is True
        and steps["n_optional"]["speculation"]["num_draft_tokens"] == 3
    )
    assert steps["n_off"]["speculation"] == {
        **steps["n_off"]["speculation"],
        "used": False,
        "reason": "disabled_for_this_call",
    }
    assert steps["n_inherit"]["speculation"]["used"] is inherit_used
    assert steps["n_inherit"]["speculation"].get("reason") == inherit_reason
    # Phase events in the ledger say what ran, node by node.
    for node_id, used in (("n_strict", True), ("n_optional", True), ("n_off", False)):
        admitted = [r.event for r in rows if r.node_id == node_id and "execution_mode" in r.event]
        assert admitted and all(e["speculation_used"] is used for e in admitted)
    if policy == "off" or provider_options:
        # The head was not loaded with the model: the first MTP node attached it, once.
        assert "head_attach_s" in steps["n_strict"]["speculation"]
        assert "head_attach_s" not in steps["n_optional"]["speculation"]


@pytest.mark.slow
def test_deferral_is_in_the_ledger(hybrid_model, tmp_path, policy_file):
    """Sibling branches submitted together: the optional MTP one runs target-only with the plain one."""
    from test_runtime_plugin import fanout

    # The plain branch decodes long enough that the optional one meets it whichever is submitted first.
    flow = fanout(
        {"plain": {"speculation": False, "max_output_tokens": 200}, "optional": {"speculation": OPTIONAL}},
        flow_id="load",
    )
    steps, rows = _run_flow(flow, hybrid_model, tmp_path, provider_options={"mlx_batch_wait_ms": 1000})
    assert steps["optional"]["speculation"]["used"] is False
    assert steps["optional"]["speculation"]["reason"] == "deferred_under_load"
    assert steps["optional"]["execution"]["mode"] == "continuous"
    events = [r.event for r in rows if r.node_id == "optional" and "execution_mode" in r.event]
    assert events and all(e["speculation_reason"] == "deferred_under_load" for e in events)


@pytest.mark.slow
def test_a_deferred_request_keys_its_prefix_as_target_only(make_llm, hybrid_model):
    """What a deferred request stores is target-only KV: a later target-only turn restores it."""
    system = "You are a careful assistant who answers briefly. " * 12
    llm = make_llm(hybrid_model, mlx_batching=True, mlx_max_batch_size=4, speculation=False)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What does a cache keep?"}]
    running = llm.generate(PROMPTS[0], messages=[], max_output_tokens=300, prompt_cache_key="other", stream=True)
    next(running)  # keyed target-only work is decoding
    first = llm.generate(
        "", messages=messages, prompt_cache_key="conv", thinking=False, max_output_tokens=8, speculation=OPTIONAL
    )
    list(running)
    assert first.metadata["speculation"]["reason"] == "deferred_under_load"
    messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "And what does it drop?"}]
    second = llm.generate("", messages=messages, prompt_cache_key="conv", thinking=False, max_output_tokens=8)
    assert second.metadata["prompt_cache"]["outcome"] == "hit" and second.usage["cached_input_tokens"] > 0


def test_companion_kind_builds_both_directories_and_rebuilds_a_missing_head(tmp_path):
    import shutil

    from abstractruntime_mlx.testing import build_from_cli, read_marker

    target = build_from_cli(str(tmp_path / "m-8bit"), "hybrid-companion", 0)
    head = companion_head_path(target)
    assert head == tmp_path / "m-MTP-8bit" and artifacts.is_mtp_head(head)
    assert not artifacts.detect_mtp(target)["embedded"] and artifacts.detect_mtp(target)["head_present"] is True
    keys = artifacts.tensor_names(artifacts.read_safetensors_headers(head))
    assert keys and not any(key.startswith("mtp.") for key in keys)
    assert read_marker(head)["part"] == "mtp_head"
    shutil.rmtree(head)
    assert tiny_model(target, kind="hybrid-companion", seed=0) == target and artifacts.is_mtp_head(head)
    assert companion_head_path(tmp_path / "plain") == tmp_path / "plain-MTP"
