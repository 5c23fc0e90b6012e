"""The command line before it does anything: ``--version``, and what it imports (help and
``runs list`` must not pull in the host, AbstractRuntime, MLX or the HTTP server, whose imports
take seconds)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.ledger import Ledger

SRC = Path(__file__).resolve().parents[1] / "src"

HOST_AND_MLX = (
    "abstractruntime",
    "abstractcore",
    "abstractruntime_mlx.runtime_plugin",
    "abstractruntime_mlx.engine",
    "mlx",
    "mlx.core",
    "mlx_lm",
    "transformers",
    "huggingface_hub",
)
SERVER = ("abstractruntime_mlx.server", "starlette", "uvicorn", "httpx")
DATABASE = ("sqlalchemy", "abstractruntime_mlx.ledger")

# Runs the command in a fresh interpreter and prints which of the named modules it imported.
PROBE = """
import json, sys
from abstractruntime_mlx.cli.main import main
argv, names = json.loads(sys.argv[1]), json.loads(sys.argv[2])
try:
    main(argv)
except SystemExit:
    pass
sys.stdout = sys.__stdout__
print(json.dumps(sorted(n for n in names if n in sys.modules)))
"""


def imported_by(argv: list[str], names: tuple[str, ...]) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv), json.dumps(names)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["runs", "--help"],
        ["run", "--help"],
        ["runs", "web", "--help"],
        ["serve", "--help"],
        ["ledger", "--help"],
    ],
)
def test_help_imports_neither_the_host_nor_mlx_nor_the_server_nor_the_database(argv: list[str]) -> None:
    assert imported_by(argv, HOST_AND_MLX + SERVER + DATABASE) == []


@pytest.mark.slow
def test_runs_list_imports_the_ledger_only(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    Ledger(f"sqlite:///{path}").close()
    assert imported_by(["runs", "list", "--ledger", str(path)], HOST_AND_MLX + SERVER) == []


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out == f"abstractruntime-mlx {importlib.metadata.version('abstractruntime-mlx')}\n"
