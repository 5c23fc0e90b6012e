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
(``~/.cache/...``); ``--model`` replaces the model of every node.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from .ledger_location import DEFAULT_LEDGER_PATH, LEDGER_ENV, default_ledger_url
TINY_MODEL_DIR: Final = "abstractruntime-mlx/tiny-hybrid-mtp"


@dataclass(frozen=True)
class RunSettings:
    flow: dict[str, Any]
    runs: int
    ledger_url: str
    model: str
    force_model: bool
    vars: dict[str, Any]
    provider_options: dict[str, Any] = field(default_factory=dict)
    sibling_batching: bool = True
    as_json: bool = False


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "run",
        help="run a VisualFlow JSON flow (N concurrent runs) and print each LLM node's result",
        description="Run a VisualFlow flow N times concurrently on one resident model; record runs, "
        "steps and every phase event in the ledger.",
    )
    parser.add_argument("flow", help="path to a VisualFlow JSON file (e.g. examples/fanout.json)")
    parser.add_argument("--model", default=None, help="model for every LLM node (default: the embedded tiny model for nodes naming none)")
    parser.add_argument("--var", action="append", default=[], metavar="KEY=VALUE", help="a run variable; VALUE is JSON if it parses, else a string; dotted keys nest (_runtime.speculation=false)")
    parser.add_argument("--runs", type=int, default=1, help="number of concurrent runs (default 1)")
    parser.add_argument("--ledger", default=None, help=f"ledger URL or SQLite path (default ${LEDGER_ENV} or {DEFAULT_LEDGER_PATH})")
    parser.add_argument("--max-batch-size", type=int, default=None, help="engine batch slots (mlx_max_batch_size; default 4)")
    parser.add_argument("--no-sibling-batching", action="store_true", help="run parallel branches strictly one after another (no prefetch)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(handler=_run)


def default_model_path(env: Mapping[str, str] = os.environ) -> str:
    """The embedded tiny hybrid model with an aligned MTP head (built offline on first use, ~1 s)."""
    from ..testing import tiny_model

    cache = Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return str(tiny_model(cache / TINY_MODEL_DIR, kind="hybrid-mtp", seed=0, mtp_alpha=0.05))


def served_model(run_vars: Mapping[str, Any]) -> str | None:
    """The model served at ``_runtime.base_url`` (or ``server_base_url``), asked over HTTP; ``None`` without one.

    Nodes that name no model then ask the server for what it serves rather than for the
    embedded tiny model.
    """
    from ..errors import ModelNotFound
    from ..remote_client import RemoteClient

    runtime = run_vars.get("_runtime")
    if not isinstance(runtime, Mapping):
        return None
    urls = [v.strip() for v in (runtime.get("base_url"), runtime.get("server_base_url")) if isinstance(v, str) and v.strip()]
    if not urls:
        return None
    with RemoteClient(urls[0], max_retries=0) as client:
        models = client.list_models()
    if not models:
        raise ModelNotFound(f"the server at {urls[0]} has no model loaded; load one (POST /acore/models/load) or pass --model")
    return str(models[0]["id"])


def parse_vars(items: Sequence[str]) -> dict[str, Any]:
    """``["a=1", "_runtime.thinking=low"]`` -> ``{"a": 1, "_runtime": {"thinking": "low"}}``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--var expects KEY=VALUE, got {item!r}")
        try:
            value: Any = json.loads(raw)
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
    from ..runtime_plugin import load_flow

    if args.runs < 1:
        raise SystemExit("--runs must be >= 1")
    try:
        flow = load_flow(args.flow)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    run_vars = parse_vars(args.var)
    options: dict[str, Any] = {}
    if args.max_batch_size is not None:
        options["mlx_max_batch_size"] = args.max_batch_size
    return RunSettings(
        flow=flow,
        runs=args.runs,
        ledger_url=default_ledger_url(args.ledger),
        model=args.model or served_model(run_vars) or default_model_path(),
        force_model=args.model is not None,
        vars=run_vars,
        provider_options=options,
        sibling_batching=not args.no_sibling_batching,
        as_json=args.json,
    )


def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if not check_before_run(settings):
        return 1
    return run_and_print(settings)


def check_before_run(settings: RunSettings) -> bool:
    """``check`` the flow as this run would use it; print its findings on stderr. False: do not run."""
    from ..runtime_plugin.check import check_flow

    report = check_flow(settings.flow, vars=settings.vars, model=settings.model, force_model=settings.force_model)
    if report.problems:
        print(report.render(), file=sys.stderr)
    return report.ok


def run_and_print(settings: RunSettings) -> int:
    from ..runtime_plugin import run_flow
    from .live import LiveRuns, pick_mode
    from .runs_cmd import print_results

    started = time.perf_counter()
    live = LiveRuns(settings.ledger_url, since=dt.datetime.now(dt.UTC), mode=pick_mode(settings.as_json, sys.stdout), out=sys.stdout)
    with live:
        results = run_flow(
            settings.flow,
            vars=settings.vars,
            runs=settings.runs,
            ledger_url=settings.ledger_url,
            model=settings.model,
            force_model=settings.force_model,
            provider_options=settings.provider_options,
            sibling_batching=settings.sibling_batching,
        )
    wall_s = time.perf_counter() - started
    print_results(results, as_json=settings.as_json, ledger_url=settings.ledger_url, wall_s=wall_s)
    return 0 if all(r.status == "completed" for r in results) else 1
