"""The host around a flow run, made of AbstractRuntime's own parts.

AbstractRuntime's local runtime (``integrations.abstractcore.factory.create_local_runtime``)
and the AbstractFlow editor's runner wire, around the kernel: an artifact store, a
``WorkflowRegistry`` holding the flow, its subflows and one AbstractAgent ReAct workflow per
Agent node, the host's ``tool_calls``/``tool_invoke`` handlers over a ``MappingToolExecutor`` of
its default tools, and a loop that ticks child runs and resumes their parents. ``FlowHost``
wires the same parts, with our LLM_CALL handler in place of the AbstractCore one (so agent
turns, subflow nodes and top-level nodes all batch on the resident model) and our ledger as
run and step store:

    host = FlowHost.for_flow(pack, flow, flows_dir="flows/")
    runtime, registry = host.runtime()          # one per thread
    run_id = runtime.start(workflow=registry.get(flow["id"]), vars=...)
    state = drive(runtime, registry, run_id)    # to completion, failure, or a wait for outside input

Tools that reach outside the machine (``NETWORK_TOOLS``) are left out of the executor unless
``allow_network_tools``; ``network_tool_uses(bundle)`` names the nodes that ask for one.

A run ends: ``drive`` runs it under ``DriveLimits`` (steps, subflow depth, wall-clock time, and
each code node's time and memory, see ``code_sandbox``); past one, the run fails at the node
named, its error starting with the limit's code (``[step_limit]``...).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

from abstractruntime import Runtime
from abstractruntime.core.config import RuntimeConfig
from abstractruntime.core.models import EffectType, RunState, RunStatus, StepRecord, WaitReason

from ...default_limits import DEFAULT_MAX_DEPTH, DEFAULT_MAX_STEPS, DEFAULT_MAX_TIMER_WAIT_S, DEFAULT_MAX_WALL_S
from ...errors import DepthLimitExceeded, RunLimitExceeded, StepLimitExceeded, WallTimeLimitExceeded
from ...json_values import array_at, object_at
from ...ledger.store import parse_timestamp
from ..adapter.routing import LOCAL_PROVIDER
from ..prefetch.catalog import load_flow
from . import code_sandbox
from .host_shims import compile_ready

if TYPE_CHECKING:
    from abstractcore.tools import ToolDefinition
    from abstractruntime import WorkflowRegistry
    from abstractruntime.core.policy import EffectPolicy
    from abstractruntime.core.runtime import EffectHandler
    from abstractruntime.integrations.abstractcore.tool_executor import MappingToolExecutor
    from abstractruntime.storage.artifacts import ArtifactStore

    from ..adapter.pack import MLXPack

__all__ = [
    "NETWORK_TOOLS",
    "FlowBundle",
    "FlowHost",
    "DriveLimits",
    "artifact_dir_for",
    "drive",
    "fail_run",
    "limit_error",
    "network_tool_uses",
    "remote_targets",
    "subflow_calls",
    "wait_chain",
    "waiting_leaf",
]

log = logging.getLogger(__name__)

NETWORK_TOOLS: Final = frozenset(
    {
        "web_search",
        "fetch_url",
        "skim_url",
        "skim_websearch",
        "browser_probe",
        "send_email",
        "list_emails",
        "read_email",
        "send_telegram_message",
    }
)
"""Default tools that reach outside this machine: off unless ``allow_network_tools``."""

_SUBFLOW_KEYS: Final = ("subflowId", "flowId", "workflowId", "workflow_id")
_MAX_DRIVE_STEPS: Final = 100_000
_MAX_DEPTH_LIMIT: Final = 200  # below wait_chain's walk, so a chain is always seen whole


# --------------------------------------------------------------------------------------
# Flows and their subflows
# --------------------------------------------------------------------------------------


def _subflow_ref(node: Mapping[str, object]) -> str | None:
    data = object_at(node, "data")
    for key in _SUBFLOW_KEYS:
        value = data.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


@dataclass(frozen=True)
class FlowBundle:
    """A root flow and every flow its ``subflow`` nodes reach, by id."""

    root: dict[str, object]
    flows: dict[str, dict[str, object]]

    @property
    def root_id(self) -> str:
        return str(self.root["id"])

    def subflows(self) -> dict[str, dict[str, object]]:
        return {k: v for k, v in self.flows.items() if k != self.root_id}

    def nodes(self) -> Iterator[tuple[str, dict[str, object]]]:
        for flow_id, flow in self.flows.items():
            for node in array_at(flow, "nodes"):
                if isinstance(node, dict):
                    yield flow_id, node

    @classmethod
    def resolve(
        cls,
        root: Mapping[str, object],
        *,
        flows_dir: str | Path | None = None,
        known: Mapping[str, Mapping[str, object]] | None = None,
    ) -> FlowBundle:
        """The root plus its subflows, found in ``known`` (e.g. stored with a run), then as
        ``FLOWS_DIR/<id>.json``, then as any ``FLOWS_DIR/*.json`` whose ``id`` matches. A missing
        subflow raises ``ValueError`` naming the node and where it was looked for."""
        flows: dict[str, dict[str, object]] = {str(root["id"]): dict(root)}
        directory = Path(flows_dir).expanduser() if flows_dir is not None else None
        by_id: dict[str, Path] | None = None
        queue = [str(root["id"])]
        while queue:
            flow = flows[queue.pop(0)]
            for node in array_at(flow, "nodes"):
                if not isinstance(node, Mapping) or node.get("type") != "subflow":
                    continue
                ref = _subflow_ref(node)
                if ref is None:
                    raise ValueError(f"subflow node {node.get('id')!r} of flow {flow.get('id')!r} names no subflowId")
                if ref in flows:
                    continue
                found: Mapping[str, object] | None = (known or {}).get(ref)
                if found is None and directory is not None:
                    candidate = directory / f"{ref}.json"
                    if not candidate.is_file():
                        if by_id is None:
                            by_id = _index_dir(directory)
                        candidate = by_id.get(ref, candidate)
                    if candidate.is_file():
                        found = load_flow(candidate)
                if found is None:
                    where = f"in {directory}" if directory is not None else "(no flows directory given)"
                    raise ValueError(
                        f"subflow {ref!r} used by node {node.get('id')!r} of flow {flow.get('id')!r} was not found {where}; "
                        "pass --flows-dir DIR holding it as DIR/<id>.json"
                    )
                flows[ref] = dict(found)
                queue.append(ref)
        return cls(root=dict(root), flows=flows)


def _index_dir(directory: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        flow_id = data.get("id") if isinstance(data, dict) else None
        if isinstance(flow_id, str):
            out.setdefault(flow_id, path)
    return out


def _agent_nodes(bundle: FlowBundle) -> list[tuple[str, str, Mapping[str, object]]]:
    out = []
    for flow_id, node in bundle.nodes():
        if node.get("type") == "agent":
            data = object_at(node, "data")
            config = object_at(data, "agentConfig")
            out.append((flow_id, str(node.get("id")), config))
    return out


def network_tool_uses(bundle: FlowBundle, *, default_tools: frozenset[str] | None = None) -> list[tuple[str, str, str]]:
    """``(flow_id, node_id, tool)`` for every node that names a tool in ``NETWORK_TOOLS``
    (agent tool lists, ``tools_allowlist`` and ``call_tool`` nodes, ``llm_call`` tools)."""
    uses: list[tuple[str, str, str]] = []
    for flow_id, node in bundle.nodes():
        data = object_at(node, "data")
        names: list[object] = []
        for key in ("agentConfig", "effectConfig"):
            names.extend(array_at(object_at(data, key), "tools"))
        pins = data.get("pinDefaults")
        if isinstance(pins, Mapping):
            for key in ("tools", "tool_name", "tool"):
                value = pins.get(key)
                names.extend(value if isinstance(value, list) else [value])
        literal = data.get("literalValue")
        if isinstance(literal, list) and node.get("type") == "tools_allowlist":
            names.extend(literal)
        for name in names:
            if isinstance(name, str) and name.strip() in NETWORK_TOOLS:
                uses.append((flow_id, str(node.get("id")), name.strip()))
    return sorted(set(uses))


def subflow_calls(bundle: FlowBundle) -> list[tuple[str, str, str]]:
    """``(flow_id, node_id, called_flow_id)`` for every ``subflow`` node of the bundle."""
    calls = []
    for flow_id, node in bundle.nodes():
        ref = _subflow_ref(node) if node.get("type") == "subflow" else None
        if ref is not None:
            calls.append((flow_id, str(node.get("id")), ref))
    return calls


REMOTE_URL_KEYS: Final = ("base_url", "server_base_url")


def remote_targets(bundle: FlowBundle) -> list[tuple[str, str, str, str]]:
    """``(flow_id, node_id, field, url)`` for every server a node of the bundle names itself
    (``base_url``/``server_base_url`` in its ``effectConfig``, ``agentConfig`` or pin defaults)."""
    targets = []
    for flow_id, node in bundle.nodes():
        data = object_at(node, "data")
        for section in ("effectConfig", "agentConfig", "pinDefaults"):
            config = object_at(data, section)
            for key in REMOTE_URL_KEYS:
                url = config.get(key)
                if isinstance(url, str) and url.strip():
                    targets.append((flow_id, str(node.get("id")), f"data.{section}.{key}", url.strip()))
    return targets


KG_MEMORY_NODE_TYPES: Final = frozenset({"memory_kg_assert", "memory_kg_query", "memory_kg_resolve"})
"""Knowledge-graph memory nodes: their handlers need an embedding service the pack does not wire."""


def kg_memory_uses(bundle: FlowBundle) -> list[tuple[str, str]]:
    """``(flow_id, node_id)`` for every knowledge-graph memory node and every LLM node that
    recalls from it (``use_kg_memory: true``): the host runs them on a memory service, which
    this pack does not wire."""
    uses: list[tuple[str, str]] = []
    for flow_id, node in bundle.nodes():
        data = object_at(node, "data")
        recalls = any(object_at(data, key).get("use_kg_memory") is True for key in ("pinDefaults", "effectConfig"))
        if recalls or node.get("type") in KG_MEMORY_NODE_TYPES:
            uses.append((flow_id, str(node.get("id"))))
    return sorted(set(uses))


# --------------------------------------------------------------------------------------
# Artifact store
# --------------------------------------------------------------------------------------


def artifact_dir_for(ledger_url: str) -> Path:
    """Where the artifacts of the ledger at ``ledger_url`` live: ``<ledger file>.artifacts/``
    beside a SQLite ledger. Other databases need an explicit directory."""
    from sqlalchemy.engine import make_url

    url = make_url(ledger_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        raise ValueError(
            f"the artifact store lives beside a SQLite ledger file; for {url.render_as_string(hide_password=True)} "
            "give an artifacts directory explicitly (--artifacts DIR)"
        )
    path = Path(url.database).expanduser()
    return path.with_name(path.name + ".artifacts")


# --------------------------------------------------------------------------------------
# Wiring
# --------------------------------------------------------------------------------------


@dataclass
class FlowHost:
    """What one flow's runs need besides the pack: its bundle, an artifact store and the
    tool executor. ``runtime()`` builds a fresh ``Runtime`` + ``WorkflowRegistry`` (compiled
    specs keep unlocked per-run caches: one pair per thread)."""

    pack: MLXPack
    bundle: FlowBundle
    artifact_store: ArtifactStore
    allow_network_tools: bool = False
    _tools: MappingToolExecutor | None = field(default=None, repr=False)
    _tool_defs: list[ToolDefinition] | None = field(default=None, repr=False)

    @classmethod
    def for_flow(
        cls,
        pack: MLXPack,
        flow: Mapping[str, object],
        *,
        flows_dir: str | Path | None = None,
        known_flows: Mapping[str, Mapping[str, object]] | None = None,
        artifacts_dir: str | Path | None = None,
        allow_network_tools: bool = False,
    ) -> FlowHost:
        from abstractruntime.storage.artifacts import FileArtifactStore, InMemoryArtifactStore

        bundle = FlowBundle.resolve(flow, flows_dir=flows_dir, known=known_flows)
        store: ArtifactStore
        if artifacts_dir is not None:
            store = FileArtifactStore(Path(artifacts_dir).expanduser())
        elif pack.ledger is not None:
            store = FileArtifactStore(artifact_dir_for(pack.ledger.url))
        else:
            store = InMemoryArtifactStore()
        for index_flow in bundle.flows.values():
            pack.flows.register(index_flow)
        return cls(pack=pack, bundle=bundle, artifact_store=store, allow_network_tools=allow_network_tools)

    # -- tools ----------------------------------------------------------------------

    def _tool_executor(self) -> MappingToolExecutor:
        if self._tools is None:
            from abstractruntime.integrations.abstractcore.default_tools import get_default_tools
            from abstractruntime.integrations.abstractcore.tool_executor import MappingToolExecutor

            tools = [t for t in get_default_tools() if self.allow_network_tools or _tool_name(t) not in NETWORK_TOOLS]
            self._tools = MappingToolExecutor.from_tools(tools)
        return self._tools

    def _agent_tool_defs(self) -> list[ToolDefinition]:
        if self._tool_defs is None:
            from abstractagent.logic.builtins import (
                ASK_USER_TOOL,
                COMPACT_MEMORY_TOOL,
                DELEGATE_AGENT_TOOL,
                INSPECT_VARS_TOOL,
                RECALL_MEMORY_TOOL,
                REMEMBER_TOOL,
            )
            from abstractcore.tools import ToolDefinition
            from abstractruntime.integrations.abstractcore.default_tools import list_default_tool_specs

            defs = [
                ToolDefinition(
                    name=s["name"],
                    description=str(s.get("description") or ""),
                    parameters=dict(s.get("parameters") or {}),
                )
                for s in list_default_tool_specs()
                if isinstance(s, dict)
                and s.get("name")
                and (self.allow_network_tools or s["name"] not in NETWORK_TOOLS)
            ]
            seen = {d.name for d in defs}
            for builtin in (
                ASK_USER_TOOL,
                RECALL_MEMORY_TOOL,
                INSPECT_VARS_TOOL,
                REMEMBER_TOOL,
                COMPACT_MEMORY_TOOL,
                DELEGATE_AGENT_TOOL,
            ):
                if builtin.name not in seen:
                    defs.append(builtin)
                    seen.add(builtin.name)
            self._tool_defs = defs
        return self._tool_defs

    def effect_handlers(self) -> dict[EffectType, EffectHandler]:
        """The host's tool handlers over our executor, and our LLM_CALL handler."""
        from abstractruntime.integrations.abstractcore.effect_handlers import (
            make_tool_calls_handler,
            make_tool_invoke_handler,
        )

        tools = self._tool_executor()
        run_store = self.pack.run_store
        return {
            EffectType.TOOL_CALLS: make_tool_calls_handler(
                tools=tools, artifact_store=self.artifact_store, run_store=run_store
            ),
            EffectType.TOOL_INVOKE: make_tool_invoke_handler(
                tools=tools, artifact_store=self.artifact_store, run_store=run_store
            ),
            EffectType.LLM_CALL: self.pack.handler,
        }

    # -- registry and runtime ---------------------------------------------------------

    def registry(self) -> WorkflowRegistry:
        """A ``WorkflowRegistry`` with the compiled flow, its subflows and one ReAct workflow
        per Agent node (AbstractAgent's, as AbstractFlow registers them)."""
        from abstractruntime import WorkflowRegistry
        from abstractruntime.visualflow_compiler import compile_visualflow_tree
        from abstractruntime.visualflow_compiler.visual.agent_ids import visual_react_workflow_id

        code_sandbox.install()  # code node bodies run in a child process under the run's limits
        registry = WorkflowRegistry()
        # The host compiles a copy shaped for its known bugs (host_shims); the run keeps the flow as written.
        compiled = {flow_id: compile_ready(flow) for flow_id, flow in self.bundle.flows.items()}
        specs = compile_visualflow_tree(root_id=self.bundle.root_id, flows_by_id=compiled)
        for spec in specs.values():
            registry.register(spec)
        agents = _agent_nodes(self.bundle)
        if agents:
            from abstractagent.adapters.react_runtime import create_react_workflow
            from abstractagent.logic.react import ReActLogic

            for flow_id, node_id, config in agents:
                # Like AbstractFlow: an Agent node without a tools list may use every tool
                # the executor has; an explicit list (even empty) is honoured.
                allowed = (
                    [t.strip() for t in array_at(config, "tools") if isinstance(t, str) and t.strip()]
                    if "tools" in config
                    else None
                )
                workflow_id = config.get("_react_workflow_id") or visual_react_workflow_id(
                    flow_id=flow_id, node_id=node_id
                )
                react = create_react_workflow(
                    logic=ReActLogic(tools=self._agent_tool_defs()),
                    workflow_id=str(workflow_id),
                    allowed_tools=allowed,
                )
                registry.register(react)
                # the handler predicts the agent's first request with it (a prefix warm)
                self.pack.flows.add_agent_workflow(flow_id, node_id, react)
        return registry

    def run_defaults(self) -> RuntimeConfig:
        """The defaults every run of the tree starts with: the local provider and the pack's
        default model as ``_runtime.provider``/``model``. The compiler reads them for Agent
        nodes that name no provider/model (which otherwise stop with a configuration error);
        the runtime seeds them at every start, so a subflow's or an agent's child run has them
        too (a run's own ``provider``/``model`` vars still win)."""
        model = self.pack.handler.routing.default_model
        return RuntimeConfig(provider=LOCAL_PROVIDER, model=model) if model else RuntimeConfig()

    def runtime(self) -> tuple[Runtime, WorkflowRegistry]:
        pack = self.pack
        if pack.run_store is None or pack.ledger_store is None:
            raise RuntimeError("this pack has no ledger; build it with a ledger URL to run flows")
        registry = self.registry()
        options: dict[str, EffectPolicy] = (
            {"effect_policy": pack.effect_policy} if pack.effect_policy is not None else {}
        )
        runtime = Runtime(
            config=self.run_defaults(),
            run_store=pack.run_store,
            ledger_store=pack.ledger_store,
            effect_handlers=self.effect_handlers(),
            workflow_registry=registry,
            artifact_store=self.artifact_store,
            **options,
        )
        return runtime, registry


def _tool_name(tool: object) -> str:
    definition = getattr(tool, "_tool_definition", None)
    name = getattr(definition, "name", None) or getattr(tool, "__name__", "")
    return str(name or "").strip()


# --------------------------------------------------------------------------------------
# Driving a run tree
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DriveLimits:
    """What one ``drive`` call allows the run tree it drives (each a ``run`` flag).

    ``max_timer_wait_s``: how long, in all, it sleeps for ``wait_until`` timers before leaving
    the run waiting (a later ``runs resume`` continues it). ``max_steps``: node steps, counted
    over the whole tree (subflow and agent runs included). ``max_depth``: how deep subflow and
    agent runs may nest (the root is depth 0). ``max_wall_s``: wall-clock seconds, checked
    between steps (a node running when it passes finishes first). ``max_code_s`` /
    ``max_code_mib`` / ``max_code_result_mib``: each code node call's time, memory and the size
    of its result's JSON (``code_sandbox``).
    """

    max_timer_wait_s: float = DEFAULT_MAX_TIMER_WAIT_S
    max_steps: int = DEFAULT_MAX_STEPS
    max_depth: int = DEFAULT_MAX_DEPTH
    max_wall_s: float = DEFAULT_MAX_WALL_S
    max_code_s: float = code_sandbox.DEFAULT_CODE_TIME_S
    max_code_mib: int = code_sandbox.DEFAULT_CODE_MEMORY_MIB
    max_code_result_mib: int = code_sandbox.DEFAULT_CODE_RESULT_MIB

    def __post_init__(self) -> None:
        if self.max_timer_wait_s < 0:
            raise ValueError(f"max_timer_wait_s must be >= 0 (got {self.max_timer_wait_s})")
        for name in ("max_steps", "max_code_mib", "max_code_result_mib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        if (
            isinstance(self.max_depth, bool)
            or not isinstance(self.max_depth, int)
            or not 0 <= self.max_depth <= _MAX_DEPTH_LIMIT
        ):
            raise ValueError(f"max_depth must be an integer from 0 to {_MAX_DEPTH_LIMIT} (got {self.max_depth!r})")
        for name in ("max_wall_s", "max_code_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0 (got {value!r})")

    def code_limits(self) -> code_sandbox.CodeLimits:
        return code_sandbox.CodeLimits(
            time_s=self.max_code_s, memory_mib=self.max_code_mib, result_mib=self.max_code_result_mib
        )


class _Budget:
    """Steps and wall-clock time left to one ``drive`` call. ``step_allowed`` is the host's
    ``step_gate``: the runtime asks it before every step of a tick."""

    def __init__(self, limits: DriveLimits) -> None:
        self.limits = limits
        self.steps = 0
        self.deadline = time.monotonic() + limits.max_wall_s

    def step_allowed(self) -> bool:
        if self.steps >= self.limits.max_steps or time.monotonic() >= self.deadline:
            return False
        self.steps += 1
        return True

    def exceeded(self) -> RunLimitExceeded | None:
        """The limit a run that still has steps to take is past, if any."""
        limits = self.limits
        if self.steps >= limits.max_steps:
            return StepLimitExceeded(
                f"the run took {limits.max_steps} steps, its limit (--max-steps)",
                limit="--max-steps",
                maximum=limits.max_steps,
            )
        if time.monotonic() >= self.deadline:
            return WallTimeLimitExceeded(
                f"the run ran for {limits.max_wall_s:g} s, its wall-clock limit (--max-wall-s)",
                limit="--max-wall-s",
                maximum=limits.max_wall_s,
            )
        return None


def limit_error(exc: RunLimitExceeded, node_id: str | None) -> str:
    """A run's error for a limit it went past: ``[code] node 'ID': message``."""
    return f"[{exc.code}] node {node_id or '?'!r}: {exc.message}"


def _status(state: RunState) -> str:
    return str(getattr(state.status, "value", state.status))


def _sub_run_id(state: RunState) -> str | None:
    waiting = state.waiting
    if waiting is None or waiting.reason != WaitReason.SUBWORKFLOW:
        return None
    details = waiting.details if isinstance(waiting.details, dict) else {}
    child = details.get("sub_run_id")
    if isinstance(child, str) and child:
        return child
    key = waiting.wait_key or ""
    return key.split("subworkflow:", 1)[1] or None if key.startswith("subworkflow:") else None


def waiting_leaf(runtime: Runtime, run_id: str) -> RunState:
    """The run at the bottom of ``run_id``'s chain of subflow waits (``run_id`` itself when it
    does not wait for a child)."""
    return wait_chain(runtime, run_id)[-1]


def wait_chain(runtime: Runtime, run_id: str) -> list[RunState]:
    """``run_id`` and the runs its chain of subflow waits goes through, down to its leaf."""
    chain = [runtime.get_state(run_id)]
    for _ in range(256):
        state = chain[-1]
        child = _sub_run_id(state) if state.status == RunStatus.WAITING else None
        if child is None:
            break
        chain.append(runtime.get_state(child))
    return chain


def _depth_exceeded(chain: list[RunState], limits: DriveLimits) -> RunLimitExceeded | None:
    depth = len(chain) - 1
    if depth <= limits.max_depth:
        return None
    parent = chain[-2]
    return DepthLimitExceeded(
        f"node {parent.current_node!r} of {parent.workflow_id!r} starts a run {depth} levels deep, past the limit of "
        f"{limits.max_depth} (--max-depth); does the subflow call itself?",
        limit="--max-depth",
        maximum=limits.max_depth,
    )


def fail_run(
    runtime: Runtime, run_id: str, *, node_id: str | None, error: str, replace_flow_error: bool = False
) -> RunState:
    """Mark a run failed at ``node_id`` with ``error`` (a failed step record, then the state):
    what a tick that raised leaves behind instead of a run ``running`` forever.
    ``replace_flow_error``: ``error`` replaces the node error the host recorded (the host's
    text of a failure this one restates with its code)."""
    state = runtime.get_state(run_id)
    node = node_id or state.current_node or "?"
    record = StepRecord.start(run=state, node_id=node, effect=None)
    runtime.ledger_store.append(record.finish_failure(error))
    state.status = RunStatus.FAILED
    state.error = error
    state.waiting = None
    if replace_flow_error:
        state.vars["_flow_error"] = error
        state.vars["_flow_error_node"] = node
    state.vars.setdefault("_flow_error", error)
    state.vars.setdefault("_flow_error_node", node)
    state.updated_at = dt.datetime.now(dt.UTC).isoformat()
    runtime.run_store.save(state)
    return state


def _guarded(runtime: Runtime, state: RunState, call: Callable[[], RunState]) -> RunState:
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - any exception inside a tick fails that run, recorded
        current = runtime.get_state(state.run_id)
        node = current.current_node or state.current_node
        error = f"node {node!r}: {type(exc).__name__}: {exc}"
        # Recorded in the run (and printed once by the command that drove it); the traceback
        # shows in debug mode (ABSTRACTRUNTIME_MLX_DEBUG=1), not as a second copy of the error.
        log.info("run %s failed inside a tick: %s", state.run_id, error, exc_info=True)
        return fail_run(runtime, state.run_id, node_id=node, error=error)


def drive(
    runtime: Runtime,
    registry: WorkflowRegistry,
    run_id: str,
    *,
    limits: DriveLimits = DriveLimits(),
    cancel: threading.Event | None = None,
) -> RunState:
    """Tick ``run_id`` and every child run it waits for until the tree rests: completed,
    failed, or waiting for something from outside (a user's answer, an event, a timer further
    away than ``limits`` allow). A finished child resumes its parent with the child's output
    (``{"sub_run_id", "output"}``, as the host's scheduler does); a failed child fails its
    parent. An exception inside a tick fails the run it happened in (``fail_run``). A run that
    goes past one of ``limits`` fails at the node it was at (``limit_error``), and so do the
    runs above it.

    On the pack's ledger the caller holds the tree's run lock (``ledger.run_lock.acquire``), as
    ``run_flow`` and ``resume_run`` do: two processes ticking one run would both run its nodes."""
    with code_sandbox.limits(limits.code_limits(), artifacts=runtime.artifact_store) as code_runs:
        return _drive(
            runtime, registry, run_id, limits=limits, budget=_Budget(limits), code_runs=code_runs, cancel=cancel
        )


def _drive(
    runtime: Runtime,
    registry: WorkflowRegistry,
    run_id: str,
    *,
    limits: DriveLimits,
    budget: _Budget,
    code_runs: code_sandbox.CodeRuns,
    cancel: threading.Event | None,
) -> RunState:
    timer_budget = limits.max_timer_wait_s

    def tick(leaf: RunState, spec: object) -> None:
        code_runs.run_id = leaf.run_id  # the run its large code results are kept for
        _guarded(runtime, leaf, lambda: runtime.tick(workflow=spec, run_id=leaf.run_id, step_gate=budget.step_allowed))
        tripped = code_runs.take_tripped()
        if tripped is not None:
            # The host ended the run as completed with the node's error; past a limit it fails.
            state = runtime.get_state(leaf.run_id)
            node = (
                state.vars.get("_flow_error_node")
                if isinstance(state.vars.get("_flow_error_node"), str)
                else state.current_node
            )
            fail_run(runtime, leaf.run_id, node_id=node, error=limit_error(tripped, node), replace_flow_error=True)

    for _ in range(_MAX_DRIVE_STEPS):
        if cancel is not None and cancel.is_set():
            break
        chain = wait_chain(runtime, run_id)
        leaf = chain[-1]
        status = leaf.status
        if status == RunStatus.RUNNING:
            spec = registry.get(leaf.workflow_id)
            if spec is None:
                fail_run(
                    runtime,
                    leaf.run_id,
                    node_id=leaf.current_node,
                    error=f"workflow {leaf.workflow_id!r} is not registered",
                )
                continue
            exceeded = _depth_exceeded(chain, limits) or budget.exceeded()
            if exceeded is not None:
                fail_run(
                    runtime, leaf.run_id, node_id=leaf.current_node, error=limit_error(exceeded, leaf.current_node)
                )
                continue
            tick(leaf, spec)
            continue
        if status == RunStatus.WAITING and leaf.waiting is not None and leaf.waiting.reason == WaitReason.UNTIL:
            due = parse_timestamp(leaf.waiting.until)
            delay = 0.0 if due is None else max(0.0, (due - dt.datetime.now(dt.UTC)).total_seconds())
            if delay > timer_budget or time.monotonic() + delay >= budget.deadline:
                break  # left waiting: a later `runs resume` continues it
            timer_budget -= delay
            if cancel is not None:
                cancel.wait(delay)
            else:
                time.sleep(delay)
            tick(leaf, registry.get(leaf.workflow_id))
            continue
        parent_id = leaf.parent_run_id if leaf.run_id != run_id else None
        if parent_id is None or status not in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
            break  # the tree rests: the root finished, or a run waits for outside input
        parent = runtime.get_state(parent_id)
        if _sub_run_id(parent) != leaf.run_id:
            break
        if status == RunStatus.COMPLETED:
            parent_spec = registry.get(parent.workflow_id)
            wait_key = parent.waiting.wait_key if parent.waiting is not None else None
            payload = {"sub_run_id": leaf.run_id, "output": leaf.output}
            _guarded(
                runtime,
                parent,
                lambda: runtime.resume(
                    workflow=parent_spec, run_id=parent_id, wait_key=wait_key, payload=payload, max_steps=0
                ),
            )
        else:
            fail_run(
                runtime,
                parent_id,
                node_id=parent.current_node,
                error=f"subflow run {leaf.run_id} ({leaf.workflow_id}) {_status(leaf)}: {leaf.error or 'no error recorded'}",
            )
    return runtime.get_state(run_id)
