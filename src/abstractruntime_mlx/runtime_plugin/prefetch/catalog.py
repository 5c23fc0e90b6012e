"""Flows by id: ``load_flow`` reads one, and what the handler knows about a registered flow
(node configs and predictable siblings).

``FlowCatalog`` holds one ``FlowIndex`` per workflow id; ``FlowIndex.later_siblings(node)``
lists the later ``llm_call`` branches of the same parallel/sequence node whose payload
``prediction`` can compute before the runtime reaches them; ``FlowIndex.prefix_call(node)`` is
the predictable prefix of an LLM node's (first) request, for a warm. The catalog also knows
each agent node's ReAct workflow (``add_agent_workflow``), whose runs send the agent's calls.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ...json_values import array_at, nests_deeper_than, object_at, parse_ascii_int
from .agent_prefix import AgentWorkflow, child_vars, first_payload
from .pin_ttl import return_wait_s
from .prediction import (
    LLM_NODE_TYPES,
    Unpredictable,
    plan_agent_inputs,
    plan_payload,
    plan_prefix,
    resolve_agent_inputs,
    resolve_payload,
    steps_to_llm_nodes,
)

__all__ = [
    "BRANCHING_NODE_TYPES",
    "BRANCH_HANDLE_PREFIX",
    "FlowCatalog",
    "FlowIndex",
    "PrefixCall",
    "SiblingCall",
    "branch_index",
    "load_flow",
]

BRANCHING_NODE_TYPES: Final = frozenset({"parallel", "sequence"})
"""Nodes whose ``then:N`` branches AbstractRuntime runs one after another on one thread."""
BRANCH_HANDLE_PREFIX: Final = "then:"


def branch_index(handle: str) -> int | None:
    """The N of a branch handle ``then:N``; ``None`` for any other handle and for an N that is
    not written in ASCII digits (``check`` refuses such a handle on a branching node)."""
    if not handle.startswith(BRANCH_HANDLE_PREFIX):
        return None
    return parse_ascii_int(handle[len(BRANCH_HANDLE_PREFIX) :])


# Flows the editor writes nest about a dozen levels (schemas in them at most MAX_SCHEMA_DEPTH);
# far deeper input would exhaust the interpreter's stack in the host's compiler.
MAX_FLOW_DEPTH: Final = 64


def load_flow(source: str | Path | Mapping[str, object]) -> dict[str, object]:
    """A VisualFlow dict from a dict, a JSON string, or a path to a JSON file; a flow nested
    deeper than ``MAX_FLOW_DEPTH`` levels is refused (``ValueError``, as any unreadable flow)."""
    flow: object
    if isinstance(source, Mapping):
        if nests_deeper_than(source, MAX_FLOW_DEPTH):
            raise ValueError(f"the flow nests deeper than {MAX_FLOW_DEPTH} levels; a VisualFlow never does")
        flow = copy.deepcopy(dict(source))
    else:
        text = str(source)
        where = "the flow"
        try:
            if text.lstrip().startswith("{"):
                flow = json.loads(text)
            else:
                path = Path(text).expanduser()
                where = str(path)
                flow = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ValueError(f"no flow file at {where}") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise ValueError(f"{where} nests deeper than {MAX_FLOW_DEPTH} levels; a VisualFlow never does") from exc
        if nests_deeper_than(flow, MAX_FLOW_DEPTH):
            raise ValueError(f"{where} nests deeper than {MAX_FLOW_DEPTH} levels; a VisualFlow never does")
    if not isinstance(flow, dict) or not isinstance(flow.get("nodes"), list):
        raise ValueError("a VisualFlow is a JSON object with a 'nodes' list (and 'edges', 'entryNode', 'id')")
    if not flow.get("id"):
        raise ValueError("the flow has no 'id' (AbstractRuntime uses it as the workflow id)")
    return flow


@dataclass(frozen=True, slots=True)
class SiblingCall:
    """A later ``llm_call`` branch of the same parallel/sequence node whose inputs are known
    before the runtime reaches it: ``payload`` is the LLM_CALL payload it will emit, as a
    template over the run's vars (``prediction``)."""

    node_id: str
    branch: int
    payload: dict[str, object]
    config: dict[str, object]

    def payload_for(self, run_vars: Mapping[str, object]) -> dict[str, object]:
        """The payload for one run; raises ``prediction.Unpredictable``."""
        return resolve_payload(self.payload, run_vars)


