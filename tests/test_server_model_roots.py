"""Load and capabilities reach only the Hugging Face cache and the configured model roots,
and their errors for any other path say nothing about it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from abstractruntime_mlx.errors import ModelNotFound
from abstractruntime_mlx.server import create_app
from abstractruntime_mlx.server.model_roots import ModelRoots
from abstractruntime_mlx.testing import tiny_model

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture()
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline Hugging Face cache holding one repo, ``org/cached``."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--cached"
    commit = "a" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    base = tmp_path / "models"
    (base / "alpha").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (base / "escape").symlink_to(outside)
    return base


def refusal(roots: ModelRoots, name: str) -> str:
    with pytest.raises(ModelNotFound) as caught:
        roots.resolve(name)
    return caught.value.message


def test_directories_inside_a_root_resolve(hub_cache: Path, root: Path) -> None:
    roots = ModelRoots.with_hub_cache([root])
    assert roots.resolve(str(root / "alpha")) == str((root / "alpha").resolve())
    assert roots.resolve("alpha") == str((root / "alpha").resolve())
    assert roots.resolve("org/cached") == "org/cached"


@pytest.mark.parametrize(
    "name", ["/proc/self", "~", "/etc", "/no/such/dir", "../outside", "alpha/../../outside", "escape"]
)
def test_paths_outside_the_roots_are_refused_without_saying_anything_about_them(
    hub_cache: Path, root: Path, name: str
) -> None:
    message = refusal(ModelRoots.with_hub_cache([root]), name)
    assert message.startswith(f"model {name!r} is not a model this server can load")
    assert str(os.getpid()) not in message and str(Path.home()) not in message.replace(repr(name), "")
    assert "outside" not in message.replace(repr(name), "") and "exist" not in message


def test_existing_and_missing_paths_fail_alike(hub_cache: Path, root: Path) -> None:
    roots = ModelRoots.with_hub_cache([root])
    assert refusal(roots, "/etc").replace("/etc", "X") == refusal(roots, "/nowhere").replace("/nowhere", "X")


def test_a_repo_id_not_in_the_cache_names_the_download_command(hub_cache: Path) -> None:
    message = refusal(ModelRoots.with_hub_cache(), "org/missing")
    assert "abstractruntime-mlx models download org/missing" in message


@pytest.fixture()
def dense_root(tmp_path: Path) -> Path:
    base = tmp_path / "served"
    tiny_model(base / "dense", kind="dense")
    return base


def test_load_and_capabilities_over_http(hub_cache: Path, dense_root: Path) -> None:
    with TestClient(create_app(None, model_roots=[dense_root])) as client:
        for name in ("/proc/self", "~", "/root", "/etc/passwd"):
            reply = client.post("/acore/models/load", json={"model": name})
            assert reply.status_code == 404, reply.text
            error = reply.json()["error"]
            assert error["code"] == "model_not_found" and error["details"] == {"field": "model"}
            assert "/proc/" + str(os.getpid()) not in reply.text and "resolve" not in error["message"]
            caps = client.get("/v1/models/execution-capabilities", params={"model_name": name})
            assert caps.status_code == 404 and caps.json()["error"]["details"] == {"field": "model_name"}
        head = client.post("/acore/models/load", json={"model": "dense", "options": {"mtp_head": "/proc/self"}})
        assert head.status_code == 404 and head.json()["error"]["details"] == {"field": "options.mtp_head"}

        caps = client.get("/v1/models/execution-capabilities", params={"model_name": "dense"})
        assert caps.status_code == 200 and caps.json()["model"] == str((dense_root / "dense").resolve())
        loaded = client.post("/acore/models/load", json={"model": "dense"})
        assert loaded.status_code == 200, loaded.text
        try:
            reply = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
            assert reply.status_code == 200, reply.text
        finally:
            assert client.post("/acore/models/unload", json={}).json()["unloaded"] is True


def test_serve_takes_repeatable_model_roots(tmp_path: Path) -> None:
    from abstractruntime_mlx.cli.main import build_parser
    from abstractruntime_mlx.cli.serve_cmd import settings_from_args

    args = build_parser().parse_args(["serve", "--model-root", "/a", "--model-root", "/b"])
    assert settings_from_args(args, environ={}).model_roots == ("/a", "/b")
