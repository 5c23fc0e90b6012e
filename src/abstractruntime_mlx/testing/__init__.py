"""Offline test helpers: tiny random-weight checkpoints and test images."""

from __future__ import annotations

from .tiny import KINDS, build_from_cli, companion_head_path, read_marker, tiny_image, tiny_model

__all__ = ["KINDS", "build_from_cli", "companion_head_path", "read_marker", "tiny_image", "tiny_model"]
