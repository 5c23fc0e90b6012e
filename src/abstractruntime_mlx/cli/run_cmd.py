"""``abstractruntime-mlx run``: run a VisualFlow JSON flow N times concurrently on MLX.

    abstractruntime-mlx run examples/fanout.json --runs 3
    abstractruntime-mlx run FLOW.json --model mlx-community/Qwen3.5-4B-4bit \\
        --var topic=caches --var _runtime.speculation=false --ledger sqlite:///runs.sqlite

Prints each LLM node's answer with its execution, speculation and thinking metadata (and
where each control came from). Every run, step and phase event is recorded in the ledger:
``--ledger URL_OR_PATH``, else ``$ABSTRACTRUNTIME_MLX_LEDGER``, else
``~/.abstractruntime-mlx/ledger.sqlite``. Without ``--model``, nodes that name no model use
the embedded tiny hybrid model with an MTP head (so per-node speculation really runs),
built offline on first use in ``$XDG_CACHE_HOME/abstractruntime-mlx/tiny-hybrid-mtp``
(``~/.cache/...``); ``--model`` replaces the model of every node. ``--speculation`` sets the
local provider's default (the forms ``serve --speculation`` takes); a node asking for MTP
gets it whatever that default is, the head attaching on first use.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

from ..errors import InvalidRequest, MLXRuntimeError, RemoteNotAllowed
from ..json_values import as_str
from .args import add_limit_arguments, drive_limits, integer
from .ledger_location import DEFAULT_LEDGER_PATH, LEDGER_ENV, default_ledger_url
from .runs_cmd import EXIT_FAILED, EXIT_OK, EXIT_WAITING, exit_code, print_results  # noqa: F401 - the exit codes of `run`
from .runs_export_cmd import add_otlp_arguments, otlp_content, otlp_target
from .terminal import printable

if TYPE_CHECKING:
    from ..runtime_plugin import FlowRunResult, PackSettings
    from ..runtime_plugin.adapter import RemotePolicy
    from ..runtime_plugin.check import CheckReport
    from ..runtime_plugin.hosting import DriveLimits
    from ..traces import OtlpTarget

TINY_MODEL_DIR: Final = "abstractruntime-mlx/tiny-hybrid-mtp"


@dataclass(frozen=True)
class RunSettings:
    flow: dict[str, object]
    runs: int
    ledger_url: str
    model: str
    force_model: bool
    vars: dict[str, object]
    remote: RemotePolicy
    limits: DriveLimits
    provider_options: dict[str, object] = field(default_factory=dict)
    sibling_batching: bool = True
    as_json: bool = False
    routes: tuple[str, ...] = ()
    flows_dir: str | None = None
    source: str | None = None
    artifacts_dir: str | None = None
    allow_network_tools: bool = False
    session_id: str | None = None
    otlp: OtlpTarget | None = None
    otlp_content: bool = False
    """The spans carry the calls' prompts and answers (``--otlp-content``)."""

    def pack_settings(self) -> PackSettings:
        """How this run's pack serves its LLM nodes."""
        from ..runtime_plugin import PackSettings

        return PackSettings(
            model=self.model,
            force_model=self.force_model,
            provider_options=self.provider_options,
            sibling_batching=self.sibling_batching,
            routes=self.routes,
            allow_remote=self.remote.to_options(),
        )


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a VisualFlow JSON flow (N concurrent runs) and print each LLM node's result",
        description="Run a VisualFlow flow N times concurrently on one resident model; record runs, "
        "steps and every phase event in the ledger.",
    )
    parser.add_argument("flow", help="path to a VisualFlow JSON file (e.g. examples/fanout.json)")
    parser.add_argument(
        "--model",
        default=None,
        help="model for every LLM node (default: the embedded tiny model for nodes naming none)",
    )
    parser.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run variable; VALUE is JSON if it parses, else a string; dotted keys nest (_runtime.speculation=false)",
    )
    parser.add_argument("--runs", type=integer, default=1, help="number of concurrent runs (default 1)")
    parser.add_argument(
        "--ledger", default=None, help=f"ledger URL or SQLite path (default ${LEDGER_ENV} or {DEFAULT_LEDGER_PATH})"
    )
    parser.add_argument(
        "--max-batch-size", type=integer, default=None, help="engine batch slots (mlx_max_batch_size; default 4)"
    )
    parser.add_argument(
        "--speculation",
        default=None,
        help="the local provider's default speculation, as serve takes it: 'off', 'native_mtp', a draft depth N, "
        "'inherit' or a JSON object (default: inherit the policy); nodes and _runtime.speculation still override it",
    )
    parser.add_argument(
        "--session",
        default=None,
        metavar="ID",
        help="the runs' session id (default: a fresh one per run); LLM nodes derive their prompt-cache keys from it, "
        "so a later run with the same --session continues these conversations warm",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="keep prompt-cache snapshots on disk here too "
        "(mlx_cache_disk_path), so a later run finds them after a restart",
    )
    parser.add_argument(
        "--no-sibling-batching",
        action="store_true",
        help="run parallel branches strictly one after another (no prefetch)",
    )
    parser.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="PROVIDER[/MODEL]=mlx:MODEL|URL",
        help="serve the LLM nodes naming PROVIDER (and MODEL) on a local model or a server; repeatable; "
        "exact PROVIDER/MODEL routes win over PROVIDER routes, both over --model",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help='JSON run settings: {"model": ..., "routes": {...}, "flows_dir": ..., '
        '"allow_network_tools": false, "allow_remote": false | true | ["HOST[:PORT]", ...]}',
    )
    parser.add_argument(
        "--flows-dir",
        default=None,
        help="where subflows are looked up as <id>.json (default: the flow file's directory)",
    )
    parser.add_argument(
        "--artifacts",
        default=None,
        metavar="DIR",
        help="artifact store directory (default: <ledger file>.artifacts beside a SQLite ledger)",
    )
    parser.add_argument(
        "--allow-network-tools",
        action="store_true",
        help="let agents and tool nodes use tools that reach outside this machine (web_search, fetch_url...)",
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="let the flow send LLM nodes to the servers it names itself (a base_url in the flow file); "
        "--route URLs and --var _runtime.base_url are allowed without it",
    )
    parser.add_argument(
        "--max-timer-wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long run sleeps for wait_until timers before leaving the run waiting (default 60)",
    )
    add_limit_arguments(parser)
    add_otlp_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(handler=_run)


