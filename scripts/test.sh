#!/usr/bin/env bash
# The test command: sets up .venv if needed, type-checks src/ (mypy, configured in
# pyproject.toml), then runs the whole suite (slow cases included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m mypy
exec python -m pytest -q -p no:cacheprovider "$@"
