"""Check a VisualFlow before anything runs: every problem at once, each naming the node and field.

    report = check_flow("flow.json", vars={"_runtime": {"speculation": False}}, model="/models/qwen")
    if not report.ok:
        print(report.render())          # or report.raise_for_problems() -> InvalidFlow
    report.to_dict()                    # {"flow_id", "ok", "problems": [{"code", "node_id", ...}]}

What is checked, in this order (a problem never stops the checks after it):

1. the document: JSON object, ``id``, ``nodes``/``edges`` lists, node ids present and unique;
2. edges: a ``source``/``target`` that names no node, a handle that names no pin of a node that
   declares its pins;
3. the host's compiler (AbstractRuntime's own ``visual_to_flow`` + ``compile_flow``): node types
   it has no handler for (every one, not only the first), the graph errors it raises, and the
   execution nodes it would silently ignore because the entry cannot reach them;
4. runs that would never end: execution wires in a cycle no loop node or loop limit bounds,
   subflows that call themselves (directly or through other subflows), in the flow and its
   subflows;
5. servers a node would send its prompts to (a ``base_url`` in the flow or the run vars) that
   the user did not allow, and link-local / cloud metadata addresses whatever was allowed;
6. LLM nodes (``llm_call`` and ``agent``, an agent's calls being its ReAct run's):
   ``effectConfig`` keys nobody reads (with a did-you-mean), speculation / thinking / sampling
   values and an agent's ``max_iterations`` our controls refuse, a wire into an agent input the
   host never reads (a warning), a provider
   that is not served here, a model that is not on this machine (offline lookup, no download),
   a remote ``base_url`` that does not answer, or an abstractruntime-mlx server there that cannot
   serve the node's model (only when asked: ``probe_remote=True``);
7. run variables: ``_runtime`` keys nobody reads (did-you-mean) and run-level controls.

A problem is an ``error`` (the run would fail, or silently do something else than written) or a
``warning`` (reported, not blocking: a node with no wire at all, which the host skips).
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final, Literal

from ...controls import SPECULATION_KEYS, Sampling, normalize_sampling, normalize_speculation, normalize_thinking
from ...errors import InvalidControls, InvalidFlow, InvalidRequest, MLXRuntimeError, RemoteNotAllowed
from ...json_values import JSONObject, array_at, as_str, nests_deeper_than, object_at
from ...request import check_prompt_cache_key
from ..adapter.routing import RemotePolicy, Routing, forbidden_reason
from ..prefetch.catalog import BRANCH_HANDLE_PREFIX, BRANCHING_NODE_TYPES, MAX_FLOW_DEPTH, branch_index
from .cycles import always_run, exec_cycles, subflow_cycles

__all__ = [
    "HOST_RUNTIME_KEYS",
    "LLM_CALL_CONFIG_KEYS",
    "PACK_RUNTIME_KEYS",
    "CheckReport",
    "Problem",
    "check_flow",
]

Severity = Literal["error", "warning"]

_NodeIndex = Mapping[str, tuple[int, Mapping[str, object]]]
"""The flow's nodes by id: ``(index in the document's nodes list, node)``."""

LLM_CALL_CONFIG_KEYS: Final = frozenset(
    {
        # read by AbstractRuntime's visual compiler for an llm_call node (executor._create_llm_call_handler)
        "provider",
        "model",
        "temperature",
        "seed",
        "thinking",
        "speculation",
        "tools",
        "include_context",
        "use_context",
        "max_input_tokens",
        "maxInputTokens",
        "max_output_tokens",
        "maxOutputTokens",
        "output",
        "outputs",
        "structured_output_fallback",
        # read by the compiler for every effect node
        "continueOnError",
        "continue_on_error",
        # read by this pack's LLM_CALL handler from the flow JSON
        "base_url",
        "server_base_url",
        "prompt_cache_key",
    }
)
"""``effectConfig`` keys somebody reads for an ``llm_call`` node; any other key is ignored silently."""

HOST_RUNTIME_KEYS: Final = frozenset(
    {
        # run-level settings AbstractRuntime 0.13 reads from vars["_runtime"]
        "speculation",
        "thinking",
        "stream",
        "prompt_cache",
        "provider",
        "model",
        "system_prompt",
        "allowed_tools",
        "tool_policy",
        "untrusted_input",
        "history_window_tokens",
        "disable_input_trimming",
        "max_attachment_bytes",
        "audio_policy",
        "audio_language",
        "stt_language",
        "session_history",
        "inbox",
        "control",
        "automation",
        "automation_context",
        "entity",
        "agora_agent",
        "turn_id",
        "llm_payload_extras",
        "email_account",
        "email_allowed_recipients",
        "operator_email",
        "workspace_read_only",
        "workspace_read_only_paths",
        "workspace_writable_paths",
        "active_memory",
        "memory_spans",
        # bookkeeping the runtime writes itself
        "effect_seq",
        "node_traces",
        "pending_media",
        "workflow_snapshot",
        "steer_watermark",
        "wait_until_streak",
        "evidence_warnings",
        "evidence_warnings_dropped",
    }
)
"""Keys of ``vars["_runtime"]`` that AbstractRuntime reads or writes."""

PACK_RUNTIME_KEYS: Final = frozenset({"base_url", "server_base_url", "mlx_pack", "prompt_cache_key"})
"""Keys of ``vars["_runtime"]`` this pack reads."""

LLM_NODE_TYPES: Final = frozenset({"llm_call", "agent"})
_CONTROL_PINS: Final = (
    "speculation",
    "thinking",
    "temperature",
    "seed",
    "max_output_tokens",
    "max_out_tokens",
    "max_input_tokens",
)
_SEED_RANDOM: Final = -1  # the compiler's default seed: "no seed"
DEFAULT_PROBE_TIMEOUT_S: Final = 2.0


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding. ``field`` is a path into the flow document (``edges[3].target``,
    ``nodes[2].data.effectConfig.speculation.num_draft_tokens``) or into the run vars
    (``vars._runtime.speculaton``)."""

    code: str
    message: str
    node_id: str | None = None
    label: str | None = None
    field: str | None = None
    severity: Severity = "error"

    def render(self) -> str:
        where = ""
        if self.node_id is not None:
            where = f"node {self.node_id!r}" + (f" ({self.label})" if self.label and self.label != self.node_id else "")
        if self.field:
            where = f"{where} {self.field}" if where else self.field
        return f"{self.severity}: {where + ': ' if where else ''}{self.message} [{self.code}]"


