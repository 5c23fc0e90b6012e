"""The run inspector: a read-only web view of a ledger (``abstractruntime-mlx runs web``).

Pages (HTML with the first data embedded, then kept live by server-sent events)::

    GET /                          run list: top-level runs, each with its child runs
                                   (filters, on the top-level runs: ?status=completed&workflow=mlx_fanout)
    GET /runs/{run_id}             timeline, per-call charts, node panel

JSON and event streams (the pages use them; so can scripts)::

    GET /api/runs                  {"runs": [...], "workflows": [...], "statuses": [...]}; each run
                                   has ``children``: its child runs (subflows, agents), nested
    GET /api/runs/stream           SSE ``runs`` events: the filtered list whenever it changes
    GET /api/runs/{run_id}         the run view (``inspection.RunView.as_dict()``)
    GET /api/runs/{run_id}/stream  SSE ``run`` events whenever the run changes (also while it
                                   waits or is interrupted: it may go on); ``end`` once it has
                                   completed, failed or been cancelled (the page stops listening)

The streams share one poller (``inspector_live``): one ledger read per interval for each list
filter or run that any stream follows, and at most ``max_streams`` streams at once.

Everything is read through the ledger's query API; nothing is written. Assets ship in the
package (``server/inspector_static``): no network at view time. With ``api_key`` every route
needs the key: ``Authorization: Bearer KEY``, or ``?key=KEY`` once in the browser (a cookie
then carries it).
"""

from __future__ import annotations

import contextlib
import hmac
import html
import json
import string
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Final
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from ..default_limits import DEFAULT_MAX_STREAMS
from ..errors import AuthenticationError, InvalidRequest, MLXRuntimeError, RunNotFound
from ..inspection import child_runs, run_tree_dicts, run_view
from ..json_values import JSONObject, JSONValue, object_at, parse_ascii_int
from ..ledger import Ledger
from .inspector_live import LivePoller, Read, Snapshot, Subscription
from .sse import SSEResponse, named_event
from .wire import error_payload

__all__ = ["DEFAULT_MAX_STREAMS", "DEFAULT_POLL_INTERVAL_S", "KEY_COOKIE", "RUN_STATUSES", "create_inspector_app"]

STATIC_DIR: Final = Path(__file__).with_name("inspector_static")
KEY_COOKIE: Final = "abstractruntime_mlx_inspector_key"
DEFAULT_POLL_INTERVAL_S: Final = 0.5
DEFAULT_LIST_LIMIT: Final = 200
MAX_LIST_LIMIT: Final = 5000
RUN_STATUSES: Final = ("running", "waiting", "interrupted", "completed", "failed", "cancelled")
MAX_FILTER_LENGTH: Final = 255


# --------------------------------------------------------------------------- auth


class InspectorAuth:
    """Pure ASGI middleware: a request needs the key as a bearer token, a ``key`` query
    parameter or the cookie set after the first ``?key=`` visit. A page opened with the right
    ``?key=`` sets the cookie and redirects to the same URL without it."""

    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    def _matches(self, value: str | bytes | None) -> bool:
        if not value:
            return False
        given = value.encode() if isinstance(value, str) else value
        return hmac.compare_digest(given.strip(), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self._matches(token):
            await self.app(scope, receive, send)
            return
        if self._matches(request.cookies.get(KEY_COOKIE)):
            await self.app(scope, receive, send)
            return
        query_key = request.query_params.get("key")
        if self._matches(query_key):
            if request.url.path.startswith("/api/") or request.method != "GET":
                await self.app(scope, receive, send)
                return
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "key"]
            target = request.url.path + (f"?{urlencode(rest)}" if rest else "")
            response: Response = RedirectResponse(target, status_code=303)
            response.set_cookie(KEY_COOKIE, query_key or "", httponly=True, samesite="strict", path="/")
            await response(scope, receive, send)
            return
        error = AuthenticationError(
            "wrong API key"
            if (token or query_key or request.cookies.get(KEY_COOKIE))
            else "this inspector needs an API key",
        )
        if request.url.path.startswith("/api/"):
            status, body = error_payload(error)
            response = JSONResponse(body, status_code=status, headers={"WWW-Authenticate": "Bearer"})
        else:
            response = _message_page(
                401,
                "API key needed",
                f"{error.message}: open this page with ?key=YOUR_KEY appended once "
                "(a cookie keeps it), or send 'Authorization: Bearer YOUR_KEY'.",
            )
        await response(scope, receive, send)


# --------------------------------------------------------------------------- inputs


