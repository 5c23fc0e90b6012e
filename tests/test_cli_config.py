"""CLI: config show / set-default, capabilities, models list / path / tiny (no network)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from abstractruntime_mlx.cli.main import main

SEED = {"mode": "native_mtp", "num_draft_tokens": 2, "require_acceleration": False}


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    path = tmp_path / "core" / "abstractcore.json"
    monkeypatch.setenv("ABSTRACTCORE_CONFIG_FILE", str(path))
    monkeypatch.delenv("ABSTRACTCORE_CONFIG_DIR", raising=False)
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def show(capsys):
    code, out, _ = run(capsys, "config", "show")
    assert code == 0
    return json.loads(out)


def test_show_missing_file(config_file, capsys):
    shown = show(capsys)
    assert shown == {
        "path": str(config_file),
        "exists": False,
        "speculation": SEED,
        "speculation_source": "seed",
        "capability_defaults": None,
    }
    assert not config_file.exists()


def test_set_default_round_trip(config_file, capsys):
    config_file.parent.mkdir(parents=True)
    original = {
        "api_keys": {"x": "y"},
        "capability_defaults": {
            "version": 1,
            "routes": {"input.text": {"provider": "mlx", "options": {"temperature": 0}}},
        },
    }
    config_file.write_text(json.dumps(original))

    code, out, _ = run(capsys, "config", "set-default", "output.text", "--speculation", "3")
    assert code == 0 and str(config_file) in out
    shown = show(capsys)
    assert shown["speculation"] == {"mode": "native_mtp", "num_draft_tokens": 3, "require_acceleration": False}
    assert shown["speculation_source"] == "file"
    assert shown["capability_defaults"]["routes"]["input.text"]["provider"] == "mlx"
    assert shown["capability_defaults"]["routes"]["input.text"]["options"]["temperature"] == 0

    assert run(capsys, "config", "set-default", "output.text", "--speculation", "off")[0] == 0
    assert show(capsys)["speculation"] is False

    assert run(capsys, "config", "set-default", "input.text", "--speculation", "inherit")[0] == 0
    shown = show(capsys)
    assert shown["speculation"] is None and shown["speculation_source"] == "absent"
    stored = json.loads(config_file.read_text())
    assert stored == original


def test_set_default_creates_file(config_file, capsys):
    assert run(capsys, "config", "set-default", "output.text", "--speculation", "5")[0] == 0
    assert show(capsys)["speculation"]["num_draft_tokens"] == 5


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["config", "set-default", "output.text", "--speculation", "0"], "invalid_controls"),
        (["config", "set-default", "output.text", "--speculation", "fast"], "invalid_controls"),
        (["config", "set-default", "output.image", "--speculation", "2"], "invalid_controls"),
        (["config", "set-default", "output.text", "--speculation", "²"], "invalid_controls"),
        (["config", "set-default", "output.text", "--speculation", "٣"], "invalid_controls"),
    ],
)
def test_set_default_errors(config_file, capsys, argv, code):
    status, _, err = run(capsys, *argv)
    assert status == 1 and f"[{code}]" in err
    assert not config_file.exists()


def test_corrupt_file_error(config_file, capsys):
    config_file.parent.mkdir(parents=True)
    config_file.write_text("{oops")
    status, _, err = run(capsys, "config", "show")
    assert status == 1 and "[policy_invalid]" in err and str(config_file) in err
    status, _, err = run(capsys, "config", "set-default", "output.text", "--speculation", "2")
    assert status == 1 and "[policy_invalid]" in err
    assert config_file.read_text() == "{oops"


def test_config_without_action_prints_help(config_file, capsys):
    status, out, _ = run(capsys, "config")
    assert status == 2 and "set-default" in out


def test_capabilities_cli(config_file, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    save_file({"mtp.fc.weight": np.ones((2, 2), dtype=np.float32)}, str(model / "model.safetensors"))
    status, out, _ = run(capsys, "capabilities", str(model))
    assert status == 0
    report = json.loads(out)
    assert report["speculation"]["supported"] is True
    assert report["speculation"]["default"] == SEED  # missing config file: the seed
    status, out, _ = run(capsys, "capabilities", str(model), "--provider", "ollama")
    assert json.loads(out)["speculation"]["reason"] == "native_mtp_backend_unavailable"
    status, out, _ = run(capsys, "capabilities", "org/absent", "--cache-dir", str(tmp_path / "hub"))
    assert status == 0 and json.loads(out)["speculation"]["reason"] == "model_not_found"


def test_models_list_and_path(tmp_path, capsys):
    status, out, _ = run(capsys, "models", "list", "--json", "--cache-dir", str(tmp_path / "no-cache"))
    assert status == 0 and json.loads(out) == []
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--m" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (cache / "models--org--m" / "refs").mkdir()
    (cache / "models--org--m" / "refs" / "main").write_text("abc")
    (snapshot / "config.json").write_text("{}")
    status, out, _ = run(capsys, "models", "list", "--json", "--cache-dir", str(cache))
    rows = json.loads(out)
    assert [r["name"] for r in rows] == ["org/m"] and rows[0]["path"] == str(snapshot)
    assert rows[0]["refs"] == ["main"]
    status, out, _ = run(capsys, "models", "path", "org/m", "--cache-dir", str(cache))
    assert status == 0 and out.strip() == str(snapshot)
    status, _, err = run(capsys, "models", "path", "org/absent", "--cache-dir", str(cache))
    assert status == 1 and "[model_not_found]" in err and "abstractruntime-mlx models download org/absent" in err


def test_models_tiny(tmp_path, capsys):
    pytest.importorskip("abstractruntime_mlx.testing.tiny")
    pytest.importorskip("mlx_lm")
    out_dir = tmp_path / "tiny"
    status, out, _ = run(capsys, "models", "tiny", str(out_dir), "--kind", "dense", "--seed", "3")
    assert status == 0 and Path(out.strip()) == out_dir
    assert (out_dir / "config.json").is_file()


def test_models_tiny_rejects_unknown_kind(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["models", "tiny", str(tmp_path / "x"), "--kind", "huge"])
