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
import logging
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, Unpack

from abstractruntime import Runtime
from abstractruntime.core.models import RunState, RunStatus, WaitReason

from ...errors import RunNotFound, RunNotResumable
from ...inspection import NodeOutcome, node_outcomes
from ...json_values import as_str, object_at
from ...ledger import Ledger, run_lock
from ..adapter.pack import MLXPack, PackOptions, PackSettings, build_pack
from ..prefetch.catalog import load_flow
from .flowdiff import flow_hash
from .host import DriveLimits, FlowHost, drive, waiting_leaf
from .waits import describe_wait, event_envelope, event_name, wait_info

if TYPE_CHECKING:
    from abstractruntime import WorkflowRegistry

__all__ = [
    "FLOW_VAR",
    "FlowRunResult",
    "NodeFailure",
    "NodeOutcome",
    "load_flow",
    "node_failures",
    "node_outcomes",
    "run_tree",
    "resume_run",
    "run_flow",
    "stored_flow",
    "stored_options",
]

log = logging.getLogger(__name__)

FLOW_VAR: Final = "mlx_pack"
"""Key under ``vars["_runtime"]`` holding the flow and the options a resume needs."""


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeFailure:
    """A node that failed in a run of the tree: a failed step, a result with
    ``success: false`` (also a failed tool call inside a result), or a flow error the compiler
    recorded (``_flow_error``, e.g. an Agent node without provider/model)."""

    run_id: str
    node_id: str
    error: str


@dataclass(slots=True)
class FlowRunResult:
    run_id: str
    workflow_id: str
    status: str
    output: dict[str, object] | None
    error: str | None
    wall_s: float
    nodes: list[NodeOutcome] = field(default_factory=list)
    failures: list[NodeFailure] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    waiting: dict[str, object] | None = None
    """What the run waits for (``waits.wait_info`` of the run its wait chain ends in, with
    that run's ``run_id``), when ``status`` is ``waiting``."""


def run_tree(ledger: Ledger, run_id: str) -> list[str]:
    """``run_id`` and its descendants (subflow and agent runs), parents before children."""
    order = [run_id]
    for current in order:
        if len(order) > 10_000:
            break
        children = ledger.list_run_states(parent_run_id=current, limit=10_000)
        order.extend(sorted(str(c["run_id"]) for c in children))
    return order


def node_failures(ledger: Ledger, run_id: str, state: Mapping[str, object] | None = None) -> list[NodeFailure]:
    """Every node failure the ledger holds for one run (see ``NodeFailure``)."""
    out: list[NodeFailure] = []
    for step in ledger.run_steps(run_id):
        if step.status == "failed":
            out.append(NodeFailure(run_id, step.node_id, step.error or "failed"))
            continue
        result = step.record.get("result") if step.status == "completed" else None
        if not isinstance(result, dict):
            continue
        if result.get("success") is False:
            out.append(NodeFailure(run_id, step.node_id, str(result.get("error") or "success: false")))
        for item in result.get("results") or []:
            if isinstance(item, dict) and item.get("success") is False:
                name = item.get("name") or item.get("tool_name") or "tool"
                out.append(NodeFailure(run_id, step.node_id, f"tool {name}: {item.get('error') or 'failed'}"))
    run_vars = (state or {}).get("vars") if isinstance(state, Mapping) else None
    if isinstance(run_vars, Mapping) and run_vars.get("_flow_error"):
        node = str(run_vars.get("_flow_error_node") or "?")
        error = str(run_vars["_flow_error"])
        if not any(f.node_id == node and f.error == error for f in out):
            out.append(NodeFailure(run_id, node, error))
    return out


