"""Where the seed names a behaviour, ours: the install extra, the seed's module paths, MTP on the
non-batched provider (mlx-vlm's in-process lane), a damaged or mismatched head falling back to
target-only, the phase-event keys on the events the seed names, and one observation per real
change of position."""

from __future__ import annotations

import json
import shutil
import threading
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from starlette.testclient import TestClient

import abstractruntime_mlx
from abstractruntime_mlx import capabilities, errors, server
from abstractruntime_mlx.engine.core.request import EngineRequest, NativePrefillProgress, PrefillObservation, TokenDelta
from abstractruntime_mlx.testing import companion_head_path, tiny_model
from test_server_harness import FakeProvider

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The cache keeps the most recent entries and drops the oldest ones. " * 30
OPTIONAL = {"mode": "native_mtp", "num_draft_tokens": 2}
STRICT = {**OPTIONAL, "require_acceleration": True}


def prefill_positions(events: list[dict]) -> list[int]:
    return [e["prefill_processed_tokens"] for e in events if "prefill_processed_tokens" in e]


# -- install and dependency floors ---------------------------------------------------------------


def test_apple_extra_installs_the_provider_stack_at_the_dependency_floors():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    apple = {Requirement(r).name: Requirement(r) for r in project["optional-dependencies"]["apple"]}
    assert set(apple) == {"mlx", "mlx-lm", "mlx-vlm"}
    for name in ("mlx-lm", "mlx-vlm"):
        assert apple[name].specifier == base[name].specifier
    assert str(apple["mlx"].specifier) == ">=0.32.2" and apple["mlx"].marker.evaluate({"sys_platform": "darwin"})
    assert {str(s) for s in base["mlx-vlm"].specifier} == {
        ">=0.7.10",
        "<0.8.0",
    }  # ours, not the seed's 0.7.1: the comment says why
    text = (ROOT / "pyproject.toml").read_text()
    assert "The seed says >= 0.7.1; ours starts at 0.7.10" in text


# -- the seed's module paths -----------------------------------------------------------------------


def test_seed_module_paths_are_the_same_objects():
    from abstractruntime_mlx.endpoint.app import create_app
    from abstractruntime_mlx.providers.speculation import get_execution_capabilities

    assert get_execution_capabilities is capabilities.get_execution_capabilities
    assert create_app is server.create_app


def test_top_level_capabilities_take_head_and_policy_path(models_dir, tmp_path, dense_model, policy_file):
    companion = tiny_model(models_dir / "parity-hybrid-4bit", kind="hybrid-companion", seed=0, mtp_alpha=0.05)
    head = companion_head_path(companion)
    named = abstractruntime_mlx.get_execution_capabilities(dense_model, head=str(head))["speculation"]
    assert named["head_path"] == str(head)  # a dense target named with a head: the head is what is reported
    assert "head_path" not in abstractruntime_mlx.get_execution_capabilities(dense_model)["speculation"]

    policy = tmp_path / "other-policy.json"
    option = {"options": {"speculation": False}}
    policy.write_text(json.dumps({"capability_defaults": {"routes": {"input.text": option, "output.text": option}}}))
    off = abstractruntime_mlx.get_execution_capabilities(str(companion), policy_path=policy)["speculation"]
    assert (off["effective_default"], off["effective_source"]) == (False, "policy")
    on = abstractruntime_mlx.get_execution_capabilities(str(companion))["speculation"]
    assert on["effective_default"] is not False  # the private policy file (absent: the fresh-install seed)


# -- MTP on the non-batched provider -------------------------------------------------------------


@pytest.mark.slow
def test_non_batched_provider_runs_mtp_on_mlx_vlms_in_process_lane(make_llm, hybrid_model):
    target_only = make_llm(hybrid_model, mlx_batching=True, speculation=False)
    reference = target_only.generate(PROMPT, thinking=False, max_output_tokens=16).token_ids

    llm = make_llm(hybrid_model)  # nothing set: the verified default is optional MTP
    assert llm._engine.loaded.upstream == "mlx_vlm" and llm.speculation_ready()
    optional = llm.generate(PROMPT, thinking=False, max_output_tokens=16)
    spec = optional.metadata["speculation"]
    assert spec["used"] is True and spec["runtime"] == "mlx_vlm" and spec["drafted_tokens"] > 0
    assert optional.token_ids == reference  # greedy MTP: the target's tokens
    assert optional.metadata["execution"]["path"] == "serial"
    strict = llm.generate(PROMPT, thinking=False, max_output_tokens=16, speculation={**STRICT, "num_draft_tokens": 3})
    assert strict.metadata["speculation"]["used"] is True and strict.token_ids == reference
    off = llm.generate(PROMPT, thinking=False, max_output_tokens=16, speculation=False)
    assert off.metadata["speculation"]["used"] is False and off.token_ids == reference


