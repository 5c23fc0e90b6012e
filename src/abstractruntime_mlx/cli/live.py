"""Live phase progress of ``run`` in the terminal, read from the ledger as rows land.

    with LiveRuns(ledger_url, since=started, mode=pick_mode(as_json, sys.stdout)):
        results = run_flow(...)

A thread re-reads the runs created on the ledger since ``since`` (cheap cursor first, the
full ``inspection.RunView`` only when a run moved) and hands them to a renderer:

- ``rich`` (stdout is a terminal): per run a title line (its status and time so far) and a
  table with a row per LLM call: the call's name (label, ``#n`` per loop visit), lane, phase,
  prefill processed / total with a bar, generated tokens, tokens/s, MTP acceptance and
  prompt-cache hit tokens, redrawn in place. Child runs (subflows, agents) are drawn under
  their parent, indented; a run that waits on a running child run reads ``running subflow
  WORKFLOW``, not ``waiting``.
- ``plain`` (stdout is a file or a pipe): one line per phase change of each call.
- ``off`` (``--json``): nothing, so stdout stays one JSON document.

Every run started on the ledger since the command began is shown, also one started by
another process on the same ledger (the ledger is the only source).
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Literal

from ..inspection import TERMINAL_STEP_STATUSES, CallSample, CallView, RunView, run_view, tree_totals
from ..ledger import Ledger, RunCursor
from .terminal import printable

if TYPE_CHECKING:
    from rich.console import Group, JustifyMethod, RenderableType

__all__ = [
    "LiveMode",
    "LiveRuns",
    "PlainRenderer",
    "RichRenderer",
    "call_line",
    "load_line",
    "pick_mode",
    "run_elapsed",
    "run_status",
    "runs_table",
    "sample_line",
    "tree_order",
]

LiveMode = Literal["rich", "plain", "off"]
DEFAULT_POLL_S = 0.25
BAR_WIDTH = 8


def pick_mode(as_json: bool, stream: IO[str]) -> LiveMode:
    """``off`` for ``--json``, ``rich`` on a terminal, ``plain`` otherwise."""
    if as_json:
        return "off"
    isatty = getattr(stream, "isatty", None)
    return "rich" if callable(isatty) and isatty() else "plain"


# --------------------------------------------------------------------------------------
# Formatting shared by both renderers
# --------------------------------------------------------------------------------------


def _int(value: int | None) -> str:
    return "" if value is None else f"{value:,}"


def _prefill_text(call: CallView) -> str:
    total = call.prompt_tokens
    done = call.prefill_processed_tokens
    if not total:
        return ""
    done = done or 0
    return f"{done:,} / {total:,} ({done / total:.0%})"


def _prefill_short(call: CallView) -> str:
    total = call.prompt_tokens
    if not total:
        return ""
    return f"{call.prefill_processed_tokens or 0:,}/{total:,}"


def _acceptance_text(call: CallView) -> str:
    rate = call.acceptance
    return "" if rate is None else f"{rate:.0%}"


def _head(run: RunView, call: CallView) -> str:
    return f"[{run.summary.run_id[:8]}] {call.name or call.label}"


def run_status(run: RunView, runs: Sequence[RunView]) -> str:
    """What a run is doing, as the live view says it: ``running subflow WORKFLOW`` for a run that
    waits on a child run that is running (the flow is busy there, not waiting for anyone),
    else its status."""
    status = run.summary.status
    if status == "waiting" and run.summary.wait_reason == "subworkflow":
        busy = [
            r
            for r in runs
            if r.summary.parent_run_id == run.summary.run_id and r.summary.status in ("running", "waiting")
        ]
        if busy:
            child = busy[-1]
            what = "agent" if child.summary.workflow_id.startswith("visual_react_agent") else "subflow"
            return (
                f"running {what} {child.summary.workflow_id}"
                if child.summary.status == "running"
                else f"waiting in {what} {child.summary.workflow_id}"
            )
    return status


def run_elapsed(run: RunView, runs: Sequence[RunView], now: dt.datetime) -> float:
    """The run's time so far with the runs below it among ``runs``: it counts up while any of
    them runs (a root waiting on its agent is busy), else ends at the tree's last checkpoint."""
    below: list[RunView] = []
    frontier = [run.summary.run_id]
    while frontier:
        found = [r for r in runs if r.summary.parent_run_id in frontier]
        below.extend(found)
        frontier = [r.summary.run_id for r in found]
    return tree_totals(run.summary, [r.summary for r in below], as_of=now).elapsed_s


