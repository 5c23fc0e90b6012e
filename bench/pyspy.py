"""Sampling profiles of bench runs with py-spy, and where the busiest thread's samples went.

``record(path)`` runs ``py-spy record`` on this process (native frames included, one stack per
thread, folded "raw" output) for as long as its ``with`` block lasts; ``busiest_thread(path)``
reads the file back and returns, for the thread with the most samples (a serving loop's
worker), each function's share of that thread's samples, counting a function once per stack
(inclusive), so "mlx_lm.generate._step 61%" means 61% of the samples were inside that call.

py-spy must be on PATH (``pip install py-spy``) and may attach to this process (root, or
``ptrace_scope`` 0). Sampling pauses the process for each sample, so a profiled run is slower
than an unprofiled one: ``bench/concurrency.py --py-spy DIR`` profiles one extra run per point
that its figures do not count.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

RATE_HZ = 100
_LINE = re.compile(r":\d+\)$")  # "fn (file.py:123)" -> one entry per function, not per line


@contextlib.contextmanager
def record(path: Path) -> Iterator[None]:
    exe = shutil.which("py-spy")
    if exe is None:
        raise RuntimeError("py-spy is not on PATH (pip install py-spy)")
    path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            exe,
            "record",
            "--pid",
            str(os.getpid()),
            "--native",
            "--threads",
            "--rate",
            str(RATE_HZ),
            "--format",
            "raw",
            "--output",
            str(path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(1.0)  # attaching takes a moment; the run should not start before sampling does
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        if not path.exists():
            raise RuntimeError(f"py-spy wrote no profile: {err.decode(errors='replace').strip()[-500:]}")


def busiest_thread(path: Path, top: int = 20) -> tuple[str, int, list[tuple[float, str]]]:
    """The thread with the most samples in the raw profile at ``path``: its name, its sample
    count and its ``top`` functions by inclusive share of those samples."""
    samples: collections.Counter[str] = collections.Counter()
    stacks: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        samples[thread] += int(count)
        stacks[thread].append((frames, int(count)))
    if not samples:
        return "", 0, []
    thread, total = samples.most_common(1)[0]
    inclusive: collections.Counter[str] = collections.Counter()
    for frames, count in stacks[thread]:
        for fn in {_LINE.sub(")", f) for f in frames}:
            inclusive[fn] += count
    shares = [(n / total, fn) for fn, n in inclusive.most_common() if not fn.startswith("0x")]
    return thread, total, shares[:top]
