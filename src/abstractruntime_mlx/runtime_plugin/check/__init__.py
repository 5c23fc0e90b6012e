"""A flow checked before anything runs: every problem at once, each naming its node and field.

- ``flow_check``: ``check_flow`` → ``CheckReport`` of ``Problem``\\ s (see ``docs/check.md``);
- ``cycles``: execution wires and subflow calls that would make a run go on forever.

The top layer of ``runtime_plugin``: it reads ``prefetch``, ``adapter`` and ``hosting``.
"""

from __future__ import annotations

from .flow_check import CheckReport, Problem, check_flow

__all__ = ["CheckReport", "Problem", "check_flow"]
