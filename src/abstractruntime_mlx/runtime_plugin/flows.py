"""VisualFlow JSON: load, index for sibling batching, run N runs concurrently, resume.

    results = run_flow("examples/fanout.json", vars={"topic": "caches"}, runs=3,
                       ledger_url="sqlite:///runs.sqlite")
    for r in results:
        print(r.run_id, r.status, [(n.node_id, n.result["metadata"]["execution"]) for n in r.nodes])

Each run thread compiles its own ``WorkflowSpec`` (a compiled VisualFlow keeps unlocked
per-run caches, so sharing one spec across threads is unsafe) and its own ``Runtime`` over
the shared stores and handler; every run's LLM nodes reach the same resident model, where
the engine batches them.

The flow and the run options are stored in the run's vars (``_runtime.mlx_pack``), so a run
can be resumed from the ledger alone (``resume_run``).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final


from .pack import MLXPack, build_pack

__all__ = [
    "FLOW_VAR",
    "FlowRunResult",
    "NodeOutcome",
    "load_flow",
    "node_outcomes",
    "resume_run",
    "run_flow",
    "stored_flow",
    "stored_options",
]

log = logging.getLogger(__name__)

FLOW_VAR: Final = "mlx_pack"
"""Key under ``vars["_runtime"]`` holding the flow and the options a resume needs."""


DEFAULT_MAX_TICKS = 10_000


def load_flow(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A VisualFlow dict from a dict, a JSON string, or a path to a JSON file."""
    if isinstance(source, Mapping):
        flow = copy.deepcopy(dict(source))
    else:
        text = str(source)
        if text.lstrip().startswith("{"):
            flow = json.loads(text)
        else:
            path = Path(text).expanduser()
            try:
                flow = json.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError as exc:
                raise ValueError(f"no flow file at {path}") from exc
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(flow, dict) or not isinstance(flow.get("nodes"), list):
        raise ValueError("a VisualFlow is a JSON object with a 'nodes' list (and 'edges', 'entryNode', 'id')")
    if not flow.get("id"):
        raise ValueError("the flow has no 'id' (AbstractRuntime uses it as the workflow id)")
    return flow


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeOutcome:
    """One LLM node of a run as the ledger recorded it (``result`` is the handler's dict)."""

    node_id: str
    step_id: str
    attempt: int
    result: dict[str, Any]
    duration_s: float | None


@dataclass(slots=True)
class FlowRunResult:
    run_id: str
    workflow_id: str
    status: str
    output: Any
    error: str | None
    wall_s: float
    nodes: list[NodeOutcome] = field(default_factory=list)


def node_outcomes(ledger: Any, run_id: str) -> list[NodeOutcome]:
    """The completed LLM nodes of a run, in completion order, read from the ledger alone."""
    out: list[NodeOutcome] = []
    for step in ledger.run_steps(run_id):
        if step.effect_type != "llm_call" or step.status != "completed":
            continue
        result = step.record.get("result")
        if isinstance(result, dict):
            out.append(NodeOutcome(step.node_id, step.step_id, step.attempt, result, step.duration_s))
    return out


def run_flow(
    flow: str | Path | Mapping[str, Any],
    *,
    vars: Mapping[str, Any] | None = None,
    runs: int = 1,
    ledger_url: str | None = None,
    pack: MLXPack | None = None,
    model: str | None = None,
    force_model: bool = False,
    provider_options: Mapping[str, Any] | None = None,
    sibling_batching: bool = True,
    record_progress: bool = True,
    session_id: str | None = None,
) -> list[FlowRunResult]:
    """Run ``flow`` ``runs`` times concurrently (one thread, one compiled spec and one
    ``Runtime`` per run) and return the results in start order.

    Give either ``pack`` (reused, left open) or ``ledger_url`` (a pack is built with
    ``model``/``force_model``/``provider_options``/``sibling_batching``/``record_progress`` and
    closed at the end). ``vars`` are the run's input vars; ``vars["_runtime"]`` holds run-level
    controls (``speculation``, ``thinking``, ``base_url``).
    """

    if runs < 1:
        raise ValueError(f"runs must be >= 1 (got {runs})")
    flow_dict = load_flow(flow)
    owned = pack is None
    if pack is None:
        if ledger_url is None:
            raise ValueError("run_flow needs ledger_url=... or pack=...")
        pack = build_pack(
            ledger_url,
            model=model,
            force_model=force_model,
            provider_options=provider_options,
            sibling_batching=sibling_batching,
            record_progress=record_progress,
        )
    try:
        pack.flows.register(flow_dict)
        run_vars = copy.deepcopy(dict(vars or {}))
        runtime_ns = run_vars.setdefault("_runtime", {})
        if not isinstance(runtime_ns, dict):
            raise ValueError("vars['_runtime'] must be an object")
        runtime_ns[FLOW_VAR] = {"flow": flow_dict, **pack.resume_options()}
        if runs == 1:
            return [_one_run(pack, flow_dict, run_vars, session_id)]
        with ThreadPoolExecutor(max_workers=runs, thread_name_prefix="abstractruntime-mlx-run") as pool:
            futures = [pool.submit(_one_run, pack, flow_dict, run_vars, session_id) for _ in range(runs)]
            return [f.result() for f in futures]
    finally:
        if owned:
            pack.close()


