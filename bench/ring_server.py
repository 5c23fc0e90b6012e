"""mlx_lm.server on MLX's distributed engine against one plain mlx_lm.server, on this machine.

    python bench/ring_server.py [--model DIR] [--ranks 2] [--calls 8] [--max-tokens 64] [--concurrency 1 4]

Starts, one after the other, on the same model: one plain ``mlx_lm.server``; ``mlx.launch -n
RANKS --backend ring -- mlx_lm.server`` (the model tensor-parallel over RANKS processes on
127.0.0.1); and the same ranks started without the launcher (``direct``: the environment
mlx.launch gives them, ``MLX_RANK`` and ``MLX_HOSTFILE``), to show what the launcher costs. Sends
each the same streamed calls through the remote client (thinking off, so the answer streams as
content; a distinct prompt per call, so no prefix is reused), ``--concurrency`` callers at a
time, and prints per set-up and concurrency: generated tok/s over the wall time, and the mean
time from sending a call to its first content delta, as the caller sees it. Nothing is asserted.
With the tiny model on one machine this measures what the ring costs (ranks exchanging partial
sums for every layer over loopback TCP, on the same cores), not a gain: sharding pays when a
model does not fit on one machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from abstractruntime_mlx.remote_client import RemoteClient
from abstractruntime_mlx.testing import tiny_model
from abstractruntime_mlx.testing.pool import MLXLMServerProcess, free_port


def one_call(url: str, model: str, index: int, max_tokens: int) -> tuple[int, float]:
    """Generated tokens, and the seconds from sending one streamed call to its first content delta."""
    with RemoteClient(url, model=model) as client:
        started, first = time.perf_counter(), float("nan")
        tokens = 0
        for chunk in client.stream(
            f"Call {index}: tell a story.", messages=[], max_output_tokens=max_tokens, temperature=0, thinking=False
        ):
            if chunk.content and first != first:  # nan: not seen yet
                first = time.perf_counter() - started
            if chunk.usage is not None:
                tokens = int(chunk.usage.get("completion_tokens", 0))
    return tokens, first


def measure(
    url: str, model: str, *, calls: int, max_tokens: int, concurrency: int, first: int
) -> tuple[float, float, float]:
    """(tok/s, mean TTFT s, wall s) of ``calls`` calls, ``concurrency`` at a time."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda i: one_call(url, model, first + i, max_tokens), range(calls)))
    wall = time.perf_counter() - started
    return sum(tokens for tokens, _ in results) / wall, statistics.mean(ttft for _, ttft in results), wall


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the tiny dense model, built here)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ring-bench-"))
    model = args.model or str(tiny_model(tmp / "dense", kind="dense", seed=0))
    rows: dict[tuple[str, int], tuple[float, float, float]] = {}
    ring = f"ring x{args.ranks}"
    setups = (("plain", 1, True), (ring, args.ranks, True), (ring + " direct", args.ranks, False))
    for name, ranks, launcher in setups:
        with MLXLMServerProcess.start(
            model, port=free_port(), ranks=ranks, launcher=launcher, log_path=tmp / f"{ranks}-{launcher}.log"
        ) as server:
            measure(server.url, model, calls=2, max_tokens=8, concurrency=2, first=10_000)  # warm
            for c in args.concurrency:
                rows[(name, c)] = measure(
                    server.url, model, calls=args.calls, max_tokens=args.max_tokens, concurrency=c, first=c * 1000
                )
                tps, ttft, wall = rows[(name, c)]
                print(
                    f"{name:15} c{c:<3} {args.calls} calls x {args.max_tokens} tokens: "
                    f"{tps:8.1f} tok/s  mean TTFT {ttft * 1000:7.1f} ms  ({wall:.2f}s)",
                    flush=True,
                )
    for name in (ring, ring + " direct"):
        for c in args.concurrency:
            got, plain = rows[(name, c)], rows[("plain", c)]
            print(f"{name}/plain c{c}: throughput {got[0] / plain[0]:.2f}x  TTFT {got[1] / plain[1]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
