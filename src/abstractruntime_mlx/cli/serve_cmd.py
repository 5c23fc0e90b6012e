"""``abstractruntime-mlx serve --model M``: one resident model behind the HTTP API (uvicorn).

Binds 127.0.0.1 by default. ``--api-key`` (or ``ABSTRACTRUNTIME_MLX_API_KEY``) makes every
route but ``/health`` require ``Authorization: Bearer KEY``. Without ``--model`` the server
starts empty and waits for ``POST /acore/models/load``, which (like the capabilities route)
reaches only repo ids in the Hugging Face cache, directories under ``--model-root DIR``
(repeatable) and the ``--model`` directory itself.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidRequest
from ..json_values import JSONObject
from .args import integer

API_KEY_ENV = "ABSTRACTRUNTIME_MLX_API_KEY"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
SHUTDOWN_GRACE_S = 5


@dataclass(frozen=True, slots=True)
class ServeSettings:
    model: str | None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    log_level: str = "warning"
    stream_interval_ms: float = 5.0
    # directories /acore/models/load may read (besides the Hugging Face cache)
    model_roots: tuple[str, ...] = ()
    # create_llm options (only those given on the command line)
    options: dict[str, object] = field(default_factory=dict)


def add_parser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    parser = subparsers.add_parser("serve", help="serve one model over HTTP (OpenAI-compatible + /acore routes)")
    parser.add_argument("--model", default=None, help="checkpoint directory or Hugging Face repo id to load at start")
    parser.add_argument(
        "--model-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory whose models POST /acore/models/load may load (repeatable; the Hugging Face cache always is one)",
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"bind address (default: {DEFAULT_HOST})")
    parser.add_argument("--port", type=integer, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    parser.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    parser.add_argument(
        "--mlx-batching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="batch concurrent requests on the native lane (default: on)",
    )
    parser.add_argument("--mlx-max-batch-size", type=integer, default=None, help="batch slots (default 4)")
    parser.add_argument("--mlx-max-queue-size", type=integer, default=None, help="waiting requests (default 32)")
    parser.add_argument("--mlx-batch-wait-ms", type=float, default=None, help="collection window in ms (default 10)")
    parser.add_argument("--mlx-queue-timeout-s", type=float, default=None, help="queue timeout in s (default 120)")
    parser.add_argument("--mlx-output-queue-size", type=integer, default=None, help="buffered outputs per request (default 256)")
    parser.add_argument(
        "--mlx-sampled-exclusive",
        action="store_true",
        default=None,
        help="run sampled requests alone, one at a time, instead of in the shared batch (same tokens; default: shared)",
    )
    parser.add_argument(
        "--mlx-cache-sharing",
        choices=["scope", "key"],
        default=None,
        help="which keyed requests share identical prompt prefixes: every key of the cache scope (default), or only "
        "requests with the same prompt_cache_key (no cross-key timing side channel; for servers shared by tenants)",
    )
    parser.add_argument("--mlx-cache-scope", default=None, help="the prefix cache's partition label (default 'local')")
    parser.add_argument(
        "--mlx-cache-disk-path", default=None, metavar="DIR", help="keep prompt-cache snapshots on disk here too (SSD tier)"
    )
    parser.add_argument(
        "--speculation",
        default=None,
        help="constructor speculation: 'off', 'native_mtp', a draft depth N, 'inherit' or a JSON object (default: inherit the policy)",
    )
    parser.add_argument("--mtp-head", default=None, help="companion MTP head (repo id or directory)")
    parser.add_argument(
        "--stream-interval-ms",
        type=float,
        default=5.0,
        help="shortest gap between two text writes of one stream; faster tokens are sent together (default 5; 0 = every chunk)",
    )
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    parser.set_defaults(handler=_serve)


def settings_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServeSettings:
    env = os.environ if environ is None else environ
    options: dict[str, object] = {"mlx_batching": bool(args.mlx_batching)}
    for name in (
        "mlx_max_batch_size",
        "mlx_max_queue_size",
        "mlx_batch_wait_ms",
        "mlx_queue_timeout_s",
        "mlx_output_queue_size",
        "mlx_sampled_exclusive",
        "mlx_cache_sharing",
        "mlx_cache_scope",
        "mlx_cache_disk_path",
        "mtp_head",
    ):
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    if args.speculation is not None:
        options["speculation"] = _speculation_arg(args.speculation)
    return ServeSettings(
        model=args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key or env.get(API_KEY_ENV) or None,
        log_level=args.log_level,
        stream_interval_ms=args.stream_interval_ms,
        model_roots=tuple(args.model_root),
        options=options,
    )


def _speculation_arg(text: str) -> bool | JSONObject | None:
    from ..controls import parse_speculation_option

    control = parse_speculation_option(text, field="--speculation")
    return None if control is None else control.to_wire()


def serve(settings: ServeSettings) -> int:
    """Load the model (if any), run uvicorn until interrupted, then unload."""
    import uvicorn

    from ..provider import create_llm
    from ..server import create_app

    if not _is_loopback(settings.host) and not settings.api_key:
        print(
            f"warning: serving on {settings.host} without an API key; anyone who can reach it can use the model",
            file=sys.stderr,
        )
    for root in settings.model_roots:
        if not Path(root).expanduser().is_dir():
            raise InvalidRequest(f"--model-root {root!r} is not a directory", details={"field": "--model-root"})
    llm = create_llm("mlx", model=settings.model, **settings.options) if settings.model else None
    roots = list(settings.model_roots)
    if settings.model and Path(settings.model).expanduser().is_dir():
        roots.append(settings.model)  # it can be loaded again after an unload
    app = create_app(
        llm, api_key=settings.api_key, stream_interval_ms=settings.stream_interval_ms, model_roots=roots
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        lifespan="on",
        # Open streams are cancelled (their engine slots freed) this long after a stop signal.
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = uvicorn.Server(config)
    print(f"abstractruntime-mlx: serving {settings.model or '(no model)'} on http://{settings.host}:{settings.port}", file=sys.stderr)
    try:
        server.run()
    finally:
        if llm is not None and app.state.served.provider is llm:
            llm.unload_model(llm.model)
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _serve(args: argparse.Namespace) -> int:
    return serve(settings_from_args(args))
