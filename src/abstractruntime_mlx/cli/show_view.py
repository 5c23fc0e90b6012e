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
import json
import shutil
import textwrap
from typing import TYPE_CHECKING

from ..inspection import RunView
from ..json_values import JSONValue, as_float

if TYPE_CHECKING:
    from rich.console import JustifyMethod, RenderableType

__all__ = [
    "NARROW_WIDTH",
    "TIMELINE_WIDTH",
    "call_input_lines",
    "calls_table",
    "calls_timeline",
    "output_lines",
    "render_text",
    "terminal_width",
]

TIMELINE_WIDTH = 48
NARROW_WIDTH = 120
"""Below this many columns ``calls_table`` drops its wide columns and lists controls after it."""
_GLYPHS = {"load": "~", "queue": "·", "prefill": "░", "generate": "█"}


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
        table.add_column(
            name,
            justify=justify,
            no_wrap=not node,
            overflow="fold",
            min_width=min(longest, width // 3) if node else None,
        )
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
            lines.extend(
                textwrap.wrap(
                    text, width=width, initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False
                )
            )
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


def _block(text: str, indent: str) -> list[str]:
    """``text`` in full, each of its lines under ``indent``."""
    return [indent + line if line else "" for line in (text.splitlines() or [""])]


def _as_text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, indent=2, default=str)


def output_lines(output: JSONValue, *, indent: str = "  ") -> list[str]:
    """The flow's final output in full: ``output FIELD:`` then the field's text (JSON for what
    is not text), one field after the other."""
    if output is None:
        return []
    if not isinstance(output, dict):
        return [f"{indent}output:", *_block(_as_text(output), indent + "  ")]
    out: list[str] = []
    for name, value in output.items():
        text = _as_text(value)
        if "\n" not in text and len(text) <= 100:
            out.append(f"{indent}output {name}: {text}")
        else:
            out += [f"{indent}output {name}:", *_block(text, indent + "  ")]
    return out


def call_input_lines(view: RunView) -> list[str]:
    """Each call's input as the model got it: the model that served it and its route, the
    rendered prompt's token count, the tools offered, then the messages with their roles in
    full. A later call of the run that repeats the previous call's messages lists only what it
    added (the earlier ones are printed under the call before it)."""
    out: list[str] = []
    for call in view.calls:
        served = call.model or "?"
        rule = call.route.get("rule")
        head = f"  {call.name or call.label}: {len(call.messages)} messages, {_int(call.prompt_tokens) or '?'} prompt tokens, served by {served}"
        out += ["", head + (f" (route {rule})" if rule else "")]
        if call.prefix_break:
            out.append(f"    prompt cache: {call.prefix_break}")
        if call.load.get("state"):
            out.append(f"    model load: {call.load.get('state')} in {as_float(call.load.get('seconds')) or 0:.2f}s")
        if call.input_note:
            out.append(f"    note: {call.input_note}")
        names = [str(t.get("name") or "?") for t in call.tools if isinstance(t, dict)]
        out.append(
            f"    tools offered: {', '.join(names)} (schemas: runs show --json)" if names else "    tools offered: none"
        )
        if call.new_from:
            out.append(
                f"    ({call.new_from} earlier message{'s' if call.new_from != 1 else ''} as in the call before; new in this turn:)"
            )
        for message in call.messages[call.new_from :]:
            extra = " ".join(f"{k}={message[k]}" for k in ("name", "tool_call_id") if message.get(k))
            out.append(f"    [{message.get('role')}]{' ' + extra if extra else ''}")
            content = message.get("content")
            if content not in (None, ""):
                out.extend(_block(_as_text(content), "      "))
            if message.get("tool_calls"):
                out.append("      tool calls:")
                out.extend(_block(_as_text(message["tool_calls"]), "        "))
        if call.tool_calls:
            out.append("    answered with tool calls:")
            out.extend(_block(_as_text(call.tool_calls), "      "))
    return ["", "llm call inputs", *out[1:]] if out else []
