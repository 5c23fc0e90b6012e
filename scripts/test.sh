#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite (slow cases included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider "$@"
