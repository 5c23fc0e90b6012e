"""HTTP serving: one ASGI app per resident model (see ``docs/server.md``)."""

from __future__ import annotations

from .app import DEFAULT_STREAM_INTERVAL_MS, ServedModel, create_app
from .media import MAX_IMAGE_BYTES, MAX_IMAGES, MAX_TOTAL_IMAGE_BYTES

__all__ = ["DEFAULT_STREAM_INTERVAL_MS", "MAX_IMAGES", "MAX_IMAGE_BYTES", "MAX_TOTAL_IMAGE_BYTES", "ServedModel", "create_app"]