@dataclass(frozen=True, slots=True)
class CheckReport:
    flow_id: str | None
    source: str | None
    problems: tuple[Problem, ...] = field(default_factory=tuple)

    @property
    def errors(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.severity == "error")

    @property
    def warnings(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.severity == "warning")

    @property
    def ok(self) -> bool:
        """No errors (warnings do not block a run)."""
        return not self.errors

    def to_dict(self) -> JSONObject:
        return {
            "flow_id": self.flow_id,
            "source": self.source,
            "ok": self.ok,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "problems": [asdict(p) for p in self.problems],
        }

    def render(self) -> str:
        name = self.source or self.flow_id or "flow"
        lines = [p.render() for p in self.problems]
        verdict = "ok" if self.ok else "not runnable"
        lines.append(f"{name}: {verdict} ({len(self.errors)} errors, {len(self.warnings)} warnings)")
        return "\n".join(lines)

    def raise_for_problems(self) -> CheckReport:
        """Raise ``InvalidFlow`` (carrying every problem) when there is an error; else return self."""
        if not self.ok:
            first = self.errors[0]
            more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
            raise InvalidFlow(
                f"flow {self.flow_id or self.source!r} cannot run: {first.render()}{more}",
                details=self.to_dict(),
            )
        return self


# --------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------


class _Findings:
    def __init__(self, nodes: _NodeIndex) -> None:
        self.items: list[Problem] = []
        self._nodes = nodes

    def add(
        self,
        code: str,
        message: str,
        *,
        node: str | None = None,
        field: str | None = None,
        severity: Severity = "error",
    ) -> None:
        label = None
        if node is not None and node in self._nodes:
            label = _label(self._nodes[node][1])
            if field is not None and field.startswith(("data", "type")):
                field = f"nodes[{self._nodes[node][0]}].{field}"
        self.items.append(Problem(code, message, node, label, field, severity))


def check_flow(
    source: str | Path | Mapping[str, object],
    *,
    vars: Mapping[str, object] | None = None,
    model: str | None = None,
    force_model: bool = False,
    default_base_url: str | None = None,
    probe_remote: bool = False,
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
    resolve_model: Callable[[str], object] | None = None,
    routes: Sequence[str] = (),
    flows_dir: str | Path | None = None,
    allow_network_tools: bool = False,
    remote: RemotePolicy | None = None,
) -> CheckReport:
    """Check ``source`` (a path, a JSON string or a dict) for a run with ``vars``.

    ``model``/``force_model``/``default_base_url`` mean what they mean to ``run_flow``: the
    default model of nodes that name none (or of every node), and the server nodes are sent to.
    ``routes`` are ``run --route`` specs; with ``model``/``force_model`` they decide which model
    serves each node (``routing.Routing``, the rule the handler applies).
    ``resolve_model`` finds a model on this machine or raises ``ModelNotFound``
    (default: ``artifacts.resolve_model_path``, offline). ``probe_remote=True`` sends one
    ``GET /health`` to each allowed remote ``base_url`` (nothing is contacted otherwise).
    ``flows_dir`` is where subflows are found (default: the flow file's directory); a node
    naming a tool that reaches outside this machine is an error unless ``allow_network_tools``.
    ``remote``: the servers the user allowed (``routing.RemotePolicy``; default none, the
    ``routes`` URLs and ``default_base_url`` are allowed): a ``base_url`` of the flow or of
    ``vars._runtime`` outside it is an error.
    """
    shown = str(source) if isinstance(source, (str, Path)) and not str(source).lstrip().startswith("{") else None
    raw, load_error = _load(source)
    if raw is None:
        return CheckReport(None, shown, (Problem("invalid_document", load_error or "not a VisualFlow"),))
    flow_id = as_str(raw.get("id"))
    nodes, findings = _index_nodes(raw)
    _check_document(raw, findings)
    _check_edges(raw, nodes, findings)
    _check_with_compiler(raw, nodes, findings)
    _check_exec_cycles(raw, findings, subflow=None)
    _check_format_templates(raw, nodes, findings)
    routing = Routing.build(
        default_model=model,
        serve_all=force_model,
        routes=routes,
        remote=(remote or RemotePolicy()).with_urls([default_base_url]),
    )
    if isinstance(raw.get("id"), str) and isinstance(raw.get("nodes"), list):
        if flows_dir is None and shown is not None:
            flows_dir = Path(shown).expanduser().resolve().parent
        _check_bundle(
            raw, nodes, findings, flows_dir=flows_dir, allow_network_tools=allow_network_tools, remote=routing.remote
        )
    run_vars = dict(vars or {})
    _check_runtime_vars(run_vars, findings, remote=routing.remote)
    _check_llm_nodes(
        nodes,
        run_vars,
        findings,
        routing=routing,
        default_base_url=default_base_url,
        probe_remote=probe_remote,
        probe_timeout_s=probe_timeout_s,
        resolve_model=resolve_model or _default_resolve_model,
        edges=array_at(raw, "edges"),
    )
    return CheckReport(flow_id, shown, tuple(findings.items))


