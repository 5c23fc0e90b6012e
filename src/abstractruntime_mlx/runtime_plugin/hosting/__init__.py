"""Runs of a flow: the host around them, driving, waiting, resuming, taking over.

- ``host``: ``FlowHost`` (the registry, tools and artifact store AbstractRuntime's own runner
  wires, with our pack underneath), ``drive`` under ``DriveLimits``;
- ``flows``: ``run_flow`` (N runs at once) and ``resume_run``, results read from the ledger;
- ``waits``: what a waiting run waits for; ``takeover``: runs whose driver is gone;
- ``flowdiff``: a flow's hash and what changed since a run started;
- ``code_sandbox`` / ``code_child``: code nodes in a process of their own, under limits;
- ``host_shims``: work-arounds for host bugs, per host version.

Imports ``adapter`` and ``prefetch``.
"""

from __future__ import annotations

from .flowdiff import FlowDrift, flow_changes, flow_drift, flow_hash
from .flows import (
    FlowRunResult,
    NodeFailure,
    NodeOutcome,
    node_failures,
    node_outcomes,
    resume_run,
    run_flow,
    run_tree,
    stored_flow,
    stored_options,
)
from .host import DriveLimits, FlowBundle, FlowHost, drive, network_tool_uses
from .takeover import Takeover, resume_interrupted

__all__ = [
    "DriveLimits",
    "FlowBundle",
    "FlowDrift",
    "FlowHost",
    "FlowRunResult",
    "NodeFailure",
    "NodeOutcome",
    "Takeover",
    "drive",
    "flow_changes",
    "flow_drift",
    "flow_hash",
    "network_tool_uses",
    "node_failures",
    "node_outcomes",
    "resume_interrupted",
    "resume_run",
    "run_flow",
    "run_tree",
    "stored_flow",
    "stored_options",
]