def load_line(run: RunView, call: CallView) -> str:
    """The line of a model load: ``loading MODEL 2.1 GB``, then ``loaded MODEL in 8.4s``."""
    from .load_progress import human_bytes

    model = str(call.load.get("model") or "?")
    size = call.load.get("size_bytes")
    size_text = f" {human_bytes(size)}" if isinstance(size, int) else ""
    seconds = call.load.get("seconds")
    if call.load.get("state") == "loading" or not isinstance(seconds, (int, float)):
        return f"{_head(run, call)}  loading {model}{size_text}"
    return f"{_head(run, call)}  {call.load.get('state')} {model}{size_text} in {seconds:.1f}s"


def tree_order(runs: Sequence[RunView]) -> list[tuple[int, RunView]]:
    """``(depth, run)``: root runs oldest first, each followed by its child runs (depth 1, 2, ...);
    a run whose parent is not among ``runs`` counts as a root."""
    ids = {r.summary.run_id for r in runs}
    below: dict[str, list[RunView]] = {}
    roots: list[RunView] = []
    for run in sorted(runs, key=lambda r: (r.summary.created_at, r.summary.run_id)):
        parent = run.summary.parent_run_id
        if parent in ids and parent is not None:
            below.setdefault(parent, []).append(run)
        else:
            roots.append(run)
    out: list[tuple[int, RunView]] = []

    def walk(run: RunView, depth: int) -> None:
        out.append((depth, run))
        for child in below.get(run.summary.run_id, []):
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    return out


def sample_line(run: RunView, call: CallView, sample: CallSample) -> str:
    """The line of a phase change: prefill started (with any cache hit) or first token."""
    bits = [_head(run, call), sample.phase]
    if sample.phase == "prefill":
        if sample.prompt_tokens:
            done = sample.prefill_processed_tokens or 0
            bits.append(f"{done:,} / {sample.prompt_tokens:,} prompt tokens")
        if sample.cached_tokens:
            bits.append(f"cache hit {sample.cached_tokens:,} tokens")
    else:
        if sample.ttft_s is not None:
            bits.append(f"first token after {sample.ttft_s * 1000:.0f}ms")
        if sample.cached_tokens:
            bits.append(f"cache hit {sample.cached_tokens:,} tokens")
    return "  ".join(bits)


def call_line(run: RunView, call: CallView) -> str:
    """One plain line describing ``call`` in its current phase."""
    phase = call.phase
    head = _head(run, call)
    bits = [head, phase]
    if phase in ("prefill", "queued"):
        if call.prompt_tokens:
            bits.append(f"prefill {_prefill_text(call)}")
        if call.cached_tokens:
            bits.append(f"cache hit {call.cached_tokens:,} tokens")
    elif phase == "generate":
        if call.ttft_s is not None:
            bits.append(f"ttft {call.ttft_s * 1000:.0f}ms")
        if call.generated_tokens is not None:
            bits.append(f"{call.generated_tokens:,} tokens")
    else:
        if call.lane:
            bits.append(f"lane {call.lane}")
        if call.prompt_tokens is not None:
            bits.append(f"prompt {call.prompt_tokens:,}")
        if call.cached_tokens:
            bits.append(f"cache hit {call.cached_tokens:,}")
        if call.generated_tokens is not None:
            bits.append(f"generated {call.generated_tokens:,}")
        if call.tokens_per_second is not None:
            bits.append(f"{call.tokens_per_second:.1f} tok/s")
        if call.acceptance is not None:
            bits.append(f"mtp acceptance {_acceptance_text(call)}")
        if call.finish_reason:
            bits.append(f"finish {call.finish_reason}")
        # A failed call's error is printed once, with the run's results, not here too.
    return "  ".join(bits)


