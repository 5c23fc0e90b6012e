"""In-process provider vs remote client over loopback, on the tiny model.

    python bench/http_serving.py [--tokens 128] [--rounds 15] [--concurrency 1 8] [--stream-interval-ms 5]

One run measures, at each concurrency level, the same streamed greedy workload
(``speculation=False``, ``temperature=0``) through:

- ``local``:  ``llm.agenerate(..., stream=True)`` in this process;
- ``remote``: ``AsyncRemoteClient`` → ``abstractruntime-mlx serve`` (a subprocess on
  127.0.0.1, so client and server do not share a GIL) → the same provider code.

Rounds alternate between the two paths so background load hits both alike. Reported per
level: aggregate completion tok/s (median over rounds) and the remote/local ratio, TTFT p50
seen by the caller (first content chunk) and what the remote path adds, and (on Linux) CPU
time per generated token: this process for ``local``; server plus client processes for
``remote``. The CPU figures do not depend on how busy the machine is; the tok/s ratio does
(on a machine with a spare core the client's and server's HTTP work runs beside the engine).
Targets: ratio >= 0.9 at concurrency 8, added TTFT p50 <= 5 ms.
"""

from __future__ import annotations

import argparse  # noqa: E402
import asyncio  # noqa: E402
import os
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from abstractruntime_mlx import create_llm  # noqa: E402
from abstractruntime_mlx.remote_client import AsyncRemoteClient  # noqa: E402
from abstractruntime_mlx.testing import tiny_model  # noqa: E402

PROMPTS = [f"Request {i}: explain caches in one paragraph." for i in range(64)]


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (Linux ``/proc``; ``None`` elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Path_:
    name: str
    generate: Any
    pids: list[int]
    rates: dict[int, list[float]] = field(default_factory=dict)
    ttfts: dict[int, list[float]] = field(default_factory=dict)
    cpu: dict[int, float] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)


async def _one(generate: Any, prompt: str, max_tokens: int) -> tuple[float, int]:
    started = time.perf_counter()
    ttft = None
    stream = await generate(
        prompt, stream=True, temperature=0, speculation=False, max_output_tokens=max_tokens, messages=[]
    )
    tokens = 0
    async for chunk in stream:
        if ttft is None and chunk.content:
            ttft = time.perf_counter() - started
        if chunk.finish_reason is not None:
            tokens = int((chunk.usage or {}).get("completion_tokens", 0))
    return (ttft if ttft is not None else float("nan")), tokens


async def _round(path: Path_, level: int, max_tokens: int, offset: int) -> None:
    cpu_before = [cpu_s(pid) for pid in path.pids]
    started = time.perf_counter()
    results = await asyncio.gather(
        *[_one(path.generate, PROMPTS[(offset + i) % len(PROMPTS)], max_tokens) for i in range(level)]
    )
    wall = time.perf_counter() - started
    cpu_after = [cpu_s(pid) for pid in path.pids]
    tokens = sum(t for _, t in results)
    path.rates.setdefault(level, []).append(tokens / wall)
    path.ttfts.setdefault(level, []).extend(ttft for ttft, _ in results)
    if all(c is not None for c in cpu_before + cpu_after):
        path.cpu[level] = path.cpu.get(level, 0.0) + sum(a - b for a, b in zip(cpu_after, cpu_before))  # type: ignore[operator]
        path.tokens[level] = path.tokens.get(level, 0) + tokens


async def _measure(paths: list[Path_], levels: list[int], rounds: int, max_tokens: int) -> None:
    for path in paths:  # warm-up, not recorded
        scratch = Path_(path.name, path.generate, path.pids)
        await _round(scratch, max(levels), max_tokens, 0)
    for level in levels:
        for r in range(rounds):
            for path in paths:
                await _round(path, level, max_tokens, r * level)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(model: Path, port: int, batch: int, interval_ms: float) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "abstractruntime_mlx.cli.main", "serve",
        "--model", str(model), "--port", str(port), "--mlx-max-batch-size", str(batch),
        "--stream-interval-ms", str(interval_ms),
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
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--stream-interval-ms", type=float, default=5.0, help="the server's --stream-interval-ms (its default)"
    )
    parser.add_argument("--model", default=None, help="checkpoint (default: a tiny dense model built offline)")
    args = parser.parse_args(argv)
    levels = sorted(set(args.concurrency))
    batch = max(levels)

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else tiny_model(Path(tmp) / "tiny", kind="dense")
        port = _free_port()
        proc = _start_server(model, port, batch, args.stream_interval_ms)
        llm = create_llm("mlx", model=str(model), mlx_batching=True, mlx_max_batch_size=batch)
        try:

            async def run() -> list[Path_]:
                async with AsyncRemoteClient(f"http://127.0.0.1:{port}") as client:
                    paths = [
                        Path_("local", llm.agenerate, [os.getpid()]),
                        Path_("remote", client.generate, [proc.pid, os.getpid()]),
                    ]
                    await _measure(paths, levels, args.rounds, args.tokens)
                    return paths

            local, remote = asyncio.run(run())
        finally:
            llm.unload_model(llm.model)
            proc.terminate()
            proc.wait(timeout=30)

    print(
        f"tiny model, {args.tokens} tokens/request, streamed, median of {args.rounds} interleaved rounds, "
        f"cpus={os.cpu_count()}, load avg {os.getloadavg()[0]:.2f}, stream interval {args.stream_interval_ms:g} ms"
    )
    print(
        f"{'conc':>4} {'local tok/s':>12} {'remote tok/s':>13} {'ratio':>6} {'local ttft p50':>15} "
        f"{'remote ttft p50':>16} {'added ttft':>11} {'cpu us/tok local':>17} {'remote':>7}"
    )
    for level in levels:
        lo_rate, re_rate = statistics.median(local.rates[level]), statistics.median(remote.rates[level])
        lo_ttft = statistics.median(local.ttfts[level]) * 1000
        re_ttft = statistics.median(remote.ttfts[level]) * 1000
        cpu = ""
        if local.tokens.get(level) and remote.tokens.get(level):
            cpu = (
                f"{local.cpu[level] / local.tokens[level] * 1e6:>17.0f} "
                f"{remote.cpu[level] / remote.tokens[level] * 1e6:>7.0f}"
            )
        print(
            f"{level:>4} {lo_rate:>12.1f} {re_rate:>13.1f} {re_rate / lo_rate:>5.2f}x "
            f"{lo_ttft:>12.2f} ms {re_ttft:>13.2f} ms {re_ttft - lo_ttft:>8.2f} ms {cpu}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
