"""The first request of an ``agent`` node up to its task: what a prefix warm sends before the
agent starts.

The host runs an agent node as a child run of AbstractAgent's ReAct workflow (one per node,
``visual_react_workflow_id``), started with vars the visual compiler builds from the node's
inputs (``compiler._build_sub_vars``); the child's ``reason`` node builds every LLM_CALL: the
ReAct system prompt with the node's ``system`` pin appended, the allowed tools' specs, then the
transcript (the task, stamped with the time it is sent). The chat template renders system and
tools first, so they are the prefix known before the agent runs.

``child_vars`` builds the child's vars as the compiler does, for what reaches that prefix (the
model, the tools, the ``system`` pin, thinking, the run's prompt-cache posture), with an empty
task; ``first_payload`` runs the ReAct workflow's own nodes on them up to its first LLM_CALL, so
the system prompt and the tools are the host's text, not a copy of it. What the compiler would
take from elsewhere (AbstractCore's default model, the run's skills block) is refused
(``Unpredictable``): a warm is sent only for a prefix known exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Final, Protocol

from ...json_values import array_at, object_at
from .prediction import Unpredictable

__all__ = ["AgentWorkflow", "child_vars", "first_payload"]

# Provider/model values the compiler reads as "use the default".
_DEFAULT_MARKERS: Final = frozenset({"default", "__default__", "__abstractcore_default__", "abstractcore.default"})
# Parent ``_runtime`` entries the compiler copies into the child's prompt that are not predicted.
_UNPREDICTED_PARENT_RUNTIME: Final = ("skills_block",)
_MAX_NODES_TO_FIRST_CALL: Final = 4  # init -> reason, with room for a host that adds a node


class AgentWorkflow(Protocol):
    """What is read of the ReAct ``WorkflowSpec`` registered for an agent node."""

    workflow_id: str
    entry_node: str

    def get_node(self, node_id: str) -> object: ...


def _text(value: object) -> str:
    if not isinstance(value, str) or value.strip().lower() in _DEFAULT_MARKERS:
        return ""
    return value.strip()


def _thinking(value: object) -> object:
    if isinstance(value, bool):
        return value
    return value.strip() or None if isinstance(value, str) else None


def child_vars(
    inputs: Mapping[str, object], config: Mapping[str, object], parent_vars: Mapping[str, object]
) -> dict[str, object]:
    """The vars the compiler starts agent node's child run with, as far as its first request's
    prefix goes (``inputs``/``config``: ``prediction.resolve_agent_inputs``); an empty task."""
    parent_runtime = object_at(parent_vars, "_runtime")
    for name in _UNPREDICTED_PARENT_RUNTIME:
        if parent_runtime.get(name):
            raise Unpredictable(f"the run's _runtime.{name} reaches the agent's prompt")
    provider = _text(inputs.get("provider")) or _text(config.get("provider"))
    model = _text(inputs.get("model")) or _text(config.get("model"))
    provider = provider.lower()
    if not provider or not model:
        run_provider = _text(parent_runtime.get("provider")).lower()
        provider = provider or run_provider
        if not model and provider == run_provider:
            model = _text(parent_runtime.get("model"))
    if not provider or not model:
        raise Unpredictable("the agent's provider/model would come from AbstractCore's defaults")
    raw_tools = inputs["tools"] if "tools" in inputs else config.get("tools")
    if isinstance(raw_tools, str):
        raw_tools = [raw_tools]
    tools: list[str] = []
    for tool in raw_tools if isinstance(raw_tools, (list, tuple)) else ():
        if isinstance(tool, str) and tool.strip() and tool.strip() not in tools:
            tools.append(tool.strip())
    runtime_ns: dict[str, object] = {"inbox": [], "provider": provider, "model": model, "allowed_tools": tools}
    posture = parent_runtime.get("prompt_cache")
    if isinstance(posture, (bool, dict)):
        runtime_ns["prompt_cache"] = copy.deepcopy(posture)
    thinking = _thinking(inputs["thinking"] if "thinking" in inputs else config.get("thinking"))
    if thinking is None:
        thinking = _thinking(parent_runtime.get("thinking"))
    if thinking is not None:
        runtime_ns["thinking"] = thinking
    speculation = inputs.get("speculation")
    if speculation is None:
        speculation = config.get("speculation")
    if speculation is None:
        speculation = parent_runtime.get("speculation")
    if speculation is not None:
        runtime_ns["speculation"] = copy.deepcopy(speculation)
    system = inputs.get("system")
    if isinstance(system, str) and system.strip():
        runtime_ns["system_prompt_extra"] = system
    return {
        "context": {"task": "", "messages": []},
        "scratchpad": {"iteration": 0, "max_iterations": 20},
        "_runtime": runtime_ns,
        "_temp": {},
        "_limits": {**copy.deepcopy(dict(object_at(parent_vars, "_limits"))), "max_iterations": 20},
    }


def first_payload(workflow: AgentWorkflow, vars: dict[str, object]) -> tuple[str, dict[str, object]]:
    """The node and the LLM_CALL payload of the first request ``workflow`` sends from ``vars``
    (``child_vars``): its nodes run on a scratch run that nothing stores. Raises
    ``Unpredictable`` when it sends anything else first, or a request with more than the
    prefix (messages: the run's vars carried a transcript)."""
    from abstractruntime.core.models import EffectType, RunState, RunStatus
    from abstractruntime.core.runtime import DefaultRunContext

    run = RunState(
        run_id="prefix-prediction",
        workflow_id=workflow.workflow_id,
        status=RunStatus.RUNNING,
        current_node=workflow.entry_node,
        vars=vars,
    )
    context = DefaultRunContext()
    node_id: str | None = workflow.entry_node
    for _ in range(_MAX_NODES_TO_FIRST_CALL):
        if node_id is None:
            break
        run.current_node = node_id
        try:
            plan = workflow.get_node(node_id)(run, context)  # type: ignore[operator]
        except Exception as exc:  # noqa: BLE001 - the host's node would fail the same way: nothing to warm
            raise Unpredictable(f"the agent's {node_id} node failed on the predicted vars: {exc!r}") from exc
        effect = getattr(plan, "effect", None)
        if effect is None:
            node_id = getattr(plan, "next_node", None)
            continue
        if getattr(effect, "type", None) != EffectType.LLM_CALL or not isinstance(effect.payload, dict):
            raise Unpredictable(f"the agent's first effect is {getattr(effect, 'type', None)}, not an LLM call")
        payload = copy.deepcopy(effect.payload)
        if array_at(payload, "messages") or payload.get("prompt"):
            raise Unpredictable("the agent's first request carries a transcript before its task")
        return node_id, payload
    raise Unpredictable(f"the agent sends no LLM call within {_MAX_NODES_TO_FIRST_CALL} nodes")
