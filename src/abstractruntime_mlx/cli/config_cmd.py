"""``abstractruntime-mlx config``: show and change the Core MTP policy (AbstractCore's config file).

abstractruntime-mlx config show
abstractruntime-mlx config set-default output.text --speculation 2|off|inherit
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from .args import help_handler


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "config",
        help="show or change the Core MTP policy",
        description="Read or change the MTP default stored in AbstractCore's config file "
        "($ABSTRACTCORE_CONFIG_FILE, else $ABSTRACTCORE_CONFIG_DIR/abstractcore.json, "
        "else ~/.abstractcore/config/abstractcore.json).",
    )
    parser.set_defaults(handler=help_handler(parser))
    actions = parser.add_subparsers(dest="config_command", metavar="ACTION")

    show = actions.add_parser("show", help="print the config path, the MTP policy and the capability defaults (JSON)")
    show.add_argument("--json", action="store_true", help="accepted for symmetry: the output is JSON already")
    show.set_defaults(handler=_show)

    set_default = actions.add_parser(
        "set-default",
        help="set the MTP default of the text route",
        description="Change only the MTP policy of the text route; other options and keys are preserved. "
        "'inherit' removes the policy (it does not restore the fresh-install seed).",
    )
    set_default.add_argument("route", help="output.text (alias input.text)")
    set_default.add_argument(
        "--speculation",
        required=True,
        metavar="N|off|inherit",
        help="a draft depth N >= 1 (native MTP, optional acceleration), off, or inherit",
    )
    set_default.set_defaults(handler=_set_default)


def _path() -> Path:
    from .. import policy

    return policy.config_path(os.environ)


def _show(_args: argparse.Namespace) -> int:
    from .. import policy

    snapshot = policy.read_policy(_path())
    print(json.dumps(snapshot.to_dict(), indent=2, sort_keys=True))
    return 0


def _set_default(args: argparse.Namespace) -> int:
    from .. import policy

    path = _path()
    route = policy.canonical_route(args.route)
    setting = policy.parse_speculation_setting(args.speculation)
    now = policy.set_default_speculation(route, setting, path)
    value = None if now is None else now.to_wire()
    print(f"set {args.route} speculation={args.speculation} in {path}")
    print(json.dumps({"path": str(path), "route": route, "speculation": value}, sort_keys=True))
    return 0
