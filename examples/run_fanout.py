"""Run examples/fanout.json through AbstractRuntime on MLX, N runs at once, and show what happened.

    python examples/run_fanout.py                      # embedded tiny model, 3 runs
    python examples/run_fanout.py --model mlx-community/Qwen3.5-4B-4bit --runs 2
    python examples/run_fanout.py --compare            # sibling-branch batching on vs off

Every run, step and phase event goes to the ledger (default: a SQLite file in a temporary
directory; ``--ledger PATH`` keeps it, then ``abstractruntime-mlx runs list --ledger PATH``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from abstractruntime_mlx.runtime_plugin import build_pack, run_flow

FLOW = Path(__file__).with_name("fanout.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model for every node (default: the embedded tiny model)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ledger", default=None, help="SQLite path or SQLAlchemy URL (default: a temporary file)")
    parser.add_argument("--compare", action="store_true", help="time one run with and without sibling-branch batching")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from abstractruntime_mlx.testing import tiny_model

            model = str(tiny_model(Path(tmp) / "tiny-dense", kind="dense"))
        ledger = args.ledger or str(Path(tmp) / "ledger.sqlite")

        with build_pack(ledger, model=model, force_model=True) as pack:
            started = time.perf_counter()
            results = run_flow(FLOW, runs=args.runs, pack=pack)
            wall = time.perf_counter() - started
            for result in results:
                print(f"run {result.run_id} {result.status} in {result.wall_s:.2f}s")
                for node in result.nodes:
                    meta = node.result["metadata"]
                    controls = meta["controls"]
                    print(
                        f"  {node.node_id:8} batch={meta['execution'].get('peak_batch_size')}"
                        f" speculation={controls['speculation']} ({controls['speculation_source']},"
                        f" used={meta['speculation'].get('used')})"
                        f" thinking={controls['thinking']} ({controls['thinking_source']})"
                        f" rows={len(pack.ledger.node_timeline(result.run_id, node.node_id))}"
                    )
            print(f"{len(results)} runs in {wall:.2f}s")

        if args.compare:
            for batching in (False, True, False, True):
                with build_pack(ledger, model=model, force_model=True, sibling_batching=batching) as pack:
                    (one,) = run_flow(FLOW, runs=1, pack=pack)
                print(f"sibling batching {'on ' if batching else 'off'}: one run in {one.wall_s:.3f}s")


if __name__ == "__main__":
    main()