def default_model_path(env: Mapping[str, str] = os.environ) -> str:
    """The embedded tiny hybrid model with an aligned MTP head (built offline on first use, ~1 s)."""
    from ..testing import tiny_model

    cache = Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return str(tiny_model(cache / TINY_MODEL_DIR, kind="hybrid-mtp", seed=0, mtp_alpha=0.05))


def served_model(run_vars: Mapping[str, object]) -> str | None:
    """The model served at ``_runtime.base_url`` (or ``server_base_url``), asked over HTTP; ``None`` without one.

    Nodes that name no model then ask the server for what it serves rather than for the
    embedded tiny model.
    """
    from ..errors import ModelNotFound
    from ..remote_client import RemoteClient

    urls = runtime_urls(run_vars)
    if not urls:
        return None
    with RemoteClient(urls[0], max_retries=0) as client:
        models = client.list_models()
    if not models:
        raise ModelNotFound(
            f"the server at {urls[0]} has no model loaded; load one (POST /acore/models/load) or pass --model"
        )
    return str(models[0]["id"])


def runtime_urls(run_vars: Mapping[str, object]) -> list[str]:
    """The servers the run vars name (``_runtime.base_url``, ``server_base_url``)."""
    runtime = run_vars.get("_runtime")
    if not isinstance(runtime, Mapping):
        return []
    return [
        v.strip() for v in (runtime.get("base_url"), runtime.get("server_base_url")) if isinstance(v, str) and v.strip()
    ]


def remote_policy(allow: object, run_vars: Mapping[str, object], *, source: str) -> RemotePolicy:
    """The servers this run may send nodes to: ``allow`` (``--allow-remote``, or the config
    file's ``allow_remote``: true, false or a list of ``HOST[:PORT]``) and the URLs the user gave
    in the run vars. A link-local or metadata address there is refused before anything runs."""
    from ..runtime_plugin.adapter import RemotePolicy

    if not isinstance(allow, bool) and not (isinstance(allow, list) and all(isinstance(h, str) for h in allow)):
        raise InvalidRequest(f"{source}: 'allow_remote' must be true, false or a list of \"HOST[:PORT]\" strings")
    urls = runtime_urls(run_vars)
    for url in urls:
        RemotePolicy(allow_all=True).check(url, where="--var _runtime.base_url")
    return RemotePolicy.build(allow, urls=urls)