def _filters(request: Request) -> tuple[str | None, str | None, int]:
    params = request.query_params
    status = params.get("status") or None
    if status is not None and status not in RUN_STATUSES:
        raise InvalidRequest(
            f"status must be one of {', '.join(RUN_STATUSES)} (got {status[:40]!r})",
            details={"field": "status", "value": status[:40]},
        )
    workflow = params.get("workflow") or None
    if workflow is not None and len(workflow) > MAX_FILTER_LENGTH:
        raise InvalidRequest(f"workflow must be at most {MAX_FILTER_LENGTH} characters", details={"field": "workflow"})
    raw_limit = params.get("limit")
    limit = DEFAULT_LIST_LIMIT
    if raw_limit is not None:
        parsed = parse_ascii_int(raw_limit)
        if parsed is None or not 1 <= parsed <= MAX_LIST_LIMIT:
            raise InvalidRequest(
                f"limit must be an integer from 1 to {MAX_LIST_LIMIT} in ASCII digits (got {raw_limit[:20]!r})",
                details={"field": "limit", "value": raw_limit[:20]},
            )
        limit = parsed
    return status, workflow, limit


def _ledger(request: Request) -> Ledger:
    ledger: Ledger = request.app.state.ledger
    return ledger


# --------------------------------------------------------------------------- data


def _runs_payload(ledger: Ledger, status: str | None, workflow: str | None, limit: int) -> JSONObject:
    """The ``limit`` most recently updated top-level runs matching the filters, each with its
    child runs nested (``children``, whatever their status or workflow)."""
    runs = ledger.list_runs(limit=limit, status=status, workflow_id=workflow, roots_only=True)
    return {
        "runs": run_tree_dicts(runs, child_runs(ledger, [r.run_id for r in runs])),
        "workflows": ledger.list_workflows(),
        "statuses": list(RUN_STATUSES),
        "filters": {"status": status, "workflow": workflow, "limit": limit},
        "ledger": ledger.url,
    }


def _run_payload(ledger: Ledger, run_id: str) -> JSONObject:
    view = run_view(ledger, run_id)
    if view is None:
        raise RunNotFound(f"no run {run_id!r} in this ledger", details={"run_id": run_id[:255]})
    return view.as_dict()


# --------------------------------------------------------------------------- pages


def _page(name: str, title: str, data: Mapping[str, JSONValue]) -> HTMLResponse:
    template = string.Template((STATIC_DIR / name).read_text(encoding="utf-8"))
    # JSON inside <script type="application/json">: "<" escaped so no "</script>" can close it.
    embedded = json.dumps(data, separators=(",", ":"), default=str).replace("<", "\\u003c")
    return HTMLResponse(template.substitute(title=html.escape(title), data=embedded))


def _message_page(status: int, title: str, message: str) -> HTMLResponse:
    body = (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<link rel='stylesheet' href='/static/inspector.css'></head><body><header><a href='/'>runs</a></header>"
        f"<main><h1>{html.escape(title)}</h1><p class='message'>{html.escape(message)}</p></main></body></html>"
    )
    return HTMLResponse(body, status_code=status)


async def list_page(request: Request) -> Response:
    status, workflow, limit = _filters(request)
    data = await run_in_threadpool(_runs_payload, _ledger(request), status, workflow, limit)
    return _page("list.html", "runs", data)


async def run_page(request: Request) -> Response:
    run_id = request.path_params["run_id"]
    data = await run_in_threadpool(_run_payload, _ledger(request), run_id)
    return _page("run.html", f"run {run_id[:8]}", data)


# --------------------------------------------------------------------------- JSON


async def runs_json(request: Request) -> Response:
    status, workflow, limit = _filters(request)
    return JSONResponse(await run_in_threadpool(_runs_payload, _ledger(request), status, workflow, limit))


async def run_json(request: Request) -> Response:
    return JSONResponse(await run_in_threadpool(_run_payload, _ledger(request), request.path_params["run_id"]))


# --------------------------------------------------------------------------- live


def _runs_read(ledger: Ledger, status: str | None, workflow: str | None, limit: int) -> Read:
    """The run-list topic's read: the filtered list, when it differs from the last one sent."""

    def read(last: Snapshot | None) -> Snapshot | None:
        payload = _runs_payload(ledger, status, workflow, limit)
        encoded = json.dumps(payload, sort_keys=True, default=str)
        if last is not None and last.marker == encoded:
            return None
        return Snapshot(encoded, (named_event("runs", payload),))

    return read


