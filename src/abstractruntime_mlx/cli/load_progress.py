"""Model loads shown on the terminal while ``serve`` runs: what loads, for how long, how big.

On a terminal (stderr is a TTY) a transient line shows a spinner, the model, its size on
disk and the time elapsed, then gives way to ``loaded NAME in 2.1 s``; elsewhere (a log file,
a service manager) a ``loading NAME (SIZE) ...`` line starts the load and the same
``loaded`` (or ``failed to load``) line ends it. The engine reports no finer progress (how
many bytes of the weights are in memory), so elapsed time is what is shown.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO, TypeVar

from ..artifacts import size_on_disk
from ..errors import MLXRuntimeError

__all__ = ["human_bytes", "showing_factory", "showing_load", "size_on_disk"]


def human_bytes(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num < 1024 or unit == "GiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} GiB"  # pragma: no cover - the loop returns


@contextlib.contextmanager
def showing_load(name: str, *, source: str | None = None, out: TextIO | None = None) -> Iterator[None]:
    """Show the load of ``name`` on ``out`` (stderr) while the body runs."""
    stream = sys.stderr if out is None else out
    size = size_on_disk(source or name)
    what = name if size is None else f"{name} ({human_bytes(size)})"
    started = time.perf_counter()
    live = stream.isatty()
    with contextlib.ExitStack() as stack:
        if live:
            from rich.console import Console
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            progress = stack.enter_context(
                Progress(
                    SpinnerColumn(),
                    TextColumn("loading {task.description}"),
                    TimeElapsedColumn(),
                    console=Console(file=stream),
                    transient=True,
                )
            )
            progress.add_task(what, total=None)
        else:
            print(f"abstractruntime-mlx: loading {what} ...", file=stream, flush=True)
        try:
            yield
        except (MLXRuntimeError, OSError, ValueError) as exc:
            stack.close()
            print(
                f"abstractruntime-mlx: failed to load {name} after {time.perf_counter() - started:.1f} s: {exc}",
                file=stream,
                flush=True,
            )
            raise
    print(f"abstractruntime-mlx: loaded {what} in {time.perf_counter() - started:.1f} s", file=stream, flush=True)


P = TypeVar("P")


def showing_factory(factory: Callable[..., P]) -> Callable[..., P]:
    """``factory(model, **options)`` whose every load is shown (``showing_load``)."""

    def load(model: str, **options: object) -> P:
        with showing_load(model):
            return factory(model, **options)

    return load
