#!/usr/bin/env bash
# Formats the tree and applies ruff's safe lint fixes (settings in pyproject.toml), the two
# things `bash scripts/test.sh` checks. What ruff cannot fix (a line over 120 in a string or a
# comment, an unused variable) it prints; those are wrapped or fixed by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m ruff format .
python -m ruff check --fix .