def run_flow(
    flow: str | Path | Mapping[str, object],
    *,
    vars: Mapping[str, object] | None = None,
    runs: int = 1,
    ledger_url: str | None = None,
    pack: MLXPack | None = None,
    session_id: str | None = None,
    flows_dir: str | Path | None = None,
    artifacts_dir: str | Path | None = None,
    allow_network_tools: bool = False,
    limits: DriveLimits | None = None,
    source: str | Path | None = None,
    settings: PackSettings | None = None,
    **options: Unpack[PackOptions],
) -> list[FlowRunResult]:
    """Run ``flow`` ``runs`` times concurrently (one thread, one compiled registry and one
    ``Runtime`` per run) and return the results in start order.

    Give either ``pack`` (reused, left open) or ``ledger_url`` (a pack is built with
    ``settings``, or ``PackSettings``' fields as keywords: ``model``, ``force_model``,
    ``routes``, ``provider_options``, ``sibling_batching``, ``record_progress``,
    ``allow_remote``...; closed at the end). ``vars`` are the run's input
    vars; ``vars["_runtime"]`` holds run-level controls (``speculation``, ``thinking``,
    ``base_url``). A node is sent to a server (its own ``base_url``, the run's) only when the
    pack allows it (``allow_remote``: True, or hosts; ``--route`` URLs are allowed); otherwise it
    fails with ``remote_not_allowed`` before anything is sent.

    ``limits`` (``host.DriveLimits``) bound each run: steps, subflow depth, wall-clock time,
    and each code node's time and memory; a run past one fails at the node named, with the
    limit's error code in its error.

    Each run has a session: ``session_id``, or a fresh one per run. LLM nodes derive their
    prompt-cache keys from it as the host does (``prompt_cache``), so a later run given the
    same ``session_id`` continues the conversations of this one.

    Subflows resolve from ``flows_dir`` (default: the flow file's directory); child runs are
    driven to completion by the same loop (``host.drive``); memory nodes use a file artifact
    store beside the ledger (``artifacts_dir`` overrides it). Each run ends completed, failed
    (with the node and error recorded) or waiting for outside input (``resume_run`` continues
    it).

    The run stores the flow it started with, its hash and where it came from (``source``,
    default: ``flow`` when it is a path), so ``runs replay`` can say what changed in the file.
    """

    if runs < 1:
        raise ValueError(f"runs must be >= 1 (got {runs})")
    flow_dict = load_flow(flow)
    if flows_dir is None:
        flows_dir = flow_directory(flow)
    owned = pack is None
    if pack is None:
        if ledger_url is None:
            raise ValueError("run_flow needs ledger_url=... or pack=...")
        pack = build_pack(ledger_url, settings=settings, **options)
    try:
        host = FlowHost.for_flow(
            pack, flow_dict, flows_dir=flows_dir, artifacts_dir=artifacts_dir, allow_network_tools=allow_network_tools
        )
        run_vars = copy.deepcopy(dict(vars or {}))
        runtime_ns = run_vars.setdefault("_runtime", {})
        if not isinstance(runtime_ns, dict):
            raise ValueError("vars['_runtime'] must be an object")
        runtime_ns[FLOW_VAR] = {
            "flow": flow_dict,
            "flow_hash": flow_hash(flow_dict),
            "source": _source_path(source if source is not None else flow),
            "subflows": host.bundle.subflows(),
            "allow_network_tools": allow_network_tools,
            "artifacts_dir": None if artifacts_dir is None else str(artifacts_dir),
            **pack.resume_options(),
        }
        drive_limits = limits or DriveLimits()
        if runs == 1:
            return [_one_run(host, run_vars, session_id, drive_limits)]
        with ThreadPoolExecutor(max_workers=runs, thread_name_prefix="abstractruntime-mlx-run") as pool:
            futures = [pool.submit(_one_run, host, run_vars, session_id, drive_limits) for _ in range(runs)]
            return [f.result() for f in futures]
    finally:
        if owned:
            pack.close()


def _source_path(flow: str | Path | Mapping[str, object]) -> str | None:
    directory = flow_directory(flow)
    return None if directory is None else str(directory / Path(str(flow)).expanduser().name)


