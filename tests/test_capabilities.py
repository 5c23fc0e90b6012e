"""artifacts + capabilities: model resolution, headers, MTP detection, no weights ever loaded."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from abstractruntime_mlx import artifacts
from abstractruntime_mlx.capabilities import get_execution_capabilities
from abstractruntime_mlx.controls import ControlLevel
from abstractruntime_mlx.errors import InvalidRequest, ModelNotFound, PolicyError

SEED = {"mode": "native_mtp", "num_draft_tokens": 2, "require_acceleration": False}
SPECULATION_KEYS = {
    "supported",
    "effective_source",
    "ready",
    "reason",
    "message",
    "companion",
    "head_present",
    "supported_depths",
    "default",
    "effective_default",
    "requires_reload",
}


def checkpoint(path: Path, *, model_type="qwen3", mtp=False, config_extra=None, corrupt_data=False) -> Path:
    """A fake checkpoint: config.json + one safetensors file of tiny arrays."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": model_type, **(config_extra or {})}
    (path / "config.json").write_text(json.dumps(config))
    tensors = {
        "model.embed_tokens.weight": np.zeros((4, 2), dtype=np.float32),
        "model.layers.0.mlp.weight": np.ones((2, 2), dtype=np.float32),
    }
    if mtp:
        tensors["mtp.fc.weight"] = np.ones((2, 4), dtype=np.float32)
        tensors["mtp.layers.0.norm.weight"] = np.ones((2,), dtype=np.float32)
    file = path / "model.safetensors"
    save_file(tensors, str(file))
    if corrupt_data:
        # Keep the header valid, replace the tensor bytes with a truncated stub: any load fails.
        raw = file.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        file.write_bytes(raw[: 8 + length] + b"\x01")
    return path