def _check_bundle(
    raw: Mapping[str, object],
    nodes: _NodeIndex,
    findings: _Findings,
    *,
    flows_dir: str | Path | None,
    allow_network_tools: bool,
    remote: RemotePolicy,
) -> None:
    """Subflows that cannot be found or that call themselves, the subflows' execution cycles,
    knowledge-graph memory, servers the user did not allow, and tools that reach outside this
    machine (``run``'s rules)."""
    from ..hosting.host import FlowBundle, kg_memory_uses, network_tool_uses, remote_targets, subflow_calls

    try:
        bundle = FlowBundle.resolve(raw, flows_dir=flows_dir)
    except ValueError as exc:
        node = _named_node(str(exc), nodes)
        findings.add("subflow_not_found", str(exc), node=node, field="data.subflowId" if node else None)
        return
    for flow_id, flow in bundle.subflows().items():
        _check_exec_cycles(flow, findings, subflow=flow_id)
    reached = {flow_id: always_run(flow) for flow_id, flow in bundle.flows.items()}
    for cycle in subflow_cycles(subflow_calls(bundle)):
        path = " -> ".join(f"{flow_id!r} (node {node_id!r})" for flow_id, node_id in cycle)
        root_hops = [node_id for flow_id, node_id in cycle if flow_id == bundle.root_id]
        endless = all(node_id in reached.get(flow_id, ()) for flow_id, node_id in cycle)
        findings.add(
            "recursive_subflow",
            f"subflows call themselves: {path} -> {cycle[0][0]!r}; "
            + (
                "every run makes the call, so each starts a run one level deeper, without end"
                if endless
                else "a condition of the flow decides each call, so it must end the recursion; run --max-depth stops it otherwise"
            ),
            node=root_hops[0] if root_hops else None,
            field="data.subflowId" if root_hops else None,
            severity="error" if endless else "warning",
        )
    for flow_id, node_id, where, url in remote_targets(bundle):
        here = flow_id == bundle.root_id
        try:
            remote.check(url, where="the node" if here else f"node {node_id!r} of subflow {flow_id!r}")
        except RemoteNotAllowed as exc:
            findings.add(exc.code, exc.message, node=node_id if here else None, field=where if here else None)
    for flow_id, node_id in kg_memory_uses(bundle):
        here = flow_id == bundle.root_id
        findings.add(
            "kg_memory",
            "uses knowledge-graph memory (a memory_kg node, or use_kg_memory), which needs a memory service this pack does not wire"
            + ("" if here else f" (in subflow {flow_id!r}, node {node_id!r})"),
            node=node_id if here else None,
        )
    if allow_network_tools:
        return
    for flow_id, node_id, tool in network_tool_uses(bundle):
        here = flow_id == bundle.root_id
        findings.add(
            "network_tool",
            f"uses {tool!r}, a tool that reaches outside this machine"
            + ("" if here else f" (in subflow {flow_id!r}, node {node_id!r})")
            + "; pass --allow-network-tools to allow it",
            node=node_id if here else None,
        )


def _check_format_templates(raw: Mapping[str, object], nodes: _NodeIndex, findings: _Findings) -> None:
    """``format`` nodes whose template the host's ``template.format(**values)`` would fail on:
    a brace that is not a placeholder (``Answer as JSON like {"a": 1}``: write ``{{``, ``}}``),
    a malformed template, or a placeholder the node's own ``values`` do not have (when no wire
    brings the values)."""
    wired = {
        str(e.get("target")) + ":" + str(e.get("targetHandle"))
        for e in array_at(raw, "edges")
        if isinstance(e, Mapping)
    }
    for node_id, (_, node) in nodes.items():
        if node.get("type") != "format" or f"{node_id}:template" in wired:
            continue
        defaults = object_at(object_at(node, "data"), "pinDefaults")
        template = defaults.get("template")
        if not isinstance(template, str):
            continue
        field = "data.pinDefaults.template"
        try:
            parts = [(name, spec) for _, name, spec, _ in string.Formatter().parse(template) if name is not None]
        except ValueError as exc:
            findings.add(
                "invalid_format_template",
                f"the template is not a format template ({exc}); write {{{{ and }}}} for literal braces",
                node=node_id,
                field=field,
            )
            continue
        fields = [re.split(r"[.\[]", name, maxsplit=1)[0] for name, _ in parts]
        odd = [
            f"{{{name}{':' + spec if spec else ''}}}"
            for (name, spec), head in zip(parts, fields, strict=True)
            if not head.isidentifier()
        ]
        if odd:
            findings.add(
                "invalid_format_template",
                f"{odd[0]} is not a placeholder (the host's str.format would fail on it); write {{{{ and }}}} for literal braces",
                node=node_id,
                field=field,
            )
            continue
        values = defaults.get("values")
        if isinstance(values, Mapping) and f"{node_id}:values" not in wired:
            missing = sorted({f for f in fields if f not in values})
            if missing:
                findings.add(
                    "invalid_format_template",
                    f"the template reads {', '.join(repr(m) for m in missing)}, which its values do not have "
                    "(the host's str.format would raise KeyError)",
                    node=node_id,
                    field=field,
                )


def _check_exec_cycles(flow: Mapping[str, object], findings: _Findings, *, subflow: str | None) -> None:
    """Execution wires in a cycle that no loop node or loop limit bounds (``cycles.exec_cycles``)."""
    for cycle in exec_cycles(flow):
        path = " -> ".join(repr(node_id) for node_id in [*cycle, cycle[0]])
        findings.add(
            "exec_cycle",
            f"execution wires go round {path}"
            + ("" if subflow is None else f" in subflow {subflow!r}")
            + " with no loop node or loop limit to end it: the run would never end (repeat inside a "
            "loop/for/while node's body, or put a loop limit on one of these wires)",
            node=cycle[0] if subflow is None else None,
        )


