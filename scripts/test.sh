#!/usr/bin/env bash
# The test command: sets up .venv if needed, type-checks src/ (mypy), checks the tree's
# formatting and lint (ruff; both configured in pyproject.toml), then runs the whole suite
# (slow cases included). Arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the
# fast subset (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m mypy
python -m ruff format --check .
python -m ruff check .
exec python -m pytest -q -p no:cacheprovider "$@"
