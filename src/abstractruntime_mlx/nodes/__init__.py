"""The LLM node: controls resolved once (value and deciding level), the local or remote
client, phase events into the ledger, the result in the shape AbstractRuntime reads.

Imports neither AbstractRuntime nor the engine. See ``docs/nodes.md``.
"""

from __future__ import annotations

from .llm_node import (
    DEFAULT_PROVIDER_OPTIONS,
    LLMNode,
    ModelLoad,
    NodeRequest,
    NodeResult,
    PreparedCall,
    ProgressRoute,
    ProviderRegistry,
    default_registry,
    resolve_node_controls,
)

__all__ = [
    "DEFAULT_PROVIDER_OPTIONS",
    "LLMNode",
    "ModelLoad",
    "NodeRequest",
    "NodeResult",
    "PreparedCall",
    "ProgressRoute",
    "ProviderRegistry",
    "default_registry",
    "resolve_node_controls",
]
