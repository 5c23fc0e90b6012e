"""policy: path resolution, seed, reading, set-default, corrupt files, the stat-keyed cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from abstractruntime_mlx import policy
from abstractruntime_mlx.controls import SpeculationControl
from abstractruntime_mlx.errors import InvalidControls, PolicyError

SEED = {"mode": "native_mtp", "num_draft_tokens": 2, "require_acceleration": False}


def write(path: Path, document) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


def doc_with(speculation, **extra_options):
    options = dict(extra_options)
    if speculation is not ...:
        options["speculation"] = speculation
    return {"capability_defaults": {"version": 1, "routes": {"input.text": {"options": options}}}}


# --------------------------------------------------------------------------- path


def test_config_path_resolution(tmp_path):
    home = Path("~/.abstractcore/config/abstractcore.json").expanduser()
    assert policy.config_path({}) == home
    assert policy.config_path({"ABSTRACTCORE_CONFIG_DIR": str(tmp_path)}) == tmp_path / "abstractcore.json"
    explicit = tmp_path / "other.json"
    assert (
        policy.config_path({"ABSTRACTCORE_CONFIG_FILE": str(explicit), "ABSTRACTCORE_CONFIG_DIR": "/nowhere"})
        == explicit
    )
    assert policy.config_path({"ABSTRACTCORE_CONFIG_FILE": ""}) == home


def test_default_path_reads_the_environment(tmp_path, monkeypatch):
    target = write(tmp_path / "c.json", doc_with(False))
    monkeypatch.setenv("ABSTRACTCORE_CONFIG_FILE", str(target))
    assert policy.read_speculation_policy() == SpeculationControl(mode="off")


# --------------------------------------------------------------------------- reading


def test_missing_file_gives_the_seed_without_writing(tmp_path):
    path = tmp_path / "cfg" / "abstractcore.json"
    assert policy.read_speculation_policy(path).to_wire() == SEED
    snapshot = policy.read_policy(path)
    assert (snapshot.exists, snapshot.source) == (False, "seed")
    assert not path.exists()


def test_ensure_seeded_creates_only_once(tmp_path):
    path = tmp_path / "cfg" / "abstractcore.json"
    assert policy.ensure_seeded(path) is True
    stored = json.loads(path.read_text())
    assert stored["capability_defaults"]["routes"]["input.text"]["options"]["speculation"] == SEED
    assert policy.read_policy(path).source == "file"
    write(path, {"other": 1})  # an existing file is never reseeded
    assert policy.ensure_seeded(path) is False
    assert json.loads(path.read_text()) == {"other": 1}
    assert policy.read_speculation_policy(path) is None


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        (doc_with(False), False),
        (doc_with(SEED), SEED),
        (doc_with({"mode": "native_mtp", "num_draft_tokens": 4}), {"mode": "native_mtp", "num_draft_tokens": 4}),
        (doc_with("off"), False),
        (doc_with(None), None),
        (doc_with(..., temperature=0), None),
        ({}, None),
        ({"capability_defaults": {}}, None),
        ({"capability_defaults": {"routes": {}}}, None),
        ({"capability_defaults": {"routes": {"input.text": {"provider": "mlx"}}}}, None),
        ({"capability_defaults": {"routes": {"output.text": {"options": {"speculation": False}}}}}, False),
        (
            {
                "capability_defaults": {
                    "routes": {
                        "output.text": {"source": "not_configured", "options": {"speculation": False}},
                        "input.text": {"options": {"speculation": SEED}},
                    }
                }
            },
            SEED,
        ),
    ],
)
def test_read_forms(tmp_path, document, expected):
    path = write(tmp_path / "c.json", document)
    value = policy.read_speculation_policy(path)
    assert (None if value is None else value.to_wire()) == expected


@pytest.mark.parametrize(
    ("content", "key"),
    [
        ("{not json", None),
        ("[1, 2]", "(root)"),
        ({"capability_defaults": []}, "capability_defaults"),
        ({"capability_defaults": {"routes": 3}}, "capability_defaults.routes"),
        ({"capability_defaults": {"routes": {"input.text": "x"}}}, "capability_defaults.routes.input.text"),
        (
            {"capability_defaults": {"routes": {"input.text": {"options": []}}}},
            "capability_defaults.routes.input.text.options",
        ),
        (doc_with("turbo"), "capability_defaults.routes.input.text.options.speculation"),
        (doc_with(2), "capability_defaults.routes.input.text.options.speculation"),
        (
            doc_with({"num_draft_tokens": "2"}),
            "capability_defaults.routes.input.text.options.speculation.num_draft_tokens",
        ),
        (
            doc_with({"require_acceleration": "no"}),
            "capability_defaults.routes.input.text.options.speculation.require_acceleration",
        ),
        (
            doc_with({"mode": "native_mtp", "speed": 1}),
            "capability_defaults.routes.input.text.options.speculation.speed",
        ),
    ],
)
def test_corrupt_file_names_path_and_key(tmp_path, content, key):
    path = write(tmp_path / "bad.json", content)
    with pytest.raises(PolicyError) as info:
        policy.read_speculation_policy(path)
    error = info.value
    assert error.code == "policy_invalid"
    assert str(path) in error.message
    assert error.details["path"] == str(path)
    if key is not None:
        assert error.details["key"] == key
        assert key in error.message


def test_cache_is_reused_and_invalidated_on_change(tmp_path, monkeypatch):
    path = write(tmp_path / "c.json", doc_with(False))
    calls = []
    real = policy._load_document
    monkeypatch.setattr(policy, "_load_document", lambda p: calls.append(p) or real(p))
    policy._read_cached.cache_clear()
    for _ in range(5):
        assert policy.read_speculation_policy(path) == SpeculationControl(mode="off")
    assert len(calls) == 1
    write(path, doc_with({"mode": "native_mtp", "num_draft_tokens": 5}))
    assert policy.read_speculation_policy(path).num_draft_tokens == 5
    assert len(calls) == 2
    policy.set_default_speculation("output.text", "off", path)
    assert policy.read_speculation_policy(path) == SpeculationControl(mode="off")
    write(path, "{broken")
    with pytest.raises(PolicyError):
        policy.read_speculation_policy(path)
    path.unlink()
    assert policy.read_speculation_policy(path).to_wire() == SEED


# --------------------------------------------------------------------------- writing


def full_document():
    return {
        "default_provider": "mlx",
        "api_keys": {"openai": "sk-test"},
        "capability_defaults": {
            "version": 1,
            "seeded": "recommended-v7",
            "routes": {
                "input.text": {
                    "provider": "mlx",
                    "model": "org/model",
                    "reasoning": "medium",
                    "options": {"temperature": 0.2, "speculation": SEED},
                },
                "output.image": {"provider": "diffusers", "options": {"steps": 4}},
            },
        },
    }


def stored_routes(path):
    return json.loads(path.read_text())["capability_defaults"]["routes"]


@pytest.mark.parametrize(
    ("value", "wire"),
    [
        (3, {"mode": "native_mtp", "num_draft_tokens": 3, "require_acceleration": False}),
        (1, {"mode": "native_mtp", "num_draft_tokens": 1, "require_acceleration": False}),
        ("off", False),
    ],
)
@pytest.mark.parametrize("route", ["output.text", "input.text", "Output.Text"])
def test_set_default_preserves_everything_else(tmp_path, value, wire, route):
    path = write(tmp_path / "c.json", full_document())
    now = policy.set_default_speculation(route, value, path)
    assert now.to_wire() == wire
    stored = json.loads(path.read_text())
    expected = full_document()
    expected["capability_defaults"]["routes"]["input.text"]["options"]["speculation"] = wire
    assert stored == expected
    assert policy.read_speculation_policy(path).to_wire() == wire


def test_inherit_removes_the_key_and_does_not_restore_the_seed(tmp_path):
    path = write(tmp_path / "c.json", full_document())
    assert policy.set_default_speculation("output.text", "inherit", path) is None
    routes = stored_routes(path)
    assert "speculation" not in routes["input.text"]["options"]
    assert routes["input.text"]["options"] == {"temperature": 0.2}
    assert routes["output.image"] == {"provider": "diffusers", "options": {"steps": 4}}
    assert policy.read_speculation_policy(path) is None
    assert policy.set_default_speculation("output.text", "inherit", path) is None  # idempotent


def test_set_default_creates_a_missing_file_from_the_seed(tmp_path):
    path = tmp_path / "new" / "abstractcore.json"
    assert policy.set_default_speculation("output.text", 4, path).num_draft_tokens == 4
    assert policy.read_policy(path).source == "file"
    other = tmp_path / "other" / "abstractcore.json"
    assert policy.set_default_speculation("output.text", "inherit", other) is None
    assert other.exists()
    assert policy.read_speculation_policy(other) is None


def test_set_default_writes_under_input_text_and_clears_the_alias(tmp_path):
    path = write(
        tmp_path / "c.json",
        {"capability_defaults": {"routes": {"output.text": {"options": {"speculation": False, "keep": 1}}}}},
    )
    policy.set_default_speculation("output.text", 2, path)
    routes = stored_routes(path)
    assert routes["output.text"] == {"options": {"keep": 1}}
    assert routes["input.text"]["options"]["speculation"]["num_draft_tokens"] == 2
    assert policy.read_speculation_policy(path).num_draft_tokens == 2


def test_set_default_refuses_corrupt_file(tmp_path):
    path = write(tmp_path / "c.json", "{broken")
    with pytest.raises(PolicyError):
        policy.set_default_speculation("output.text", 2, path)
    assert path.read_text() == "{broken"
    write(path, {"capability_defaults": {"routes": {"input.text": {"options": ["x"]}}}})
    with pytest.raises(PolicyError) as info:
        policy.set_default_speculation("output.text", 2, path)
    assert info.value.details["key"] == "capability_defaults.routes.input.text.options"


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "2", "on", None])
def test_set_default_rejects_bad_values(tmp_path, value):
    with pytest.raises(InvalidControls):
        policy.set_default_speculation("output.text", value, tmp_path / "c.json")
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("route", ["output.image", "text", ""])
def test_set_default_rejects_other_routes(tmp_path, route):
    with pytest.raises(InvalidControls) as info:
        policy.set_default_speculation(route, 2, tmp_path / "c.json")
    assert info.value.field == "route"


def test_write_is_atomic_and_keeps_the_mode(tmp_path):
    path = write(tmp_path / "c.json", full_document())
    os.chmod(path, 0o600)
    policy.set_default_speculation("output.text", 5, path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]  # no temp file left behind


@pytest.mark.parametrize(("text", "value"), [("inherit", "inherit"), ("OFF", "off"), ("3", 3), (" 1 ", 1)])
def test_parse_setting(text, value):
    assert policy.parse_speculation_setting(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "two", "", "on"])
def test_parse_setting_rejects(text):
    with pytest.raises(InvalidControls):
        policy.parse_speculation_setting(text)


def test_abstractcore_reads_what_we_write(tmp_path):
    """The same file, read by AbstractCore's own reader (reference only, skipped if absent)."""
    speculation = pytest.importorskip("abstractcore.providers.speculation")
    path = write(tmp_path / "c.json", full_document())
    policy.set_default_speculation("output.text", 3, path)
    assert speculation.configured_speculation_default(config_file=str(path)) == {
        "mode": "native_mtp",
        "num_draft_tokens": 3,
        "require_acceleration": False,
    }
    policy.set_default_speculation("output.text", "off", path)
    assert speculation.configured_speculation_default(config_file=str(path)) is False
    policy.set_default_speculation("output.text", "inherit", path)
    assert speculation.configured_speculation_default(config_file=str(path)) is None
    missing = tmp_path / "missing.json"
    assert speculation.configured_speculation_default(config_file=str(missing)) == SEED
