"""Plain input types of the ledger: which node an event comes from, a queued event, and the
idempotency key AbstractRuntime's own progress records use. Shared by the store and the writer.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["NodeKey", "ProgressEvent", "host_progress_key", "progress_idempotency_key"]


@dataclass(frozen=True, slots=True)
class NodeKey:
    """Where progress events come from: one LLM node (attempt) of one run.

    ``run_id`` and ``node_id`` identify the node for ``flush``; ``step_id`` (the runtime's
    step id of the LLM_CALL STARTED record) and ``attempt`` are recorded on every row and
    make the default idempotency key deterministic.
    """

    run_id: str
    node_id: str
    workflow_id: str | None = None
    step_id: str | None = None
    attempt: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ValueError(f"NodeKey.run_id must be a non-empty string (got {self.run_id!r})")
        if not isinstance(self.node_id, str) or not self.node_id:
            raise ValueError(f"NodeKey.node_id must be a non-empty string (got {self.node_id!r})")


@dataclass(frozen=True, slots=True)
class ProgressEvent:
    """One phase event waiting to be written. ``created_at`` is ``time.time()`` when observed."""

    key: NodeKey
    event: Mapping[str, object]
    idempotency_key: str
    created_at: float


def progress_idempotency_key(key: NodeKey, event: Mapping[str, object]) -> str:
    """The default idempotency key of a progress event, in AbstractRuntime's form
    ``system:progress:<step_id>:<12 hex>`` (``<run_id>`` stands in for an unknown step id).

    Deterministic when the event says which one it is (``key.step_id`` and
    ``event["event_index"]`` known), so a retried write of the same event is stored once;
    otherwise the 12 hex digits are random and such events cannot be deduplicated. Keys are
    unique within a run.
    """
    index = event.get("event_index")
    if key.step_id is not None and index is not None:
        identity = f"progress:{key.run_id}:{key.step_id}:{key.attempt or 1}:{event.get('phase')}:{index}"
    else:
        identity = f"progress:{key.run_id}:{uuid.uuid4().hex}"
    return host_progress_key(key.step_id or key.run_id, identity)


def host_progress_key(anchor: str, identity: str) -> str:
    """``system:progress:<anchor>:<sha256(identity)[:12]>`` (migration 0002 rewrites old keys the same way)."""
    return f"system:progress:{anchor}:{hashlib.sha256(identity.encode('utf-8')).hexdigest()[:12]}"
