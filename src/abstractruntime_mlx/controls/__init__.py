"""Speculation / thinking / sampling controls and the precedence resolver (no I/O, no MLX).

See ``docs/controls.md``.
"""

from __future__ import annotations

from .models import (
    SAMPLING_FIELDS,
    SPECULATION_KEYS,
    SPECULATION_MODES,
    THINKING_LEVELS,
    Sampling,
    SpeculationControl,
    ThinkingValue,
    merge_speculation,
    normalize_max_output_tokens,
    normalize_sampling,
    normalize_speculation,
    parse_speculation_option,
    normalize_stop,
    normalize_thinking,
)
from .resolve import (
    DEFAULT_DRAFT_TOKENS,
    LEVELS,
    NOTHING_SAID,
    SPECULATION_OFF_REASONS,
    SPECULATION_SOURCES,
    THINKING_SOURCES,
    UNSET,
    VERIFIED_DEFAULT,
    ControlLevel,
    ResolvedControls,
    Unset,
    control_level,
    resolve_controls,
    resolve_speculation,
    resolve_thinking,
)

__all__ = [
    "DEFAULT_DRAFT_TOKENS",
    "LEVELS",
    "NOTHING_SAID",
    "SAMPLING_FIELDS",
    "SPECULATION_KEYS",
    "SPECULATION_MODES",
    "SPECULATION_OFF_REASONS",
    "SPECULATION_SOURCES",
    "THINKING_LEVELS",
    "THINKING_SOURCES",
    "UNSET",
    "VERIFIED_DEFAULT",
    "ControlLevel",
    "ResolvedControls",
    "Sampling",
    "SpeculationControl",
    "ThinkingValue",
    "Unset",
    "control_level",
    "merge_speculation",
    "normalize_max_output_tokens",
    "normalize_sampling",
    "normalize_speculation",
    "parse_speculation_option",
    "normalize_stop",
    "normalize_thinking",
    "resolve_controls",
    "resolve_speculation",
    "resolve_thinking",
]
