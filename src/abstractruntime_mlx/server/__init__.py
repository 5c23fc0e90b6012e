"""HTTP serving: one ASGI app over a pool of resident models (see ``docs/server.md``)."""

from __future__ import annotations

from .app import DEFAULT_STREAM_INTERVAL_MS, create_app
from .media import MAX_IMAGE_BYTES, MAX_IMAGES, MAX_TOTAL_IMAGE_BYTES
from .pool import ModelCounters, ModelPool, ModelSpec, ModelState, PoolSettings, ResidentModel

__all__ = [
    "DEFAULT_STREAM_INTERVAL_MS",
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_TOTAL_IMAGE_BYTES",
    "ModelCounters",
    "ModelPool",
    "ModelSpec",
    "ModelState",
    "PoolSettings",
    "ResidentModel",
    "create_app",
]
