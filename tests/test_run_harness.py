"""Helpers shared by the run-lock and takeover tests (no tests here): the flow whose driver a
test stops or kills while its second LLM node runs."""

from __future__ import annotations

from typing import Any


def slow_chain(flow_id: str, *, slow_tokens: int) -> dict[str, Any]:
    """A VisualFlow of two LLM nodes: ``first`` (8 tokens), then ``slow`` (up to ``slow_tokens``,
    speculation off), whose answer is the flow's output ``story``."""
    return {
        "id": flow_id,
        "entryNode": "start",
        "nodes": [
            {"id": "start", "type": "on_flow_start", "data": {}},
            {"id": "first", "type": "llm_call", "data": {"effectConfig": {"provider": "mlx", "temperature": 0, "max_output_tokens": 8}, "pinDefaults": {"prompt": "One."}}},
            {"id": "slow", "type": "llm_call", "data": {"effectConfig": {"provider": "mlx", "temperature": 0, "max_output_tokens": slow_tokens, "speculation": False}, "pinDefaults": {"prompt": "Write a long story."}}},
            {"id": "end", "type": "on_flow_end", "data": {"inputs": [{"id": "exec-in", "type": "execution"}, {"id": "story", "type": "string"}]}},
        ],
        "edges": [
            {"source": "start", "sourceHandle": "exec-out", "target": "first", "targetHandle": "exec-in"},
            {"source": "first", "sourceHandle": "exec-out", "target": "slow", "targetHandle": "exec-in"},
            {"source": "slow", "sourceHandle": "exec-out", "target": "end", "targetHandle": "exec-in"},
            {"source": "slow", "sourceHandle": "response", "target": "end", "targetHandle": "story"},
        ],
    }
