"""``abstractruntime-mlx runs``: inspect and replay runs recorded in the ledger.

    abstractruntime-mlx runs list [--limit 20] [--status completed]
    abstractruntime-mlx runs show RUN_ID [--json]    # steps, node results, phase timeline
    abstractruntime-mlx runs replay RUN_ID      # re-render from the ledger; resume if interrupted
    abstractruntime-mlx runs web                # the same in a browser, live (runs_web_cmd)
    abstractruntime-mlx runs export RUN_ID... --otlp URL | --json FILE   # OpenTelemetry traces (runs_export_cmd)
    abstractruntime-mlx runs resume RUN_ID --answer TEXT     # continue a waiting run
    abstractruntime-mlx runs resume RUN_ID --event NAME[=JSON]
    abstractruntime-mlx runs resume --all-running    # take over runs whose driver is gone

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
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final

from ..errors import MLXRuntimeError, RunNotFound, RunNotResumable
from ..json_values import JSONValue, array_at, as_str, object_at
from .args import add_limit_arguments, drive_limits, help_handler, integer
from .ledger_location import default_ledger_url, existing_ledger_file, open_for_inspection, resolve_run_id
from .terminal import printable

if TYPE_CHECKING:
    from ..inspection import CallView
    from ..ledger import Ledger, ProgressRow, RunSummary, StepRow
    from ..runtime_plugin import FlowRunResult

# AbstractRuntime's RunStatus values, and ``interrupted``: a run stopped by Ctrl-C (the ledger's
# status column only; ``runs resume`` continues it).
RUN_STATUSES: Final = ("running", "waiting", "interrupted", "completed", "failed", "cancelled")
RESUMABLE: Final = ("running", "waiting", "interrupted")

TEXT_WIDTH = 72


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("runs", help="list, show or replay runs recorded in the ledger")
    parser.set_defaults(handler=help_handler(parser))
    actions = parser.add_subparsers(dest="runs_command", metavar="ACTION")

    listing = actions.add_parser("list", help="recent runs, newest first, child runs indented under their root")
    listing.add_argument("--limit", type=integer, default=20, help="how many root runs (default 20)")
    listing.add_argument("--status", default=None, choices=RUN_STATUSES, help="only root runs with this status")
    listing.add_argument(
        "--flat",
        action="store_true",
        help="every run as its own row, child runs too (--limit and --status apply to all)",
    )
    listing.add_argument("--ledger", default=None, help="ledger URL or SQLite path")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=_list)

    show = actions.add_parser("show", help="a run's steps, node results and phase timeline")
    show.add_argument("run_id", help="run id or a unique prefix")
    show.add_argument("--ledger", default=None, help="ledger URL or SQLite path")
    show.add_argument("--events", action="store_true", help="also list every phase event")
    show.add_argument(
        "--json",
        action="store_true",
        help="print the same as JSON: run, steps, LLM nodes and calls, events, child runs",
    )
    show.set_defaults(handler=_show)

    replay = actions.add_parser(
        "replay",
        help="re-render a run from the ledger alone; an interrupted run resumes without redoing finished nodes",
    )
    replay.add_argument("run_id", help="run id or a unique prefix")
    replay.add_argument("--ledger", default=None, help="ledger URL or SQLite path")
    replay.add_argument(
        "--model", default=None, help="model to resume with (default: the one the run was started with)"
    )
    replay.add_argument("--no-resume", action="store_true", help="only render, even if the run is unfinished")
    replay.add_argument(
        "--flow",
        default=None,
        metavar="FILE",
        help="compare the run's flow with FILE (default: the file it was started from)",
    )
    replay.add_argument("--json", action="store_true")
    replay.set_defaults(handler=_replay)

    from . import runs_export_cmd, runs_web_cmd

    runs_web_cmd.add_parser(actions)
    runs_export_cmd.add_parser(actions)

    resume = actions.add_parser(
        "resume",
        help="continue a waiting run: answer its question, send the event it waits for, or wait for its timer",
    )
    resume.add_argument(
        "run_id", nargs="?", default=None, help="run id or a unique prefix (the root run or any run of its tree)"
    )
    resume.add_argument(
        "--all-running",
        action="store_true",
        help="take over every interrupted run whose driver is gone (runs_takeover_cmd)",
    )
    what = resume.add_mutually_exclusive_group()
    what.add_argument("--answer", default=None, metavar="TEXT", help="the answer to an ask_user question")
    what.add_argument(
        "--event",
        default=None,
        metavar="NAME[=JSON]",
        help="the event a wait_event node waits for, with an optional JSON payload",
    )
    resume.add_argument("--ledger", default=None, help="ledger URL or SQLite path")
    resume.add_argument(
        "--model", default=None, help="model to resume with (default: the one the run was started with)"
    )
    resume.add_argument(
        "--max-timer-wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to sleep for timers (default 60)",
    )
    add_limit_arguments(resume)
    resume.add_argument("--json", action="store_true")
    resume.set_defaults(handler=_resume)


# --------------------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------------------


def _open(url_or_path: str | None) -> Ledger:
    """The ledger, opened for reading only."""
    return open_for_inspection(default_ledger_url(url_or_path))


def _list(args: argparse.Namespace) -> int:
    from ..inspection import child_runs

    url = default_ledger_url(args.ledger)
    with open_for_inspection(url) as ledger:
        rows = ledger.list_runs(limit=args.limit, status=args.status, roots_only=not args.flat)
        children = {} if args.flat else child_runs(ledger, [r.run_id for r in rows])
        if args.json:
            print(json.dumps([_tree_dict(r, children) for r in rows], indent=2, default=str))
            return 0
        print(f"ledger: {url}")
        if not rows:
            print("no runs")
            return 0
        print(printable(runs_list_table(_tree_rows(rows, children))))
    return 0


def runs_list_table(rows: Sequence[tuple[int, RunSummary]], *, width: int | None = None) -> str:
    """``runs list``'s table (``rich``): ids and workflow names are never cut, a long one wraps in
    its cell. Under 100 columns the workflow goes under the run id and the counts are left out."""
    from rich import box
    from rich.table import Table

    from .show_view import render_text, terminal_width

    width = width or terminal_width()
    narrow = width < 100
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("run id / workflow" if narrow else "run id", no_wrap=False, overflow="fold", min_width=38)
    if not narrow:
        table.add_column("workflow", overflow="fold")
    table.add_column("status", no_wrap=True)
    table.add_column("started (UTC)", no_wrap=True)
    table.add_column("duration", justify="right", no_wrap=True)
    if not narrow:
        table.add_column("nodes", justify="right", no_wrap=True)
        table.add_column("events", justify="right", no_wrap=True)
    for depth, r in rows:
        indent = "  " * (depth - 1) + "└ " if depth else ""
        started = f"{r.created_at:%m-%d %H:%M:%S}" if narrow else f"{r.created_at:%Y-%m-%d %H:%M:%S}"
        if narrow:
            cells = [
                f"{indent}{r.run_id}\n{' ' * len(indent)}  {r.workflow_id}",
                r.status,
                started,
                f"{r.duration_s:.2f}s",
            ]
        else:
            cells = [
                f"{indent}{r.run_id}",
                r.workflow_id,
                r.status,
                started,
                f"{r.duration_s:.2f}s",
                str(r.node_count),
                str(r.progress_count),
            ]
        table.add_row(*cells)
    return render_text(table, width)


def _tree_rows(
    rows: Sequence[RunSummary], children: Mapping[str, list[RunSummary]], depth: int = 0
) -> list[tuple[int, RunSummary]]:
    out: list[tuple[int, RunSummary]] = []
    for r in rows:
        out.append((depth, r))
        out.extend(_tree_rows(children.get(r.run_id, []), children, depth + 1))
    return out


def _tree_dict(r: RunSummary, children: Mapping[str, list[RunSummary]]) -> dict[str, object]:
    out = _summary_dict(r)
    out["children"] = [_tree_dict(c, children) for c in children.get(r.run_id, [])]
    return out


def _summary_dict(r: RunSummary) -> dict[str, object]:
    return {name: getattr(r, name) for name in r.__dataclass_fields__ if name != "state"}


def _show(args: argparse.Namespace) -> int:
    with _open(args.ledger) as ledger:
        run_id = resolve_run_id(ledger, args.run_id)
        if args.json:
            from ..inspection import run_dict

            print(json.dumps(run_dict(ledger, run_id, events=args.events), indent=2, default=str))
        else:
            print(printable(render_run(ledger, run_id, events=args.events)))
    return 0


def _replay(args: argparse.Namespace) -> int:
    from ..runtime_plugin import resume_run

    url = default_ledger_url(args.ledger)
    with open_for_inspection(url) as ledger:  # only a resume writes, through its own store
        run_id = resolve_run_id(ledger, args.run_id)
        detail = ledger.get_run(run_id)
    assert detail is not None
    resuming = detail.status in ("running", "interrupted") and not args.no_resume
    report_flow_drift(run_id, detail.state, flow_file=args.flow, resuming=resuming)
    if resuming:
        print(
            printable(
                f"run {run_id} was interrupted at node {detail.state.get('current_node')!r}; resuming (finished nodes are reused)"
            )
        )
        result = resume_run(run_id, ledger_url=url, model=args.model, refuse_finished=True)
        print_results([result], as_json=args.json, ledger_url=url)
        return 0 if result.status == "completed" else 1
    from ..inspection import node_outcomes
    from ..runtime_plugin import FlowRunResult

    with open_for_inspection(url) as ledger:
        state = detail.state
        output = state.get("output")
        result = FlowRunResult(
            run_id=run_id,
            workflow_id=detail.workflow_id,
            status=detail.status,
            output=output if isinstance(output, dict) else None,
            error=as_str(state.get("error")),
            wall_s=detail.duration_s,
            nodes=node_outcomes(ledger, run_id),
        )
    print_results([result], as_json=args.json, ledger_url=url, replayed=True)
    return 0 if result.status == "completed" else 1


def report_flow_drift(
    run_id: str, state: Mapping[str, object], *, flow_file: str | None = None, resuming: bool
) -> None:
    """Say on stderr what changed in the run's flow file since the run started. A resume always
    continues the graph the run started with (stored in the run), never the edited file."""
    from ..runtime_plugin.hosting import flow_drift, stored_flow, stored_options

    run_vars = object_at(state, "vars")
    drift = flow_drift(stored_flow(run_vars), stored_options(run_vars), flow_file=flow_file)
    if drift is None:
        return
    then = "resuming the graph the run started with (stored in the run)" if resuming else "the run is shown as it ran"
    print(printable(f"note: {drift.render(run_id)}\n{then}; start a new run to use the edited flow"), file=sys.stderr)


def parse_event(text: str) -> tuple[str, object]:
    """``"approved"`` → ``("approved", {})``; ``'done={"ok": true}'`` → ``("done", {"ok": True})``;
    a payload that is not JSON is kept as a string."""
    name, sep, raw = text.partition("=")
    if not name.strip():
        raise SystemExit(f"error: --event expects NAME[=JSON], got {text!r}")
    if not sep:
        return name.strip(), {}
    try:
        return name.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return name.strip(), raw


def _resume(args: argparse.Namespace) -> int:
    from ..ledger import Ledger
    from ..ledger.run_lock import root_run_id
    from ..runtime_plugin import resume_run

    if args.all_running or args.run_id is None:
        from .runs_takeover_cmd import resume_all_running

        return resume_all_running(args)
    url = default_ledger_url(args.ledger)
    existing_ledger_file(url)  # resuming writes, but never into a ledger it would have to create
    with Ledger(url) as ledger:
        run_id = root_run_id(ledger, resolve_run_id(ledger, args.run_id))
        detail = ledger.get_run(run_id)
    assert detail is not None
    if detail.status not in RESUMABLE:
        raise RunNotResumable(
            f"run {run_id} is {detail.status}; only a waiting or interrupted run can be resumed",
            details={"run_id": run_id, "status": detail.status},
        )
    event = parse_event(args.event) if args.event is not None else None
    report_flow_drift(run_id, detail.state, resuming=True)
    try:
        result = resume_run(
            run_id,
            ledger_url=url,
            model=args.model,
            answer=args.answer,
            event=event,
            limits=drive_limits(args, max_timer_wait_s=max(0.0, args.max_timer_wait)),
            refuse_finished=True,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    print_results([result], as_json=args.json, ledger_url=url, wall_s=result.wall_s)
    return exit_code([result])


EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_WAITING: Final = 3
"""``run`` exits 0 when every run completed with no node failure, 1 when a run failed or a
node failed, 3 when runs only wait for outside input (``runs resume`` continues them)."""


def exit_code(results: Sequence[FlowRunResult]) -> int:
    if any(r.status not in ("completed", "waiting") or r.failures for r in results):
        return EXIT_FAILED
    if any(r.status == "waiting" for r in results):
        return EXIT_WAITING
    return EXIT_OK


# --------------------------------------------------------------------------------------
# Rendering (shared with ``run``)
# --------------------------------------------------------------------------------------


def print_results(
    results: Sequence[FlowRunResult],
    *,
    as_json: bool = False,
    ledger_url: str | None = None,
    wall_s: float | None = None,
    replayed: bool = False,
) -> None:
    if as_json:
        from ..inspection import node_dict

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
                        "waiting": r.waiting,
                        "children": r.children,
                        "failures": [{"run_id": f.run_id, "node_id": f.node_id, "error": f.error} for f in r.failures],
                        "nodes": [node_dict(n) for n in r.nodes],
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
        print(printable(f"run {r.run_id}  {r.workflow_id}  {r.status}  ({label})"))
        labels = _tree_labels(ledger_url, r) if ledger_url and (r.failures or r.nodes) else {}
        # One line per error: a node failure by the node's label; the run's own error only when
        # it says more than its node failures.
        if r.error and not any(_one_line(f.error) in _one_line(r.error) for f in r.failures):
            print(printable(f"  error: {_one_line(r.error)}"))
        if r.waiting:
            print(printable(f"  waiting: {format_wait(r.waiting, r.run_id)}"))
        for n in r.nodes:
            prefix = "" if n.run_id in ("", r.run_id) else f"[{n.run_id[:8]}] "
            print(printable(format_node(prefix + labels.get((n.run_id, n.node_id), n.node_id), n.result)))
            peak = max(peak, peak_batch(n.result))
        for f in r.failures:
            where = "" if f.run_id == r.run_id else f" (run {f.run_id[:8]})"
            print(
                printable(
                    f"  node failed: {labels.get((f.run_id, f.node_id), repr(f.node_id))}{where}: {_one_line(f.error)}"
                )
            )
        from .show_view import output_lines

        for line in output_lines(_json_safe(r.output)):
            print(printable(line))
        print()
    if wall_s is not None:
        print(summary_line(results, wall_s=wall_s, peak=peak))
    if ledger_url:
        ids = " ".join(r.run_id[:8] for r in results[:3])
        print(f"ledger: {ledger_url}  (inspect: abstractruntime-mlx runs show {ids.split()[0] if ids else 'RUN_ID'})")


def _json_safe(value: object) -> JSONValue:
    """A flow output as plain JSON values (what is not JSON becomes its text)."""
    loaded: JSONValue = json.loads(json.dumps(value, default=str))
    return loaded


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _tree_labels(ledger_url: str, result: FlowRunResult) -> dict[tuple[str, str], str]:
    """``(run id, node id) -> 'Label' (node id)`` for the runs of ``result``'s tree (the flow's own
    labels, as the run views name nodes); empty when the ledger cannot be read."""
    from ..inspection import run_flow_document
    from ..run_graph import display_labels

    out: dict[tuple[str, str], str] = {}
    run_ids = {result.run_id, *result.children}
    try:
        with open_for_inspection(ledger_url) as ledger:
            for run_id in run_ids:
                detail = ledger.get_run(run_id)
                flow = run_flow_document(ledger, detail) if detail is not None else None
                for node_id, label in (display_labels(flow) if flow is not None else {}).items():
                    out[(run_id, node_id)] = node_id if label == node_id else f"{label!r} ({node_id})"
    except MLXRuntimeError:
        return {}
    return out


def peak_batch(result: Mapping[str, object]) -> int:
    value = object_at(object_at(result, "metadata"), "execution").get("peak_batch_size")
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def summary_line(results: Sequence[FlowRunResult], *, wall_s: float, peak: int) -> str:
    """``2/3 runs completed, 1 waiting, 0 failed; 1 node failure; 9 LLM calls; prompt tokens 1,200/2,400 reused;
    peak engine batch 4 (1.20s)``."""
    done = sum(1 for r in results if r.status == "completed")
    waiting = sum(1 for r in results if r.status == "waiting")
    failed = len(results) - done - waiting
    failures = sum(len(r.failures) for r in results)
    calls = sum(len(r.nodes) for r in results)
    prompt, cached = prompt_tokens_reused(results)
    return (
        f"{done}/{len(results)} runs completed, {waiting} waiting, {failed} failed; "
        f"{failures} node failure{'s' if failures != 1 else ''}; {calls} LLM call{'s' if calls != 1 else ''}; "
        f"prompt tokens {cached:,}/{prompt:,} reused; peak engine batch {peak} ({wall_s:.2f}s)"
    )


def prompt_tokens_reused(results: Sequence[FlowRunResult]) -> tuple[int, int]:
    """(prompt tokens, of which restored from the prompt cache) over every LLM call of ``results``."""
    prompt = cached = 0
    for r in results:
        for n in r.nodes:
            usage = object_at(n.result, "usage")
            prompt += _count(usage.get("prompt_tokens"))
            cached += _count(usage.get("cached_input_tokens"))
    return prompt, cached


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def format_wait(waiting: Mapping[str, object], run_id: str) -> str:
    """What run ``run_id`` (a root run) waits for and the ``runs resume`` that continues it."""
    reason = waiting.get("reason")
    where = f"run {str(waiting.get('run_id'))[:8]} node {waiting.get('node_id')!r}"
    if reason == "user":
        choices = array_at(waiting, "choices")
        text = f"an answer to {waiting.get('prompt') or '(no prompt)'!r}"
        if choices:
            text += f" (choices: {', '.join(str(c) for c in choices)})"
        return f"{text} at {where}; continue with: {resume_hint(run_id, waiting)}"
    if reason == "until":
        return f"a timer until {waiting.get('until')} at {where}; continue with: {resume_hint(run_id, waiting)}"
    if reason == "event":
        return f"event {waiting.get('event')!r} at {where}; continue with: {resume_hint(run_id, waiting)}"
    return f"{reason} ({waiting.get('wait_key')}) at {where}"


def resume_hint(run_id: str, waiting: Mapping[str, object]) -> str:
    """The ``runs resume`` command that continues ``run_id``, waiting as ``waiting`` says (the
    event's name filled in where it is known)."""
    reason = waiting.get("reason")
    command = f"runs resume {run_id}"
    if reason == "user":
        return f"{command} --answer TEXT"
    if reason == "event":
        return f"{command} --event {waited_event(waiting) or 'NAME'}[=JSON]"
    return command


def waited_event(waiting: Mapping[str, object]) -> str:
    """The name of the event a wait_event node waits for: ``event``, else the last part of an
    ``evt:`` wait key."""
    name = as_str(waiting.get("event"))
    if name:
        return name
    key = str(waiting.get("wait_key") or "")
    return key.split(":", 3)[-1] if key.startswith("evt:") else key


def format_node(node_id: str, result: Mapping[str, object]) -> str:
    from ..inspection import control_text, prefix_break_text

    meta = object_at(result, "metadata")
    execution = object_at(meta, "execution")
    spec = object_at(meta, "speculation")
    controls = object_at(meta, "controls")
    usage = object_at(result, "usage")
    sibling = object_at(meta, "sibling_batch")
    lines = [f"  - {node_id}: {_clip(str(result.get('content') or ''))!r}"]
    exec_bits = [f"mode={execution.get('mode', '?')}"]
    for name, label, scale, unit in (
        ("peak_batch_size", "batch", 1, ""),
        ("queue_s", "queue", 1000, "ms"),
        ("ttft_s", "ttft", 1000, "ms"),
    ):
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
    lines.append(
        f"      thinking: {control_text(controls.get('thinking'))} (from {controls.get('thinking_source', '?')})"
    )
    cache = meta.get("prompt_cache")
    if isinstance(cache, dict):
        line = f"      prompt cache: key={cache.get('key')} {cache.get('outcome', '?')}"
        if cache.get("cached_tokens") is not None:
            line += f" cached={cache['cached_tokens']}/{usage.get('prompt_tokens', '?')} fed={cache.get('fed_tokens')}"
        if cache.get("prefetched_tokens"):
            line += f" prefetched={cache['prefetched_tokens']}"
        if cache.get("degraded_reason"):
            line += f" degraded: {cache['degraded_reason']}"
        lines.append(line)
        broke = prefix_break_text(object_at(cache, "prefix_break"), excerpts=True)
        if broke:
            lines.append(f"        {broke}")
    for warm in array_at(meta, "prefix_warm"):
        if isinstance(warm, dict):
            state = "queued" if warm.get("queued") else f"not queued ({warm.get('reason')})"
            part = "system prompt" if warm.get("prefix_only") else "prompt"
            lines.append(
                f"      prefix warm: {warm.get('node_id')}'s {part}, {warm.get('prompt_tokens')} tokens, {state}"
            )
    if sibling.get("role") == "sibling":
        state = "prefetched" if sibling.get("used") else f"not used ({sibling.get('reason')})"
        lines.append(f"      sibling batch: {state}, launched by {sibling.get('trigger_node')}")
    elif sibling.get("launched"):
        lines.append(
            f"      sibling batch: launched {', '.join(str(n) for n in array_at(sibling, 'launched'))} with this call"
        )
    return "\n".join(lines)


def _clip(text: str, width: int = TEXT_WIDTH) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def render_run(ledger: Ledger, run_id: str, *, events: bool = False, _depth: int = 0) -> str:
    """A terminal view of one run: header, what it waits for, steps, node results, the LLM
    calls with their timeline (one bar per call: loop iterations are drawn separately), then
    its child runs (subflows, agents), indented."""
    from ..inspection import MAX_NESTING, node_outcomes, run_flow_document, run_view
    from ..run_graph import display_labels
    from .show_view import call_input_lines, calls_table, calls_timeline, output_lines

    detail = ledger.get_run(run_id)
    if detail is None:
        raise RunNotFound(f"no run {run_id!r} in {ledger.url}", details={"run_id": run_id[:255]})
    steps = ledger.run_steps(run_id)
    progress = ledger.node_timeline(run_id)
    flow = run_flow_document(ledger, detail)
    labels = display_labels(flow) if flow is not None else {}
    title = "run" if not detail.parent_run_id else "child run"
    tree_view = run_view(ledger, run_id) if _depth == 0 else None
    totals = tree_view.totals if tree_view is not None else None
    duration = totals.elapsed_s if totals is not None else detail.duration_s
    out: list[str] = [
        f"{title} {detail.run_id}",
        f"  workflow {detail.workflow_id}",
        f"  status {detail.status}  started {detail.created_at:%Y-%m-%d %H:%M:%S} UTC  duration {duration:.2f}s",
        f"  steps {detail.step_count}  phase events {detail.progress_count}",
    ]
    if totals is not None and totals.runs > 1:
        out += [
            f"  with its {totals.runs - 1} child run{'s' if totals.runs != 2 else ''}: {totals.calls} LLM calls",
            f"  prompt tokens {totals.prompt_tokens:,} ({totals.cached_tokens:,} from cache), generated {totals.generated_tokens:,}",
        ]
    if detail.state.get("error"):
        out.append(f"  error: {_one_line(str(detail.state['error']))}")
    current = detail.state.get("current_node")
    node_name = _node_name(labels, str(current)) if current else None
    where = f" at node {node_name}" if node_name else ""
    if detail.status == "interrupted":
        out += [f"  interrupted (Ctrl-C){where}; continue:", f"    abstractruntime-mlx runs resume {run_id}"]
    elif detail.status == "running":
        out += [
            f"  running{where}; if no process drives it any more, it was interrupted;",
            f"  continue it: abstractruntime-mlx runs resume {run_id}",
        ]
    elif detail.status == "failed" and not detail.parent_run_id:
        out.append("  failed; see its steps below, then start a new run (abstractruntime-mlx run FLOW)")
    waiting = detail.state.get("waiting")
    if detail.status == "waiting" and isinstance(waiting, dict):
        out.extend(_wait_lines(run_id, node_name, waiting))
    from .show_view import terminal_width

    width = max(60, terminal_width() - 4 * _depth)  # a child run is indented 4 columns per level
    view = run_view(ledger, run_id, tree=False)
    output = output_lines(tree_view.output if tree_view is not None else _json_safe(detail.state.get("output")))
    out.extend(wrapped for line in output for wrapped in _wrapped(line, width))
    out += ["", "steps", _steps_table(steps, labels, width=width, calls=view.calls if view is not None else ())]
    nodes = node_outcomes(ledger, run_id)
    if nodes:
        out.append("")
        out.append("llm nodes")
        for n in nodes:
            out.extend(_wrapped(format_node(labels.get(n.node_id, n.node_id), n.result), width))
    if view is not None and view.calls:
        out += ["", "llm calls", calls_table(view, width=width), "", calls_timeline(view, columns=width)]
        out.extend(wrapped for line in call_input_lines(view) for wrapped in _wrapped(line, width))
    if _depth == 0:
        out.extend(_tree_call_lines(ledger, run_id))
    if progress and events:
        out.append("")
        out.extend(_event_lines(progress, detail.created_at))
    children = ledger.list_run_states(parent_run_id=run_id, limit=10_000)
    for child in sorted(children, key=lambda c: str(c.get("created_at") or "")):
        if _depth >= MAX_NESTING:
            out.append(
                f"\n  child run {child.get('run_id')} ({child.get('workflow_id')}): deeper than {MAX_NESTING} levels, see `runs show` on it"
            )
            continue
        out.append("")
        body = render_run(ledger, str(child["run_id"]), events=events, _depth=_depth + 1)
        out.extend("    " + line if line else line for line in body.splitlines())
    return "\n".join(out)


def _wrapped(text: str, width: int) -> list[str]:
    """``text``'s lines wrapped at ``width`` columns, continuations indented under their line."""
    import textwrap

    out: list[str] = []
    for line in text.splitlines():
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        out.extend(
            textwrap.wrap(line, width=width, subsequent_indent=indent, break_on_hyphens=False, drop_whitespace=True)
            or [""]
        )
    return out


def _steps_table(
    steps: Sequence[StepRow], labels: Mapping[str, str], *, width: int, calls: Sequence[CallView] = ()
) -> str:
    """The steps of a run as a ``rich`` table, nodes by label; nothing is cut (a long label wraps).

    ``time`` is the step's own (started to ended record); for an LLM step ``llm call`` is its
    call's (queue to last token, from the phase events). They differ under sibling prefetch: the
    step that launched its siblings waits for its call (and the model's first load), while a
    prefetched sibling's step only picks up a finished result."""
    from rich import box
    from rich.table import Table

    from .show_view import render_text

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("seq", justify="right", no_wrap=True)
    table.add_column("node", overflow="fold")
    table.add_column("status", no_wrap=True)
    table.add_column("effect", overflow="fold")
    table.add_column("att", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("llm call", justify="right", no_wrap=True)
    call_times = _call_times(calls)
    for step in steps:
        effect = step.effect_type or "-"
        if effect == "emit_event":
            name = object_at(object_at(step.record, "effect"), "payload").get("name")
            effect = str(name or effect)
        duration = f"{step.duration_s * 1000:.0f}ms" if step.duration_s is not None else ""
        call = (
            call_times.get((step.step_id, step.attempt), "")
            if step.status != "started" and step.effect_type == "llm_call"
            else ""
        )
        table.add_row(
            str(step.seq),
            labels.get(step.node_id, step.node_id),
            step.status,
            effect,
            str(step.attempt),
            duration,
            call,
        )
    return "\n".join("  " + line for line in render_text(table, width - 2).splitlines())


def _call_times(calls: Sequence[CallView]) -> dict[tuple[str | None, int], str]:
    """``(step_id, attempt)`` -> the call's own time, ``prefetched`` when a sibling launched it."""
    out: dict[tuple[str | None, int], str] = {}
    for call in calls:
        if call.start_s is None or call.end_s is None:
            continue
        note = " prefetched" if call.sibling_batch.get("role") == "sibling" else ""
        out[(call.step_id, call.attempt)] = f"{max(0.0, call.end_s - call.start_s) * 1000:.0f}ms{note}"
    return out


def _tree_call_lines(ledger: Ledger, run_id: str) -> list[str]:
    """``runs show``'s section on the LLM calls of the run and its child runs, when it has any
    child run with calls: one line per call naming its run (``.`` for the run itself), then totals."""
    from ..inspection import tree_call_summary

    tree = tree_call_summary(ledger, run_id)
    by_call = array_at(tree, "by_call")
    if not any(isinstance(c, dict) and c.get("run_id") != run_id for c in by_call):
        return []
    from rich import box
    from rich.table import Table

    from .show_view import render_text, terminal_width

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("run", no_wrap=True)
    table.add_column("call", overflow="fold")
    table.add_column("status", no_wrap=True)
    table.add_column("prompt", justify="right", no_wrap=True)
    table.add_column("gen", justify="right", no_wrap=True)
    for c in by_call:
        assert isinstance(c, dict)
        owner = "." if c["run_id"] == run_id else str(c["run_id"])[:8]
        table.add_row(
            owner,
            str(c.get("name") or c["label"]),
            str(c["status"]),
            f"{c['prompt_tokens'] or 0:,}",
            f"{c['generated_tokens'] or 0:,}",
        )
    lines = ["", "llm calls of this run and its child runs", "  (run: . for this one, else the child run's id prefix)"]
    lines.extend("  " + line for line in render_text(table, terminal_width() - 2).splitlines())
    lines.append(
        f"  total: {tree['calls']} LLM call{'s' if tree['calls'] != 1 else ''} in {tree['runs']} "
        f"run{'s' if tree['runs'] != 1 else ''}, prompt tokens {tree['prompt_tokens']:,}, "
        f"generated tokens {tree['generated_tokens']:,}"
    )
    return lines


def _node_name(labels: Mapping[str, str], node_id: str) -> str:
    """``'Label' (node_id)``, or ``'node_id'`` for a node whose label is its id (or unknown)."""
    label = labels.get(node_id, node_id)
    return repr(node_id) if label == node_id else f"{label!r} ({node_id})"


def _wait_lines(run_id: str, node: str | None, waiting: Mapping[str, object]) -> list[str]:
    reason = waiting.get("reason")
    lines = [f"  waiting at node {node} for {reason}"]
    if reason == "user":
        lines.append(f"    prompt: {waiting.get('prompt')!r}")
        if waiting.get("choices"):
            lines.append(
                f"    choices: {', '.join(str(c) for c in array_at(waiting, 'choices'))}"
                + ("" if waiting.get("allow_free_text", True) else " (nothing else)")
            )
    elif reason == "until":
        lines.append(f"    until: {waiting.get('until')}")
    elif reason == "event":
        lines.append(f"    event: {waited_event(waiting)}  (key {waiting.get('wait_key') or ''})")
    elif reason == "subworkflow":
        details = object_at(waiting, "details")
        lines.append(f"    child run: {details.get('sub_run_id')} ({details.get('sub_workflow_id')}), shown below")
    else:
        lines.append(f"    wait key: {waiting.get('wait_key')}")
    if reason in ("user", "until", "event"):
        lines += ["    continue:", f"      abstractruntime-mlx {resume_hint(run_id, waiting)}"]
    return lines


def _event_lines(progress: Sequence[ProgressRow], run_start: dt.datetime) -> list[str]:
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
