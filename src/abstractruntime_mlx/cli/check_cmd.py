"""``abstractruntime-mlx check``: every problem of a flow in one report, before anything runs.

    abstractruntime-mlx check FLOW.json [FLOW.json ...] [--var KEY=VALUE ...] [--model M] [--json] [--probe]

Exit status 0 when every flow can run (warnings are printed and do not block), 1 when one has
errors. ``run`` performs the same check first and refuses to start a flow with errors. Nothing
is loaded, run, written or contacted: models are looked up on disk only; with ``--probe`` each
allowed remote ``base_url`` gets one ``GET /health``. See ``docs/check.md``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from .run_cmd import parse_vars
from .terminal import printable

__all__ = ["CheckSettings", "add_parser", "check_and_print"]


@dataclass(frozen=True)
class CheckSettings:
    flows: tuple[str, ...]
    vars: dict[str, object]
    model: str | None
    force_model: bool
    probe_remote: bool = False
    as_json: bool = False
    flows_dir: str | None = None
    allow_network_tools: bool = False
    routes: tuple[str, ...] = ()
    allow_remote: bool = False


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "check",
        help="check a VisualFlow JSON flow without running it (every problem, node by node)",
        description="Report every problem of a flow before it runs: wires to missing nodes, unreachable "
        "nodes, unknown node types, unknown effectConfig/_runtime keys, invalid controls, models not on "
        "this machine, runs that would never end, servers you did not allow (and, with --probe, servers that "
        "do not answer). Exit 1 when there is an error.",
    )
    parser.add_argument(
        "flows",
        nargs="+",
        metavar="FLOW",
        help="path to a VisualFlow JSON file (several: one report each, then a summary)",
    )
    parser.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run variable, as for `run` (_runtime.speculation=false)",
    )
    parser.add_argument(
        "--model", default=None, help="the model `run --model` would serve every LLM node with (checked on disk only)"
    )
    parser.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="SPEC",
        help="a routing rule, as for `run` (PROVIDER[/MODEL]=mlx:MODEL|URL)",
    )
    parser.add_argument(
        "--flows-dir",
        default=None,
        metavar="DIR",
        help="where subflows are found, as for `run` (default: each flow file's directory)",
    )
    parser.add_argument(
        "--allow-network-tools",
        action="store_true",
        help="as for `run`: tools that reach outside this machine are allowed",
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="as for `run`: the servers the flow names itself (base_url) are allowed",
    )
    probe = parser.add_mutually_exclusive_group()
    probe.add_argument(
        "--probe",
        action="store_true",
        help="send one GET /health to each allowed remote base_url, and ask an abstractruntime-mlx "
        "server there whether it serves each node's model (nothing is contacted without it)",
    )
    probe.add_argument("--no-probe", action="store_true", help="contact no server (the default; kept for scripts)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=_check)


def _check(args: argparse.Namespace) -> int:
    settings = CheckSettings(
        flows=tuple(args.flows),
        vars=parse_vars(args.var),
        model=args.model,
        force_model=args.model is not None,
        probe_remote=args.probe,
        as_json=args.json,
        flows_dir=args.flows_dir,
        allow_network_tools=args.allow_network_tools,
        routes=tuple(args.route),
        allow_remote=args.allow_remote,
    )
    return check_and_print(settings)


def check_and_print(settings: CheckSettings) -> int:
    from ..runtime_plugin.check import check_flow
    from .run_cmd import remote_policy

    remote = remote_policy(settings.allow_remote, settings.vars, source="--allow-remote")
    model = settings.model
    if model is None:
        from .run_cmd import default_model_path

        model = default_model_path()  # what `run` gives nodes that name no model
    reports = [
        check_flow(
            flow,
            vars=settings.vars,
            model=model,
            force_model=settings.force_model,
            probe_remote=settings.probe_remote,
            flows_dir=settings.flows_dir,
            allow_network_tools=settings.allow_network_tools,
            routes=settings.routes,
            remote=remote,
        )
        for flow in settings.flows
    ]
    runnable = sum(r.ok for r in reports)
    if settings.as_json:
        body: object = reports[0].to_dict() if len(reports) == 1 else [r.to_dict() for r in reports]
        print(json.dumps(body, indent=2))
    else:
        print(printable("\n".join(r.render() for r in reports)))
        if len(reports) > 1:
            print(f"{runnable} of {len(reports)} flows can run")
    return 0 if runnable == len(reports) else 1