def flow_directory(flow: str | Path | Mapping[str, object]) -> Path | None:
    """The directory of a flow given as a file path (where its subflows are looked for)."""
    if isinstance(flow, Mapping):
        return None
    text = str(flow)
    if text.lstrip().startswith("{"):
        return None
    return Path(text).expanduser().resolve().parent


def new_session_id() -> str:
    """A fresh session id for a run started without one."""
    return f"session-{uuid.uuid4().hex}"


def _one_run(host: FlowHost, run_vars: dict[str, object], session_id: str | None, limits: DriveLimits) -> FlowRunResult:
    pack = host.pack
    runtime, registry = host.runtime()  # one per thread: compiled flows keep unlocked per-run caches
    started = time.perf_counter()
    if pack.ledger is None:  # pragma: no cover - host.runtime() refuses a pack without one
        raise RuntimeError("this pack has no ledger; build it with a ledger URL to run flows")
    run_id = str(uuid.uuid4())
    # Locked before the run exists: no other process can resume it while this one drives it.
    with run_lock.acquire(pack.ledger, run_id), pack.prefetcher.run_in_progress():
        # Every run has a session: the host derives each LLM call's prompt-cache key from it.
        session = session_id or new_session_id()
        runtime.start(
            workflow=registry.get(host.bundle.root_id), vars=copy.deepcopy(run_vars), session_id=session, run_id=run_id
        )
        try:
            state = drive(runtime, registry, run_id, limits=limits)
        finally:
            pack.prefetcher.discard_run(run_id)
            pack.handler.cache_hints.finish_run(run_id)
    return _result(pack, state, time.perf_counter() - started)


def _result(pack: MLXPack, state: RunState, wall_s: float) -> FlowRunResult:
    ledger = pack.ledger
    if ledger is None:
        raise ValueError("a flow run's result is read from the ledger; this pack has none")
    tree = run_tree(ledger, state.run_id)
    nodes: list[NodeOutcome] = []
    failures: list[NodeFailure] = []
    waiting: dict[str, object] | None = None
    for run_id in tree:
        stored = ledger.load_run(run_id) if run_id != state.run_id else {"vars": state.vars}
        nodes.extend(node_outcomes(ledger, run_id))
        failures.extend(node_failures(ledger, run_id, stored))
    if state.status == RunStatus.WAITING and pack.run_store is not None:
        leaf = state
        for _ in range(256):
            child = (
                (leaf.waiting.details or {}).get("sub_run_id")
                if leaf.waiting is not None and isinstance(leaf.waiting.details, dict)
                else None
            )
            loaded = pack.run_store.load(child) if isinstance(child, str) else None
            if loaded is None or loaded.status != RunStatus.WAITING:
                break
            leaf = loaded
        waiting = {"run_id": leaf.run_id, "node_id": leaf.current_node, **(wait_info(leaf.waiting) or {})}
    return FlowRunResult(
        run_id=state.run_id,
        workflow_id=state.workflow_id,
        status=str(getattr(state.status, "value", state.status)),
        output=state.output,
        error=state.error,
        wall_s=wall_s,
        nodes=nodes,
        failures=failures,
        children=tree[1:],
        waiting=waiting,
    )


