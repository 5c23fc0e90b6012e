"""The text lane's step plan: which waiting rows a step admits, and when finished rows leave.

Pure functions of plain values (no MLX, no threads), so each decision is tested on numbers
(``tests/test_scheduler_plan.py``); ``text_loop.TextLoopBackend`` reads them every step, as the
engine reads ``core/scheduler.py`` for admission.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PrefillPlan", "plan_prefill", "should_compact"]


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """Which waiting rows (indices, in arrival order) a text-lane step admits: ``short`` ones
    (their prompt fits one chunk) prefill together at once, ``long`` ones start a group that
    runs a chunk a step; the rest wait."""

    short: tuple[int, ...] = ()
    long: tuple[int, ...] = ()


def plan_prefill(
    prompt_lengths: Sequence[int], *, free: int, step_size: int, chunking: bool, alone: Sequence[bool] = ()
) -> PrefillPlan:
    """Admit waiting rows (``prompt_lengths``: the tokens each has to prefill, in arrival order)
    into ``free`` slots: a prompt whose all but last token fit ``step_size`` is short; a longer
    one starts a chunked group unless one is ``chunking`` already (one such group at a time; it
    waits meanwhile). A row marked ``alone`` (a keyed row: its cache starts from its own
    restored prefix) prefills in a group of its own: short, at once; long, as the chunked group
    by itself, the long rows after it waiting."""
    short: list[int] = []
    long: list[int] = []
    closed = chunking  # no more rows join a chunked group this step
    for i, length in enumerate(prompt_lengths):
        if free <= 0:
            break
        if length - 1 <= step_size:
            short.append(i)
        elif closed:
            continue
        elif i < len(alone) and alone[i]:
            if long:
                continue
            long.append(i)
            closed = True
        else:
            long.append(i)
        free -= 1
    return PrefillPlan(tuple(short), tuple(long))


def should_compact(n_rows: int, n_finished: int, *, joining: bool, idle_allowed: bool) -> bool:
    """Whether a text-lane step drops its finished rows from the batch now. Rows joining always
    compact first; otherwise finished rows idle (``idle_allowed``, where idle slots cost the
    step less than a compaction) until half the batch has finished, or leave at once."""
    if n_finished == 0:
        return False
    return joining or not idle_allowed or 2 * n_finished >= n_rows
