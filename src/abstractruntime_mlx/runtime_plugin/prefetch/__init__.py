"""What the flow's graph lets the pack do before the runtime gets there.

- ``catalog``: flows by id (``load_flow``) and what the handler knows of a registered flow
  (``FlowCatalog`` / ``FlowIndex``: node configs, predictable later siblings);
- ``prediction``: a later ``llm_call`` branch's payload, computed from the flow alone;
- ``prefetch``: ``SiblingPrefetcher`` runs those branches early, so siblings meet in one batch;
- ``prompt_cache``: each call's prompt-cache key, derived as the host derives it.

The lowest layer of ``runtime_plugin``: it imports neither ``adapter`` nor ``hosting``.
"""

from __future__ import annotations

from .catalog import FlowCatalog, FlowIndex, load_flow
from .prediction import Unpredictable, plan_payload, resolve_payload
from .prefetch import PrefetchStats, SiblingPrefetcher
from .prompt_cache import CallIdentity, node_prompt_cache_key

__all__ = [
    "CallIdentity",
    "FlowCatalog",
    "FlowIndex",
    "PrefetchStats",
    "SiblingPrefetcher",
    "Unpredictable",
    "load_flow",
    "node_prompt_cache_key",
    "plan_payload",
    "resolve_payload",
]