def hub_cache(cache: Path, repo_id: str, **kwargs) -> Path:
    """Lay out ``repo_id`` as a Hugging Face cache snapshot and return the snapshot dir."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text("c0ffee")
    return checkpoint(repo / "snapshots" / "c0ffee", **kwargs)


@pytest.fixture
def no_policy(tmp_path):
    """A Core config file whose text route has no speculation key (no policy)."""
    path = tmp_path / "core" / "abstractcore.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"capability_defaults": {"version": 1, "routes": {}}}))
    return path


@pytest.fixture
def no_weight_loading(monkeypatch):
    """Any attempt to load weights fails the test."""
    import mlx.core as mx

    def refuse(*_args, **_kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(mx, "load", refuse)
    for module in ("mlx_lm", "mlx_vlm"):
        mod = pytest.importorskip(module)
        monkeypatch.setattr(mod, "load", refuse)
    import safetensors.numpy

    monkeypatch.setattr(safetensors.numpy, "load_file", refuse)


# --------------------------------------------------------------------------- artifacts


def test_resolve_local_directory(tmp_path):
    model = checkpoint(tmp_path / "m")
    assert artifacts.resolve_model_path(str(model)) == model.resolve()
    assert artifacts.resolve_model_path(model) == model.resolve()


@pytest.mark.parametrize("name", ["./nope", "/definitely/not/here", "~/nope-model-dir"])
def test_resolve_missing_path(name):
    with pytest.raises(ModelNotFound) as info:
        artifacts.resolve_model_path(name)
    assert info.value.code == "model_not_found"


def test_resolve_file_is_not_a_model(tmp_path):
    file = tmp_path / "x.safetensors"
    file.write_bytes(b"")
    with pytest.raises(ModelNotFound):
        artifacts.resolve_model_path(str(file))


def test_resolve_hub_cache_offline(tmp_path):
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, "org/model-4bit")
    assert artifacts.resolve_model_path("org/model-4bit", cache_dir=cache) == snapshot
    assert artifacts.hub_repo_id(snapshot) == "org/model-4bit"


@pytest.mark.parametrize("name", ["org/absent", "absent", "bad name!!"])
def test_missing_hub_model_names_the_download_command(tmp_path, name):
    with pytest.raises(ModelNotFound) as info:
        artifacts.resolve_model_path(name, cache_dir=tmp_path / "hub")
    assert f"abstractruntime-mlx models download {name}" in info.value.message


def test_headers_only(tmp_path):
    model = checkpoint(tmp_path / "m", mtp=True, corrupt_data=True)
    headers = artifacts.read_safetensors_headers(model)
    assert list(headers) == ["model.safetensors"]
    names = artifacts.tensor_names(headers)
    assert "mtp.fc.weight" in names and "__metadata__" not in names
    assert headers["model.safetensors"]["mtp.fc.weight"]["shape"] == [2, 4]
    assert artifacts.read_safetensors_headers(model / "model.safetensors") == headers


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x01\x02",
        struct.pack("<Q", 10**12) + b"{}",
        struct.pack("<Q", 4) + b"[1]\x00",
        struct.pack("<Q", 3) + b"{x}",
    ],
)
def test_corrupt_header(tmp_path, content):
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(InvalidRequest) as info:
        artifacts.read_safetensors_headers(tmp_path)
    assert "model.safetensors" in info.value.message


def test_detect_embedded_mtp(tmp_path):
    found = artifacts.detect_mtp(checkpoint(tmp_path / "m", mtp=True))
    assert found["embedded"] is True and found["num_mtp_keys"] == 2
    assert found["head_present"] is True and found["verified"] is True
    plain = artifacts.detect_mtp(checkpoint(tmp_path / "p"))
    assert plain["embedded"] is False and plain["verified"] is False and plain["head_present"] is None


def test_detect_wrapped_mtp_keys():
    assert artifacts.is_mtp_key("mtp.fc.weight")
    assert artifacts.is_mtp_key("language_model.mtp.layers.0.w")
    assert not artifacts.is_mtp_key("model.layers.0.smtp.w")
    assert not artifacts.is_mtp_key("mtpx.w")


def test_companion_names():
    assert artifacts.companion_candidates("org/Qwen3.8-27B-4bit") == [
        "org/Qwen3.8-27B-4bit-MTP",
        "org/Qwen3.8-27B-MTP-4bit",
    ]
    assert artifacts.companion_candidates("org/Model") == ["org/Model-MTP"]


def test_detect_companion_head_in_hub_cache(tmp_path):
    cache = tmp_path / "hub"
    target = hub_cache(cache, "org/Q-27B-4bit")
    head = hub_cache(cache, "org/Q-27B-MTP-4bit", model_type="qwen3_5_mtp")
    assert artifacts.is_mtp_head(head)
    found = artifacts.detect_mtp(target, cache_dir=cache)  # name derived from the snapshot path
    assert found["companion"] == "org/Q-27B-MTP-4bit"
    assert found["companion_path"] == str(head)
    assert found["head_present"] is True and found["verified"] is True
    # A conventional name that is not an MTP head does not count.
    other = tmp_path / "hub2"
    hub_cache(other, "org/Z-4bit")
    hub_cache(other, "org/Z-4bit-MTP", model_type="qwen3")
    assert (
        artifacts.detect_mtp(other / "models--org--Z-4bit" / "snapshots" / "c0ffee", cache_dir=other)["companion"]
        is None
    )


def test_detect_sibling_head_directory(tmp_path):
    target = checkpoint(tmp_path / "Model")
    checkpoint(tmp_path / "Model-MTP", model_type="qwen3_5_mtp")
    found = artifacts.detect_mtp(target, name=str(target))
    assert found["companion"] == str(tmp_path / "Model-MTP")
    assert found["head_present"] is True


def test_detect_explicit_head_missing(tmp_path):
    found = artifacts.detect_mtp(checkpoint(tmp_path / "m"), head="org/not-downloaded", cache_dir=tmp_path / "hub")
    assert found["companion"] == "org/not-downloaded"
    assert found["head_present"] is False and found["verified"] is True


def test_fingerprint(tmp_path):
    a = checkpoint(tmp_path / "a", mtp=True)
    b = checkpoint(tmp_path / "b", mtp=True)
    assert artifacts.model_fingerprint(a) == artifacts.model_fingerprint(b)
    assert artifacts.model_fingerprint(a).startswith("sha256:")
    (b / "tokenizer_config.json").write_text("{}")
    assert artifacts.model_fingerprint(a) != artifacts.model_fingerprint(b)
    c = checkpoint(tmp_path / "c")
    assert artifacts.model_fingerprint(c) != artifacts.model_fingerprint(a)
    d = checkpoint(tmp_path / "d", mtp=True, corrupt_data=True)  # header hash + size, no tensor read
    assert artifacts.model_fingerprint(d) != artifacts.model_fingerprint(a)


# --------------------------------------------------------------------------- capabilities


def test_embedded_mtp_without_loading_weights(tmp_path, no_policy, no_weight_loading):
    model = checkpoint(tmp_path / "m", mtp=True, corrupt_data=True)
    report = get_execution_capabilities(str(model), policy_path=no_policy)
    assert set(report) == {"version", "provider", "model", "speculation", "thinking", "concurrency"}
    assert report["thinking"] == {"effective_default": None, "effective_source": "model_default"}
    assert report["version"] == 1 and report["provider"] == "mlx" and report["model"] == str(model)
    spec = report["speculation"]
    assert set(spec) == SPECULATION_KEYS | {"head_path", "head_fingerprint"}
    assert spec["head_path"] == str(model) and spec["head_fingerprint"] == artifacts.model_fingerprint(model)
    assert spec["supported"] is True
    assert spec["ready"] is None
    assert spec["reason"] == "model_not_loaded"
    assert spec["head_present"] is True
    assert spec["supported_depths"] == [1, 2, 3, 4, 5]
    assert spec["default"] is None
    assert spec["effective_default"] == {"mode": "native_mtp", "num_draft_tokens": 2, "require_acceleration": False}
    assert spec["effective_source"] == "verified_default"
    assert spec["requires_reload"] is None
    assert report["concurrency"] == {"supported": None, "source": "unknown", "reason": None}
    json.dumps(report)


def test_policy_default_and_seed(tmp_path, no_weight_loading):
    model = checkpoint(tmp_path / "m", mtp=True)
    seed = get_execution_capabilities(str(model), policy_path=tmp_path / "missing.json")["speculation"]
    assert seed["default"] == SEED and seed["effective_default"] == SEED
    off_file = tmp_path / "off.json"
    off_file.write_text(
        json.dumps({"capability_defaults": {"routes": {"input.text": {"options": {"speculation": False}}}}})
    )
    off = get_execution_capabilities(str(model), policy_path=off_file)["speculation"]
    assert off["supported"] is True and off["default"] is False and off["effective_default"] is False
    partial = tmp_path / "partial.json"
    partial.write_text(
        json.dumps(
            {"capability_defaults": {"routes": {"input.text": {"options": {"speculation": {"num_draft_tokens": 4}}}}}}
        )
    )
    got = get_execution_capabilities(str(model), policy_path=partial)["speculation"]
    assert got["default"] == {"mode": "native_mtp", "num_draft_tokens": 4}
    assert got["effective_default"] == {"mode": "native_mtp", "num_draft_tokens": 4, "require_acceleration": False}


def test_corrupt_policy_raises(tmp_path):
    model = checkpoint(tmp_path / "m", mtp=True)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(PolicyError):
        get_execution_capabilities(str(model), policy_path=bad)


def test_without_mtp_keys(tmp_path, no_policy, no_weight_loading):
    spec = get_execution_capabilities(str(checkpoint(tmp_path / "m")), policy_path=no_policy)["speculation"]
    assert spec["supported"] is False and spec["ready"] is False
    assert spec["reason"] == "mtp_artifact_unverified"
    assert spec["effective_default"] is False and spec["supported_depths"] == []


def test_declared_but_missing_mtp_weights(tmp_path, no_policy):
    model = checkpoint(tmp_path / "m", model_type="qwen3_5", config_extra={"text_config": {"mtp_num_hidden_layers": 1}})
    spec = get_execution_capabilities(str(model), policy_path=no_policy)["speculation"]
    assert spec["reason"] == "embedded_mtp_weights_missing" and spec["supported"] is False


def test_model_is_a_head(tmp_path, no_policy):
    head = checkpoint(tmp_path / "h", model_type="qwen3_5_mtp")
    assert get_execution_capabilities(str(head), policy_path=no_policy)["speculation"]["reason"] == "model_is_mtp_head"


def test_unsupported_provider(tmp_path, no_policy):
    report = get_execution_capabilities(
        str(checkpoint(tmp_path / "m", mtp=True)), provider="ollama", policy_path=no_policy
    )
    spec = report["speculation"]
    assert (spec["supported"], spec["ready"], spec["effective_default"]) == (False, False, False)
    assert spec["reason"] == "native_mtp_backend_unavailable"
    assert report["provider"] == "ollama"


def test_missing_model_is_reported_not_raised(tmp_path, no_policy):
    spec = get_execution_capabilities("org/absent", policy_path=no_policy, cache_dir=tmp_path / "hub")["speculation"]
    assert spec["supported"] is False and spec["reason"] == "model_not_found"
    assert "abstractruntime-mlx models download org/absent" in spec["message"]


def test_unreadable_checkpoint_is_reported(tmp_path, no_policy):
    model = checkpoint(tmp_path / "m")
    (model / "model.safetensors").write_bytes(b"\x00")
    spec = get_execution_capabilities(str(model), policy_path=no_policy)["speculation"]
    assert spec["reason"] == "checkpoint_unreadable" and str(model) in spec["message"]


def test_checkpoint_without_weights(tmp_path, no_policy):
    model = checkpoint(tmp_path / "m")
    (model / "model.safetensors").unlink()
    spec = get_execution_capabilities(str(model), policy_path=no_policy)["speculation"]
    assert spec["reason"] == "checkpoint_unreadable" and "no *.safetensors" in spec["message"]


def test_companion_head_not_cached(tmp_path, no_policy):
    spec = get_execution_capabilities(
        str(checkpoint(tmp_path / "m")), head="org/m-MTP", policy_path=no_policy, cache_dir=tmp_path / "hub"
    )["speculation"]
    assert spec["supported"] is True and spec["head_present"] is False
    assert spec["reason"] == "mtp_head_not_cached"
    assert "abstractruntime-mlx models download org/m-MTP" in spec["message"]


def test_hub_model_with_cached_companion(tmp_path, no_policy, no_weight_loading):
    cache = tmp_path / "hub"
    hub_cache(cache, "org/Q-4bit")
    hub_cache(cache, "org/Q-MTP-4bit", model_type="qwen3_5_mtp")
    spec = get_execution_capabilities("org/Q-4bit", policy_path=no_policy, cache_dir=cache)["speculation"]
    assert spec["supported"] is True and spec["companion"] == "org/Q-MTP-4bit" and spec["head_present"] is True


class Instance:
    def __init__(self, ready=None, concurrent=True, default="missing"):
        if ready is not None:
            self.speculation_ready = lambda: ready
        self.supports_concurrent_generation = lambda: concurrent
        if default != "missing":
            self.control_defaults = lambda: ControlLevel.parse(speculation=default)


@pytest.mark.parametrize(
    ("instance", "ready", "reason", "reload"),
    [
        (Instance(ready=True), True, None, False),
        (Instance(ready=False), False, "speculation_is_load_time", True),
        (Instance(), None, "readiness_unknown", None),
    ],
)
def test_with_instance(tmp_path, no_policy, instance, ready, reason, reload):
    report = get_execution_capabilities(
        str(checkpoint(tmp_path / "m", mtp=True)), instance=instance, policy_path=no_policy
    )
    spec = report["speculation"]
    assert (spec["ready"], spec["reason"], spec["requires_reload"]) == (ready, reason, reload)
    assert report["concurrency"] == {"supported": True, "source": "loaded_instance", "reason": None}


def test_instance_concurrency_and_provider_default(tmp_path, no_policy):
    model = str(checkpoint(tmp_path / "m", mtp=True))
    report = get_execution_capabilities(
        model, instance=Instance(concurrent=False, default=False), policy_path=no_policy
    )
    assert report["concurrency"]["supported"] is False
    assert report["speculation"]["effective_default"] is False
    assert report["speculation"]["effective_source"] == "provider"
    strict = {"mode": "native_mtp", "num_draft_tokens": 3, "require_acceleration": True}
    got = get_execution_capabilities(model, instance=Instance(default=strict), policy_path=no_policy)
    assert got["speculation"]["effective_default"] == strict
    inherit = get_execution_capabilities(model, instance=Instance(default=None), policy_path=tmp_path / "none.json")
    assert inherit["speculation"]["effective_default"] == SEED
    assert inherit["speculation"]["effective_source"] == "policy"


def test_unsupported_model_ready_is_false_even_with_instance(tmp_path, no_policy):
    spec = get_execution_capabilities(
        str(checkpoint(tmp_path / "m")), instance=Instance(ready=True), policy_path=no_policy
    )["speculation"]
    assert spec["ready"] is False and spec["supported"] is False


def test_tiny_builder_checkpoints(tmp_path, no_policy):
    """The real tiny-model builder's layout is detected as the engine will see it."""
    tiny = pytest.importorskip("abstractruntime_mlx.testing.tiny")
    pytest.importorskip("mlx_vlm")
    hybrid = tiny.tiny_model(tmp_path / "hybrid", kind="hybrid-mtp", seed=0)
    vision = tiny.tiny_model(tmp_path / "vision", kind="vision", seed=0)
    dense = tiny.tiny_model(tmp_path / "dense", kind="dense", seed=0)
    assert artifacts.detect_mtp(hybrid)["embedded"] is True
    assert get_execution_capabilities(str(hybrid), policy_path=no_policy)["speculation"]["supported"] is True
    assert get_execution_capabilities(str(vision), policy_path=no_policy)["speculation"]["reason"] == (
        "embedded_mtp_weights_missing"
    )
    assert get_execution_capabilities(str(dense), policy_path=no_policy)["speculation"]["reason"] == (
        "mtp_artifact_unverified"
    )
