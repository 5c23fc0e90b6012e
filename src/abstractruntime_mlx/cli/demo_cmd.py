"""``abstractruntime-mlx demo``: the fan-out flow three times at once, then once alone, told node by node.

    abstractruntime-mlx demo [FLOW] [--runs N] [--ledger URL] [--verbose]

1. ``--runs`` (3) runs of the flow at once: every LLM call of every run lands in one engine
   batch. Per node of the first run: its own LLM call's time (queue to last token, from the
   ledger's phase events, so a sibling the parallel node prefetched shows its call, not the
   few milliseconds its step took to pick the result up), tokens, batch size and what became
   of its speculation, with the reason said in words when MTP was asked for and not used.
2. The same flow once with sibling batching off: each call runs alone, so the MTP nodes
   speculate; their accepted/drafted tokens are shown.
3. ``runs list`` of the ledger.

About 30 lines. ``--verbose`` adds what ``run`` prints for every run (the live phase lines and
each node's metadata) and ``runs show`` of the first run. See ``docs/cli-run.md``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final

from .args import integer
from .terminal import printable

if TYPE_CHECKING:
    from ..ledger import Ledger
    from .run_cmd import RunSettings

__all__ = ["DEFAULT_FLOW", "add_parser", "speculation_outcome", "speculation_why"]

DEFAULT_FLOW: Final = "examples/fanout.json"
_WIDTH: Final = 100  # explanations wrap here, so the line count is what a terminal shows

_WHY: Final = {
    "deferred_under_load": (
        "optional MTP is deferred while target-only work shares the batch (here the plain branch and the "
        "other runs' calls): a verify round costs more than a plain decode step, so under load it would cost "
        "throughput; alone, or with only MTP requests of its depth, it speculates (step 2). "
        "'require_acceleration: true' makes it strict (docs/provider.md, load-aware optional MTP)"
    ),
}


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the fan-out example flow 3 times at once, then once alone, and say node by node what happened",
        description="Run FLOW (default examples/fanout.json) N times at once on one resident model, then once with "
        "each call alone, and print per node its LLM call's time, tokens, batch and speculation outcome (the reason "
        "in words when MTP was not used), then `runs list`. --verbose adds `run`'s full output and `runs show`.",
    )
    parser.add_argument("flow", nargs="?", default=DEFAULT_FLOW, help=f"the flow (default {DEFAULT_FLOW})")
    parser.add_argument("--runs", type=integer, default=3, help="concurrent runs in step 1 (default 3)")
    parser.add_argument("--ledger", default=None, help="ledger URL or SQLite path (default as for `run`)")
    parser.add_argument("--model", default=None, help="as for `run` (default: the embedded tiny MTP model)")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also print `run`'s full output for every run and `runs show` of the first",
    )
    parser.set_defaults(handler=_demo)


def _run_settings(args: argparse.Namespace, *, runs: int, sibling_batching: bool) -> RunSettings:
    """The settings ``run FLOW --runs N [--no-sibling-batching]`` would use (its own parser)."""
    from .run_cmd import add_parser as add_run_parser
    from .run_cmd import settings_from_args

    parser = argparse.ArgumentParser(prog="abstractruntime-mlx")
    add_run_parser(parser.add_subparsers())
    argv = ["run", args.flow, "--runs", str(runs)]
    argv += ["--ledger", args.ledger] if args.ledger else []
    argv += ["--model", args.model] if args.model else []
    argv += [] if sibling_batching else ["--no-sibling-batching"]
    return settings_from_args(parser.parse_args(argv))


def _demo(args: argparse.Namespace) -> int:
    from ..ledger import Ledger
    from .run_cmd import _run_flow, check_before_run, run_and_print
    from .runs_cmd import exit_code

    if args.runs < 1:
        raise SystemExit("--runs must be >= 1")
    batched = _run_settings(args, runs=args.runs, sibling_batching=True)
    alone = _run_settings(args, runs=1, sibling_batching=False)
    if not check_before_run(batched):
        return 1
    model = "the embedded tiny MTP model" if args.model is None else args.model
    url = batched.ledger_url
    print(printable(f"demo: {args.flow}, {args.runs} runs at once on {model}; ledger {url}"))
    if args.verbose:
        code = run_and_print(batched)
        first = _latest_roots(url, args.runs)
    else:
        results = _run_flow(batched)
        code = exit_code(results)
        first = [r.run_id for r in results]
    with Ledger(url) as ledger:
        print()
        print(f"1. {args.runs} runs at once: their LLM calls batch on one resident model")
        for line in _runs_lines(ledger, first):
            print(printable(line))
        print()
        print(printable(f"   run {first[0][:8]}, node by node (call: its own LLM call, queue to last token):"))
        for line in node_lines(ledger, first[0]):
            print(printable("   " + line))
    single = _run_flow(alone)
    code = max(code, exit_code(single))
    with Ledger(url) as ledger:
        print()
        print("2. the same flow once, sibling batching off: each call runs alone")
        for line in node_lines(ledger, single[0].run_id, explain=False):
            print(printable("   " + line))
    print()
    print("3. abstractruntime-mlx runs list")
    _cli(["runs", "list", "--ledger", url, "--limit", str(args.runs + 1)])
    if args.verbose:
        print()
        print(printable(f"abstractruntime-mlx runs show {first[0]}"))
        _cli(["runs", "show", first[0], "--ledger", url])
    else:
        print(
            printable(
                f"inspect a run: abstractruntime-mlx runs show {first[0][:8]} --ledger {url}  (--verbose prints it)"
            )
        )
    return code


def _latest_roots(url: str, count: int) -> list[str]:
    from ..ledger import Ledger

    with Ledger(url) as ledger:
        roots = [r for r in ledger.list_runs(limit=10 * count + 10) if r.parent_run_id is None]
    return [r.run_id for r in sorted(roots[:count], key=lambda r: r.created_at)]


def _runs_lines(ledger: Ledger, run_ids: Sequence[str]) -> list[str]:
    lines = []
    for run_id in run_ids:
        detail = ledger.get_run(run_id)
        if detail is not None:
            lines.append(f"   run {run_id[:8]}  {detail.status}  {detail.duration_s:.2f}s")
    return lines


def node_lines(ledger: Ledger, run_id: str, *, explain: bool = True) -> list[str]:
    """One row per LLM call of ``run_id`` (its own time from the phase events, tokens, batch,
    speculation outcome), then, with ``explain``, why each unused MTP request was not used."""
    from ..inspection import run_view

    view = run_view(ledger, run_id, tree=False)
    calls = list(view.calls) if view is not None else []
    rows = [("node", "call", "queue", "ttft", "tokens", "batch", "speculation")]
    reasons: dict[str, list[str]] = {}
    for call in calls:
        spec = call.speculation
        queue = call.execution.get("queue_s")
        rows.append(
            (
                call.name or call.label,
                _ms(_span(call.start_s, call.end_s)),
                _ms(queue),
                _ms(call.ttft_s),
                f"{call.prompt_tokens}+{call.generated_tokens}",
                str(call.execution.get("peak_batch_size") or ""),
                speculation_outcome(spec),
            )
        )
        if spec.get("requested") and not spec.get("used"):
            reasons.setdefault(str(spec.get("reason") or "unknown"), []).append(call.name or call.label)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if explain:
        import textwrap

        for reason, names in reasons.items():
            text = f"{', '.join(names)}: MTP asked for, not used ({reason}): {speculation_why(reason)}"
            lines.extend(textwrap.wrap(text, width=_WIDTH, subsequent_indent="  "))
    return lines


def speculation_outcome(spec: Mapping[str, object]) -> str:
    """``off``; ``native_mtp(2) used, 14/35 drafted tokens accepted``; ``native_mtp(2) not used: REASON``."""
    if not spec.get("requested"):
        return "off"
    depth = spec.get("num_draft_tokens")
    asked = f"{spec.get('mode')}({depth})" if depth is not None else str(spec.get("mode"))
    if spec.get("used"):
        accepted, drafted = spec.get("accepted_tokens"), spec.get("drafted_tokens")
        if isinstance(accepted, (int, float)) and isinstance(drafted, int):
            return f"{asked} used, {accepted:g}/{drafted} drafted tokens accepted"
        return f"{asked} used"
    return f"{asked} not used: {spec.get('reason')}"


def speculation_why(reason: str) -> str:
    """A reason code of ``metadata["speculation"]`` in words."""
    return _WHY.get(reason, "see docs/provider.md")


def _span(start: object, end: object) -> float | None:
    if isinstance(start, (int, float)) and isinstance(end, (int, float)):
        return max(0.0, float(end) - float(start))
    return None


def _ms(seconds: object) -> str:
    return f"{float(seconds) * 1000:.0f}ms" if isinstance(seconds, (int, float)) else "-"


def _cli(argv: Sequence[str]) -> int:
    from .main import main

    return main(list(argv))
