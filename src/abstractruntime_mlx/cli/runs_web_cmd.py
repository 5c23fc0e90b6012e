"""``abstractruntime-mlx runs web``: the read-only run inspector in a browser.

    abstractruntime-mlx runs web --ledger sqlite:///runs.sqlite            # http://127.0.0.1:8765/
    abstractruntime-mlx runs web --ledger postgresql+psycopg://u@db/ledger --port 9000 --api-key K

Binds 127.0.0.1 by default. ``--api-key`` (or ``ABSTRACTRUNTIME_MLX_API_KEY``) makes every
page and route need the key (open the printed URL once: a cookie keeps it). The ledger is opened
as ``runs list`` opens it (``ledger_location.open_for_inspection``): a SQLite file read-only, so the
inspector never writes to it, and a file that holds no ledger is refused (``ledger_not_found``).
"""

from __future__ import annotations

import argparse
import socket
import sys
from dataclasses import dataclass
from typing import Final

from ..default_limits import DEFAULT_MAX_STREAMS
from .args import integer
from .ledger_location import default_ledger_url, open_for_inspection
from .serve_cmd import API_KEY_ENV, _is_loopback

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8765
SHUTDOWN_GRACE_S: Final = 1  # open event streams only re-read the ledger; nothing to drain


@dataclass(frozen=True, slots=True)
class WebSettings:
    ledger_url: str
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    poll_interval_s: float = 0.5
    max_streams: int = DEFAULT_MAX_STREAMS
    log_level: str = "warning"


def add_parser(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    web = actions.add_parser(
        "web",
        help="browse the ledger's runs in a web page (read-only; live while runs are in progress)",
        description="Serve a read-only inspector over the ledger: run list, per-run timeline, charts and node panel.",
    )
    web.add_argument("--ledger", default=None, help="ledger URL or SQLite path")
    web.add_argument("--host", default=DEFAULT_HOST, help=f"bind address (default: {DEFAULT_HOST})")
    web.add_argument(
        "--port", type=integer, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT}; 0 picks a free one)"
    )
    web.add_argument("--api-key", default=None, help=f"require this key (default: ${API_KEY_ENV})")
    web.add_argument(
        "--poll-interval", type=float, default=0.5, help="seconds between ledger reads of a live page (default 0.5)"
    )
    web.add_argument(
        "--max-streams",
        type=integer,
        default=DEFAULT_MAX_STREAMS,
        help="live event streams open at once; one more is refused with 503 "
        f"too_many_streams (default {DEFAULT_MAX_STREAMS})",
    )
    web.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    web.set_defaults(handler=_web)


def settings_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> WebSettings:
    import os

    env = os.environ if environ is None else environ
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"error: --port must be 0..65535 (got {args.port})")
    if not args.poll_interval > 0:
        raise SystemExit(f"error: --poll-interval must be > 0 (got {args.poll_interval})")
    if args.max_streams < 1:
        raise SystemExit(f"error: --max-streams must be >= 1 (got {args.max_streams})")
    return WebSettings(
        ledger_url=default_ledger_url(args.ledger),
        host=args.host,
        port=args.port,
        api_key=args.api_key or env.get(API_KEY_ENV) or None,
        poll_interval_s=args.poll_interval,
        max_streams=args.max_streams,
        log_level=args.log_level,
    )


def serve_inspector(settings: WebSettings) -> int:
    import uvicorn

    from ..server.inspector import create_inspector_app

    ledger = open_for_inspection(settings.ledger_url)
    if not _is_loopback(settings.host) and not settings.api_key:
        print(f"warning: serving the ledger on {settings.host} without an API key", file=sys.stderr)
    app = create_inspector_app(
        ledger, api_key=settings.api_key, poll_interval_s=settings.poll_interval_s, max_streams=settings.max_streams
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        lifespan="on",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = uvicorn.Server(config)
    try:
        # Bound here so that the printed URL names the real port (also with --port 0).
        sock = socket.create_server((settings.host, settings.port))
    except OSError as exc:
        ledger.close()
        raise SystemExit(f"error: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}") from exc
    print(_announce(settings, sock.getsockname()[1]), file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        ledger.close()
    return 0


def _announce(settings: WebSettings, port: int) -> str:
    url = f"http://{settings.host}:{port}/"
    if settings.api_key:
        url += "?key=" + settings.api_key
    return f"abstractruntime-mlx: inspecting {settings.ledger_url} on {url}"


def _web(args: argparse.Namespace) -> int:
    return serve_inspector(settings_from_args(args))