def _run_read(ledger: Ledger, run_id: str) -> Read:
    """One run's topic read: its cheap cursor, and the whole view only when the cursor moved;
    once the run has finished, the view is followed by ``end`` and the stream closes."""

    def read(last: Snapshot | None) -> Snapshot | None:
        cursor = ledger.run_cursor(run_id)
        if last is not None and last.marker == cursor:
            return None
        payload = _run_payload(ledger, run_id)
        if payload["unfinished"]:
            return Snapshot(cursor, (named_event("run", payload),))
        end = named_event("end", {"status": object_at(payload, "run").get("status")})
        return Snapshot(cursor, (named_event("run", payload), end), final=True)

    return read


def _live(request: Request) -> LivePoller:
    poller: LivePoller = request.app.state.live
    return poller


async def _follow(request: Request, subscription: Subscription) -> AsyncIterator[str]:
    """The SSE records of one stream: each new state of its topic, ``: idle`` comments between
    them (a write is how a closed connection gets noticed), until the final state or the client
    goes away."""
    interval = _live(request).interval_s
    while not await request.is_disconnected():
        snapshot = await subscription.next(timeout_s=interval)
        if snapshot is None:
            yield ": idle\n\n"
            continue
        yield "".join(snapshot.events)
        if snapshot.final:
            return


async def runs_stream(request: Request) -> Response:
    status, workflow, limit = _filters(request)
    read = _runs_read(_ledger(request), status, workflow, limit)
    subscription = _live(request).subscribe(("runs", status, workflow, limit), read)
    return SSEResponse(_follow(request, subscription), on_close=subscription.close)


async def run_stream(request: Request) -> Response:
    run_id = request.path_params["run_id"]
    ledger = _ledger(request)
    if await run_in_threadpool(ledger.run_cursor, run_id) is None:
        raise RunNotFound(f"no run {run_id!r} in this ledger", details={"run_id": run_id[:255]})
    subscription = _live(request).subscribe(("run", run_id), _run_read(ledger, run_id))
    return SSEResponse(_follow(request, subscription), on_close=subscription.close)


# --------------------------------------------------------------------------- app


def _guarded(
    endpoint: Callable[[Request], Awaitable[Response]], *, page: bool
) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        try:
            response: Response = await endpoint(request)
            return response
        except MLXRuntimeError as exc:
            if page:
                return _message_page(exc.http_status, exc.code.replace("_", " "), exc.message)
            status, body = error_payload(exc)
            return JSONResponse(body, status_code=status)

    return run


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if request.url.path.startswith("/api/"):
        code = (
            "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else "http_error"
        )
        body = {"error": {"message": str(exc.detail), "type": "invalid_request_error", "code": code}}
        return JSONResponse(body, status_code=exc.status_code)
    return _message_page(exc.status_code, str(exc.detail), f"{request.method} {request.url.path}")


def create_inspector_app(
    ledger: Ledger | str,
    *,
    api_key: str | None = None,
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
    max_streams: int = DEFAULT_MAX_STREAMS,
) -> Starlette:
    """The inspector over ``ledger`` (a ``Ledger``, left open, or a URL, opened here and closed at
    shutdown). ``poll_interval_s``: how often live pages re-read the ledger (one read per
    interval for all the streams that follow the same list or run); ``max_streams``: how many
    event streams may be open at once (one more is a 503 ``too_many_streams``)."""
    if poll_interval_s <= 0:
        raise ValueError(f"poll_interval_s must be > 0 (got {poll_interval_s})")
    live = LivePoller(interval_s=float(poll_interval_s), max_streams=max_streams)
    owned = not isinstance(ledger, Ledger)
    store = Ledger(ledger) if isinstance(ledger, str) else ledger

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await live.close()
            if owned:
                store.close()

    routes: list[Route | Mount] = [
        Route("/", _guarded(list_page, page=True), methods=["GET"]),
        Route("/runs/{run_id}", _guarded(run_page, page=True), methods=["GET"]),
        Route("/api/runs", _guarded(runs_json, page=False), methods=["GET"]),
        Route("/api/runs/stream", _guarded(runs_stream, page=False), methods=["GET"]),
        Route("/api/runs/{run_id}", _guarded(run_json, page=False), methods=["GET"]),
        Route("/api/runs/{run_id}/stream", _guarded(run_stream, page=False), methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _on_http_error}, lifespan=lifespan)
    app.state.ledger = store
    app.state.live = live
    if api_key:
        app.add_middleware(InspectorAuth, api_key=api_key)
    return app
