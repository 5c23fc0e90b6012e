#!/usr/bin/env bash
# The main job: sets up .venv if needed, runs the fan-out demo flow three times at once on the
# embedded tiny model (built offline), then shows what the ledger recorded.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
LEDGER="sqlite:///$(pwd)/.demo/ledger.sqlite"
mkdir -p .demo
abstractruntime-mlx run examples/fanout.json --runs 3 --ledger "$LEDGER"
abstractruntime-mlx runs list --ledger "$LEDGER"
RUN_ID=$(abstractruntime-mlx runs list --ledger "$LEDGER" --limit 1 --json | python -c "import json,sys; print(json.load(sys.stdin)[0]['run_id'])")
abstractruntime-mlx runs show "$RUN_ID" --ledger "$LEDGER"
