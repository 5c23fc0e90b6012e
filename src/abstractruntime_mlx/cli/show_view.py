"""``runs show``'s LLM-call table and timeline, drawn from an ``inspection.RunView``.

    print(calls_table(view))      # one row per LLM call: lane, timings, tokens, rates, controls
    print(calls_timeline(view))   # one bar per call on the run's time axis

One row and one bar per LLM call (node, step, attempt), named as every view names it
(``CallView.name``: ``LLM Call (node-4) #2``): a node visited twice in a loop shows twice. The
controls column gives each control's effective value and the level that decided it
(``speculation native_mtp(depth=2) ← call``); under 120 columns the table keeps the figures
that matter most and lists the controls under it, so it reads at 80 columns. Names and ids are
never cut: a long one wraps inside its cell. Plain text when stdout is not a terminal.
"""

from __future__ import annotations

import io
import shutil
import textwrap
from typing import TYPE_CHECKING

from ..inspection import CallView, RunView
from ..json_values import as_float

if TYPE_CHECKING:
    from rich.console import JustifyMethod, RenderableType

__all__ = ["NARROW_WIDTH", "TIMELINE_WIDTH", "calls_table", "calls_timeline", "render_text", "terminal_width"]

TIMELINE_WIDTH = 48
NARROW_WIDTH = 120
"""Below this many columns ``calls_table`` drops its wide columns and lists controls after it."""
_GLYPHS = {"queue": "·", "prefill": "░", "generate": "█"}


def render_text(renderable: RenderableType, width: int) -> str:
    """A ``rich`` renderable as plain text ``width`` columns wide (no colour, trailing spaces cut)."""
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=width, no_color=True, force_terminal=False, soft_wrap=False).print(renderable)
    return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip("\n").splitlines())


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:.0f}ms"


def _int(value: int | None) -> str:
    return "" if value is None else f"{value:,}"


def _visits(view: RunView) -> list[str]:
    """Row names: the calls' names (``label #n`` for loop iterations)."""
    return [call.name or call.label for call in view.calls]


def terminal_width() -> int:
    """The terminal's width (``$COLUMNS`` first, as ``shutil`` reads it; 160 when unknown)."""
    return shutil.get_terminal_size((160, 24)).columns


def calls_table(view: RunView, *, width: int | None = None) -> str:
    """The run's LLM calls as a table, with each control's value and deciding level
    (``width``: default the terminal's; under ``NARROW_WIDTH`` the narrow form)."""
    width = width or terminal_width()
    if width < NARROW_WIDTH:
        return _narrow_calls_table(view, width)
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
        wraps = name in ("node", "controls (value ← decided by)")
        table.add_column(name, justify=justify, no_wrap=not wraps, overflow="fold")
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
    return render_text(table, width)


def _narrow_calls_table(view: RunView, width: int) -> str:
    """``calls_table`` for a narrow terminal: node, status, lane, ttft, tokens and rate in the
    table, then one line per call with its controls."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("node", "left"),
        ("status", "left"),
        ("lane", "left"),
        ("ttft", "right"),
        ("prompt", "right"),
        ("cached", "right"),
        ("gen", "right"),
        ("tok/s", "right"),
    )
    names = _visits(view)
    longest = max((len(n) for n in names), default=4)
    for name, justify in columns:
        node = name == "node"
        table.add_column(name, justify=justify, no_wrap=not node, overflow="fold", min_width=min(longest, width // 3) if node else None)
    for name, call in zip(names, view.calls, strict=True):
        table.add_row(
            name,
            call.status if call.status != "running" else call.phase,
            call.lane or "",
            _ms(call.ttft_s),
            _int(call.prompt_tokens),
            _int(call.cached_tokens),
            _int(call.generated_tokens),
            "" if call.tokens_per_second is None else f"{call.tokens_per_second:.1f}",
        )
    lines = [render_text(table, width)]
    controls = [(name, call) for name, call in zip(names, view.calls, strict=True) if call.controls]
    if controls:
        lines.append("controls (value ← decided by)")
        for name, call in controls:
            text = f"{name}: " + "; ".join(f"{c.name} {c.value} ← {c.source}" for c in call.controls)
            lines.extend(textwrap.wrap(text, width=width, initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False))
    return "\n".join(lines)


def calls_timeline(view: RunView, *, width: int = TIMELINE_WIDTH, columns: int | None = None) -> str:
    """One bar per LLM call on the run's time axis: ``·`` queued, ``░`` prefill, ``█`` generation.
    A name longer than the label column gets a line of its own (never cut); a call's figures
    move under its bar when the line would pass ``columns`` (default: the terminal's width)."""
    columns = columns or terminal_width()
    horizon = view.horizon_s
    names = _visits(view)
    label_width = min(24, max([len(n) for n in names] + [4]))
    width = max(16, min(width, columns - label_width - 12))  # the axis line fits the terminal
    scale = width / horizon
    lines = [
        "phase timeline (seconds since the run started)",
        "  · queue  ░ prefill  █ generation; one bar per LLM call",
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
        label = name
        if len(name) > label_width:
            lines.append(f"  {name}")
            label = ""
        bar = f"  {label:{label_width}}  |{''.join(cells)}|"
        figures = "  ".join(facts)
        if len(bar) + 2 + len(figures) <= columns:
            lines.append(f"{bar}  {figures}".rstrip())
        else:
            lines.extend([bar, f"  {'':{label_width}}   {figures}".rstrip()])
    return "\n".join(lines)
