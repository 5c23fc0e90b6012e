"""Error bodies in the wire each route family speaks (one place for every route and the auth middleware).

Every error starts as this server's ``{"error": {"message", "type", "code", "details"?}}``
(``wire.error_payload``); the Anthropic routes (``/v1/messages...``) answer
``{"type": "error", "error": {"type", "message", "code", "details"?}}``, the Ollama routes
(``/api/...``) ``{"error": "<message>", "code", "details"?}``. The stable ``code`` travels in
every shape; the HTTP status is the same in all three.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..json_values import JSONObject, JSONValue
from .wire import error_payload

ANTHROPIC_PREFIX: Final = "/v1/messages"
OLLAMA_PREFIX: Final = "/api/"

_ANTHROPIC_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status."""
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def _inner(payload: Mapping[str, JSONValue]) -> Mapping[str, JSONValue]:
    inner = payload.get("error")
    return inner if isinstance(inner, Mapping) else {"message": str(inner)}


def anthropic_error_body(status: int, payload: Mapping[str, JSONValue]) -> JSONObject:
    inner = _inner(payload)
    error: JSONObject = {
        "type": anthropic_error_type(status),
        "message": inner.get("message"),
        "code": inner.get("code"),
    }
    if inner.get("details") is not None:
        error["details"] = inner["details"]
    return {"type": "error", "error": error}


def ollama_error_body(payload: Mapping[str, JSONValue]) -> JSONObject:
    inner = _inner(payload)
    body: JSONObject = {"error": inner.get("message"), "code": inner.get("code")}
    if inner.get("details") is not None:
        body["details"] = inner["details"]
    return body


def error_body_for(path: str, status: int, payload: Mapping[str, JSONValue]) -> JSONObject:
    """``payload`` (this server's error body) in the shape the route at ``path`` speaks."""
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error_body(status, payload)
    if path.startswith(OLLAMA_PREFIX):
        return ollama_error_body(payload)
    return dict(payload)


def dialect_error_response(path: str, exc: BaseException) -> JSONResponse:
    """The JSON error answer to ``exc`` for the route at ``path``."""
    status, payload = error_payload(exc)
    return JSONResponse(error_body_for(path, status, payload), status_code=status)


def reshape_error(path: str, response: Response) -> Response:
    """``response`` as it is, unless it is one of this server's JSON error answers: then the same
    error in the shape the route at ``path`` speaks."""
    if response.status_code < 400 or not isinstance(response, JSONResponse):
        return response
    payload = json.loads(bytes(response.body))
    if not isinstance(payload, dict) or "error" not in payload:
        return response
    return JSONResponse(error_body_for(path, response.status_code, payload), status_code=response.status_code)


def dialect_route(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """``endpoint`` with every failure in its route family's error shape (Anthropic's or Ollama's, by path)."""

    async def run(request: Request) -> Response:
        try:
            response = await endpoint(request)
        except Exception as exc:  # noqa: BLE001 - unexpected ones are logged by error_payload
            return dialect_error_response(request.url.path, exc)
        return reshape_error(request.url.path, response)

    run.__name__ = getattr(endpoint, "__name__", "endpoint")
    return run
