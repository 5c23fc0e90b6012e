#!/usr/bin/env bash
# Create (or reuse) .venv and install the package with its test extra. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import abstractruntime_mlx, pytest, openai, hypothesis, abstractagent, mypy, ruff" 2>/dev/null || [ "${FORCE_INSTALL:-0}" = 1 ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q -e ".[test]"
fi
