#!/usr/bin/env bash
# The main job: sets up .venv if needed, runs the fan-out demo flow three times at once on the
# embedded tiny MTP model (built offline), then once with each call alone, and says node by node
# what happened (call times, batch, speculation and why), then lists the runs in the ledger.
# About 30 lines; `bash scripts/demo.sh --verbose` adds `run`'s full output and `runs show`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
LEDGER="sqlite:///$(pwd)/.demo/ledger.sqlite"
mkdir -p .demo
abstractruntime-mlx demo examples/fanout.json --ledger "$LEDGER" "$@"
