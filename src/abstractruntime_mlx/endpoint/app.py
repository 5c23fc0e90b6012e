"""``create_app(provider_instance=llm)`` at the seed's path (``abstractcore.endpoint.app``);
the implementation is ``abstractruntime_mlx.server.app``."""

from __future__ import annotations

from ..server.app import create_app

__all__ = ["create_app"]
