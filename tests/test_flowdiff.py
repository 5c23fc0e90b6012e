"""A flow's hash ignores editor-only fields; flow_changes names every node, field and wire that changed."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from abstractruntime_mlx.runtime_plugin.hosting.flowdiff import flow_changes, flow_hash

EXAMPLE = json.loads((Path(__file__).resolve().parents[1] / "examples" / "fanout.json").read_text())


def test_hash_ignores_editor_fields_and_order():
    moved = copy.deepcopy(EXAMPLE)
    moved["nodes"][2]["position"] = {"x": 10, "y": 20}
    moved["nodes"][2]["data"]["icon"] = "&#x1F4AD;"
    moved["edges"].reverse()
    moved["updated_at"] = "2026-12-01T00:00:00Z"
    assert flow_hash(moved) == flow_hash(EXAMPLE)
    assert flow_changes(EXAMPLE, moved) == []
    assert flow_hash(EXAMPLE).startswith("sha256:") and len(flow_hash(EXAMPLE)) == 71


def test_changes_name_nodes_fields_and_wires():
    edited = copy.deepcopy(EXAMPLE)
    edited["nodes"][2]["data"]["label"] = "Plain"
    edited["nodes"][2]["data"]["effectConfig"]["temperature"] = 0.7
    del edited["nodes"][3]["data"]["effectConfig"]["speculation"]
    edited["nodes"].append({"id": "extra", "type": "llm_call", "data": {}})
    edited["nodes"] = [n for n in edited["nodes"] if n["id"] != "think"]
    edited["edges"][1]["target"] = "extra"
    edited["entryNode"] = "fanout"
    assert flow_hash(edited) != flow_hash(EXAMPLE)
    assert flow_changes(EXAMPLE, edited) == [
        'entryNode "start" -> "fanout"',
        "node 'think' removed",
        "node 'extra' added (type 'llm_call')",
        'node \'mtp2\': data.effectConfig.speculation removed (was {"mode": "native_mtp", "num_draft_tokens": 2})',
        "node 'plain' (Plain): data.effectConfig.temperature 0 -> 0.7",
        "node 'plain' (Plain): data.label added (\"Plain\")",
        "wire fanout.then:0 -> plain.exec-in removed",
        "wire fanout.then:0 -> extra.exec-in added",
    ]


def test_long_change_lists_are_cut():
    edited = copy.deepcopy(EXAMPLE)
    for i in range(20):
        edited["nodes"].append({"id": f"n{i}", "type": "concat", "data": {}})
    changes = flow_changes(EXAMPLE, edited)
    assert len(changes) == 13 and changes[-1] == "... and 8 more changes"
