"""``abstractruntime-mlx ledger``: the ledger database's schema revision.

    abstractruntime-mlx ledger status [URL_OR_PATH]     # revision, newest revision, pending migrations
    abstractruntime-mlx ledger upgrade [URL_OR_PATH]    # apply the pending migrations (one transaction)

The ledger is the argument, else ``$ABSTRACTRUNTIME_MLX_LEDGER``, else
``~/.abstractruntime-mlx/ledger.sqlite``. Other commands refuse a ledger at an older revision
and name ``ledger upgrade``. See ``docs/ledger.md``.
"""

from __future__ import annotations

import argparse
import json

from .args import help_handler
from .ledger_location import default_ledger_url, existing_ledger_file


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("ledger", help="the ledger database's schema revision: status, upgrade")
    parser.set_defaults(handler=help_handler(parser))
    actions = parser.add_subparsers(dest="ledger_command", metavar="ACTION")
    status = actions.add_parser("status", help="the ledger's schema revision and the migrations it lacks")
    status.add_argument("url", nargs="?", default=None, help="ledger URL or SQLite path")
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=_status)
    upgrade = actions.add_parser("upgrade", help="migrate the ledger to this release's schema revision")
    upgrade.add_argument("url", nargs="?", default=None, help="ledger URL or SQLite path")
    upgrade.set_defaults(handler=_upgrade)


def _status(args: argparse.Namespace) -> int:
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from ..ledger import schema

    url = default_ledger_url(args.url)
    existing_ledger_file(url)
    engine = create_engine(url)
    shown = make_url(url).render_as_string(hide_password=True)
    try:
        with engine.connect() as conn:
            info = schema.describe(conn, shown_url=shown)
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps({"ledger": shown, **info}))
    else:
        pending = ", ".join(info["pending"]) or "none"
        print(
            f"ledger: {shown}\nrevision: {info['revision'] or 'empty'} "
            f"(this release: {info['head']})\npending: {pending}"
        )
    return 0


def _upgrade(args: argparse.Namespace) -> int:
    from ..ledger import SCHEMA_REVISION, Ledger

    url = default_ledger_url(args.url)
    existing_ledger_file(url)
    with Ledger(url, upgrade=True) as ledger:
        if ledger.upgraded_from is None:
            print(f"ledger {ledger.url} is at revision {SCHEMA_REVISION}; nothing to do")
        else:
            print(f"ledger {ledger.url}: upgraded from revision {ledger.upgraded_from} to {SCHEMA_REVISION}")
    return 0