# --------------------------------------------------------------------------------------
# Renderers
# --------------------------------------------------------------------------------------


class PlainRenderer:
    """One line per phase change of each call: prefill started, first token, then the call's
    end with its lane, counts, rate and MTP acceptance. Phase changes are read from the call's
    recorded events, so one that began and ended between two polls still gets its line."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._phases: dict[tuple[str, str], str] = {}
        self._samples_seen: dict[tuple[str, str], int] = {}
        self._ended: set[tuple[str, str]] = set()
        self._loads: dict[tuple[str, str], object] = {}
        self._runs: dict[str, str] = {}

    def update(self, runs: Sequence[RunView]) -> None:
        for _depth, run in tree_order(runs):
            run_id = run.summary.run_id
            status = run_status(run, runs)
            if run_id not in self._runs:
                self._runs[run_id] = status
                parent = run.summary.parent_run_id
                child_of = f" (child of {parent[:8]})" if parent else ""
                self._write(f"[{run_id[:8]}] run {run_id} {run.summary.workflow_id}{child_of} {status}")
            for call in run.calls:
                key = (run_id, call.key)
                state = call.load.get("state")
                if state and self._loads.get(key) != state:
                    self._loads[key] = state
                    self._write(load_line(run, call))
                for sample in call.samples[self._samples_seen.get(key, 0) :]:
                    if sample.phase in ("prefill", "generate") and sample.phase != self._phases.get(key):
                        self._phases[key] = sample.phase
                        self._write(sample_line(run, call, sample))
                self._samples_seen[key] = len(call.samples)
                # The end is told with the recorded result (lane, speculation), or when the run stopped.
                ended = call.recorded or (call.status in TERMINAL_STEP_STATUSES and run.summary.status != "running")
                if ended and key not in self._ended:
                    self._ended.add(key)
                    self._write(call_line(run, call))
            if status != self._runs[run_id]:
                self._runs[run_id] = status
                self._write(f"[{run_id[:8]}] run {status}")

    def close(self) -> None:
        self._out.flush()

    def _write(self, line: str) -> None:
        self._out.write(printable(line) + "\n")
        self._out.flush()


WIDE_COLUMNS = 100
"""From this many columns on, ``runs_table`` also shows each call's lane and MTP acceptance."""


def runs_table(runs: Sequence[RunView], *, width: int = WIDE_COLUMNS, now: dt.datetime | None = None) -> Group:
    """``rich`` renderables: per run (child runs under their parent, indented), a title line and
    a table with a row per LLM call. ``width``: the terminal's; under ``WIDE_COLUMNS`` the lane
    and MTP columns are left out so the table fits 80 columns, and a name too long for its
    cell wraps there, never cut. Run times count up to ``now`` (default: the clock) while the
    run or a run below it is running; a call waiting for its model shows ``loading MODEL SIZE``."""
    from rich import box
    from rich.console import Group
    from rich.padding import Padding
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    styles = {
        "load": "magenta",
        "prefill": "yellow",
        "generate": "cyan",
        "completed": "green",
        "failed": "red",
        "queued": "dim",
    }
    wide = width >= WIDE_COLUMNS
    parts: list[RenderableType] = []
    when = now or dt.datetime.now(dt.UTC)
    for depth, run in tree_order(runs):
        status = run_status(run, runs)
        indent = 2 * depth
        title = Text.assemble(
            " " * max(0, indent - 2) + ("└ " if depth else ""),
            ("run ", "bold"),
            (printable(run.summary.run_id[:8]), "bold"),
            f"  {printable(run.summary.workflow_id)}  ",
            (printable(status), styles.get(run.summary.status, "")),
            f"  {run_elapsed(run, runs, when):.1f}s",
        )
        parts.append(title)
        loading = [call for call in run.calls if call.phase == "load"]
        for call in loading:
            parts.append(Text(" " * indent + printable(load_line(run, call).split("  ", 1)[-1]), style="magenta"))
        if not run.calls:
            continue
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
        longest = max(len(call.name or call.label) for call in run.calls)
        columns: tuple[tuple[str, JustifyMethod, int], ...] = (
            ("node", "left", min(longest, 24)),
            *((("lane", "left", 10),) if wide else ()),
            ("phase", "left", 9),
            ("prefill", "left", BAR_WIDTH),
            ("", "right", 11),
            ("gen", "right", 4),
            ("tok/s", "right", 6),
            *((("mtp", "right", 4),) if wide else ()),
            ("cache", "right", 5),
        )
        for name, justify, min_width in columns:
            # The node's name wraps in its cell when the terminal is narrow: never cut.
            folds = name == "node"
            table.add_column(
                name, justify=justify, no_wrap=not folds, overflow="fold" if folds else "ellipsis", min_width=min_width
            )
        for call in run.calls:
            total = call.prompt_tokens or 0
            done = call.prefill_processed_tokens or 0
            cells: list[RenderableType] = [
                Text(printable(call.name or call.label)),
                *([printable(call.lane or "")] if wide else []),
                Text(printable(call.phase), style=styles.get(call.phase, "")),
                ProgressBar(total=max(total, 1), completed=min(done, total) if total else 0, width=BAR_WIDTH),
                _prefill_short(call),
                _int(call.generated_tokens),
                "" if call.tokens_per_second is None else f"{call.tokens_per_second:.1f}",
                *([_acceptance_text(call)] if wide else []),
                _int(call.cached_tokens) if call.cached_tokens else "",
            ]
            table.add_row(*cells)
        parts.append(Padding(table, (0, 0, 0, indent)) if indent else table)
    return Group(*parts)


