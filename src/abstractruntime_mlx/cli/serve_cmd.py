"""``abstractruntime-mlx serve --model M [--model NAME=PATH ...]``: models behind the HTTP API (uvicorn).

Each ``--model`` is a model the server serves by name (``NAME=PATH``, or the path or repo id
itself); the first is loaded at start (requests naming no model go to it), the others on
their first request, and ``--pin NAME`` ones at start too (never evicted). ``--alias
ALIAS=NAME`` adds a name. ``--memory-budget`` / ``--keep-alive`` set the pool's residency rules
(``server/pool.py``). Binds 127.0.0.1 by default. ``--api-key`` (or ``ABSTRACTRUNTIME_MLX_API_KEY``) makes every
route but ``/health`` require ``Authorization: Bearer KEY``. Without ``--model`` the server
starts empty and waits for ``POST /acore/models/load``, which (like the capabilities route)
reaches only repo ids in the Hugging Face cache, directories under ``--model-root DIR``
(repeatable) and the ``--model`` directory itself. Every model load is shown on stderr
(``load_progress``); ``--log-level info`` adds uvicorn's access log (a line per request);
``--ledger URL`` records every served call (``server/serve_ledger.py``); ``--otlp URL`` sends
each one as OpenTelemetry spans when it ends (``traces/``; in a temporary ledger without
``--ledger``). ``--max-connections``, ``--header-timeout`` and ``--idle-timeout`` bound the
connections (``server/connections.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..default_limits import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS
from ..errors import InvalidRequest
from ..json_values import JSONObject
from .args import integer, number
from .runs_export_cmd import add_otlp_arguments, otlp_content, otlp_target

if TYPE_CHECKING:
    from ..provider.mlx_provider import MLXProvider
    from ..server import ModelSpec, PoolSettings
    from ..server.serve_ledger import ServeLedger
    from ..traces import OtlpTarget

API_KEY_ENV = "ABSTRACTRUNTIME_MLX_API_KEY"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
SHUTDOWN_GRACE_S = 5


@dataclass(frozen=True, slots=True)
class ServedName:
    """One ``--model NAME[=PATH]``: the name clients send and what is loaded for it."""

    name: str
    source: str


@dataclass(frozen=True, slots=True)
class ServeSettings:
    model: str | None  # the first --model's source (loaded at start)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    log_level: str = "warning"
    stream_interval_ms: float = 5.0
    # directories /acore/models/load may read (besides the Hugging Face cache)
    model_roots: tuple[str, ...] = ()
    # create_llm options (only those given on the command line), for every model
    options: dict[str, object] = field(default_factory=dict)
    models: tuple[ServedName, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    pinned: tuple[str, ...] = ()
    memory_budget_bytes: int | None = None
    keep_alive_s: float | None = None
    kv_tokens_per_row: int | None = None
    # record every served call in this ledger (``serve --ledger``); None: no recording
    ledger_url: str | None = None
    # send every served call as OpenTelemetry spans (``serve --otlp``); recorded in a temporary
    # ledger when there is no ``ledger_url``
    otlp: OtlpTarget | None = None
    # the spans carry the prompts and answers (``--otlp-content``, or the GenAI content variable)
    otlp_content: bool = False
    # connection limits (server/connections.py); max_connections None: the default, fitted to the descriptor limit
    max_connections: int | None = None
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    idle_timeout_s: int = DEFAULT_IDLE_TIMEOUT_S

    def model_specs(self) -> list[ModelSpec]:
        from ..server import ModelSpec

        return [ModelSpec(m.name, m.source, dict(self.options), pinned=m.name in self.pinned) for m in self.models]

    def pool_settings(self) -> PoolSettings:
        from ..server import PoolSettings
        from ..server.memory import DEFAULT_KV_TOKENS_PER_ROW

        return PoolSettings(
            memory_budget_bytes=self.memory_budget_bytes,
            keep_alive_s=self.keep_alive_s,
            default_options=dict(self.options),
            kv_tokens_per_row=self.kv_tokens_per_row or DEFAULT_KV_TOKENS_PER_ROW,
        )

    def preload(self) -> list[str]:
        """What ``serve`` loads at start: the first ``--model`` and every pinned one."""
        first = [self.models[0].name] if self.models else []
        return first + [name for name in self.pinned if name not in first]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("serve", help="serve models over HTTP (OpenAI-compatible + /acore routes)")
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME[=PATH]",
        help="a model to serve: a checkpoint directory or Hugging Face repo id, or NAME=PATH to serve it as NAME "
        "(repeatable; the first loads at start and takes requests that name no model, the others on first request)",
    )
    parser.add_argument(
        "--alias", action="append", default=[], metavar="ALIAS=NAME", help="another name for a --model (repeatable)"
    )
    parser.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NAME",
        help="load this --model at start and never evict it (repeatable)",
    )
    parser.add_argument(
        "--memory-budget",
        default=None,
        metavar="SIZE",
        help="memory the resident models may use (8GiB, 512MiB, bytes); a load past it evicts idle models first "
        "(default: what the machine has: its working set, and the memory available now)",
    )
    parser.add_argument(
        "--keep-alive",
        default=None,
        metavar="DURATION",
        help="how long a model stays loaded after its last request (30s, 5m, 1h; 0: unload when idle; "
        "negative: until memory is needed, the default); a request's keep_alive wins",
    )
    parser.add_argument(
        "--kv-reserve-tokens",
        type=integer,
        default=None,
        metavar="N",
        help="tokens per batch row the memory check reserves for the KV "
        "cache (default 4096, or the context if shorter)",
    )
    parser.add_argument(
        "--model-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory whose models POST /acore/models/load may load "
        "(repeatable; the Hugging Face cache always is one)",
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"bind address (default: {DEFAULT_HOST})")
    parser.add_argument("--port", type=integer, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    parser.add_argument(
        "--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})"
    )
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
    parser.add_argument(
        "--mlx-output-queue-size", type=integer, default=None, help="buffered outputs per request (default 256)"
    )
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
        "--mlx-cache-disk-path",
        default=None,
        metavar="DIR",
        help="keep prompt-cache snapshots on disk here too (SSD tier)",
    )
    parser.add_argument(
        "--speculation",
        default=None,
        help="constructor speculation: 'off', 'native_mtp', a draft depth N, "
        "'inherit' or a JSON object (default: inherit the policy)",
    )
    parser.add_argument("--mtp-head", default=None, help="companion MTP head (repo id or directory)")
    parser.add_argument(
        "--stream-interval-ms",
        type=float,
        default=5.0,
        help="shortest gap between two text writes of one stream; faster "
        "tokens are sent together (default 5; 0 = every chunk)",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level; 'info' adds its access log, one line per request (default: warning)",
    )
    parser.add_argument(
        "--ledger",
        default=None,
        metavar="URL_OR_PATH",
        help="record every served call in this ledger (a run per X-Session-Affinity "
        "session, else per request), for runs list/show/web",
    )
    add_otlp_arguments(parser)
    _add_connection_arguments(parser)
    parser.set_defaults(handler=_serve)


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """The connection limits (``server/connections.py``): bounded before any route or the API key runs."""
    parser.add_argument(
        "--max-connections",
        type=integer,
        default=None,
        metavar="N",
        help="open connections at most; past it the oldest one waiting for a request header "
        "is closed, or (every one busy) the new one gets 503 too_many_connections "
        f"(default {DEFAULT_MAX_CONNECTIONS}, kept below the open-file limit)",
    )
    parser.add_argument(
        "--header-timeout",
        type=number,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help=f"a connection's request header must be complete this long after it opens or after its last response, "
        f"else it is closed (default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--idle-timeout",
        type=integer,
        default=DEFAULT_IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help="an HTTP keep-alive connection that sends nothing this long after a "
        f"response is closed (default {DEFAULT_IDLE_TIMEOUT_S})",
    )


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
    models = tuple(_served_name(text) for text in args.model)
    names = [m.name for m in models]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise InvalidRequest(f"--model: the name {duplicated[0]!r} is given twice", details={"field": "--model"})
    aliases = tuple(_alias(text, names) for text in args.alias)
    given = [alias for alias, _ in aliases]
    twice = sorted({a for a in given if given.count(a) > 1})
    if twice:  # one name, one model: never a silent last-wins
        raise InvalidRequest(
            f"--alias: the alias {twice[0]!r} is given twice", details={"field": "--alias", "alias": twice[0]}
        )
    for pin in args.pin:
        if pin not in names:
            raise InvalidRequest(
                f"--pin {pin!r} names no --model (served names: {names or 'none'})", details={"field": "--pin"}
            )
    return ServeSettings(
        model=models[0].source if models else None,
        host=args.host,
        port=args.port,
        api_key=args.api_key or env.get(API_KEY_ENV) or None,
        log_level=args.log_level,
        ledger_url=None if args.ledger is None else _ledger_arg(args.ledger),
        otlp=otlp_target(args),
        otlp_content=otlp_content(args.otlp_content, env),
        stream_interval_ms=args.stream_interval_ms,
        model_roots=tuple(args.model_root),
        options=options,
        models=models,
        aliases=aliases,
        pinned=tuple(dict.fromkeys(args.pin)),
        memory_budget_bytes=_budget_arg(args.memory_budget),
        keep_alive_s=_keep_alive_arg(args.keep_alive),
        kv_tokens_per_row=_positive(args.kv_reserve_tokens, "--kv-reserve-tokens"),
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout,
        idle_timeout_s=args.idle_timeout,
    )


def _served_name(text: str) -> ServedName:
    """``NAME=PATH`` or a bare path / repo id (its own name)."""
    name, sep, source = text.partition("=")
    name, source = name.strip(), source.strip()
    if not sep:
        return ServedName(text.strip(), text.strip())
    if not name or not source:
        raise InvalidRequest(
            f"--model {text!r}: expected NAME=PATH (or a bare path or repo id)", details={"field": "--model"}
        )
    return ServedName(name, source)


def _alias(text: str, names: list[str]) -> tuple[str, str]:
    alias, sep, target = text.partition("=")
    alias, target = alias.strip(), target.strip()
    if not sep or not alias or not target:
        raise InvalidRequest(f"--alias {text!r}: expected ALIAS=NAME", details={"field": "--alias"})
    if target not in names:
        raise InvalidRequest(
            f"--alias {text!r}: {target!r} is not a --model name (served names: {names or 'none'})",
            details={"field": "--alias"},
        )
    if alias in names:
        raise InvalidRequest(f"--alias {text!r}: {alias!r} is already a --model name", details={"field": "--alias"})
    return alias, target


def _budget_arg(text: str | None) -> int | None:
    from ..server.memory import parse_byte_size

    if text is None:
        return None
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise InvalidRequest(f"--memory-budget: {exc}", details={"field": "--memory-budget"}) from exc


def _keep_alive_arg(text: str | None) -> float | None:
    from ..server.keep_alive import parse_keep_alive

    return None if text is None else parse_keep_alive(text, field="--keep-alive")


def _positive(value: int | None, flag: str) -> int | None:
    if value is not None and value < 1:
        raise InvalidRequest(f"{flag} must be at least 1", details={"field": flag})
    return value


def _speculation_arg(text: str) -> bool | JSONObject | None:
    from ..controls import parse_speculation_option

    control = parse_speculation_option(text, field="--speculation")
    return None if control is None else control.to_wire()


def serve(settings: ServeSettings) -> int:
    """Load the first and the pinned models, run uvicorn until interrupted, then unload."""
    import uvicorn

    from ..server import create_app
    from ..server.connections import ConnectionLimits, connection_cap, guarded_protocol, raise_open_file_limit
    from .load_progress import showing_factory

    limits = ConnectionLimits(
        connection_cap(settings.max_connections, raise_open_file_limit()),
        settings.header_timeout_s,
        settings.idle_timeout_s,
    )

    if not _is_loopback(settings.host) and not settings.api_key:
        print(
            f"warning: serving on {settings.host} without an API key; anyone who can reach it can use the model",
            file=sys.stderr,
        )
    for root in settings.model_roots:
        if not Path(root).expanduser().is_dir():
            raise InvalidRequest(f"--model-root {root!r} is not a directory", details={"field": "--model-root"})
    roots = list(settings.model_roots)
    roots += [
        m.source for m in settings.models if Path(m.source).expanduser().is_dir()
    ]  # loadable again after an unload
    scratch = None
    ledger_url = settings.ledger_url
    if ledger_url is None and settings.otlp is not None:  # spans are built from a ledger: a temporary one
        scratch = tempfile.TemporaryDirectory(prefix="abstractruntime-mlx-otlp-")
        ledger_url = f"sqlite:///{Path(scratch.name) / 'ledger.sqlite'}"
    recorder = _open_serve_ledger(ledger_url, announce=scratch is None)
    app = create_app(
        serve_ledger=recorder,
        model_factory=showing_factory(_load_mlx),
        api_key=settings.api_key,
        stream_interval_ms=settings.stream_interval_ms,
        model_roots=roots,
        models=settings.model_specs(),
        aliases=dict(settings.aliases),
        residency=settings.pool_settings(),
    )
    pool = app.state.pool
    for name in settings.preload():
        pool.preload([name])  # shown by the factory (load_progress)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        lifespan="on",
        # Open streams are cancelled (their engine slots freed) this long after a stop signal.
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        http=guarded_protocol(limits),
        timeout_keep_alive=limits.idle_timeout_s,
    )
    server = uvicorn.Server(config)
    served = ", ".join(m.name for m in settings.models) or "(no model)"
    print(f"abstractruntime-mlx: serving {served} on http://{settings.host}:{settings.port}", file=sys.stderr)
    exporter = _live_export(settings.otlp, ledger_url, content=settings.otlp_content)
    try:
        with exporter:
            server.run()
    finally:
        pool.unload_all_now()  # what the lifespan did not unload (uvicorn stopped before it started)
        if recorder is not None:  # closed by the app's shutdown, unless uvicorn never started it
            recorder.close()
            recorder.ledger.close()
        if scratch is not None:
            scratch.cleanup()
    return 0


def _live_export(
    target: OtlpTarget | None, ledger_url: str | None, *, content: bool
) -> contextlib.AbstractContextManager[object]:
    """``--otlp``: each served call's spans sent when it ends (``traces.LiveExport``)."""
    if target is None or ledger_url is None:
        return contextlib.nullcontext()
    import datetime as dt

    from ..traces import LiveExport
    from .main import installed_version

    print(f"abstractruntime-mlx: sending OpenTelemetry spans to {target.url}", file=sys.stderr)
    return LiveExport(
        ledger_url, target, since=dt.datetime.now(dt.UTC), service_version=installed_version(), content=content
    )


def _load_mlx(model: str, **options: object) -> MLXProvider:
    from ..provider import create_llm

    return create_llm("mlx", model=model, **options)


def _ledger_arg(value: str) -> str:
    from ..ledger import normalize_ledger_url

    return normalize_ledger_url(value)


def _open_serve_ledger(url: str | None, *, announce: bool = True) -> ServeLedger | None:
    """The recorder of ``serve --ledger`` (the ledger is created if new, like ``run``'s)."""
    if url is None:
        return None
    from ..ledger import Ledger
    from ..server.serve_ledger import ServeLedger

    recorder = ServeLedger(Ledger(url))
    if announce:
        print(f"abstractruntime-mlx: recording served calls in {recorder.ledger.url}", file=sys.stderr)
    return recorder


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _serve(args: argparse.Namespace) -> int:
    return serve(settings_from_args(args))
