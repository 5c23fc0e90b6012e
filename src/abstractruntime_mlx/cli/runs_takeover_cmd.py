"""``abstractruntime-mlx runs resume --all-running``: take over the runs whose driver is gone.

    abstractruntime-mlx runs resume --all-running --ledger postgresql+psycopg://.../runs
    abstractruntime-mlx runs resume --all-running RUN_ID      # that run's tree only

Every run tree with a run still ``running`` is resumed here, one after the other, reusing the
nodes the ledger has results for (``runtime_plugin.hosting.takeover``). A tree another live process
still drives is left alone and listed as ``held``; that is not an error (a periodic takeover
job sees the healthy coordinators' runs every time). Exit status: 0 when every resumed run
completed (or there was nothing to take over), 1 when a resumed run failed or resuming one
raised, 3 when resumed runs only wait for outside input (as ``run``). ``--answer``/``--event``
do not apply: a run that waits for one is not interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Final

from ..errors import InvalidRequest
from .args import drive_limits
from .ledger_location import default_ledger_url, existing_ledger_file
from .terminal import printable

if TYPE_CHECKING:
    from ..runtime_plugin.hosting import Takeover

# ``run``'s exit statuses (runs_cmd.exit_code), which this module does not import: runs_cmd calls it.
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_WAITING: Final = 3


def resume_all_running(args: argparse.Namespace) -> int:
    """The ``runs resume --all-running [RUN_ID]`` handler (``runs_cmd`` parses the arguments)."""
    from ..runtime_plugin.hosting import resume_interrupted

    if not args.all_running:
        raise InvalidRequest("runs resume needs a RUN_ID, or --all-running to take over every interrupted run")
    if args.answer is not None or args.event is not None:
        raise InvalidRequest(
            "--all-running resumes interrupted runs; --answer and --event are for one waiting run (runs resume RUN_ID)"
        )
    url = default_ledger_url(args.ledger)
    existing_ledger_file(url)
    outcomes = resume_interrupted(
        url,
        run_ids=None if args.run_id is None else [args.run_id],
        model=args.model,
        limits=drive_limits(args, max_timer_wait_s=max(0.0, args.max_timer_wait)),
    )
    if args.json:
        print(json.dumps([_outcome_dict(o) for o in outcomes], indent=2, default=str))
    else:
        if not outcomes:
            print(printable(f"no interrupted run to take over in {url}"))
        for o in outcomes:
            print(printable(_outcome_line(o)))
    for o in outcomes:
        if o.error is not None and str(o.status) == "failed":
            print(printable(f"error: [{o.error.code}] run {o.run_id}: {o.error.message}"), file=sys.stderr)
    return _exit_status(outcomes)


def _outcome_dict(o: Takeover) -> dict[str, object]:
    r = o.result
    return {
        "run_id": o.run_id,
        "takeover": str(o.status),
        "status": None if r is None else r.status,
        "wall_s": None if r is None else r.wall_s,
        "output": None if r is None else r.output,
        "failures": []
        if r is None
        else [{"run_id": f.run_id, "node_id": f.node_id, "error": f.error} for f in r.failures],
        "error": None if o.error is None else {"code": o.error.code, "message": o.error.message},
    }


def _outcome_line(o: Takeover) -> str:
    r = o.result
    if r is None:
        return f"run {o.run_id}  {o.status}: {o.error.message if o.error is not None else ''}"
    line = f"run {r.run_id}  {r.workflow_id}  resumed: {r.status}  ({r.wall_s:.2f}s, {len(r.nodes)} LLM nodes)"
    if r.error:
        line += f"\n  error: {r.error}"
    return line


def _exit_status(outcomes: list[Takeover]) -> int:
    results = [o.result for o in outcomes if o.result is not None]
    if any(str(o.status) == "failed" for o in outcomes) or any(
        r.status not in ("completed", "waiting") or r.failures for r in results
    ):
        return EXIT_FAILED
    if any(r.status == "waiting" for r in results):
        return EXIT_WAITING
    return EXIT_OK
