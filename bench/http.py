"""In-process provider vs remote client over loopback, on the tiny model.

    python bench/http.py [--tokens 128] [--rounds 3] [--concurrency 1 8]

One run measures, at each concurrency level, the same streamed greedy workload
(``speculation=False``, ``temperature=0``) through:

- ``local``:  ``llm.agenerate(..., stream=True)`` in this process;
- ``remote``: ``AsyncRemoteClient`` → ``abstractruntime-mlx serve`` (a subprocess on
  127.0.0.1, so client and server do not share a GIL) → the same provider code.

Reported per level: aggregate completion tok/s (median over rounds), the remote/local ratio,
TTFT p50 measured by the caller (first content chunk), and the TTFT the remote path adds.
Targets: ratio >= 0.9 at concurrency 8, added TTFT p50 <= 5 ms.
"""

from __future__ import annotations

import sys

# This file is named like the stdlib's ``http`` package; keep its folder off the import path.
if sys.path and sys.path[0] and __file__.startswith(sys.path[0].rstrip("/") + "/"):
    sys.path.pop(0)

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from abstractruntime_mlx import create_llm
from abstractruntime_mlx.remote_client import AsyncRemoteClient
from abstractruntime_mlx.testing import tiny_model

PROMPTS = [f"Request {i}: explain caches in one paragraph." for i in range(64)]


async def _one(generate: Any, prompt: str, max_tokens: int) -> tuple[float, int]:
    started = time.perf_counter()
    ttft = None
    stream = await generate(prompt, stream=True, temperature=0, speculation=False, max_output_tokens=max_tokens, messages=[])
    tokens = 0
    async for chunk in stream:
        if ttft is None and chunk.content:
            ttft = time.perf_counter() - started
        if chunk.finish_reason is not None:
            tokens = int((chunk.usage or {}).get("completion_tokens", 0))
    return (ttft if ttft is not None else float("nan")), tokens


async def _round(generate: Any, concurrency: int, max_tokens: int, offset: int) -> tuple[float, list[float]]:
    started = time.perf_counter()
    results = await asyncio.gather(
        *[_one(generate, PROMPTS[(offset + i) % len(PROMPTS)], max_tokens) for i in range(concurrency)]
    )
    wall = time.perf_counter() - started
    return sum(t for _, t in results) / wall, [ttft for ttft, _ in results]


async def _measure(generate: Any, levels: list[int], rounds: int, max_tokens: int) -> dict[int, dict[str, float]]:
    await _round(generate, max(levels), max_tokens, 0)  # warm-up
    out: dict[int, dict[str, float]] = {}
    for level in levels:
        rates, ttfts = [], []
        for r in range(rounds):
            rate, firsts = await _round(generate, level, max_tokens, r * level)
            rates.append(rate)
            ttfts.extend(firsts)
        out[level] = {"tok_s": statistics.median(rates), "ttft_p50_ms": statistics.median(ttfts) * 1000}
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(model: Path, port: int, batch: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "abstractruntime_mlx.cli.main", "serve",
        "--model", str(model), "--port", str(port), "--mlx-max-batch-size", str(batch),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json().get("loaded"):
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not become healthy in 60 s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--model", default=None, help="checkpoint (default: a tiny dense model built offline)")
    args = parser.parse_args(argv)
    levels = sorted(set(args.concurrency))
    batch = max(levels)

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else tiny_model(Path(tmp) / "tiny", kind="dense")

        llm = create_llm("mlx", model=str(model), mlx_batching=True, mlx_max_batch_size=batch)
        try:
            local = asyncio.run(_measure(llm.agenerate, levels, args.rounds, args.tokens))
        finally:
            llm.unload_model(llm.model)

        port = _free_port()
        proc = _start_server(model, port, batch)
        try:

            async def remote_run() -> dict[int, dict[str, float]]:
                async with AsyncRemoteClient(f"http://127.0.0.1:{port}") as client:
                    return await _measure(client.generate, levels, args.rounds, args.tokens)

            remote = asyncio.run(remote_run())
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    print(f"tiny model, {args.tokens} tokens/request, streamed, median of {args.rounds} rounds, cpu={os.cpu_count()}")
    print(f"{'conc':>4} {'local tok/s':>12} {'remote tok/s':>13} {'ratio':>6} {'local ttft p50':>15} {'remote ttft p50':>16} {'added ttft':>11}")
    for level in levels:
        lo, re_ = local[level], remote[level]
        ratio = re_["tok_s"] / lo["tok_s"]
        added = re_["ttft_p50_ms"] - lo["ttft_p50_ms"]
        print(
            f"{level:>4} {lo['tok_s']:>12.1f} {re_['tok_s']:>13.1f} {ratio:>5.2f}x "
            f"{lo['ttft_p50_ms']:>12.2f} ms {re_['ttft_p50_ms']:>13.2f} ms {added:>8.2f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
