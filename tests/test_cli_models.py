"""models list / rm on a private Hugging Face cache and a local folder of models (tiny
random-weight checkpoints, copied into place; nothing is downloaded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from abstractruntime_mlx.cli.main import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def places(tmp_path: Path, dense_model: str, hybrid_model: str) -> dict[str, Path]:
    """A cache holding org/tiny (dense) and a folder holding hyb (hybrid MTP), lab/dense (an
    org/name layout) and notes (not a model)."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    shutil.copytree(dense_model, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    local = tmp_path / "models"
    shutil.copytree(hybrid_model, local / "hyb")
    shutil.copytree(dense_model, local / "lab" / "dense")
    (local / "notes").mkdir()
    (local / "notes" / "readme.txt").write_text("not a model")
    return {"cache": cache, "local": local, "repo": repo}


def test_list_shows_cache_and_local_models_with_size_and_kind(
    capsys: pytest.CaptureFixture[str], places: dict[str, Path]
) -> None:
    code, out, _ = run(
        capsys, "models", "list", "--json", "--cache-dir", str(places["cache"]), "--dir", str(places["local"])
    )
    assert code == 0
    rows = {row["name"]: row for row in json.loads(out)}
    assert sorted(rows) == ["hyb", "lab/dense", "org/tiny"]
    assert (rows["org/tiny"]["source"], rows["org/tiny"]["kind"]) == ("hf-cache", "text")
    assert (rows["hyb"]["source"], rows["hyb"]["kind"]) == (
        "local",
        "vision+mtp",
    )  # qwen3_5: a vision config and mtp.* weights
    assert rows["lab/dense"]["kind"] == "text"
    weights = sum(f.stat().st_size for f in (places["local"] / "hyb").rglob("*") if f.is_file())
    assert rows["hyb"]["size_on_disk"] == weights > 0
    assert rows["org/tiny"]["size_on_disk"] > 0 and rows["org/tiny"]["refs"] == ["main"]

    code, table, _ = run(capsys, "models", "list", "--cache-dir", str(places["cache"]), "--dir", str(places["local"]))
    assert code == 0
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["NAME", "KIND", "SIZE", "SOURCE"]
    assert any(line.split()[:2] == ["hyb", "vision+mtp"] for line in lines)
    assert not any("notes" in line for line in lines)


def test_list_reads_the_model_dirs_variable(
    capsys: pytest.CaptureFixture[str], places: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ABSTRACTRUNTIME_MLX_MODEL_DIRS", str(places["local"]))
    code, out, _ = run(capsys, "models", "list", "--json", "--cache-dir", str(places["cache"]))
    assert code == 0 and "hyb" in {row["name"] for row in json.loads(out)}


def test_rm_asks_then_removes_a_cached_model(capsys: pytest.CaptureFixture[str], places: dict[str, Path]) -> None:
    cache = str(places["cache"])
    code, _, err = run(capsys, "models", "rm", "org/tiny", "--cache-dir", cache)
    assert code == 1 and err.startswith("error: [invalid_request] not removed: org/tiny") and "--yes" in err
    assert len(err.strip().splitlines()) == 1
    assert places["repo"].is_dir()
    code, out, _ = run(capsys, "models", "rm", "org/tiny", "--cache-dir", cache, "--yes")
    assert code == 0 and out.startswith("removed org/tiny")
    assert not places["repo"].exists()
    code, out, _ = run(capsys, "models", "list", "--json", "--cache-dir", cache)
    assert json.loads(out) == []


def test_rm_removes_a_local_model_folder_only(capsys: pytest.CaptureFixture[str], places: dict[str, Path]) -> None:
    local = places["local"]
    code, _, _ = run(
        capsys, "models", "rm", "lab/dense", "--dir", str(local), "--cache-dir", str(places["cache"]), "--yes"
    )
    assert code == 0 and not (local / "lab" / "dense").exists() and (local / "hyb").is_dir()
    # a folder that is not a model is never removed, by name or by path
    for name in ("notes", str(local / "notes")):
        code, _, err = run(
            capsys, "models", "rm", name, "--dir", str(local), "--cache-dir", str(places["cache"]), "--yes"
        )
        assert code == 1 and err.startswith("error: [model_not_found]") and len(err.strip().splitlines()) == 1
    assert (local / "notes" / "readme.txt").is_file()


def test_bad_dir_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(
        capsys, "models", "list", "--dir", str(tmp_path / "absent"), "--cache-dir", str(tmp_path / "hub")
    )
    assert code == 1 and err.strip() == f"error: [invalid_request] --dir '{tmp_path / 'absent'}' is not a directory"
