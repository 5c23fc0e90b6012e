"""``abstractruntime-mlx lb-config``: write an HAProxy configuration for a pool of model servers.

    abstractruntime-mlx lb-config --server 10.0.0.2:8080 --server 10.0.0.3:8080 --out pool.cfg
    abstractruntime-mlx lb-config --server 127.0.0.1:8081 --slots 4 --queue 32   # to stdout

Each server's engine slots and queue places are read from the server when it answers (``GET
/acore/prompt_cache/stats``, with ``--api-key`` or ``$ABSTRACTRUNTIME_MLX_API_KEY``), else taken
from ``--slots``/``--queue``; a server that does not answer and no flags is an error. See
``lb_config`` for what the configuration does, and docs/scale-out.md for the set-up.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .args import integer, number

API_KEY_ENV = "ABSTRACTRUNTIME_MLX_API_KEY"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "lb-config",
        help="write an HAProxy configuration for a pool of model servers (session affinity, health checks, retries)",
    )
    parser.add_argument(
        "--server",
        action="append",
        default=[],
        required=True,
        metavar="HOST:PORT",
        help="a model server of the pool (repeat for each)",
    )
    parser.add_argument(
        "--slots",
        type=integer,
        default=None,
        help="engine batch slots of a server that cannot be asked (serve's default is 4)",
    )
    parser.add_argument(
        "--queue",
        type=integer,
        default=None,
        help="queue places of a server that cannot be asked (serve's default is 32)",
    )
    parser.add_argument(
        "--bind", default="127.0.0.1:8090", metavar="HOST:PORT", help="where HAProxy listens (default 127.0.0.1:8090)"
    )
    parser.add_argument(
        "--stats-socket",
        default=None,
        metavar="PATH",
        help="HAProxy's admin socket, mode 600 (show stat, show servers state); one word: no whitespace, '#' or quotes",
    )
    parser.add_argument(
        "--balance-factor",
        type=integer,
        default=150,
        help="hash-balance-factor, bounded load in %% of the average (0: off; default 150)",
    )
    parser.add_argument(
        "--retries", type=integer, default=3, help="how many times HAProxy sends a failed call again (default 3)"
    )
    parser.add_argument(
        "--queue-timeout",
        type=number,
        default=120.0,
        metavar="SECONDS",
        help="how long a call may wait in HAProxy's queue (default 120)",
    )
    parser.add_argument("--api-key", default=None, help=f"bearer key to ask the servers with (default: ${API_KEY_ENV})")
    parser.add_argument(
        "--no-probe", action="store_true", help="do not ask the servers; use --slots and --queue for all"
    )
    parser.add_argument("--out", default=None, metavar="FILE", help="write the configuration here (default: stdout)")
    parser.set_defaults(handler=_lb_config)


def _lb_config(args: argparse.Namespace) -> int:
    from ..errors import InvalidRequest
    from ..lb_config import LBSettings, PoolServer, haproxy_config, parse_address, probe_capacity

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    servers: list[PoolServer] = []
    for spec in args.server:
        host, port = parse_address(spec)
        capacity = None if args.no_probe else probe_capacity(host, port, api_key=api_key)
        if capacity is not None:
            servers.append(PoolServer(host, port, slots=capacity[0], queue=capacity[1], source="server"))
            continue
        if args.slots is None or args.queue is None:
            why = "--no-probe was given" if args.no_probe else "it did not answer GET /acore/prompt_cache/stats"
            raise InvalidRequest(
                f"server {spec}: its slots and queue are unknown ({why}); start it first, or pass --slots N --queue M",
                details={"field": "server", "server": spec},
            )
        servers.append(PoolServer(host, port, slots=args.slots, queue=args.queue, source="flags"))
    settings = LBSettings(
        servers=tuple(servers),
        bind=args.bind,
        stats_socket=args.stats_socket,
        balance_factor=args.balance_factor,
        retries=args.retries,
        queue_timeout_s=args.queue_timeout,
    )
    written_by = "Written by: abstractruntime-mlx lb-config " + " ".join(f"--server {s.address}" for s in servers)
    text = haproxy_config(settings, comment=[written_by])
    if args.out is None:
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(out)  # HAProxy reloading at this moment reads the old file or the new one, whole
    for server in servers:
        print(
            f"server {server.address}: maxconn {server.maxconn} ({server.slots} "
            f"slots + {server.queue} queue, from {server.source})",
            file=sys.stderr,
        )
    print(f"wrote {out}", file=sys.stderr)
    return 0