def test_non_batched_provider_loaded_without_mtp_names_the_load_time_choice(make_llm, hybrid_model):
    llm = make_llm(hybrid_model, speculation=False)
    assert llm._engine.loaded.upstream == "mlx_lm"
    optional = llm.generate("hi", max_output_tokens=2, speculation=OPTIONAL)
    assert optional.metadata["speculation"]["used"] is False
    assert optional.metadata["speculation"]["reason"] == "speculation_is_load_time"
    with pytest.raises(errors.SpeculationUnavailable) as info:
        llm.generate("hi", max_output_tokens=2, speculation=STRICT)
    assert info.value.reason == "speculation_is_load_time" and info.value.code == "speculation_unavailable"


@pytest.mark.slow
def test_in_process_lane_names_what_a_prompt_cache_key_does_not_do(make_llm, hybrid_model):
    llm = make_llm(hybrid_model)
    result = llm.generate(PROMPT, messages=[], prompt_cache_key="k", thinking=False, max_output_tokens=4)
    report = result.metadata["prompt_cache"]
    assert (report["key"], report["outcome"], report["reason"]) == ("k", "not_supported", "in_process_lane")


# -- a head that cannot load: optional MTP falls back to target-only ---------------------------


def _truncated(head: Path, out: Path) -> Path:
    shutil.copytree(head, out)
    for weights in out.glob("*.safetensors"):
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    return out


def _mismatched(head: Path, out: Path) -> Path:
    """The same head with every matrix one column narrower: it no longer fits the target."""
    import mlx.core as mx

    shutil.copytree(head, out)
    for weights in out.glob("*.safetensors"):
        tensors = mx.load(str(weights))
        mx.save_safetensors(str(weights), {k: (v[..., :-1] if v.ndim >= 2 else v) for k, v in tensors.items()})
    return out


@pytest.fixture(scope="module")
def damaged_heads(models_dir, tmp_path_factory):
    target = tiny_model(models_dir / "damage-hybrid-4bit", kind="hybrid-companion", seed=0, mtp_alpha=0.05)
    head = companion_head_path(target)
    root = tmp_path_factory.mktemp("damaged-heads")
    return str(target), {
        "truncated": str(_truncated(head, root / "truncated")),
        "mismatched": str(_mismatched(head, root / "mismatched")),
    }


@pytest.mark.parametrize("damage", ["truncated", "mismatched"])
@pytest.mark.parametrize("batching", [True, False])
def test_damaged_head_at_load_falls_back_to_target_only(make_llm, damaged_heads, damage, batching):
    target, heads = damaged_heads
    reference = make_llm(target, mlx_batching=True, speculation=False).generate("hi", max_output_tokens=6).token_ids
    llm = make_llm(target, mtp_head=heads[damage], mlx_batching=batching)  # nothing set: optional MTP
    assert not llm.speculation_ready() and llm._engine.loaded.drafter_error
    result = llm.generate("hi", max_output_tokens=6)
    spec = result.metadata["speculation"]
    assert (spec["used"], spec["reason"]) == (False, "mtp_head_attach_failed")
    assert result.token_ids == reference
    with pytest.raises(errors.SpeculationUnavailable) as info:
        llm.generate("hi", max_output_tokens=6, speculation=STRICT)
    assert info.value.reason == "mtp_head_attach_failed" and info.value.code == "speculation_unavailable"


@pytest.mark.parametrize("damage", ["truncated", "mismatched"])
def test_damaged_head_at_first_use_falls_back_to_target_only(make_llm, damaged_heads, damage):
    target, heads = damaged_heads
    llm = make_llm(target, mtp_head=heads[damage], mlx_batching=True, speculation=False)
    assert llm.speculation_attachable()  # not read yet: the damage shows at first use
    optional = llm.generate("hi", max_output_tokens=4, speculation=OPTIONAL)
    assert optional.metadata["speculation"]["reason"] == "mtp_head_attach_failed"
    assert optional.finish_reason == "length" and not llm.speculation_attachable()
    with pytest.raises(errors.SpeculationUnavailable):
        llm.generate("hi", max_output_tokens=4, speculation=STRICT)


# -- the phase-event keys on the events the seed names ----------------------------------------


def test_key_mode_lane_puts_the_split_on_the_start_event(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=False, mlx_prefill_step_size=64, progress_min_interval_s=0.0)
    first: list[dict] = []
    llm.generate(PROMPT, messages=[], prompt_cache_key="chat", max_output_tokens=4, on_progress=first.append)
    assert first[0]["cached_tokens"] == 0 and first[0]["fed_tokens"] == first[0]["prompt_tokens"]  # a miss is known too
    second: list[dict] = []
    result = llm.generate(
        PROMPT + " And then?", messages=[], prompt_cache_key="chat", max_output_tokens=4, on_progress=second.append
    )
    start = second[0]
    assert start["phase"] == "prefill" and "prefill_processed_tokens" not in start
    assert start["cached_tokens"] == result.usage["cached_input_tokens"] > 0
    assert start["fed_tokens"] == start["prompt_tokens"] - start["cached_tokens"]