def parse_vars(items: Sequence[str]) -> dict[str, object]:
    """``["a=1", "_runtime.thinking=low"]`` -> ``{"a": 1, "_runtime": {"thinking": "low"}}``."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--var expects KEY=VALUE, got {item!r}")
        try:
            value: object = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        target = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            nested = target.setdefault(part, {})
            if not isinstance(nested, dict):
                raise SystemExit(f"--var {item!r}: {part!r} is already a value, not an object")
            target = nested
        target[parts[-1]] = value
    return out


def settings_from_args(args: argparse.Namespace) -> RunSettings:
    from ..controls import parse_speculation_option
    from ..runtime_plugin import load_flow
    from ..runtime_plugin.adapter import parse_route, routes_from_config

    if args.runs < 1:
        raise SystemExit("--runs must be >= 1")
    try:
        flow = load_flow(args.flow)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    run_vars = parse_vars(args.var)
    options: dict[str, object] = {}
    if args.max_batch_size is not None:
        options["mlx_max_batch_size"] = args.max_batch_size
    if args.speculation is not None:
        try:
            control = parse_speculation_option(args.speculation, field="--speculation")
        except MLXRuntimeError as exc:
            raise SystemExit(f"error: {exc.message}") from exc
        if control is not None:
            options["speculation"] = control.to_wire()
    if args.cache_dir is not None:
        options["mlx_cache_disk_path"] = args.cache_dir
    if args.session is not None and not args.session.strip():
        raise SystemExit("error: --session must not be empty")
    config = read_run_config(args.config) if args.config else {}
    model = args.model or as_str(config.get("model"))
    routes = tuple(routes_from_config(config.get("routes"), source=str(args.config))) + tuple(args.route)
    for spec in routes:
        try:
            parse_route(spec)
        except RemoteNotAllowed:
            raise  # printed with its own code: refused whatever the flags
        except MLXRuntimeError as exc:
            raise SystemExit(f"error: --route {exc.message}") from exc
    if args.max_timer_wait < 0:
        raise SystemExit("error: --max-timer-wait must be >= 0")
    limits = drive_limits(args, max_timer_wait_s=args.max_timer_wait)
    remote = remote_policy(
        True if args.allow_remote else config.get("allow_remote", False),
        run_vars,
        source=str(args.config or "--allow-remote"),
    )
    return RunSettings(
        flow=flow,
        source=args.flow,
        runs=args.runs,
        ledger_url=default_ledger_url(args.ledger),
        model=model or served_model(run_vars) or default_model_path(),
        force_model=model is not None,
        vars=run_vars,
        provider_options=options,
        sibling_batching=not args.no_sibling_batching,
        as_json=args.json,
        routes=routes,
        flows_dir=args.flows_dir
        or as_str(config.get("flows_dir"))
        or str(Path(args.flow).expanduser().resolve().parent),
        artifacts_dir=args.artifacts or as_str(config.get("artifacts_dir")),
        allow_network_tools=bool(args.allow_network_tools or config.get("allow_network_tools", False)),
        remote=remote,
        limits=limits,
        session_id=args.session.strip() if args.session else None,
        otlp=otlp_target(args),
        otlp_content=otlp_content(args.otlp_content),
    )


RUN_CONFIG_KEYS: Final = frozenset(
    {"model", "routes", "flows_dir", "artifacts_dir", "allow_network_tools", "allow_remote"}
)


def read_run_config(path: str) -> dict[str, object]:
    """The JSON object of ``--config FILE`` (keys: ``RUN_CONFIG_KEYS``); a flag given on the
    command line wins over the file."""
    from ..runtime_plugin.adapter import routes_from_config

    file = Path(path).expanduser()
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SystemExit(f"error: no config file at {file}") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"error: {file} is not a readable JSON file: {exc}") from exc
    if not isinstance(data, dict):
        raise SystemExit(f"error: {file} must hold a JSON object")
    unknown = sorted(set(data) - RUN_CONFIG_KEYS)
    if unknown:
        raise SystemExit(f"error: {file}: unknown keys {unknown} (known: {sorted(RUN_CONFIG_KEYS)})")
    try:
        routes_from_config(data.get("routes"), source=str(file))
    except MLXRuntimeError as exc:
        raise SystemExit(f"error: {exc.message}") from exc
    return data


def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if not check_before_run(settings):
        return 1
    return run_and_print(settings)


def check_before_run(settings: RunSettings) -> bool:
    """``check`` the flow as this run would use it; print its findings on stderr. False: do not run.

    A run routed to servers (``--route``) asks them first (``check --probe``): it would contact
    them anyway, and a node whose model the server cannot serve is refused before anything runs."""
    from ..runtime_plugin.check import check_flow
    from ..runtime_plugin.hosting import flow_hash

    report = check_flow(
        settings.flow,
        vars=settings.vars,
        model=settings.model,
        force_model=settings.force_model,
        routes=settings.routes,
        flows_dir=settings.flows_dir,
        allow_network_tools=settings.allow_network_tools,
        remote=settings.remote,
        probe_remote=bool(settings.routes),
    )
    if not report.ok:
        print(printable(report.render()), file=sys.stderr)
    elif report.warnings:
        text = warnings_text(
            report, name=settings.source or "flow", flow_key=flow_hash(settings.flow), seen_file=warned_flows_file()
        )
        print(printable(text), file=sys.stderr)
    return report.ok


WARNED_FLOWS: Final = "abstractruntime-mlx/warned-flows"
"""Under ``$XDG_CACHE_HOME``: hashes of the flows whose warnings ``run`` has shown (one a line)."""
MAX_WARNED_FLOWS: Final = 1000
MAX_WARNING_CHARS: Final = 160


def warned_flows_file(env: Mapping[str, str] = os.environ) -> Path:
    return Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / WARNED_FLOWS


def warnings_text(report: CheckReport, *, name: str, flow_key: str, seen_file: Path) -> str:
    """What ``run`` prints about a runnable flow's warnings: the first time for this flow (by
    hash), one line each (clipped at ``MAX_WARNING_CHARS``); afterwards only their count. The
    full report is always ``abstractruntime-mlx check FLOW``."""
    count = len(report.warnings)
    again = f"`abstractruntime-mlx check {name}` lists {'it' if count == 1 else 'them'} in full"
    try:
        seen = seen_file.read_text(encoding="utf-8").split()
    except OSError:
        seen = []
    if flow_key in seen:
        return f"{name}: {count} warning{'s' if count != 1 else ''}, shown at its first run ({again})"
    lines = []
    for problem in report.warnings:
        line = " ".join(problem.render().split())
        lines.append(line if len(line) <= MAX_WARNING_CHARS else line[: MAX_WARNING_CHARS - 1] + "…")
    lines.append(f"{name}: runs with {count} warning{'s' if count != 1 else ''} (shown once per flow; {again})")
    try:
        seen_file.parent.mkdir(parents=True, exist_ok=True)
        seen_file.write_text("\n".join([*seen[-(MAX_WARNED_FLOWS - 1) :], flow_key]) + "\n", encoding="utf-8")
    except OSError:
        pass  # not remembered: shown again next time, which is all that is lost
    return "\n".join(lines)


def run_and_print(settings: RunSettings) -> int:
    from ..runtime_plugin import FlowBundle, network_tool_uses
    from .live import LiveRuns, pick_mode

    try:
        bundle = FlowBundle.resolve(settings.flow, flows_dir=settings.flows_dir)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    if not settings.allow_network_tools:
        uses = network_tool_uses(bundle)
        if uses:
            flow_id, node_id, tool = uses[0]
            more = f" (and {len(uses) - 1} more)" if len(uses) > 1 else ""
            raise SystemExit(
                f"error: node {node_id!r} of flow {flow_id!r} uses {tool!r}, a tool that reaches "
                f"outside this machine{more}; pass --allow-network-tools to allow it"
            )
    started = time.perf_counter()
    since = dt.datetime.now(dt.UTC)
    live = LiveRuns(settings.ledger_url, since=since, mode=pick_mode(settings.as_json, sys.stdout), out=sys.stdout)
    try:
        with live, _live_export(settings, since):
            results = _run_flow(settings)
    except KeyboardInterrupt:
        return interrupted(settings.ledger_url, since)
    wall_s = time.perf_counter() - started
    print_results(results, as_json=settings.as_json, ledger_url=settings.ledger_url, wall_s=wall_s)
    return exit_code(results)


def _live_export(settings: RunSettings, since: dt.datetime) -> contextlib.AbstractContextManager[object]:
    """``--otlp``: the runs' spans sent as their calls and runs end (``traces.LiveExport``)."""
    if settings.otlp is None:
        return contextlib.nullcontext()
    from ..traces import LiveExport
    from .main import installed_version

    return LiveExport(
        settings.ledger_url,
        settings.otlp,
        since=since,
        service_version=installed_version(),
        content=settings.otlp_content,
    )


