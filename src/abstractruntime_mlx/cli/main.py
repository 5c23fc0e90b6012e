"""`abstractruntime-mlx` command line.

Each command group lives in its own module with ``add_parser(subparsers)``; the parser sets
``handler`` to a function taking the parsed namespace and returning an exit code. Handlers build
typed settings and call library functions; library code never sees the namespace.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import MLXRuntimeError

# Modules that contribute subcommands, in help order.
COMMAND_MODULES = (
    "config_cmd",
    "capabilities_cmd",
    "models_cmd",
    "generate_cmd",
    "serve_cmd",
    "check_cmd",
    "run_cmd",
    "runs_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="abstractruntime-mlx",
        description="Run AbstractRuntime LLM nodes on MLX.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"{__package__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__package__}.{name}":
                continue  # command group not built yet
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args) or 0)
    except MLXRuntimeError as exc:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
