"""Shared fixtures: tiny offline models, built once per test session."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from abstractruntime_mlx.testing import tiny_model

PG_URL = os.environ.get("LEDGER_TEST_URL")


def pytest_collection_finish(session: pytest.Session) -> None:
    # What imports and collection built (hundreds of thousands of objects) lives to the end of
    # the session; frozen, it is not walked again by each full collection (`make_llm` runs one
    # per test), which otherwise cost about half a second each.
    gc.freeze()


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def dense_model(models_dir):
    return str(tiny_model(models_dir / "dense", kind="dense", seed=0))


@pytest.fixture(scope="session")
def hybrid_model(models_dir):
    return str(tiny_model(models_dir / "hybrid-mtp", kind="hybrid-mtp", seed=0, mtp_alpha=0.05))


@pytest.fixture(scope="session")
def vision_model(models_dir):
    return str(tiny_model(models_dir / "vision", kind="vision", seed=0))


@pytest.fixture()
def policy_file(tmp_path, monkeypatch):
    """Point the Core policy at a private file (absent: the fresh-install seed applies)."""
    path = tmp_path / "abstractcore.json"
    monkeypatch.setenv("ABSTRACTCORE_CONFIG_FILE", str(path))
    return path


@pytest.fixture()
def cli_env(tmp_path, monkeypatch, policy_file):
    """For CLI calls in this process: a private cache (the embedded tiny model is built there)
    and ledger (yielded); what the CLI made resident is unloaded at the end."""
    from abstractruntime_mlx.nodes import default_registry

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ledger = tmp_path / "runs.sqlite"
    monkeypatch.setenv("ABSTRACTRUNTIME_MLX_LEDGER", str(ledger))
    yield ledger
    default_registry().close()


@pytest.fixture()
def make_llm(policy_file):
    """create_llm that unloads everything it made at the end of the test."""
    from abstractruntime_mlx import create_llm

    made = []

    def factory(model, **options):
        llm = create_llm("mlx", model=model, **options)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        try:
            llm.unload_model()
        except Exception:  # noqa: BLE001 - a test may have left a stream open on purpose
            pass
    gc.collect()


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A ledger URL per backend: a fresh SQLite file always, PostgreSQL when LEDGER_TEST_URL is set."""
    from abstractruntime_mlx.ledger import sqlite_url

    if request.param == "sqlite":
        return sqlite_url(tmp_path / "ledger.db")
    if not PG_URL:
        pytest.skip("LEDGER_TEST_URL is not set")
    return PG_URL


@pytest.fixture(scope="module")
def registry():
    """Resident providers shared by one test module's nodes, closed at its end."""
    from abstractruntime_mlx.nodes import ProviderRegistry

    reg = ProviderRegistry()
    yield reg
    reg.close()