def resume_run(
    run_id: str,
    *,
    ledger_url: str | None = None,
    pack: MLXPack | None = None,
    model: str | None = None,
    answer: str | None = None,
    event: tuple[str, object] | None = None,
    limits: DriveLimits | None = None,
    refuse_finished: bool = False,
) -> FlowRunResult:
    """Continue a run from the ledger, with the flow (and subflows) stored in the run.

    An interrupted run (``running``) continues from its last checkpoint: nodes whose result is
    in the ledger are not run again (the runtime resumes at the saved node, and an effect whose
    COMPLETED record landed before the crash is reused by its idempotency key). A waiting run
    is continued at the run its wait chain ends in: ``answer`` answers an ``ask_user``,
    ``event=(name, payload)`` delivers an event to a ``wait_event``, a timer is waited for
    (within ``limits``). ``model`` replaces the stored default model (e.g. the same weights at
    a new path).

    The run tree is locked first (``ledger.run_lock``), before the model is loaded, and held
    until the run rests again: a run another live process drives raises ``RunLocked``, and what
    happens next is decided on the state read under the lock. A finished run is returned as it
    is, or raises ``RunNotResumable`` with ``refuse_finished``; an ``answer`` or ``event`` for a
    run that does not wait for one (any more: a second answer to one question) raises
    ``RunNotResumable`` and runs nothing.
    """

    if pack is None and ledger_url is None:
        raise ValueError("resume_run needs ledger_url=... or pack=...")
    with _lock_run_tree(run_id, ledger_url=ledger_url, pack=pack):
        owned = pack is None
        if pack is None:
            assert ledger_url is not None
            pack = _pack_for_stored_run(ledger_url, run_id, model=model)
        try:
            return _resume_locked(
                pack, run_id, answer=answer, event=event, limits=limits, refuse_finished=refuse_finished
            )
        finally:
            if owned:
                pack.close()


def _lock_run_tree(run_id: str, *, ledger_url: str | None, pack: MLXPack | None) -> run_lock.RunLock:
    """The held lock of the tree ``run_id`` belongs to, taken through the pack's ledger or a
    short-lived one (the lock outlives it: a file lock, or a connection of its own)."""
    if pack is not None:
        if pack.ledger is None:
            raise ValueError("resume_run needs a pack with a ledger")
        return _lock_stored_run(pack.ledger, run_id)
    assert ledger_url is not None
    with Ledger(ledger_url) as ledger:
        return _lock_stored_run(ledger, run_id)


def _lock_stored_run(ledger: Ledger, run_id: str) -> run_lock.RunLock:
    if ledger.load_run(run_id) is None:
        raise RunNotFound(f"no run {run_id!r} in {ledger.url}", details={"run_id": run_id[:255]})
    return run_lock.acquire(ledger, run_id)


def _resume_locked(
    pack: MLXPack,
    run_id: str,
    *,
    answer: str | None,
    event: tuple[str, object] | None,
    limits: DriveLimits | None,
    refuse_finished: bool,
) -> FlowRunResult:
    assert pack.run_store is not None
    state = pack.run_store.load(run_id)
    if state is None:
        raise RunNotFound(
            f"no run {run_id!r} in {pack.ledger.url if pack.ledger else 'the ledger'}", details={"run_id": run_id[:255]}
        )
    if state.status not in (RunStatus.RUNNING, RunStatus.WAITING):
        if refuse_finished or answer is not None or event is not None:
            raise _not_resumable(run_id, state, "only a waiting or interrupted run can be resumed")
        return _result(pack, state, 0.0)
    stored = stored_flow(state.vars)
    if stored is None:
        raise ValueError(
            f"run {run_id} was not started by run_flow: it carries no _runtime.{FLOW_VAR}.flow to resume with"
        )
    options = stored_options(state.vars)
    host = FlowHost.for_flow(
        pack,
        stored,
        known_flows=_stored_subflows(options),
        artifacts_dir=as_str(options.get("artifacts_dir")),
        allow_network_tools=bool(options.get("allow_network_tools", False)),
    )
    runtime, registry = host.runtime()
    started = time.perf_counter()
    with pack.prefetcher.run_in_progress():
        try:
            leaf = waiting_leaf(runtime, run_id)
            if leaf.status == RunStatus.WAITING:
                _answer_wait(runtime, registry, leaf, answer=answer, event=event)
            elif answer is not None or event is not None:
                raise _not_resumable(
                    run_id, leaf, "it does not wait for an answer or an event: there is nothing to answer"
                )
            state = drive(runtime, registry, run_id, limits=limits or DriveLimits())
        finally:
            pack.prefetcher.discard_run(run_id)
            pack.handler.cache_hints.finish_run(run_id)
    return _result(pack, state, time.perf_counter() - started)