EXIT_INTERRUPTED: Final = 130
"""128 + SIGINT, what a shell reports for a command stopped by Ctrl-C."""


def interrupted(ledger_url: str, since: dt.datetime) -> int:
    """After Ctrl-C: mark the runs this command started that were still running as
    ``interrupted`` and say, one line per root run, how to continue it."""
    from ..ledger import Ledger

    with Ledger(ledger_url) as ledger:
        started = ledger.list_runs(limit=100_000, created_after=since)
        marked = set(ledger.mark_interrupted([r.run_id for r in started]))
        for run in started:
            if run.parent_run_id is None and (run.run_id in marked or run.status == "running"):
                print(
                    printable(
                        f"interrupted: run {run.run_id} ({run.workflow_id}); "
                        f"continue: abstractruntime-mlx runs resume {run.run_id}"
                    ),
                    file=sys.stderr,
                )
    return EXIT_INTERRUPTED


def _run_flow(settings: RunSettings) -> list[FlowRunResult]:
    from ..runtime_plugin import run_flow

    return run_flow(
        settings.flow,
        vars=settings.vars,
        runs=settings.runs,
        ledger_url=settings.ledger_url,
        flows_dir=settings.flows_dir,
        source=settings.source,
        artifacts_dir=settings.artifacts_dir,
        allow_network_tools=settings.allow_network_tools,
        limits=settings.limits,
        session_id=settings.session_id,
        settings=settings.pack_settings(),
    )