def _one_run(pack: MLXPack, flow: dict[str, Any], run_vars: dict[str, Any], session_id: str | None) -> FlowRunResult:
    from abstractruntime.visualflow_compiler import compile_visualflow

    spec = compile_visualflow(flow)  # one per thread: compiled flows keep unlocked per-run caches
    runtime = pack.runtime()
    started = time.perf_counter()
    with pack.prefetcher.run_in_progress():
        run_id = runtime.start(workflow=spec, vars=copy.deepcopy(run_vars), session_id=session_id)
        try:
            state = _tick_to_rest(runtime, spec, run_id)
        finally:
            pack.prefetcher.discard_run(run_id)
    return _result(pack, state, time.perf_counter() - started)


def _tick_to_rest(runtime: Any, spec: Any, run_id: str) -> Any:
    from abstractruntime.core.models import RunStatus

    state = runtime.get_state(run_id)
    for _ in range(DEFAULT_MAX_TICKS):
        if state.status != RunStatus.RUNNING:
            return state
        state = runtime.tick(workflow=spec, run_id=run_id)
    raise RuntimeError(f"run {run_id} did not come to rest after {DEFAULT_MAX_TICKS} ticks")


def _result(pack: MLXPack, state: Any, wall_s: float) -> FlowRunResult:
    return FlowRunResult(
        run_id=state.run_id,
        workflow_id=state.workflow_id,
        status=str(getattr(state.status, "value", state.status)),
        output=state.output,
        error=state.error,
        wall_s=wall_s,
        nodes=node_outcomes(pack.ledger, state.run_id),
    )


def resume_run(
    run_id: str,
    *,
    ledger_url: str | None = None,
    pack: MLXPack | None = None,
    model: str | None = None,
) -> FlowRunResult:
    """Continue an interrupted run from its last checkpoint, using the flow stored in the run.

    Nodes whose result is in the ledger are not run again: the runtime resumes at the saved
    node, and an effect whose COMPLETED record landed before the crash is reused by its
    idempotency key. ``model`` replaces the stored default model (e.g. the same weights at a
    new path). A run that is not ``running`` is returned as it is.
    """
    from abstractruntime.core.models import RunStatus
    from abstractruntime.visualflow_compiler import compile_visualflow


    owned = pack is None
    if pack is None:
        if ledger_url is None:
            raise ValueError("resume_run needs ledger_url=... or pack=...")
        pack = _pack_for_stored_run(ledger_url, run_id, model=model, build_pack=build_pack)
    try:
        state = pack.run_store.load(run_id)
        if state is None:
            raise ValueError(f"no run {run_id} in {pack.ledger.url}")
        started = time.perf_counter()
        if state.status != RunStatus.RUNNING:
            return _result(pack, state, 0.0)
        stored = stored_flow(state.vars)
        if stored is None:
            raise ValueError(f"run {run_id} was not started by run_flow: it carries no _runtime.{FLOW_VAR}.flow to resume with")
        pack.flows.register(stored)
        spec = compile_visualflow(stored)
        runtime = pack.runtime()
        with pack.prefetcher.run_in_progress():
            try:
                state = _tick_to_rest(runtime, spec, run_id)
            finally:
                pack.prefetcher.discard_run(run_id)
        return _result(pack, state, time.perf_counter() - started)
    finally:
        if owned:
            pack.close()


def stored_flow(run_vars: Mapping[str, Any]) -> dict[str, Any] | None:
    runtime_ns = run_vars.get("_runtime") if isinstance(run_vars, Mapping) else None
    stored = runtime_ns.get(FLOW_VAR) if isinstance(runtime_ns, Mapping) else None
    flow = stored.get("flow") if isinstance(stored, Mapping) else None
    return dict(flow) if isinstance(flow, Mapping) else None


def stored_options(run_vars: Mapping[str, Any]) -> dict[str, Any]:
    runtime_ns = run_vars.get("_runtime") if isinstance(run_vars, Mapping) else None
    stored = runtime_ns.get(FLOW_VAR) if isinstance(runtime_ns, Mapping) else None
    if not isinstance(stored, Mapping):
        return {}
    return {k: copy.deepcopy(v) for k, v in stored.items() if k != "flow"}


def _pack_for_stored_run(ledger_url: str, run_id: str, *, model: str | None, build_pack: Any) -> MLXPack:
    from ..ledger import Ledger

    probe = Ledger(ledger_url)
    try:
        data = probe.load_run(run_id)
    finally:
        probe.close()
    if data is None:
        raise ValueError(f"no run {run_id} in {ledger_url}")
    options = stored_options(data.get("vars") or {})
    return build_pack(
        ledger_url,
        model=model or options.get("model"),
        force_model=bool(options.get("force_model", False)),
        provider_options=options.get("provider_options") or None,
        sibling_batching=bool(options.get("sibling_batching", True)),
    )