def test_batched_lane_has_the_split_from_the_first_mid_prefill_event(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_prefill_step_size=64, progress_min_interval_s=0.0)
    events: list[dict] = []
    llm.generate(PROMPT, max_output_tokens=4, on_progress=events.append)
    assert "cached_tokens" not in events[0]  # learnt on the worker, once prefill started
    mid = [e for e in events if "prefill_processed_tokens" in e]
    assert mid and mid[0]["prefill_processed_tokens"] > 0
    assert all("cached_tokens" in e and "fed_tokens" in e for e in mid)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"mlx_batching": True}, {"mlx_batching": False}], ids=["batched", "serialized"])
def test_one_observation_per_real_change_of_position(make_llm, dense_model, options):
    llm = make_llm(dense_model, mlx_prefill_step_size=64, progress_min_interval_s=0.0, **options)
    events: list[dict] = []
    llm.generate(PROMPT, thinking=False, max_output_tokens=4, on_progress=events.append)
    positions = prefill_positions(events)
    assert len(positions) >= 3 and 0 not in positions
    assert all(a < b for a, b in zip(positions, positions[1:])), positions  # strictly: no repeats


@pytest.mark.parametrize("options", [{"mlx_batching": True}, {"mlx_batching": False}], ids=["batched", "serialized"])
def test_a_prompt_shorter_than_one_chunk_reports_no_position(make_llm, dense_model, options):
    llm = make_llm(dense_model, progress_min_interval_s=0.0, **options)
    events: list[dict] = []
    result = llm.generate("Hello there, cache?", thinking=False, max_output_tokens=3, on_progress=events.append)
    assert result.usage["prompt_tokens"] < 256
    assert prefill_positions(events) == []
    assert [e["phase"] for e in events[:2]] == ["prefill", "generate"]  # the first token follows the start event


@pytest.mark.slow
def test_serialized_lane_chunks_by_2048_unless_a_step_is_chosen(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=False, progress_min_interval_s=0.0)
    assert llm._engine.config.serial_prefill_step_size == 2048
    events: list[dict] = []
    long_prompt = "Caches trade memory for time. " * 200
    result = llm.generate(long_prompt, thinking=False, max_output_tokens=2, on_progress=events.append)
    total = result.usage["prompt_tokens"]
    assert 2048 < total < 4096
    assert prefill_positions(events)[0] == 2048  # one chunk of 2,048, then the rest
    llm.unload_model()
    chosen = make_llm(dense_model, mlx_batching=False, mlx_prefill_step_size=64)
    assert chosen._engine.config.serial_prefill_step_size == 64


# -- the engine stream ----------------------------------------------------------------------------


@pytest.mark.slow
def test_engine_stream_hands_observations_to_the_callback_on_the_iterating_thread(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_prefill_step_size=64)
    engine = llm._engine
    loaded = engine.serving_model()
    ids = loaded.encode(PROMPT)
    seen: list[tuple[PrefillObservation, int]] = []

    def on_prefill_progress(obs: NativePrefillProgress) -> None:
        seen.append((obs, threading.get_ident()))

    observed = list(engine.stream(EngineRequest("a", ids, 4), on_prefill_progress=on_prefill_progress))
    assert observed and all(isinstance(item, TokenDelta) for item in observed)
    assert len(seen) >= 3 and {thread for _obs, thread in seen} == {threading.get_ident()}
    assert [obs.processed for obs, _ in seen] == sorted({obs.processed for obs, _ in seen})
    # A consumer that did not ask sees the stream it saw before: tokens only, the same ones.
    plain = list(engine.submit(EngineRequest("b", ids, 4, observe_prefill=True)))
    assert [d.token_ids for d in plain] == [d.token_ids for d in observed]


# -- a provider without text progress events -----------------------------------------------------


class _SilentProvider(FakeProvider):
    def supports_text_progress_events(self) -> bool:
        return False


def test_server_drops_include_progress_for_a_provider_without_phase_events():
    fake = _SilentProvider()
    with TestClient(server.create_app(fake)) as client:
        response = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_progress": True}},
        )
    assert response.status_code == 200
    events = [line.removeprefix("event: ") for line in response.text.splitlines() if line.startswith("event: ")]
    assert "progress" not in events and "result" in events  # no phase invented
    assert fake.calls and "on_progress" not in fake.calls[0]  # the callback never reached the provider