def _not_resumable(run_id: str, state: RunState, why: str) -> RunNotResumable:
    status = str(getattr(state.status, "value", state.status))
    where = "" if state.run_id == run_id else f" (its run {state.run_id})"
    return RunNotResumable(
        f"run {run_id}{where} is {status}; {why} (another process may have continued it already)",
        details={"run_id": run_id, "status": status},
    )


def _answer_wait(
    runtime: Runtime,
    registry: WorkflowRegistry,
    leaf: RunState,
    *,
    answer: str | None,
    event: tuple[str, object] | None,
) -> None:
    """Deliver ``answer`` or ``event`` to the run ``leaf`` waits in (a timer needs neither)."""
    wait = leaf.waiting
    reason = wait.reason
    spec = registry.get(leaf.workflow_id)
    if reason == WaitReason.USER:
        if answer is None:
            raise ValueError(
                f"run {leaf.run_id} waits for an answer ({describe_wait(wait)}): resume it with --answer TEXT"
            )
        if wait.choices and not wait.allow_free_text and answer not in wait.choices:
            raise ValueError(f"run {leaf.run_id} accepts only one of {list(wait.choices)} (got {answer!r})")
        runtime.resume(
            workflow=spec, run_id=leaf.run_id, wait_key=wait.wait_key, payload={"response": answer}, max_steps=0
        )
    elif reason == WaitReason.EVENT:
        if event is None:
            raise ValueError(
                f"run {leaf.run_id} waits for an event ({describe_wait(wait)}): resume it with --event NAME[=JSON]"
            )
        name, payload = event
        waited = event_name(wait.wait_key)
        if waited is not None and waited != name:
            raise ValueError(f"run {leaf.run_id} waits for event {waited!r}, not {name!r}")
        runtime.resume(
            workflow=spec,
            run_id=leaf.run_id,
            wait_key=wait.wait_key,
            payload=event_envelope(name, payload, leaf),
            max_steps=0,
        )
    elif reason == WaitReason.UNTIL:
        if answer is not None or event is not None:
            raise ValueError(
                f"run {leaf.run_id} waits for a timer ({describe_wait(wait)}), not for an answer or an event"
            )
    else:
        raise ValueError(f"run {leaf.run_id} waits for {describe_wait(wait)}, which resume cannot answer")


def stored_flow(run_vars: Mapping[str, object]) -> dict[str, object] | None:
    """The flow a run started with (``vars._runtime.mlx_pack.flow``), or None."""
    flow = object_at(object_at(run_vars, "_runtime"), FLOW_VAR).get("flow")
    return dict(flow) if isinstance(flow, Mapping) else None


def stored_options(run_vars: Mapping[str, object]) -> dict[str, object]:
    """Everything else ``run_flow`` stored with the run (hash, source, subflows, pack options)."""
    stored = object_at(object_at(run_vars, "_runtime"), FLOW_VAR)
    return {k: copy.deepcopy(v) for k, v in stored.items() if k != "flow"}


def _stored_subflows(options: Mapping[str, object]) -> dict[str, Mapping[str, object]]:
    return {str(k): v for k, v in object_at(options, "subflows").items() if isinstance(v, Mapping)}


def _pack_for_stored_run(ledger_url: str, run_id: str, *, model: str | None) -> MLXPack:
    from ...ledger import Ledger

    probe = Ledger(ledger_url)
    try:
        data = probe.load_run(run_id)
    finally:
        probe.close()
    if data is None:
        raise RunNotFound(f"no run {run_id!r} in {ledger_url}", details={"run_id": run_id[:255]})
    return build_pack(
        ledger_url, settings=PackSettings.from_resume_options(stored_options(object_at(data, "vars")), model=model)
    )
