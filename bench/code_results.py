"""What large code node results cost the coordinator (the process that drives the run).

    python bench/code_results.py                    # every case
    python bench/code_results.py --case 1x250MB --max-code-result-mib 512

Each case runs in a fresh process (``run_flow`` on a new SQLite ledger, the real host and its
code-node children) and prints the run's status and error code, the coordinator's peak RSS
(``ru_maxrss`` of that process alone: the code nodes' children are not counted), and what the
run left on disk: the ledger (database and WAL) and the artifact store.

Cases: ``1x1B`` (a trivial result: the baseline), ``3x20MB`` (three chained code nodes, each
returning a 20 MB string: kept as artifacts), ``1x250MB`` (one returning 250 MB: past the
default 64 MiB limit, ``code_result_limit``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CASES = {"1x1B": (1, 1), "3x20MB": (3, 20_000_000), "1x250MB": (1, 250_000_000)}

CHILD = r"""
import json, os, resource, sys
from pathlib import Path
from abstractruntime_mlx.runtime_plugin import DriveLimits, run_flow
nodes, size, result_mib, work = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
os.environ["ABSTRACTCORE_CONFIG_FILE"] = str(work / "abstractcore.json")
def node(i):
    return {"id": f"n{i}", "type": "code", "data": {"codeBody": f"return '{i % 10}' + 'x' * {size - 3}",
            "inputs": [{"id": "exec-in", "type": "execution"}],
            "outputs": [{"id": "exec-out", "type": "execution"}, {"id": "output", "type": "any"}]}}
ids = ["start"] + [f"n{i}" for i in range(nodes)] + ["end"]
flow = {"id": "big", "entryNode": "start",
        "nodes": [{"id": "start", "type": "on_flow_start", "data": {}}] + [node(i) for i in range(nodes)]
                 + [{"id": "end", "type": "on_flow_end", "data": {}}],
        "edges": [{"source": a, "sourceHandle": "exec-out", "target": b, "targetHandle": "exec-in"}
                  for a, b in zip(ids, ids[1:])]}
ledger = work / "l.sqlite"
fields = DriveLimits.__dataclass_fields__  # the same script measures a build without the result limit
result_limit = {"max_code_result_mib": result_mib} if "max_code_result_mib" in fields else {}
limits = DriveLimits(max_code_mib=2048, **result_limit)
(run,) = run_flow(flow, ledger_url=str(ledger), limits=limits)
def size_of(paths):
    return sum(p.stat().st_size for p in paths if p.is_file())
print(json.dumps({
    "status": run.status, "error": (run.error or "")[:60],
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "ledger_mib": size_of([ledger, ledger.with_name(ledger.name + "-wal")]) / 2**20,
    "artifacts_mib": size_of((work / "l.sqlite.artifacts").rglob("*")) / 2**20,
}))
"""


def run_case(name: str, result_mib: int) -> dict[str, object]:
    nodes, size = CASES[name]
    with tempfile.TemporaryDirectory() as work:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(nodes), str(size), str(result_mib), work],
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"{name}: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="default: every case")
    parser.add_argument("--max-code-result-mib", type=int, default=64)
    args = parser.parse_args()
    print(f"{'case':<9} {'status':<10} {'error':<22} {'peak RSS MiB':>12} {'ledger MiB':>10} {'artifacts MiB':>13}")
    for name in args.case or list(CASES):
        row = run_case(name, args.max_code_result_mib)
        code = str(row["error"]).split("]")[0].lstrip("[") if row["error"] else "-"
        print(
            f"{name:<9} {row['status']!s:<10} {code:<22} {row['peak_rss_mib']:>12.0f} "
            f"{row['ledger_mib']:>10.2f} {row['artifacts_mib']:>13.1f}"
        )


if __name__ == "__main__":
    main()