@dataclass(frozen=True, slots=True)
class PrefixCall:
    """The predictable prefix of an LLM node's next request, and who sends it: ``payload`` (an
    LLM_CALL payload) goes out from a run with ``run_vars``, of workflow ``workflow_id`` (None:
    the flow's own run), at node ``node_id`` (an agent's: its ReAct workflow's ``reason``).
    ``prefix_only``: the payload lacks the prompt (it comes from a node that runs first)."""

    payload: dict[str, object]
    run_vars: Mapping[str, object]
    node_id: str
    workflow_id: str | None = None
    prefix_only: bool = False


class FlowIndex:
    """What the handler needs to know about one flow: node configs and, per ``llm_call`` node
    that is a direct branch of a parallel/sequence node, its predictable later siblings."""

    def __init__(self, flow: Mapping[str, object]) -> None:
        self.workflow_id = str(flow.get("id"))
        nodes: dict[str, Mapping[str, object]] = {
            str(n.get("id")): n for n in array_at(flow, "nodes") if isinstance(n, Mapping)
        }
        self._flow = flow
        self._steps: dict[str, dict[str, int]] = {}
        self._return_waits: dict[str, float | None] = {}
        self._prefixes: dict[str, dict[str, object] | str] = {}  # node -> prefix template, or why none
        self._agent_workflows: dict[str, AgentWorkflow] = {}  # agent node -> its ReAct workflow
        self.node_types = {node_id: str(node.get("type")) for node_id, node in nodes.items()}
        self.llm_nodes = tuple(node_id for node_id, kind in self.node_types.items() if kind in LLM_NODE_TYPES)
        edges = [e for e in array_at(flow, "edges") if isinstance(e, Mapping)]
        self._configs: dict[str, dict[str, object]] = {}
        for node_id, node in nodes.items():
            data = object_at(node, "data")
            config = object_at(data, "effectConfig")
            self._configs[node_id] = dict(config)
        branches: dict[str, list[tuple[int, str]]] = {}
        for edge in edges:
            source = str(edge.get("source"))
            handle = str(edge.get("sourceHandle") or "")
            if nodes.get(source, {}).get("type") not in BRANCHING_NODE_TYPES or edge.get("targetHandle") != "exec-in":
                continue
            branch = branch_index(handle)
            if branch is None:
                continue
            branches.setdefault(source, []).append((branch, str(edge.get("target"))))
        self._siblings: dict[str, list[SiblingCall]] = {}
        self.unpredictable: dict[str, str] = {}
        for targets in branches.values():
            targets.sort()
            calls: list[SiblingCall] = []
            for branch, target in targets:
                branch_node = nodes.get(target)
                if branch_node is None or branch_node.get("type") != "llm_call":
                    continue
                try:
                    payload = plan_payload(flow, target)
                except Unpredictable as exc:
                    self.unpredictable[target] = str(exc)
                    continue
                calls.append(SiblingCall(target, branch, payload, self._configs.get(target, {})))
            for branch, target in targets:
                later = [c for c in calls if c.branch > branch and c.node_id != target]
                if later and nodes.get(target, {}).get("type") == "llm_call":
                    self._siblings.setdefault(target, []).extend(later)

    def node_config(self, node_id: str) -> dict[str, object]:
        return dict(self._configs.get(node_id, {}))

    def return_wait_s(self, node_id: str) -> float | None:
        """How long a run waits before it comes back to ``node_id`` (``pin_ttl.return_wait_s``)."""
        if node_id not in self._return_waits:
            self._return_waits[node_id] = return_wait_s(self._flow, node_id)
        return self._return_waits[node_id]

    def steps_from(self, node_id: str) -> dict[str, int]:
        """Execution edges from ``node_id`` to each LLM node it reaches (``prediction``)."""
        if node_id not in self._steps:
            self._steps[node_id] = steps_to_llm_nodes(self._flow, node_id)
        return self._steps[node_id]

    def next_llm_nodes(self, node_id: str) -> list[str]:
        """The LLM nodes ``node_id`` enables: those it reaches over the fewest execution edges."""
        steps = self.steps_from(node_id)
        nearest = min(steps.values(), default=0)
        return [node for node, distance in steps.items() if distance == nearest and node != node_id]

    def add_agent_workflow(self, node_id: str, workflow: AgentWorkflow) -> None:
        """The ReAct workflow the host registered for agent node ``node_id``."""
        self._agent_workflows[node_id] = workflow

    def prefix_call(self, node_id: str, run_vars: Mapping[str, object]) -> PrefixCall:
        """The predictable prefix of LLM node ``node_id``'s request in a run with ``run_vars``: an
        ``llm_call``'s from ``prediction.plan_prefix``, an agent's first request up to its task
        from ``agent_prefix``; raises ``Unpredictable``."""
        if node_id not in self._prefixes:
            try:
                kind = self.node_types.get(node_id)
                if kind == "agent":
                    self._prefixes[node_id] = plan_agent_inputs(self._flow, node_id)
                elif kind == "llm_call":
                    self._prefixes[node_id] = plan_prefix(self._flow, node_id)
                else:
                    raise Unpredictable(f"a {kind} node sends no LLM call")
            except Unpredictable as exc:
                self._prefixes[node_id] = str(exc)
        template = self._prefixes[node_id]
        if isinstance(template, str):
            raise Unpredictable(template)
        if self.node_types.get(node_id) != "agent":
            payload = resolve_payload(template, run_vars)
            prefix_only = bool(payload.pop("prefix_only", False))
            return PrefixCall(payload, run_vars, node_id, prefix_only=prefix_only)
        workflow = self._agent_workflows.get(node_id)
        if workflow is None:
            raise Unpredictable("the host registered no ReAct workflow for this agent")
        vars = child_vars(*resolve_agent_inputs(template, run_vars), run_vars)
        sender, payload = first_payload(workflow, vars)
        return PrefixCall(payload, vars, sender, workflow_id=workflow.workflow_id, prefix_only=True)

    def later_siblings(self, node_id: str) -> list[SiblingCall]:
        """Predictable ``llm_call`` branches after ``node_id``'s branch, in pin order."""
        return list(self._siblings.get(node_id, ()))


class FlowCatalog:
    """Flows by workflow id, for the handler (sibling prediction and node configs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flows: dict[str, FlowIndex] = {}
        self._agents: dict[str, tuple[FlowIndex, str]] = {}  # ReAct workflow id -> (flow, agent node)

    def register(self, flow: Mapping[str, object]) -> FlowIndex:
        index = FlowIndex(flow)
        with self._lock:
            self._flows[index.workflow_id] = index
        return index

    def get(self, workflow_id: str) -> FlowIndex | None:
        with self._lock:
            return self._flows.get(workflow_id)

    def add_agent_workflow(self, flow_id: str, node_id: str, workflow: AgentWorkflow) -> None:
        """Agent node ``node_id`` of flow ``flow_id`` runs as ``workflow`` (a no-op for a flow
        not registered)."""
        with self._lock:
            index = self._flows.get(flow_id)
            if index is None:
                return
            index.add_agent_workflow(node_id, workflow)
            self._agents[workflow.workflow_id] = (index, node_id)

    def agent_of(self, workflow_id: str) -> tuple[FlowIndex, str] | None:
        """The flow and the agent node whose ReAct workflow is ``workflow_id``."""
        with self._lock:
            return self._agents.get(workflow_id)
