"""``abstractruntime-mlx runs``: inspect and replay runs recorded in the ledger.

    abstractruntime-mlx runs list [--limit 20] [--status completed]
    abstractruntime-mlx runs show RUN_ID        # steps, node results, phase timeline
    abstractruntime-mlx runs replay RUN_ID      # re-render from the ledger; resume if interrupted
    abstractruntime-mlx runs web                # the same in a browser, live (runs_web_cmd)

``RUN_ID`` may be a unique prefix. The ledger is ``--ledger URL_OR_PATH``, else
``$ABSTRACTRUNTIME_MLX_LEDGER``, else ``~/.abstractruntime-mlx/ledger.sqlite``. ``list``,
``show`` and ``replay`` (unless it resumes) only read: a SQLite ledger that does not exist
is an error (nothing is created) and one is opened read-only, so a ledger on a read-only file system or copied from elsewhere
can be inspected.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from ..errors import LedgerNotFound
from ..inspection import control_text, run_view
from ..ledger import Ledger
from .ledger_location import default_ledger_url
from .show_view import calls_table, calls_timeline

# AbstractRuntime's RunStatus values.
RUN_STATUSES: Final = ("running", "waiting", "completed", "failed", "cancelled")

TEXT_WIDTH = 72


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("runs", help="list, show or replay runs recorded in the ledger")
    parser.set_defaults(handler=lambda _args: (parser.print_help(), 2)[1])
    actions = parser.add_subparsers(dest="runs_command", metavar="ACTION")

    listing = actions.add_parser("list", help="recent runs, newest first")
    listing.add_argument("--limit", type=int, default=20)
    listing.add_argument("--status", default=None, choices=RUN_STATUSES, help="only runs with this status")
    listing.add_argument("--ledger", default=None, help="ledger URL or SQLite path")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=_list)

    show = actions.add_parser("show", help="a run's steps, node results and phase timeline")
    show.add_argument("run_id", help="run id or a unique prefix")
    show.add_argument("--ledger", default=None, help="ledger URL or SQLite path")
    show.add_argument("--events", action="store_true", help="also list every phase event")
    show.set_defaults(handler=_show)

    replay = actions.add_parser(
        "replay",
        help="re-render a run from the ledger alone; an interrupted run resumes without redoing finished nodes",
    )
    replay.add_argument("run_id", help="run id or a unique prefix")
    replay.add_argument("--ledger", default=None, help="ledger URL or SQLite path")
    replay.add_argument("--model", default=None, help="model to resume with (default: the one the run was started with)")
    replay.add_argument("--no-resume", action="store_true", help="only render, even if the run is unfinished")
    replay.add_argument("--json", action="store_true")
    replay.set_defaults(handler=_replay)

    from . import runs_web_cmd

    runs_web_cmd.add_parser(actions)


# --------------------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------------------


def _open(url_or_path: str | None) -> Ledger:
    """The ledger, opened for reading only."""
    return open_for_inspection(default_ledger_url(url_or_path))


def open_for_inspection(url: str) -> Ledger:
    """``Ledger(url)`` for reading: a missing SQLite file is ``LedgerNotFound``, an existing one opens read-only.

    Read-only is SQLite's ``mode=ro``; where the directory cannot be written either (a
    read-only file system) the file is also opened ``immutable``, since no one can change it.
    Other databases open as usual.
    """
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or not database or database.startswith("file:") or parsed.query:
        return Ledger(url)
    path = Path(database).expanduser().resolve()
    if not path.is_file():
        raise LedgerNotFound(
            f"no ledger at {path}: no run has been recorded there (`abstractruntime-mlx run FLOW --ledger {path}` creates it)",
            details={"path": str(path)},
        )
    options = "mode=ro&uri=true"
    if not os.access(path.parent, os.W_OK):
        options += "&immutable=1"
    return Ledger(f"sqlite:///file:{path}?{options}")


def resolve_run_id(ledger: Ledger, run_id: str) -> str:
    if ledger.get_run(run_id) is not None:
        return run_id
    matches = [r.run_id for r in ledger.list_runs(limit=100_000) if r.run_id.startswith(run_id)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise SystemExit(f"no run {run_id!r} in {ledger.url}")
    raise SystemExit(f"run id prefix {run_id!r} is ambiguous: {', '.join(sorted(matches)[:5])}...")


def _list(args: argparse.Namespace) -> int:
    url = default_ledger_url(args.ledger)
    with open_for_inspection(url) as ledger:
        rows = ledger.list_runs(limit=args.limit, status=args.status)
        if args.json:
            print(json.dumps([_summary_dict(r) for r in rows], indent=2, default=str))
            return 0
        print(f"ledger: {url}")
        if not rows:
            print("no runs")
            return 0
        print(f"{'RUN ID':36}  {'WORKFLOW':16}  {'STATUS':9}  {'STARTED (UTC)':19}  {'DURATION':>8}  {'NODES':>5}  {'EVENTS':>6}")
        for r in rows:
            print(
                f"{r.run_id:36}  {r.workflow_id[:16]:16}  {r.status:9}  {r.created_at:%Y-%m-%d %H:%M:%S}  "
                f"{r.duration_s:7.2f}s  {r.node_count:5}  {r.progress_count:6}"
            )
    return 0


def _summary_dict(r: Any) -> dict[str, Any]:
    return {name: getattr(r, name) for name in r.__dataclass_fields__ if name != "state"}


def _show(args: argparse.Namespace) -> int:
    with _open(args.ledger) as ledger:
        run_id = resolve_run_id(ledger, args.run_id)
        print(render_run(ledger, run_id, events=args.events))
    return 0


def _replay(args: argparse.Namespace) -> int:
    from ..runtime_plugin import resume_run

    url = default_ledger_url(args.ledger)
    with open_for_inspection(url) as ledger:  # only a resume writes, through its own store
        run_id = resolve_run_id(ledger, args.run_id)
        detail = ledger.get_run(run_id)
    assert detail is not None
    if detail.status == "running" and not args.no_resume:
        print(f"run {run_id} was interrupted at node {detail.state.get('current_node')!r}; resuming (finished nodes are reused)")
        result = resume_run(run_id, ledger_url=url, model=args.model)
        print_results([result], as_json=args.json, ledger_url=url)
        return 0 if result.status == "completed" else 1
    from ..runtime_plugin import FlowRunResult, node_outcomes

    with open_for_inspection(url) as ledger:
        state = detail.state
        result = FlowRunResult(
            run_id=run_id,
            workflow_id=detail.workflow_id,
            status=detail.status,
            output=state.get("output"),
            error=state.get("error"),
            wall_s=detail.duration_s,
            nodes=node_outcomes(ledger, run_id),
        )
    print_results([result], as_json=args.json, ledger_url=url, replayed=True)
    return 0 if result.status == "completed" else 1


# --------------------------------------------------------------------------------------
# Rendering (shared with ``run``)
# --------------------------------------------------------------------------------------


def print_results(
    results: Sequence[Any],
    *,
    as_json: bool = False,
    ledger_url: str | None = None,
    wall_s: float | None = None,
    replayed: bool = False,
) -> None:
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "run_id": r.run_id,
                        "workflow_id": r.workflow_id,
                        "status": r.status,
                        "error": r.error,
                        "wall_s": r.wall_s,
                        "output": r.output,
                        "nodes": [{"node_id": n.node_id, "result": n.result} for n in r.nodes],
                    }
                    for r in results
                ],
                indent=2,
                default=str,
            )
        )
        return
    peak = 0
    for r in results:
        label = "replayed from the ledger" if replayed else f"{r.wall_s:.2f}s"
        print(f"run {r.run_id}  {r.workflow_id}  {r.status}  ({label})")
        if r.error:
            print(f"  error: {r.error}")
        for n in r.nodes:
            print(format_node(n.node_id, n.result))
            peak = max(peak, int((n.result.get("metadata") or {}).get("execution", {}).get("peak_batch_size") or 0))
        print()
    if wall_s is not None:
        done = sum(1 for r in results if r.status == "completed")
        print(f"{done}/{len(results)} runs completed in {wall_s:.2f}s; peak engine batch {peak}")
    if ledger_url:
        ids = " ".join(r.run_id[:8] for r in results[:3])
        print(f"ledger: {ledger_url}  (inspect: abstractruntime-mlx runs show {ids.split()[0] if ids else 'RUN_ID'})")


def format_node(node_id: str, result: dict[str, Any]) -> str:
    meta = result.get("metadata") or {}
    execution = meta.get("execution") or {}
    spec = meta.get("speculation") or {}
    controls = meta.get("controls") or {}
    usage = result.get("usage") or {}
    sibling = meta.get("sibling_batch") or {}
    lines = [f"  - {node_id}: {_clip(result.get('content') or '')!r}"]
    exec_bits = [f"mode={execution.get('mode', '?')}"]
    for name, label, scale, unit in (("peak_batch_size", "batch", 1, ""), ("queue_s", "queue", 1000, "ms"), ("ttft_s", "ttft", 1000, "ms")):
        value = execution.get(name)
        if isinstance(value, (int, float)):
            exec_bits.append(f"{label}={value * scale:.0f}{unit}" if unit else f"{label}={value}")
    lines.append(
        f"      execution: {' '.join(exec_bits)}  tokens={usage.get('prompt_tokens', '?')}+{usage.get('completion_tokens', '?')}"
        f"  finish={result.get('finish_reason')}"
    )
    spec_value = controls.get("speculation", spec.get("requested"))
    spec_line = f"      speculation: {control_text(spec_value)} (from {controls.get('speculation_source', spec.get('source', '?'))})"
    spec_line += f" used={str(spec.get('used')).lower()}"
    if spec.get("reason"):
        spec_line += f" reason={spec['reason']}"
    lines.append(spec_line)
    lines.append(f"      thinking: {control_text(controls.get('thinking'))} (from {controls.get('thinking_source', '?')})")
    cache = meta.get("prompt_cache")
    if isinstance(cache, dict):
        line = f"      prompt cache: key={cache.get('key')} {cache.get('outcome', '?')}"
        if cache.get("cached_tokens") is not None:
            line += f" cached={cache['cached_tokens']}/{usage.get('prompt_tokens', '?')} fed={cache.get('fed_tokens')}"
        if cache.get("degraded_reason"):
            line += f" degraded: {cache['degraded_reason']}"
        lines.append(line)
    if sibling.get("role") == "sibling":
        state = "prefetched" if sibling.get("used") else f"not used ({sibling.get('reason')})"
        lines.append(f"      sibling batch: {state}, launched by {sibling.get('trigger_node')}")
    elif sibling.get("launched"):
        lines.append(f"      sibling batch: launched {', '.join(sibling['launched'])} with this call")
    return "\n".join(lines)


def _clip(text: str, width: int = TEXT_WIDTH) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def render_run(ledger: Ledger, run_id: str, *, events: bool = False) -> str:
    """A terminal view of one run: header, steps, node results, phase timeline."""
    from ..runtime_plugin import node_outcomes

    detail = ledger.get_run(run_id)
    if detail is None:
        raise SystemExit(f"no run {run_id} in {ledger.url}")
    steps = ledger.run_steps(run_id)
    progress = ledger.node_timeline(run_id)
    out: list[str] = [
        f"run {detail.run_id}",
        f"  workflow {detail.workflow_id}  status {detail.status}  started {detail.created_at:%Y-%m-%d %H:%M:%S} UTC"
        f"  duration {detail.duration_s:.2f}s  steps {detail.step_count}  phase events {detail.progress_count}",
    ]
    if detail.state.get("error"):
        out.append(f"  error: {detail.state['error']}")
    if detail.status == "running":
        out.append(f"  interrupted at node {detail.state.get('current_node')!r}: `abstractruntime-mlx runs replay {run_id}` resumes it")
    out.append("")
    out.append("steps")
    out.append(f"  {'SEQ':>3}  {'NODE':14}  {'STATUS':9}  {'EFFECT':12}  {'ATT':>3}  {'TIME':>8}")
    for s in steps:
        effect = s.effect_type or "-"
        if effect == "emit_event":
            name = ((s.record.get("effect") or {}).get("payload") or {}).get("name")
            effect = str(name or effect)[:12]
        duration = f"{s.duration_s * 1000:.0f}ms" if s.duration_s is not None else ""
        out.append(f"  {s.seq:>3}  {s.node_id[:14]:14}  {s.status:9}  {effect[:12]:12}  {s.attempt:>3}  {duration:>8}")
    nodes = node_outcomes(ledger, run_id)
    if nodes:
        out.append("")
        out.append("llm nodes")
        out.extend(format_node(n.node_id, n.result) for n in nodes)
    view = run_view(ledger, run_id)
    if view is not None and view.calls:
        out += ["", "llm calls", calls_table(view), "", calls_timeline(view)]
    if progress and events:
        out.append("")
        out.extend(_event_lines(progress, detail.created_at))
    return "\n".join(out)


def _event_lines(progress: Sequence[Any], run_start: dt.datetime) -> list[str]:
    lines = ["phase events"]
    for row in progress:
        t = _secs(row.created_at, run_start)
        bits = [f"+{t:7.3f}s", f"{row.node_id[:14]:14}", f"{(row.phase or '?'):8}"]
        for name in ("prompt_tokens", "cached_tokens", "prefill_processed_tokens", "generated_tokens"):
            value = getattr(row, name)
            if value is not None:
                bits.append(f"{name}={value}")
        if row.ttft_s is not None:
            bits.append(f"ttft={row.ttft_s * 1000:.0f}ms")
        if row.tokens_per_second is not None:
            bits.append(f"{row.tokens_per_second:.0f}tok/s")
        if row.finish_reason:
            bits.append(f"finish={row.finish_reason}")
        lines.append("  " + "  ".join(bits))
    return lines


def _secs(when: dt.datetime, origin: dt.datetime) -> float:
    return (when - origin).total_seconds()
