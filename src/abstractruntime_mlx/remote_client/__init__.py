"""HTTP clients for ``abstractruntime-mlx serve`` and AbstractCore servers (see ``docs/remote-client.md``)."""

from __future__ import annotations

from ._base import DEFAULT_TIMEOUT, ClientState
from .client import AsyncChunkStream, AsyncRemoteClient, RemoteClient, SyncChunkStream

__all__ = ["DEFAULT_TIMEOUT", "AsyncChunkStream", "AsyncRemoteClient", "ClientState", "RemoteClient", "SyncChunkStream"]
