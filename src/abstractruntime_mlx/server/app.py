"""The ASGI app serving the models of one ``ModelPool`` (``pool.py``: several resident models).

Routes (see ``docs/server.md``)::

    GET  /health                               never needs auth
    GET  /v1/models
    GET  /v1/models/execution-capabilities     ?model_name=&provider=mlx
    GET  /v1/models/{model_id}
    POST /v1/chat/completions                  OpenAI-compatible, stream or not (chat.py)
    POST /acore/models/load                    {model, provider?, options{}}
    POST /acore/models/unload                  {model?}
    GET  /acore/prompt_cache/stats
    POST /acore/prompt_cache/clear             {key?}
    POST /acore/prompt_cache/key_meta          {provider?, model?, key, meta}
    GET  /acore/prompt_cache/key_meta          ?key=
    POST /v1/responses                         OpenAI's Responses API (responses.py)
    POST /v1/completions                       OpenAI's text completions (completions.py)
    POST /v1/embeddings                        refused: embeddings_unsupported (embeddings.py)
    GET  /metrics                              Prometheus text format (metrics.py)
    POST /v1/messages                          Anthropic's Messages API (anthropic.py)
    POST /v1/messages/count_tokens             its prompt token count, nothing generated
    POST /api/chat, /api/generate              Ollama's API (ollama.py): NDJSON streams
    GET  /api/tags, /api/ps, /api/version; POST /api/show

Every failure is ``{"error": {"message", "type", "code"}}`` with the error's HTTP status (in
Anthropic's and Ollama's shapes on their routes, ``dialects.py``);
after the first SSE byte it is a ``data: {"error": ...}`` event followed by ``[DONE]`` (an
``error`` event on ``/v1/responses``). The three generating routes (chat, responses,
completions) run their call through ``calls.serve_call``: one provider pump, one SSE record
loop; each route only parses its body and renders the answer (a ``calls.WireRenderer``).
Generation runs through the provider's ``agenerate_request`` on the event loop (the engine's
worker thread does the MLX work), so concurrent requests reach the engine together and are batched.
Nothing a request carries is worked on by the loop itself: bodies are decoded on a thread, and
a ``response_format`` schema is checked (within ``structured``'s limits) on the schema threads.
A client that disconnects cancels its request: the ``cancel_event`` is set and the provider
stream closed, which frees the engine slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Final, cast

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..capabilities import get_execution_capabilities
from ..controls import normalize_speculation
from ..errors import AuthenticationError, InvalidRequest, ModelNotFound, ResidencyConflict
from ..json_values import JSONObject, JSONValue
from ..request import MAX_PROMPT_CACHE_KEY_CHARS
from .anthropic import count_tokens, create_message
from .chat import chat_completions
from .completions import create_completion
from .dialects import error_body_for
from .edge import (
    MAX_BODY_BYTES,  # noqa: F401 - re-exported: the body limit of every route
    ServedProvider,
    error_response,
    pool_of,
    read_body,
    served_provider,
)
from .embeddings import create_embeddings
from .keep_alive import parse_keep_alive
from .load_policy import client_load_options, option_equal
from .memory import machine_memory
from .metrics import MetricsMiddleware, ServerMetrics, metrics_endpoint
from .model_roots import ModelRoots
from .ollama import ollama_chat, ollama_generate, ollama_ps, ollama_show, ollama_tags, ollama_version
from .pool import UNSET, KeepAlive, ModelPool, ModelSpec, ModelState, PoolSettings, provider_health
from .responses import create_response
from .schemas import (
    MAX_MODEL_NAME_CHARS,
    LoadModelRequest,
    PromptCacheClearRequest,
    PromptCacheKeyMetaRequest,
    UnloadModelRequest,
    parse_body,
)
from .serve_ledger import ServeLedger
from .wire import error_payload, now_s

# Tokens of one stream arriving faster than this are written together. Real models stream
# slower than 200 tokens/s per request, so only very fast streams (the tiny test models) are
# affected; it halves the per-token HTTP cost there. 0 = one write per chunk.
DEFAULT_STREAM_INTERVAL_MS: Final = 5.0
MAX_KEY_META_ENTRIES: Final = 4096
MAX_KEY_META_BYTES: Final = 16 * 1024
RESERVED_META_KEYS: Final = frozenset(
    {"fed_token_ids", "fed_token_count", "backend", "token_count", "provider", "model"}
)
PUBLIC_PATHS: Final = frozenset({"/health"})


ModelFactory = Callable[..., ServedProvider]
"""``factory(model, **options)``: builds the provider ``/acore/models/load`` asks for."""


def _default_factory(model: str, **options: object) -> ServedProvider:
    from ..provider import create_llm

    return create_llm("mlx", model=model, **options)


def _remember_key_meta(
    store: OrderedDict[str, dict[str, object]], key: str, meta: Mapping[str, object]
) -> dict[str, object]:
    merged = {**store.pop(key, {}), **meta}
    store[key] = merged
    while len(store) > MAX_KEY_META_ENTRIES:
        store.popitem(last=False)
    return merged


def _differing_options(provider: ServedProvider, requested: Mapping[str, object]) -> dict[str, dict[str, object]]:
    """Requested options whose value differs from the resident one (``{name: {resident, requested}}``)."""
    resident = dict(getattr(provider, "execution_options", None) or {})
    out: dict[str, dict[str, object]] = {}
    for name, value in requested.items():
        if name == "speculation":
            hook = getattr(provider, "speculation_default", None)
            have = normalize_speculation(hook() if callable(hook) else None)
            want = normalize_speculation(value)
            if have != want:
                out[name] = {"resident": None if have is None else have.to_wire(), "requested": value}
            continue
        have_value = resident.get(name, getattr(provider, name, None))
        if not option_equal(have_value, value):
            out[name] = {"resident": have_value, "requested": value}
    return out


# --------------------------------------------------------------------------- auth


class BearerAuth:
    """Pure ASGI middleware: every HTTP path except ``/health`` needs ``Authorization: Bearer KEY``
    (or ``x-api-key: KEY``, the header Anthropic's clients send)."""

    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        api_key = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization" and not given:
                given = value
            elif name == b"x-api-key" and not api_key:
                api_key = value
        scheme, _, token = given.partition(b" ")
        bearer_ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        accepted = bearer_ok or (bool(api_key) and hmac.compare_digest(api_key.strip(), self._key))
        given = given or api_key
        if not accepted:
            error = AuthenticationError(
                "missing or wrong API key: send 'Authorization: Bearer <key>'"
                if given
                else "this server needs an API key: send 'Authorization: Bearer <key>'"
            )
            status, body = error_payload(error)
            shaped = error_body_for(scope["path"], status, body)
            response = JSONResponse(shaped, status_code=status, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------- helpers


def _resident_provider(pool: ModelPool, requested: str | None) -> ServedProvider:
    """The resident model ``requested`` names (default: the default model), never loading one."""
    found = pool.find(requested)
    if found is None or found.provider is None:
        shown = "the default model" if not requested else repr(requested)
        names = [m.name for m in pool.resident()]
        raise ModelNotFound(f"{shown} is not loaded on this server (resident: {names or 'none'}); load it first")
    return served_provider(found)


# --------------------------------------------------------------------------- routes


async def health(request: Request) -> Response:
    """200 while the server can serve; 503 when every resident model failed (unload and load it again).

    ``model``/``model_state`` describe the default model; ``models`` every known model and its
    residency; ``memory`` the budget the pool loads against."""
    pool = pool_of(request)
    models = pool.models()
    resident = [m for m in models if m.provider is not None]
    default = pool.find(None)
    body: JSONObject = {
        "status": "healthy",
        "server": "abstractruntime-mlx",
        "model": default.name if default is not None and default.provider is not None else None,
        "loaded": bool(resident),
        "models": [{"id": m.name, **m.to_dict()} for m in models],
        "memory": pool.memory(await asyncio.to_thread(machine_memory)),
    }
    if default is not None and default.provider is not None:
        model_health = provider_health(served_provider(default))
        if model_health is not None:
            body["model_state"] = model_health["state"]
    failed = [m for m in resident if m.state is ModelState.FAILED]
    if resident and len(failed) == len(resident):
        first = provider_health(served_provider(failed[0])) or {}
        body.update(status="unhealthy", error=first.get("error"))
        return JSONResponse(body, status_code=503)
    return JSONResponse(body)


async def list_models(request: Request) -> Response:
    """Every model this server knows: resident ones and those it loads on first request."""
    pool = pool_of(request)
    created = request.app.state.created
    data: list[JSONValue] = [
        {"id": m.name, "object": "model", "created": created, "owned_by": "abstractruntime-mlx", **m.to_dict()}
        for m in pool.models()
    ]
    return JSONResponse({"object": "list", "data": data})


async def retrieve_model(request: Request) -> Response:
    """OpenAI's model object of one model the server knows (by any name it answers to: its
    name, an alias, a path); 404 ``model_not_found`` for any other."""
    asked = str(request.path_params["model_id"])
    known = pool_of(request).find(asked) if len(asked) <= MAX_MODEL_NAME_CHARS else None
    if known is None:
        raise ModelNotFound(
            f"no model {asked[:MAX_MODEL_NAME_CHARS]!r} on this server", details={"model": asked[:MAX_MODEL_NAME_CHARS]}
        )
    created = request.app.state.created
    return JSONResponse(
        {"id": known.name, "object": "model", "created": created, "owned_by": "abstractruntime-mlx", **known.to_dict()}
    )


async def execution_capabilities(request: Request) -> Response:
    pool = pool_of(request)
    asked = request.query_params.get("model_name") or request.query_params.get("model") or pool.default_name()
    provider_name = request.query_params.get("provider") or "mlx"
    if not asked:
        raise InvalidRequest("model_name is required when no model is loaded", details={"field": "model_name"})
    if len(asked) > MAX_MODEL_NAME_CHARS:
        raise InvalidRequest(
            f"model_name is longer than {MAX_MODEL_NAME_CHARS} characters", details={"field": "model_name"}
        )
    known = pool.find(asked)
    instance = None if known is None or known.provider is None else served_provider(known)
    if instance is not None:
        name = str(instance.model)
    elif known is not None:
        name = known.source
    else:
        name = await asyncio.to_thread(pool.roots.resolve, asked, field="model_name")
    caps = await asyncio.to_thread(get_execution_capabilities, name, provider=provider_name, instance=instance)
    residency: JSONObject = (
        {"state": ModelState.UNLOADED.value, "loadable": True}
        if known is None
        else {"id": known.name, **known.to_dict()}
    )
    return JSONResponse({**caps, "residency": residency})


async def load_model(request: Request) -> Response:
    body = parse_body(LoadModelRequest, await read_body(request))
    keep_alive: KeepAlive = None if body.pin else UNSET
    if body.keep_alive is not None:
        keep_alive = parse_keep_alive(body.keep_alive)
    pool = pool_of(request)
    # What a client may set (load_policy.py); the operator's options stay under it.
    options = client_load_options(body.checked_options(), operator=pool.operator_options(body.model))
    known = pool.find(body.model)
    if known is not None and known.provider is not None and known.state is not ModelState.FAILED:
        provider = served_provider(known)
        differing = _differing_options(provider, options)
        if differing:
            raise ResidencyConflict(
                f"{known.name!r} is resident with different execution options {differing}; "
                "changing resident execution options requires unloading first (POST /acore/models/unload)"
            )
    loaded = await pool.load(body.model, options if options or known is None else None, keep_alive=keep_alive)
    provider = cast(ServedProvider, loaded.provider)
    return JSONResponse(
        {
            "ok": True,
            "success": True,
            "loaded_new": loaded.loaded_new,
            "provider": "mlx",
            "model": loaded.name,
            "options": _json_safe(getattr(provider, "execution_options", {})),
            "concurrency": bool(provider.supports_concurrent_generation()),
        }
    )


async def unload_model(request: Request) -> Response:
    body = parse_body(UnloadModelRequest, await read_body(request))
    if body.force:
        raise InvalidRequest("force unload is not supported: close or cancel the active streams, then unload")
    pool = pool_of(request)
    if body.model is not None and pool.find(body.model) is None:
        raise ModelNotFound(f"{body.model!r} is not a model of this server")
    names = await pool.unload(body.model) if body.model is not None or pool.resident() else []
    return JSONResponse(
        {
            "ok": True,
            "success": True,
            "unloaded": bool(names),
            "model": names[0] if len(names) == 1 else None,
            "models": list(names),
        }
    )


async def prompt_cache_stats(request: Request) -> Response:
    provider = _resident_provider(pool_of(request), request.query_params.get("model"))
    stats = await asyncio.to_thread(provider.get_prompt_cache_stats)
    return JSONResponse({"supported": bool(stats.get("enabled")), "operation": "stats", "stats": _json_safe(stats)})


async def prompt_cache_clear(request: Request) -> Response:
    body = parse_body(PromptCacheClearRequest, await read_body(request))
    provider = _resident_provider(pool_of(request), body.model)
    result = await asyncio.to_thread(provider.prompt_cache_clear, body.key)
    cleared = bool(result.get("cleared"))
    return JSONResponse({"supported": cleared, "operation": "clear", "ok": cleared, "result": _json_safe(result)})


async def prompt_cache_key_meta(request: Request) -> Response:
    key_meta: OrderedDict[str, dict[str, object]] = request.app.state.key_meta
    if request.method == "GET":
        key = (request.query_params.get("key") or "").strip()  # the form every edge gives a key
        if not key:
            raise InvalidRequest("key is required")
        if len(key) > MAX_PROMPT_CACHE_KEY_CHARS:
            raise InvalidRequest(f"key is {len(key):,} characters; the limit is {MAX_PROMPT_CACHE_KEY_CHARS}")
        if key not in key_meta:
            raise ModelNotFound(f"no metadata is stored for prompt cache key {key!r}")
        return JSONResponse({"ok": True, "operation": "key_meta", "key": key, "meta": key_meta[key]})
    body = parse_body(PromptCacheKeyMetaRequest, await read_body(request))
    if body.model and pool_of(request).find(body.model) is None:
        raise ModelNotFound(f"{body.model!r} is not a model of this server")
    reserved = sorted(k for k in body.meta if k in RESERVED_META_KEYS)
    if reserved:
        raise InvalidRequest(f"meta field(s) {reserved} are reserved cache bookkeeping and cannot be set")
    size = len(json.dumps(body.meta, default=str).encode())
    if size > MAX_KEY_META_BYTES:
        raise InvalidRequest(f"meta is {size} bytes serialized; the limit is {MAX_KEY_META_BYTES}")
    merged = _remember_key_meta(key_meta, body.key, body.meta)
    return JSONResponse({"ok": True, "supported": True, "operation": "key_meta", "key": body.key, "meta": merged})


def _json_safe(value: object) -> JSONValue:
    safe: JSONValue = json.loads(json.dumps(value, default=str))
    return safe


# --------------------------------------------------------------------------- app


def _guarded(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Render every failure of ``endpoint`` as the JSON error body (typed errors keep their status)."""

    async def run(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception as exc:  # noqa: BLE001 - unexpected ones are logged by error_payload
            return error_response(exc)

    run.__name__ = getattr(endpoint, "__name__", "endpoint")
    return run


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse(
        {
            "error": {
                "message": f"{exc.detail}: {request.method} {request.url.path}",
                "type": "invalid_request_error",
                "code": code,
            }
        },
        status_code=exc.status_code,
    )


def create_app(
    provider_instance: ServedProvider | None = None,
    *,
    api_key: str | None = None,
    model_factory: ModelFactory | None = None,
    stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS,
    model_roots: Iterable[str | os.PathLike[str]] = (),
    models: Sequence[ModelSpec] = (),
    aliases: Mapping[str, str] | None = None,
    residency: PoolSettings | None = None,
    serve_ledger: ServeLedger | None = None,
) -> Starlette:
    """The ASGI app serving ``provider_instance`` (or none until ``/acore/models/load``).

    ``model_factory(model, **options)`` builds a provider for ``/acore/models/load``; the
    default is ``abstractruntime_mlx.create_llm("mlx", model=..., **options)``. With
    ``api_key`` every route but ``/health`` needs ``Authorization: Bearer <api_key>``.
    A provider this app loaded is unloaded at shutdown; ``provider_instance`` stays the
    caller's to unload. ``stream_interval_ms`` is the shortest gap between two text writes
    of one SSE stream (tokens arriving faster are sent together; 0 = one write per chunk).
    Load and capabilities reach only repo ids in the Hugging Face cache and directories
    under ``model_roots`` (see ``model_roots.py``); ``provider_instance`` is exempt.

    ``models`` are the models this server knows by name (``serve --model NAME=PATH``), loaded
    on first request (``app.state.pool.preload`` loads some at once); ``aliases`` map other
    names to them; ``residency`` sets the memory budget, the default keep-alive and the
    options of models loaded by name only (``pool.py``). ``provider_instance`` is pinned.
    ``serve_ledger`` records every served call (``serve_ledger.py``); it is closed (its last
    records written) when the app shuts down, its ledger stays the caller's.
    """
    if stream_interval_ms < 0:
        raise ValueError("stream_interval_ms must be >= 0")
    pool = ModelPool(
        factory=model_factory or _default_factory,
        roots=ModelRoots.with_hub_cache(model_roots),
        settings=residency,
        specs=models,
        aliases=aliases,
        instance=provider_instance,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        reaper = asyncio.create_task(pool.run_reaper(), name="keep-alive reaper")
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            await pool.shutdown()
            if serve_ledger is not None:
                await asyncio.to_thread(serve_ledger.close)

    routes = [
        Route(path, _guarded(endpoint), methods=methods)
        for path, endpoint, methods in (
            ("/health", health, ["GET"]),
            ("/v1/models", list_models, ["GET"]),
            ("/v1/models/execution-capabilities", execution_capabilities, ["GET"]),
            ("/v1/models/{model_id:path}", retrieve_model, ["GET"]),
            ("/v1/chat/completions", chat_completions, ["POST"]),
            ("/acore/models/load", load_model, ["POST"]),
            ("/acore/models/unload", unload_model, ["POST"]),
            ("/acore/prompt_cache/stats", prompt_cache_stats, ["GET"]),
            ("/acore/prompt_cache/clear", prompt_cache_clear, ["POST"]),
            ("/acore/prompt_cache/key_meta", prompt_cache_key_meta, ["GET", "POST"]),
            ("/v1/responses", create_response, ["POST"]),
            ("/v1/completions", create_completion, ["POST"]),
            ("/v1/embeddings", create_embeddings, ["POST"]),
            ("/metrics", metrics_endpoint, ["GET"]),
            ("/v1/messages", create_message, ["POST"]),
            ("/v1/messages/count_tokens", count_tokens, ["POST"]),
            ("/api/chat", ollama_chat, ["POST"]),
            ("/api/generate", ollama_generate, ["POST"]),
            ("/api/tags", ollama_tags, ["GET"]),
            ("/api/ps", ollama_ps, ["GET"]),
            ("/api/show", ollama_show, ["POST"]),
            ("/api/version", ollama_version, ["GET"]),
        )
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _on_http_error}, lifespan=lifespan)
    app.state.pool = pool
    app.state.key_meta = OrderedDict()
    app.state.created = now_s()
    app.state.stream_interval_s = stream_interval_ms / 1000.0
    app.state.metrics = ServerMetrics(pool)
    app.state.serve_ledger = serve_ledger
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)  # outermost: it sees every answer
    return app
