"""Speculation / thinking / sampling controls and the precedence resolver (no I/O, no MLX).

See ``docs/controls.md``.
"""

from __future__ import annotations

from .models import (
    SAMPLING_FIELDS,
    SPECULATION_KEYS,
    SPECULATION_MODES,
    THINKING_LEVELS,
    SamplingControls,
    SpeculationControl,
    ThinkingValue,
    merge_speculation,
    normalize_sampling,
    normalize_speculation,
    normalize_thinking,
)
from .resolve import (
    LEVELS,
    SPECULATION_SOURCES,
    THINKING_SOURCES,
    UNSET,
    VERIFIED_DEFAULT,
    ResolvedControls,
    resolve_controls,
    resolve_speculation,
    resolve_thinking,
)

__all__ = [
    "LEVELS",
    "SAMPLING_FIELDS",
    "SPECULATION_KEYS",
    "SPECULATION_MODES",
    "SPECULATION_SOURCES",
    "THINKING_LEVELS",
    "THINKING_SOURCES",
    "UNSET",
    "VERIFIED_DEFAULT",
    "ResolvedControls",
    "SamplingControls",
    "SpeculationControl",
    "ThinkingValue",
    "merge_speculation",
    "normalize_sampling",
    "normalize_speculation",
    "normalize_thinking",
    "resolve_controls",
    "resolve_speculation",
    "resolve_thinking",
]