def _load(source: str | Path | Mapping[str, object]) -> tuple[dict[str, object] | None, str | None]:
    too_deep = f"nests deeper than {MAX_FLOW_DEPTH} levels; a VisualFlow never does"
    if isinstance(source, Mapping):
        return (None, f"the flow {too_deep}") if nests_deeper_than(source, MAX_FLOW_DEPTH) else (dict(source), None)
    text = str(source)
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            return None, f"not valid JSON: {exc}"
        except RecursionError:
            return None, f"the flow {too_deep}"
    else:
        path = Path(text).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None, f"no flow file at {path}"
        except (OSError, UnicodeDecodeError) as exc:
            return None, f"cannot read {path}: {exc}"
        except json.JSONDecodeError as exc:
            return None, f"{path} is not valid JSON: {exc}"
        except RecursionError:
            return None, f"{path} {too_deep}"
    if nests_deeper_than(data, MAX_FLOW_DEPTH):
        return None, f"the flow {too_deep}"
    if not isinstance(data, dict):
        return None, f"a VisualFlow is a JSON object, not {type(data).__name__}"
    return data, None


def _label(node: Mapping[str, object]) -> str | None:
    data = object_at(node, "data")
    for value in (data.get("label"), node.get("label")):
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def _index_nodes(raw: Mapping[str, object]) -> tuple[dict[str, tuple[int, Mapping[str, object]]], _Findings]:
    nodes: dict[str, tuple[int, Mapping[str, object]]] = {}
    duplicates: list[tuple[int, str]] = []
    malformed: list[tuple[int, str]] = []
    raw_nodes = raw.get("nodes")
    for i, node in enumerate(raw_nodes if isinstance(raw_nodes, list) else []):
        if not isinstance(node, Mapping):
            malformed.append((i, f"node is a {type(node).__name__}, not an object"))
            continue
        node_id = node.get("id")
        if not isinstance(node_id, str) or not node_id.strip():
            malformed.append((i, "node has no id (the host skips it)"))
            continue
        if node_id in nodes:
            duplicates.append((i, node_id))
            continue
        nodes[node_id] = (i, node)
    findings = _Findings(nodes)
    for i, message in malformed:
        findings.add("invalid_node", message, field=f"nodes[{i}]")
    for i, node_id in duplicates:
        findings.add(
            "duplicate_node_id",
            f"node id {node_id!r} is used by nodes[{nodes[node_id][0]}] too",
            field=f"nodes[{i}].id",
        )
    for node_id, (_, node) in nodes.items():
        node_type = node.get("type")
        if not isinstance(node_type, str) or not node_type.strip():
            findings.add("invalid_node", "node has no type", node=node_id, field="type")
        if "data" in node and not isinstance(node.get("data"), Mapping):
            findings.add("invalid_node", "node data must be an object", node=node_id, field="data")
    return nodes, findings


def _check_document(raw: Mapping[str, object], findings: _Findings) -> None:
    flow_id = raw.get("id")
    if not isinstance(flow_id, str) or not flow_id.strip():
        findings.add(
            "invalid_document", "the flow has no 'id' (AbstractRuntime uses it as the workflow id)", field="id"
        )
    if not isinstance(raw.get("nodes"), list):
        findings.add("invalid_document", "'nodes' must be a list of nodes", field="nodes")
    if "edges" in raw and not isinstance(raw.get("edges"), list):
        findings.add("invalid_document", "'edges' must be a list of edges", field="edges")


def _pins(node: Mapping[str, object], side: str) -> set[str] | None:
    """The declared pin ids of one side (``inputs``/``outputs``), or None when the node declares none."""
    data = object_at(node, "data")
    inputs, outputs = data.get("inputs"), data.get("outputs")
    if not (isinstance(inputs, list) and inputs) and not (isinstance(outputs, list) and outputs):
        return None  # hand-written flows often declare no pins: nothing to compare with
    pins = data.get(side)
    return (
        {str(p.get("id")) for p in pins if isinstance(p, Mapping) and p.get("id")} if isinstance(pins, list) else set()
    )


def _check_edges(raw: Mapping[str, object], nodes: _NodeIndex, findings: _Findings) -> None:
    edges = array_at(raw, "edges")
    for i, edge in enumerate(edges):
        where = f"edges[{i}]"
        if not isinstance(edge, Mapping):
            findings.add("invalid_edge", f"edge is a {type(edge).__name__}, not an object", field=where)
            continue
        ends = {}
        for end, handle_key, side in (("source", "sourceHandle", "outputs"), ("target", "targetHandle", "inputs")):
            node_id = edge.get(end)
            handle = edge.get(handle_key)
            if not isinstance(node_id, str) or not node_id.strip():
                findings.add("invalid_edge", f"edge has no {end} (the host drops it)", field=f"{where}.{end}")
                continue
            ends[end] = node_id
            if node_id not in nodes:
                hint = _did_you_mean(node_id, nodes)
                findings.add(
                    "edge_to_missing_node",
                    f"{end} {node_id!r} is not a node of this flow{hint}",
                    field=f"{where}.{end}",
                )
                continue
            if not isinstance(handle, str) or not handle.strip():
                findings.add(
                    "invalid_edge",
                    f"edge has no {handle_key} (the host drops it)",
                    node=node_id,
                    field=f"{where}.{handle_key}",
                )
                continue
            if side == "outputs" and not _valid_branch_handle(nodes[node_id][1], handle):
                findings.add(
                    "invalid_edge",
                    f"{handle_key} {handle!r} is not a branch handle: a {nodes[node_id][1].get('type')} node's branches "
                    f"are {BRANCH_HANDLE_PREFIX}N with N in ASCII digits (then:0, then:1, ...)",
                    node=node_id,
                    field=f"{where}.{handle_key}",
                )
                continue
            pins = _pins(nodes[node_id][1], side)
            if pins is not None and handle not in pins and not _implicit_pin(nodes[node_id][1], handle, side):
                # Saved pin lists are editor snapshots (the host renames and adds pins), so a
                # data handle outside them may still carry a value: a warning, not an error.
                hint = _did_you_mean(handle, pins)
                findings.add(
                    "edge_to_missing_pin",
                    f"{handle_key} {handle!r} is not a declared pin of node {node_id!r}{hint}; "
                    "the wire carries a value only if the node's output has that key",
                    node=node_id,
                    field=f"{where}.{handle_key}",
                    severity="warning",
                )


