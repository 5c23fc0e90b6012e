"""Take over the runs whose coordinator is gone (``runs resume --all-running``).

A coordinator holds each run's lock while it drives the run (``ledger.run_lock``: a file lock on
SQLite, an advisory lock on PostgreSQL, both released by the OS or the database when the holder
dies). So on any machine that reaches the same ledger:

    outcomes = resume_interrupted(ledger_url)           # every interrupted run tree
    outcomes = resume_interrupted(ledger_url, run_ids=["9f1c..."])

An *interrupted* run tree is one with a run still ``running`` in the ledger (a child run of a
subflow or agent counts for its root). Each one is resumed with ``resume_run`` (nodes whose
result is in the ledger are not run again); a tree whose lock is still held is not touched and
is reported ``held``; a tree that finished between the listing and the lock is reported
``finished``. Trees are taken one after the other, in the order they were created.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from ...errors import MLXRuntimeError, RunLocked, RunNotResumable
from ...ledger import Ledger
from ...ledger.run_lock import root_run_id
from .flows import FlowRunResult, resume_run
from .host import DriveLimits

__all__ = ["Takeover", "TakeoverStatus", "interrupted_roots", "resume_interrupted"]

_MAX_LISTED: Final = 100_000


class TakeoverStatus(enum.StrEnum):
    RESUMED = "resumed"  # driven here until it rested (completed, failed or waiting): see ``result``
    HELD = "held"  # another live process drives it: left alone
    FINISHED = "finished"  # it was no longer running when its lock was taken
    FAILED = "failed"  # resuming raised: see ``error``


@dataclass(frozen=True, slots=True)
class Takeover:
    """What became of one interrupted run tree."""

    run_id: str
    status: TakeoverStatus
    result: FlowRunResult | None = None
    error: MLXRuntimeError | None = None


def interrupted_roots(ledger: Ledger) -> list[str]:
    """The root run ids of every run tree with a run still ``running``, oldest first."""
    running = ledger.list_runs(limit=_MAX_LISTED, status="running")
    roots: dict[str, object] = {}
    for summary in sorted(running, key=lambda r: r.created_at):
        roots.setdefault(root_run_id(ledger, summary.run_id), None)
    return list(roots)


def resume_interrupted(
    ledger_url: str,
    *,
    run_ids: Sequence[str] | None = None,
    model: str | None = None,
    limits: DriveLimits | None = None,
) -> list[Takeover]:
    """Resume every interrupted run tree of the ledger (or the trees of ``run_ids``), skipping
    those another process still holds. ``model`` replaces the stored default model."""
    with Ledger(ledger_url) as ledger:
        roots = (
            interrupted_roots(ledger)
            if run_ids is None
            else list(dict.fromkeys(root_run_id(ledger, r) for r in run_ids))
        )
    outcomes: list[Takeover] = []
    for root in roots:
        try:
            result = resume_run(root, ledger_url=ledger_url, model=model, limits=limits, refuse_finished=True)
        except RunLocked as exc:
            outcomes.append(Takeover(root, TakeoverStatus.HELD, error=exc))
        except RunNotResumable as exc:
            outcomes.append(Takeover(root, TakeoverStatus.FINISHED, error=exc))
        except MLXRuntimeError as exc:
            outcomes.append(Takeover(root, TakeoverStatus.FAILED, error=exc))
        else:
            outcomes.append(Takeover(root, TakeoverStatus.RESUMED, result=result))
    return outcomes
