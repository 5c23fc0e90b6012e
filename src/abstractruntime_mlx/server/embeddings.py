"""``POST /v1/embeddings``: refused, with a stable code, because no model this server loads embeds.

The provider generates text only (``capabilities`` says so); answering 404 would read as a
missing route, so the route exists and says why: ``embeddings_unsupported`` (400), naming the
model the body asks for (else the server's default model).
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response

from ..errors import EmbeddingsUnsupported
from .edge import pool_of, read_body
from .schemas import MAX_MODEL_NAME_CHARS


async def create_embeddings(request: Request) -> Response:
    raw = await read_body(request)
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError:
        body = {}
    asked = body.get("model") if isinstance(body, dict) else None
    name = (
        asked.strip()[:MAX_MODEL_NAME_CHARS]
        if isinstance(asked, str) and asked.strip()
        else pool_of(request).default_name()
    )
    raise EmbeddingsUnsupported(
        f"{name or 'this server'!s} cannot embed: this server runs text-generation models only; "
        "use an embedding server for /v1/embeddings",
        details={"model": name},
    )
