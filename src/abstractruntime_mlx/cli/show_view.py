"""``runs show``'s LLM-call table and timeline, drawn from an ``inspection.RunView``.

    print(calls_table(view))      # one row per LLM call: lane, timings, tokens, rates, controls
    print(calls_timeline(view))   # one bar per call on the run's time axis

One row and one bar per LLM call (node, step, attempt): a node visited twice in a loop shows
twice. The controls column gives each control's effective value and the level that decided
it (``speculation native_mtp(depth=2) ← call``). Plain text when stdout is not a terminal.
"""

from __future__ import annotations

import io
import shutil
from typing import TYPE_CHECKING

from ..inspection import CallView, RunView
from ..json_values import as_float

if TYPE_CHECKING:
    from rich.console import JustifyMethod, RenderableType

__all__ = ["TIMELINE_WIDTH", "calls_table", "calls_timeline"]

TIMELINE_WIDTH = 48
_GLYPHS = {"queue": "·", "prefill": "░", "generate": "█"}


def _render(renderable: RenderableType, width: int) -> str:
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=width, no_color=True, force_terminal=False, soft_wrap=False).print(renderable)
    return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip("\n").splitlines())


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:.0f}ms"


def _int(value: int | None) -> str:
    return "" if value is None else f"{value:,}"


def _visits(view: RunView) -> list[str]:
    """Row names: a node with several calls (loop iterations) gets ``#1``, ``#2``, ..."""
    totals: dict[str, int] = {}
    for call in view.calls:
        totals[call.node_id] = totals.get(call.node_id, 0) + 1
    seen: dict[str, int] = {}
    names = []
    for call in view.calls:
        seen[call.node_id] = seen.get(call.node_id, 0) + 1
        name = call.node_id if call.label == call.node_id else f"{call.label} ({call.node_id})"
        if totals[call.node_id] > 1:
            name += f" #{seen[call.node_id]}"
        if call.attempt > 1:
            name += f" attempt {call.attempt}"
        names.append(name)
    return names


def calls_table(view: RunView, *, width: int | None = None) -> str:
    """The run's LLM calls as a table, with each control's value and deciding level
    (``width``: the terminal's, at least 120 columns)."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("node", "left"),
        ("status", "left"),
        ("lane", "left"),
        ("batch", "right"),
        ("start", "right"),
        ("queue", "right"),
        ("ttft", "right"),
        ("prompt", "right"),
        ("cached", "right"),
        ("gen", "right"),
        ("tok/s", "right"),
        ("mtp acc", "right"),
        ("controls (value ← decided by)", "left"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name != "controls (value ← decided by)")
    for name, call in zip(_visits(view), view.calls, strict=True):
        controls = "\n".join(f"{c.name} {c.value} ← {c.source}" for c in call.controls)
        batch = call.execution.get("peak_batch_size")
        table.add_row(
            name,
            call.status if call.status != "running" else call.phase,
            call.lane or "",
            "" if batch is None else str(batch),
            "" if call.start_s is None else f"{call.start_s:.3f}s",
            _ms(as_float(call.execution.get("queue_s"))),
            _ms(call.ttft_s),
            _int(call.prompt_tokens),
            _int(call.cached_tokens),
            _int(call.generated_tokens),
            "" if call.tokens_per_second is None else f"{call.tokens_per_second:.1f}",
            "" if call.acceptance is None else f"{call.acceptance:.0%}",
            controls,
        )
    return _render(table, width or max(120, shutil.get_terminal_size((160, 24)).columns))


def calls_timeline(view: RunView, *, width: int = TIMELINE_WIDTH) -> str:
    """One bar per LLM call on the run's time axis: ``·`` queued, ``░`` prefill, ``█`` generation."""
    horizon = view.horizon_s
    scale = width / horizon
    names = _visits(view)
    label_width = min(24, max([len(n) for n in names] + [4]))
    lines = [
        "phase timeline (seconds since the run started; · queue, ░ prefill, █ generation; one bar per LLM call)",
        f"  {'NODE':{label_width}}  0{' ' * (width - 1)}{horizon:.2f}s",
    ]
    for name, call in zip(names, view.calls, strict=True):
        cells = [" "] * width
        for phase, start, end in call.segments():
            a = max(0, min(width - 1, int(start * scale)))
            b = max(a + 1, min(width, int(round(end * scale))))
            for i in range(a, b):
                cells[i] = _GLYPHS.get(phase, "?")
        facts = []
        if call.start_s is not None and call.end_s is not None:
            facts.append(f"{call.start_s:.3f}→{call.end_s:.3f}s")
        if call.ttft_s is not None:
            facts.append(f"ttft {_ms(call.ttft_s)}")
        if call.generated_tokens is not None:
            facts.append(f"{call.generated_tokens} tok")
        if call.tokens_per_second is not None:
            facts.append(f"{call.tokens_per_second:.0f} tok/s")
        clipped = name if len(name) <= label_width else name[: label_width - 1] + "…"
        lines.append(f"  {clipped:{label_width}}  |{''.join(cells)}|  {'  '.join(facts)}")
    return "\n".join(lines)