class RichRenderer:
    """``runs_table``, redrawn in place (``rich.live.Live``); the last state stays on screen."""

    def __init__(self, out: IO[str]) -> None:
        from rich.console import Console
        from rich.live import Live

        self._console = Console(file=out)
        self._live = Live(console=self._console, refresh_per_second=8, transient=False, auto_refresh=True)
        self._live.start()

    def update(self, runs: Sequence[RunView]) -> None:
        self._live.update(runs_table(runs, width=self._console.width), refresh=True)

    def close(self) -> None:
        self._live.stop()


# --------------------------------------------------------------------------------------
# The follower
# --------------------------------------------------------------------------------------


class LiveRuns:
    """Follow the runs created on the ledger since ``since`` and render them until closed."""

    def __init__(
        self,
        ledger_url: str,
        *,
        since: dt.datetime,
        mode: LiveMode,
        out: IO[str],
        poll_s: float = DEFAULT_POLL_S,
    ) -> None:
        self.mode = mode
        self._url = ledger_url
        self._since = since
        self._out = out
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ledger: Ledger | None = None
        self._renderer: PlainRenderer | RichRenderer | None = None
        self._cursors: dict[str, RunCursor | None] = {}
        self._views: dict[str, RunView] = {}

    def __enter__(self) -> LiveRuns:
        if self.mode == "off":
            return self
        self._ledger = Ledger(self._url)
        self._renderer = RichRenderer(self._out) if self.mode == "rich" else PlainRenderer(self._out)
        self._thread = threading.Thread(target=self._follow, name="abstractruntime-mlx-live", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        try:
            self.poll()  # the final state, after the runs' last rows were committed
        finally:
            assert self._renderer is not None and self._ledger is not None
            self._renderer.close()
            self._ledger.close()

    @property
    def views(self) -> list[RunView]:
        """The latest view of every run followed so far."""
        return list(self._views.values())

    def poll(self) -> list[RunView]:
        """Re-read what moved and render; returns the current views."""
        assert self._ledger is not None and self._renderer is not None
        for summary in self._ledger.list_runs(limit=10_000, created_after=self._since):
            cursor = self._ledger.run_cursor(summary.run_id)
            if cursor == self._cursors.get(summary.run_id):
                continue
            view = run_view(self._ledger, summary.run_id, tree=False)
            if view is not None:
                self._cursors[summary.run_id] = cursor
                self._views[summary.run_id] = view
        views = list(self._views.values())
        self._renderer.update(views)
        return views

    def _follow(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - the view must never break the run it watches
                self._out.write(printable(f"live view stopped: {type(exc).__name__}: {exc}") + "\n")
                return
