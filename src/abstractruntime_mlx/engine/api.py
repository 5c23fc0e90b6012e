"""The engine's public face: everything the provider and the server use of ``engine/``.

Packages outside ``engine/`` import from here only (``tests/test_import_graph.py``); what is
behind it (``core/``, ``backends/``, ``model/``, ``cache/``) may move without them noticing.
"""

from __future__ import annotations

from .backends.rows import SampledLogprob
from .cache.cache_priority import validate_hints, validate_pin
from .cache.prefix_break import attribute
from .cache.prefix_cache import CacheOptions, PrefixCache, image_hash, working_set
from .cache.prefix_cache import validate_options as validate_cache_options
from .cache.report import unreached_cache_report
from .core.config import REMOVED, EngineConfig
from .core.loop import Engine
from .core.reports import SpeculationPlan, speculation_report
from .core.request import EngineRequest, FinishReason, ImagePrompt, Outcome, PrefillObservation, TokenDelta
from .core.stream import RequestStream
from .model.chat import prepare_conversation, render_prompt
from .model.model import HEAD_UPSTREAMS, LoadedModel, Upstream, load_model

__all__ = [
    "HEAD_UPSTREAMS",
    "REMOVED",
    "CacheOptions",
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "FinishReason",
    "ImagePrompt",
    "LoadedModel",
    "Outcome",
    "PrefillObservation",
    "PrefixCache",
    "RequestStream",
    "SampledLogprob",
    "SpeculationPlan",
    "TokenDelta",
    "Upstream",
    "attribute",
    "image_hash",
    "load_model",
    "prepare_conversation",
    "render_prompt",
    "speculation_report",
    "unreached_cache_report",
    "validate_cache_options",
    "validate_hints",
    "validate_pin",
    "working_set",
]
