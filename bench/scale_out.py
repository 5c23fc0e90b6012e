"""Scale-out on this machine: a pool of two ``serve`` processes behind HAProxy against one server
reached directly, and the time from a server's death to its runs continuing.

    python bench/scale_out.py [--model DIR] [--runs 8] [--max-tokens 64]

Prints, for the same fan-out flow (``--runs`` runs of 4 LLM branches, each run its own session):
- ``direct``: one ``serve``, no balancer; ``pool``: two ``serve`` behind HAProxy (``lb-config``);
  aggregate generated tok/s, mean TTFT of the calls, and the pool/direct ratios;
- ``failover``: the same batch through the pool with one server SIGKILLed as soon as it decodes;
  the seconds from the kill until every run's calls continued (the last retried step's start
  after the kill), and the whole batch's wall time. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from abstractruntime_mlx.ledger import Ledger, sqlite_url  # noqa: E402
from abstractruntime_mlx.runtime_plugin import FlowRunResult, run_flow  # noqa: E402
from abstractruntime_mlx.testing import tiny_model  # noqa: E402
from abstractruntime_mlx.testing.pool import HAProxyProcess, ServerProcess, free_port  # noqa: E402
from test_scale_out_haproxy import fanout_flow  # noqa: E402


def batch(url: str, model: str, ledger_url: str, runs: int, max_tokens: int) -> tuple[list[FlowRunResult], float]:
    started = time.perf_counter()
    results = run_flow(
        fanout_flow(max_tokens),
        runs=runs,
        ledger_url=ledger_url,
        model=model,
        vars={"_runtime": {"base_url": url}},
        allow_remote=["127.0.0.1"],
    )
    return results, time.perf_counter() - started


def figures(results: list[FlowRunResult], wall_s: float) -> tuple[float, float]:
    tokens = sum(int(n.result["usage"].get("completion_tokens", 0)) for r in results for n in r.nodes)  # type: ignore[union-attr]
    ttfts = [
        float(n.result["metadata"]["execution"]["ttft_s"])
        for r in results
        for n in r.nodes
        if "ttft_s" in n.result["metadata"].get("execution", {})
    ]  # type: ignore[union-attr, operator]
    return tokens / wall_s, statistics.mean(ttfts) if ttfts else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="scale-out-"))
    model = args.model or str(tiny_model(tmp / "dense", kind="dense", seed=0))
    servers = [ServerProcess.start(model, port=free_port()) for _ in range(2)]
    try:
        lb_port, cfg, sock = free_port(), tmp / "pool.cfg", tmp / "haproxy.sock"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "abstractruntime_mlx.cli.main",
                "lb-config",
                *(a for s in servers for a in ("--server", f"127.0.0.1:{s.port}")),
                "--bind",
                f"127.0.0.1:{lb_port}",
                "--stats-socket",
                str(sock),
                "--out",
                str(cfg),
            ],
            check=True,
            capture_output=True,
        )
        with HAProxyProcess.start(cfg, socket_path=sock, port=lb_port, servers_up=2) as lb:
            batch(servers[0].url, model, sqlite_url(tmp / "warm.db"), 2, 8)  # warm both paths
            batch(lb.url, model, sqlite_url(tmp / "warm2.db"), 2, 8)
            rows = {}
            for name, url in (("direct", servers[0].url), ("pool", lb.url)):
                results, wall = batch(url, model, sqlite_url(tmp / f"{name}.db"), args.runs, args.max_tokens)
                rows[name] = figures(results, wall)
                print(
                    f"{name:7} {args.runs} runs x 4 calls: {rows[name][0]:8.1f} tok/s  "
                    f"mean TTFT {rows[name][1] * 1000:7.1f} ms  ({wall:.2f}s)"
                )
            print(
                f"pool/direct: throughput {rows['pool'][0] / rows['direct'][0]:.2f}x  "
                f"TTFT {rows['pool'][1] / rows['direct'][1]:.2f}x"
            )

            ledger_url = sqlite_url(tmp / "failover.db")
            out: dict[str, object] = {}
            thread = threading.Thread(target=lambda: out.update(r=batch(lb.url, model, ledger_url, args.runs, 400)))
            thread.start()
            victim = None
            while victim is None and thread.is_alive():
                victim = next((s for s in servers if int(s.execution().get("active", 0) or 0) >= 1), None)
            if victim is None:
                print("failover: the batch ended before a server decoded")
                return 1
            killed_at = time.time()
            victim.kill()
            thread.join()
            results, wall = out["r"]  # type: ignore[misc]
            with Ledger(ledger_url) as ledger:
                retried = [
                    s
                    for r in results
                    for s in ledger.run_steps(r.run_id)
                    if s.effect_type == "llm_call" and s.status == "completed" and s.attempt >= 2
                ]
            resumed = [s.started_at.timestamp() - killed_at for s in retried if s.started_at is not None]
            done = sum(1 for r in results if r.status == "completed")
            print(
                f"failover: {done}/{len(results)} runs completed; {len(retried)} calls retried "
                "by the runtime (the rest by HAProxy); death to last retried call started "
                f"{max(resumed) if resumed else 0.0:.2f}s; batch {wall:.2f}s"
            )
    finally:
        for server in servers:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