def _valid_branch_handle(node: Mapping[str, object], handle: str) -> bool:
    """False for a ``then:`` handle of a branching node whose N is not ASCII digits (``then:²``)."""
    if node.get("type") not in BRANCHING_NODE_TYPES or not handle.startswith(BRANCH_HANDLE_PREFIX):
        return True
    return branch_index(handle) is not None


def _implicit_pin(node: Mapping[str, object], handle: str, side: str) -> bool:
    # Pins every execution node has even when the editor did not list them.
    return handle in ("exec-in", "exec-out") and side == ("inputs" if handle == "exec-in" else "outputs")


def _check_with_compiler(raw: Mapping[str, object], nodes: _NodeIndex, findings: _Findings) -> None:
    """What AbstractRuntime's own compiler says: unknown node types, graph errors, ignored nodes."""
    from abstractruntime.visualflow_compiler import compile_flow, load_visualflow_json, visual_to_flow

    wired = _wired_nodes(raw)
    unknown = False
    for node_id, (_, node) in nodes.items():
        node_type = node.get("type")
        if isinstance(node_type, str) and node_type.strip() and not _compiler_knows(node_type.strip()):
            unknown = True
            hint = _did_you_mean(node_type, _KNOWN_TYPE_HINTS)
            findings.add(
                "unknown_node_type",
                f"AbstractRuntime's compiler has no node type {node_type!r}{hint}"
                + ("" if node_id in wired else " (not wired: the host skips it)"),
                node=node_id,
                field="type",
                severity="error" if node_id in wired else "warning",
            )
    if not isinstance(raw.get("id"), str) or not isinstance(raw.get("nodes"), list):
        return  # reported above; the compiler cannot read the document
    document = dict(raw)
    if unknown:
        # The compiler stops at the first unknown type. For the rest of its verdict (what the
        # entry reaches) stand a plain execution node in for each unknown one.
        document["nodes"] = [
            {**n, "type": _STAND_IN_TYPE} if isinstance(n, Mapping) and _is_unknown(n) else n
            for n in array_at(raw, "nodes")
        ]
    try:
        flow = visual_to_flow(load_visualflow_json(document))
    except Exception as exc:  # noqa: BLE001 - the compiler's own refusal is the finding
        if not unknown:
            findings.add("compile_error", _compiler_message(exc), node=_named_node(str(exc), nodes))
        return
    ignored = {n for n in getattr(flow, "_ignored_exec_nodes", None) or () if n in nodes}
    _report_unreachable(raw, ignored, _live_nodes(raw, set(getattr(flow, "nodes", {}) or {}), ignored), wired, findings)
    if unknown:
        return
    try:
        compile_flow(flow)
    except Exception as exc:  # noqa: BLE001
        findings.add("compile_error", _compiler_message(exc), node=_named_node(str(exc), nodes))


def _live_nodes(raw: Mapping[str, object], compiled: set[str], ignored: set[str]) -> set[str]:
    """Nodes that take part in a run: the execution nodes the compiler kept, and the data
    nodes whose outputs reach one of them (transitively)."""
    feeds: dict[str, set[str]] = {}
    for edge in array_at(raw, "edges"):
        if isinstance(edge, Mapping) and edge.get("targetHandle") != "exec-in":
            feeds.setdefault(str(edge.get("target")), set()).add(str(edge.get("source")))
    live = set(compiled)
    todo = list(compiled)
    while todo:
        for source in feeds.get(todo.pop(), ()):
            if source not in live and source not in ignored:
                live.add(source)
                todo.append(source)
    return live


def _report_unreachable(
    raw: Mapping[str, object], ignored: set[str], live: set[str], wired: set[str], findings: _Findings
) -> None:
    """Execution nodes the entry cannot reach (the compiler drops them without a word).

    An error when a node that does run reads one of their outputs (it would read nothing, as
    after a mistyped exec wire); otherwise a warning: a dead branch, or a chain started by
    another trigger node (``on_event``, a second ``on_flow_start``) that ``run`` does not fire.
    """
    consumers: dict[str, list[str]] = {}
    for edge in array_at(raw, "edges"):
        if isinstance(edge, Mapping) and edge.get("targetHandle") != "exec-in":
            consumers.setdefault(str(edge.get("source")), []).append(str(edge.get("target")))
    for node_id in sorted(ignored):
        if node_id not in wired:
            findings.add("unreachable_node", "node has no wires; the host ignores it", node=node_id, severity="warning")
            continue
        readers = sorted({t for t in consumers.get(node_id, ()) if t in live and t != node_id})
        if readers:
            findings.add(
                "unreachable_node",
                f"no execution path from the entry node reaches this node, so it never runs, yet "
                f"{', '.join(repr(r) for r in readers)} read{'s' if len(readers) == 1 else ''} its output "
                "(check the exec wires into it and the flow's entryNode)",
                node=node_id,
            )
        else:
            findings.add(
                "unreachable_node",
                "no execution path from the entry node reaches this node: it never runs in this run",
                node=node_id,
                severity="warning",
            )


