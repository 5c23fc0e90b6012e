"""A flow's identity (a content hash) and what changed between two versions of a flow.

    flow_hash(flow)                      # "sha256:<64 hex>" of the canonical JSON
    flow_changes(stored, current)        # ["node 'plain' (Plain): effectConfig.temperature 0 -> 0.7", ...]

A run stores the hash of the flow it started with (``_runtime.mlx_pack.flow_hash``) and where
the flow came from (``source``); ``runs replay`` compares them with the file as it is now and
says what changed, instead of silently resuming a graph the run never saw. Editor-only fields
(positions, colours, icons, the edge's own ``id``, ``animated``, timestamps) are not part of a
flow's identity: moving a node is not a change.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ...json_values import array_at, object_at

__all__ = ["FlowDrift", "flow_changes", "flow_drift", "flow_hash"]

_EDITOR_NODE_KEYS: Final = frozenset(
    {"position", "positionAbsolute", "selected", "dragging", "width", "height", "measured", "icon", "headerColor"}
)
_EDITOR_DATA_KEYS: Final = frozenset({"icon", "headerColor", "nodeType"})
_EDITOR_FLOW_KEYS: Final = frozenset({"created_at", "updated_at", "viewport"})
_EDGE_KEYS: Final = ("source", "sourceHandle", "target", "targetHandle")
_MAX_SHOWN: Final = 12


def _node_identity(node: Mapping[str, object]) -> dict[str, object]:
    out = {k: v for k, v in node.items() if k not in _EDITOR_NODE_KEYS}
    data = node.get("data")
    if isinstance(data, Mapping):
        out["data"] = {k: v for k, v in data.items() if k not in _EDITOR_DATA_KEYS}
    return out


def _edge_identity(edge: object) -> object:
    if not isinstance(edge, Mapping):
        return edge
    out = {k: edge.get(k) for k in _EDGE_KEYS}
    if edge.get("data"):
        out["data"] = edge["data"]
    return out


def _identity(flow: Mapping[str, object]) -> dict[str, object]:
    out = {k: v for k, v in flow.items() if k not in _EDITOR_FLOW_KEYS and k not in ("nodes", "edges")}
    nodes = array_at(flow, "nodes")
    edges = array_at(flow, "edges")
    out["nodes"] = sorted(
        (_node_identity(n) if isinstance(n, Mapping) else n for n in nodes),
        key=lambda n: json.dumps(n, sort_keys=True, default=str),
    )
    out["edges"] = sorted((_edge_identity(e) for e in edges), key=lambda e: json.dumps(e, sort_keys=True, default=str))
    return out


def flow_hash(flow: Mapping[str, object]) -> str:
    """``sha256:<hex>`` of the flow's canonical JSON, editor-only fields left out."""
    canonical = json.dumps(_identity(flow), sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _nodes(flow: Mapping[str, object]) -> dict[str, dict[str, object]]:
    nodes = array_at(flow, "nodes")
    return {str(n.get("id")): _node_identity(n) for n in nodes if isinstance(n, Mapping) and n.get("id")}


def _named(node_id: str, node: Mapping[str, object]) -> str:
    data = object_at(node, "data")
    label = data.get("label")
    return f"node {node_id!r}" + (f" ({label})" if isinstance(label, str) and label and label != node_id else "")


def _short(value: object) -> str:
    text = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _differences(prefix: str, old: object, new: object, out: list[str]) -> None:
    if old == new:
        return
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for key in sorted(set(old) | set(new), key=str):
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in old:
                out.append(f"{path} added ({_short(new[key])})")
            elif key not in new:
                out.append(f"{path} removed (was {_short(old[key])})")
            else:
                _differences(path, old[key], new[key], out)
        return
    out.append(f"{prefix or 'value'} {_short(old)} -> {_short(new)}")


def flow_changes(stored: Mapping[str, object], current: Mapping[str, object]) -> list[str]:
    """What differs from ``stored`` to ``current``, one line per change, node and field named.
    Empty when the flows are the same (editor-only fields aside)."""
    if flow_hash(stored) == flow_hash(current):
        return []
    changes: list[str] = []
    for key in ("id", "entryNode"):
        if stored.get(key) != current.get(key):
            changes.append(f"{key} {_short(stored.get(key))} -> {_short(current.get(key))}")
    old_nodes, new_nodes = _nodes(stored), _nodes(current)
    for node_id in sorted(set(old_nodes) - set(new_nodes)):
        changes.append(f"{_named(node_id, old_nodes[node_id])} removed")
    for node_id in sorted(set(new_nodes) - set(old_nodes)):
        changes.append(f"{_named(node_id, new_nodes[node_id])} added (type {new_nodes[node_id].get('type')!r})")
    for node_id in sorted(set(old_nodes) & set(new_nodes)):
        details: list[str] = []
        _differences("", old_nodes[node_id], new_nodes[node_id], details)
        changes.extend(f"{_named(node_id, new_nodes[node_id])}: {d}" for d in details)
    old_edges = {json.dumps(_edge_identity(e), sort_keys=True, default=str) for e in array_at(stored, "edges")}
    new_edges = {json.dumps(_edge_identity(e), sort_keys=True, default=str) for e in array_at(current, "edges")}
    for text, verb in [(e, "removed") for e in sorted(old_edges - new_edges)] + [
        (e, "added") for e in sorted(new_edges - old_edges)
    ]:
        edge = json.loads(text)
        if isinstance(edge, dict):
            changes.append(
                f"wire {edge.get('source')}.{edge.get('sourceHandle')} -> {edge.get('target')}.{edge.get('targetHandle')} {verb}"
            )
    skip = ("nodes", "edges", "id", "entryNode")
    others: list[str] = []
    _differences(
        "",
        {k: v for k, v in _identity(stored).items() if k not in skip},
        {k: v for k, v in _identity(current).items() if k not in skip},
        others,
    )
    changes.extend(f"flow {line}" for line in others)
    if len(changes) > _MAX_SHOWN:
        changes = changes[:_MAX_SHOWN] + [f"... and {len(changes) - _MAX_SHOWN} more changes"]
    return changes


@dataclass(frozen=True, slots=True)
class FlowDrift:
    """How the flow file a run came from differs from the flow the run started with."""

    source: str
    stored_hash: str
    current_hash: str | None
    changes: tuple[str, ...]

    def render(self, run_id: str) -> str:
        head = f"the flow file {self.source} changed since run {run_id} started"
        if self.current_hash is None:
            return f"{head}: {self.changes[0]}"
        lines = [f"{head} ({self.stored_hash[7:19]} -> {self.current_hash[7:19]}):"]
        lines.extend(f"  - {change}" for change in self.changes)
        return "\n".join(lines)


def flow_drift(
    stored: Mapping[str, object] | None, options: Mapping[str, object], *, flow_file: str | Path | None = None
) -> FlowDrift | None:
    """Compare the flow a run started with (``stored``; ``options`` are the other keys of
    ``_runtime.mlx_pack``: ``flow_hash``, ``source``) with its file as it is now (``flow_file``,
    else the stored ``source``). None: unchanged, or nothing to compare with."""
    source = flow_file if flow_file is not None else options.get("source")
    if stored is None or not isinstance(source, (str, Path)) or not str(source):
        return None
    stored_hash = str(options.get("flow_hash") or flow_hash(stored))
    path = Path(source).expanduser()
    try:
        current = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return FlowDrift(str(source), stored_hash, None, ("the file no longer exists",))
    except (OSError, ValueError) as exc:
        return FlowDrift(str(source), stored_hash, None, (f"the file cannot be read as JSON ({exc})",))
    if not isinstance(current, Mapping):
        return FlowDrift(str(source), stored_hash, None, ("the file is no longer a JSON object",))
    current_hash = flow_hash(current)
    if current_hash == stored_hash:
        return None
    changes = flow_changes(stored, current) or ["(editor-level changes only)"]
    return FlowDrift(str(source), stored_hash, current_hash, tuple(changes))