_STAND_IN_TYPE: Final = "answer_user"  # an execution node the compiler knows, for reachability only


def _is_unknown(node: Mapping[str, object]) -> bool:
    node_type = node.get("type")
    return isinstance(node_type, str) and bool(node_type.strip()) and not _compiler_knows(node_type.strip())


def _compiler_message(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"AbstractRuntime's compiler refuses the flow: {text}"


def _named_node(message: str, nodes: Iterable[str]) -> str | None:
    quoted = [n for n in nodes if f"'{n}'" in message]
    return quoted[0] if len(quoted) == 1 else None


def _wired_nodes(raw: Mapping[str, object]) -> set[str]:
    out: set[str] = set()
    for edge in array_at(raw, "edges"):
        if isinstance(edge, Mapping):
            out.update(str(edge.get(end)) for end in ("source", "target") if edge.get(end))
    return out


_KNOWN_TYPE_HINTS: Final = (
    "on_flow_start",
    "on_flow_end",
    "llm_call",
    "agent",
    "subflow",
    "parallel",
    "sequence",
    "if",
    "switch",
    "loop",
    "while",
    "for",
    "code",
    "function",
    "ask_user",
    "answer_user",
    "emit_event",
    "wait_event",
    "wait_until",
    "tool_calls",
    "call_tool",
    "set_var",
    "get_var",
    "literal_string",
    "literal_number",
    "literal_json",
    "concat",
    "memory_note",
    "memory_query",
)


@functools.lru_cache(maxsize=1024)
def _compiler_knows(node_type: str) -> bool:
    """Whether AbstractRuntime's compiler has a handler for ``node_type``: the compiler is asked
    with a two-node probe flow (it refuses a wired unknown type with ``UnknownNodeTypeError``)."""
    from abstractruntime.visualflow_compiler import compile_visualflow
    from abstractruntime.visualflow_compiler.visual.models import UnknownNodeTypeError

    probe = {
        "id": "abstractruntime-mlx-type-probe",
        "entryNode": "start",
        "nodes": [
            {"id": "start", "type": "on_flow_start", "data": {}},
            {"id": "probe", "type": node_type, "data": {}},
        ],
        "edges": [{"source": "start", "sourceHandle": "exec-out", "target": "probe", "targetHandle": "exec-in"}],
    }
    try:
        compile_visualflow(probe)
    except UnknownNodeTypeError:
        return False
    except Exception:  # noqa: BLE001 - a known type that needs configuration the probe lacks
        return True
    return True


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --------------------------------------------------------------------------------------
# Run vars and LLM nodes
# --------------------------------------------------------------------------------------


def _check_runtime_vars(run_vars: Mapping[str, object], findings: _Findings, *, remote: RemotePolicy) -> None:
    runtime_ns = run_vars.get("_runtime")
    if runtime_ns is None:
        return
    if not isinstance(runtime_ns, Mapping):
        findings.add("invalid_vars", "_runtime must be an object of run-level settings", field="vars._runtime")
        return
    known = HOST_RUNTIME_KEYS | PACK_RUNTIME_KEYS
    for key in runtime_ns:
        if key not in known:
            hint = _did_you_mean(key, known)
            findings.add(
                "unknown_runtime_key",
                f"neither AbstractRuntime nor this pack reads _runtime.{key}{hint}; it would be ignored",
                field=f"vars._runtime.{key}",
            )
    _check_controls(runtime_ns, findings, prefix="vars._runtime", node=None)
    stream = runtime_ns.get("stream")
    if stream is not None and not isinstance(stream, bool):
        findings.add("invalid_controls", "_runtime.stream must be true or false", field="vars._runtime.stream")
    for key in ("base_url", "server_base_url"):
        value = runtime_ns.get(key)
        if value is not None and not (isinstance(value, str) and value.strip()):
            findings.add("invalid_controls", f"_runtime.{key} must be a URL string", field=f"vars._runtime.{key}")
        elif isinstance(value, str):
            try:
                remote.check(value.strip(), where=f"_runtime.{key}")
            except RemoteNotAllowed as exc:
                findings.add(exc.code, exc.message, field=f"vars._runtime.{key}")


def _positive_int(key: str) -> Callable[[object], None]:
    def check(value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidControls(f"{key} must be an integer >= 1", field=key, value=value)

    return check


def _prompt_cache_key(value: object) -> None:
    # "" (all whitespace, or a non-string) turns reuse off for the node, as the host reads it: only a key is checked.
    if isinstance(value, str) and value.strip():
        check_prompt_cache_key(value)


def _seed(value: object) -> Sampling | None:
    return None if value == _SEED_RANDOM else normalize_sampling(seed=value)


_CONTROL_RULES: Final[dict[str, Callable[[object], object]]] = {
    "speculation": normalize_speculation,
    "thinking": normalize_thinking,
    "temperature": lambda v: normalize_sampling(temperature=v),
    "seed": _seed,
    "prompt_cache_key": _prompt_cache_key,
    **{
        key: _positive_int(key)
        for key in (
            "max_output_tokens",
            "maxOutputTokens",
            "max_out_tokens",
            "max_input_tokens",
            "maxInputTokens",
            "max_iterations",
        )
    },
}


def _check_controls(source: Mapping[str, object], findings: _Findings, *, prefix: str, node: str | None) -> None:
    """Speculation, thinking and sampling values, as our controls accept them."""
    for key, value in source.items():
        rule = _CONTROL_RULES.get(key)
        if rule is None or value is None:
            continue
        try:
            rule(value)
        except InvalidControls as exc:
            where, hint = key, ""
            if key == "speculation" and exc.field and exc.field.startswith("speculation."):
                where = exc.field
                if exc.field.split(".", 1)[1] not in SPECULATION_KEYS:
                    hint = _did_you_mean(exc.field.split(".", 1)[1], SPECULATION_KEYS)
            findings.add("invalid_controls", exc.message + hint, node=node, field=f"{prefix}.{where}")


def _check_llm_nodes(
    nodes: _NodeIndex,
    run_vars: Mapping[str, object],
    findings: _Findings,
    *,
    routing: Routing,
    default_base_url: str | None,
    probe_remote: bool,
    probe_timeout_s: float,
    resolve_model: Callable[[str], object],
    edges: Sequence[object] = (),
) -> None:
    """Every node that makes LLM calls (``LLM_NODE_TYPES``): its config keys (llm_call), its
    controls and limits, then where its calls go (``_check_route``). An Agent's calls are its
    ReAct run's: provider/model from its ``pinDefaults`` (which win, as in the host) or
    ``agentConfig``; they go to the server every node goes to (``--base-url``) or stay here, as
    the handler sends them (the agent's child run carries no ``base_url`` of its own)."""
    runtime_ns = object_at(run_vars, "_runtime")
    run_base_url = _first_str(runtime_ns.get("base_url"), runtime_ns.get("server_base_url"), default_base_url)
    seen = _RouteCache()
    for node_id, (_, node) in nodes.items():
        node_type = node.get("type")
        if node_type not in LLM_NODE_TYPES:
            continue
        data = object_at(node, "data")
        config_key = "effectConfig" if node_type == "llm_call" else "agentConfig"
        config = data.get(config_key)
        if config is None:
            config = {}
        if not isinstance(config, Mapping):
            findings.add("invalid_node", f"{config_key} must be an object", node=node_id, field=f"data.{config_key}")
            continue
        if node_type == "llm_call":
            for key in config:
                if key not in LLM_CALL_CONFIG_KEYS:
                    hint = _did_you_mean(key, LLM_CALL_CONFIG_KEYS)
                    findings.add(
                        "unknown_config_key",
                        f"nobody reads effectConfig.{key}{hint}; it would be ignored",
                        node=node_id,
                        field=f"data.effectConfig.{key}",
                    )
        pins = object_at(data, "pinDefaults")
        control_pins = _CONTROL_PINS if node_type == "llm_call" else (*_CONTROL_PINS, *_AGENT_LIMIT_PINS)
        limits = {} if node_type == "llm_call" else {k: config[k] for k in _AGENT_LIMIT_PINS if k in config}
        _check_controls(
            {**{k: v for k, v in config.items() if k not in _AGENT_LIMIT_PINS}, **limits},
            findings,
            prefix=f"data.{config_key}",
            node=node_id,
        )
        _check_controls(
            {k: pins[k] for k in control_pins if k in pins}, findings, prefix="data.pinDefaults", node=node_id
        )
        if node_type == "llm_call":
            model = config.get("model")
            provider_field, model_field = "data.effectConfig.provider", "data.effectConfig.model"
            decision_args = (config.get("provider"), model if isinstance(model, str) and model else None)
            explicit = _first_str(config.get("base_url"), config.get("server_base_url"), run_base_url)
        else:
            _check_agent_inputs(node_id, edges, findings)
            provider_field, provider = _agent_setting(pins, config, "provider")
            model_field, model = _agent_setting(pins, config, "model")
            decision_args = (provider, model if isinstance(model, str) and model else None)
            explicit = _first_str(default_base_url)
        _check_route(
            node_id,
            decision_args,
            explicit,
            findings,
            routing=routing,
            config=config,
            runtime_ns=runtime_ns,
            default_base_url=default_base_url,
            provider_field=provider_field,
            model_field=model_field,
            probe_remote=probe_remote,
            probe_timeout_s=probe_timeout_s,
            resolve_model=resolve_model,
            seen=seen,
        )


AGENT_INPUT_PINS: Final = frozenset(
    {
        # what AbstractRuntime 0.13's Agent input handler passes on to the agent
        # (visualflow_compiler/visual/executor.py, _create_agent_input_handler)
        "exec-in",
        "prompt",
        "task",  # read through host_shims (the host itself reads only "prompt")
        "context",
        "provider",
        "model",
        "system",
        "tools",
        "max_iterations",
        "max_in_tokens",
        "max_input_tokens",
        "maxInputTokens",
        "max_out_tokens",
        "max_output_tokens",
        "maxOutputTokens",
        "temperature",
        "seed",
        "thinking",
        "speculation",
        "prompt_cache_binding",
        "resp_schema",
        "response_schema",
        "include_context",
        "use_context",
        "memory",
        "use_session_attachments",
        "use_span_memory",
        "use_semantic_search",
        "use_kg_memory",
        "memory_query",
        "memory_scope",
        "recall_level",
        "max_span_messages",
        "kg_max_input_tokens",
        "kg_limit",
        "kg_min_score",
    }
)
"""Input pins of an Agent node whose value reaches the agent; a wire into any other is dropped."""

_AGENT_LIMIT_PINS: Final = ("max_iterations",)


def _agent_setting(pins: Mapping[str, object], config: Mapping[str, object], key: str) -> tuple[str, object]:
    """An Agent's provider or model as the host picks it: the pin default, else ``agentConfig``."""
    value = pins.get(key)
    if isinstance(value, str) and value.strip():
        return f"data.pinDefaults.{key}", value
    return f"data.agentConfig.{key}", config.get(key)


def _check_agent_inputs(node_id: str, edges: Sequence[object], findings: _Findings) -> None:
    """A wire into an Agent input the host never passes on carries no value to the agent."""
    for i, edge in enumerate(edges):
        if not isinstance(edge, Mapping) or edge.get("target") != node_id:
            continue
        handle = edge.get("targetHandle")
        if isinstance(handle, str) and handle.strip() and handle not in AGENT_INPUT_PINS:
            hint = _did_you_mean(handle, AGENT_INPUT_PINS)
            findings.add(
                "unread_input",
                f"the wire into input {handle!r} can never carry a value: the host's Agent node does not read that input{hint}",
                node=node_id,
                field=f"edges[{i}].targetHandle",
                severity="warning",
            )


@dataclass
class _RouteCache:
    """What was already looked up, per check: models on disk, servers probed, models served."""

    models: dict[str, str | None] = field(default_factory=dict)
    urls: dict[str, _Probe] = field(default_factory=dict)
    served: dict[tuple[str, str], str | None] = field(default_factory=dict)


def _check_route(
    node_id: str,
    asked: tuple[object, str | None],
    explicit: str | None,
    findings: _Findings,
    *,
    routing: Routing,
    config: Mapping[str, object],
    runtime_ns: Mapping[str, object],
    default_base_url: str | None,
    provider_field: str,
    model_field: str,
    probe_remote: bool,
    probe_timeout_s: float,
    resolve_model: Callable[[str], object],
    seen: _RouteCache,
) -> None:
    """Where one LLM node's calls go (``routing.decide``, the handler's rule): a provider not
    served here, a model not on this machine, and (``probe_remote``) a server that does not
    answer or does not serve the model."""
    try:
        decision = routing.decide(asked[0], asked[1], explicit_base_url=explicit)
    except InvalidRequest as exc:
        findings.add("provider_not_served", exc.message, node=node_id, field=provider_field)
        return
    base_url = decision.base_url
    if base_url is not None:
        if probe_remote and routing.remote.allows(base_url) and forbidden_reason(base_url) is None:
            if base_url not in seen.urls:
                seen.urls[base_url] = _probe_url(base_url, probe_timeout_s)
            probe = seen.urls[base_url]
            if probe.error is not None:
                findings.add(
                    "remote_unreachable",
                    f"the server at {base_url} does not answer ({probe.error})",
                    node=node_id,
                    field=_base_url_field(config, runtime_ns, default_base_url),
                )
            elif probe.ours and decision.model is not None:
                key = (base_url, decision.model)
                if key not in seen.served:
                    seen.served[key] = _model_not_served(base_url, decision.model, probe_timeout_s)
                if seen.served[key] is not None:
                    findings.add("model_not_served", str(seen.served[key]), node=node_id, field=model_field)
        return
    chosen = decision.model
    if chosen is None:
        findings.add(
            "no_model",
            "the node names no model and the run has no default model (--model)",
            node=node_id,
            field=model_field,
        )
        return
    if chosen not in seen.models:
        try:
            resolve_model(chosen)
            seen.models[chosen] = None
        except MLXRuntimeError as exc:
            seen.models[chosen] = exc.message
    if seen.models[chosen] is not None:
        where = {"node model": model_field, "--model": "--model", "default model": "--model"}.get(
            decision.rule, decision.rule
        )
        findings.add("model_not_found", str(seen.models[chosen]), node=node_id, field=where)


def _base_url_field(config: Mapping[str, object], runtime_ns: Mapping[str, object], default: str | None) -> str:
    for key in ("base_url", "server_base_url"):
        if _first_str(config.get(key)):
            return f"data.effectConfig.{key}"
    for key in ("base_url", "server_base_url"):
        if _first_str(runtime_ns.get(key)):
            return f"vars._runtime.{key}"
    return "--base-url" if default else "base_url"


def _first_str(*values: object) -> str | None:
    for value in values:
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def _default_resolve_model(name: str) -> Path:
    from ...artifacts import resolve_model_path

    return resolve_model_path(name)


@dataclass(frozen=True, slots=True)
class _Probe:
    """What one ``GET /health`` found: ``error`` (why nothing answered) or whether an
    abstractruntime-mlx server answered (``ours``: it can be asked which models it serves)."""

    error: str | None
    ours: bool = False


def _probe_url(base_url: str, timeout_s: float) -> _Probe:
    """Whether anything answers HTTP at ``base_url`` (any status), and whether it is our server."""
    import httpx

    url = base_url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        return _Probe("not an http(s) URL")
    try:
        response = httpx.get(f"{url}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        return _Probe(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    try:
        body = response.json()
    except ValueError:
        return _Probe(None)
    return _Probe(None, ours=isinstance(body, dict) and body.get("server") == "abstractruntime-mlx")


def _model_not_served(base_url: str, model: str, timeout_s: float) -> str | None:
    """Why the abstractruntime-mlx server at ``base_url`` cannot serve ``model`` (its capabilities
    route answers ``model_not_found``), else None (served, or the server would not say)."""
    import httpx

    try:
        response = httpx.get(
            f"{base_url.rstrip('/')}/v1/models/execution-capabilities",
            params={"model_name": model, "provider": "mlx"},
            timeout=timeout_s,
        )
        body = response.json() if response.status_code == 404 else None
    except (httpx.HTTPError, ValueError):
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("code") == "model_not_found":
        return f"the server at {base_url} does not serve model {model!r}: {error.get('message')}"
    return None


def problems_of(reports: Sequence[CheckReport]) -> list[Problem]:
    """Every problem of several reports, in order."""
    return [p for r in reports for p in r.problems]
