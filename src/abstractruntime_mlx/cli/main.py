"""`abstractruntime-mlx` command line.

Each command group lives in its own module with ``add_parser(subparsers)``; the parser sets
``handler`` to a function taking the parsed namespace and returning an exit code. Handlers build
typed settings and call library functions; library code never sees the namespace. A command
module imports at its top only what its parser needs: the host, MLX, SQLAlchemy and the server
are imported inside the handlers, so ``--help`` and ``runs list`` start in a fraction of a second
(``tests/test_cli_startup.py`` holds them to it).

A command that fails prints one line on stderr, ``error: [code] message``, and exits 1: the
stable ``code`` of a typed error, ``io_error`` for a file system failure (an unwritable path,
a full disk), ``invalid_request`` for a bad argument or input file, ``internal_error`` for
anything unexpected. ``ABSTRACTRUNTIME_MLX_DEBUG=1`` adds the traceback. Log records of this
package go to stderr as one line each (their tracebacks only in debug mode), never to stdout,
which carries the command's output alone. A reader that closes stdout early
(``runs show RUN | head -2``) ends the command quietly, with status 141 as SIGPIPE would.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import logging
import os
import sys
import traceback
from collections.abc import Iterator
from typing import Final

from ..errors import MLXRuntimeError
from .terminal import printable

DEBUG_ENV: Final = "ABSTRACTRUNTIME_MLX_DEBUG"
DISTRIBUTION: Final = "abstractruntime-mlx"
EXIT_BROKEN_PIPE: Final = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left
PACKAGE_LOGGER: Final = "abstractruntime_mlx"

# Modules that contribute subcommands, in help order.
COMMAND_MODULES = (
    "config_cmd",
    "capabilities_cmd",
    "models_cmd",
    "generate_cmd",
    "chat_cmd",
    "serve_cmd",
    "lb_config_cmd",
    "check_cmd",
    "run_cmd",
    "runs_cmd",
    "demo_cmd",
    "ledger_cmd",
    "completion_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="abstractruntime-mlx",
        description="Run AbstractRuntime LLM nodes on MLX.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
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


def installed_version() -> str:
    """The installed distribution's version (its metadata), or ``unknown`` when the package is
    run from a source tree that was never installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _command(argv)
        finally:
            sys.stdout.flush()  # so a reader that left is seen here, not at interpreter exit
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE


def _stdout_to_devnull() -> None:
    """The reader of stdout left (``| head``): what is still buffered goes nowhere, so the
    interpreter's last flush does not complain either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _command(argv: list[str] | None) -> int:
    # transformers (imported by mlx-lm/mlx-vlm for tokenizers) otherwise prints a PyTorch
    # advisory on every command; this package never uses PyTorch.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    debug = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
    with _package_logs_on_stderr(debug):
        try:
            return int(handler(args) or 0)
        except KeyboardInterrupt:
            print("error: [interrupted] stopped by Ctrl-C", file=sys.stderr)
            return 130
        except BrokenPipeError:
            raise  # the reader left: main ends quietly
        except SystemExit as exc:
            if not isinstance(exc.code, str):
                raise
            print(error_line(exc), file=sys.stderr)
            return 1
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line
            if debug:
                traceback.print_exc()
            print(error_line(exc), file=sys.stderr)
            return 1


def error_line(exc: BaseException) -> str:
    """``error: [code] message`` for any exception, safe to print (messages quote flow ids)."""
    return printable(_error_text(exc))


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, MLXRuntimeError):
        return f"error: [{exc.code}] {exc.message}"
    if isinstance(exc, SystemExit):
        return f"error: [invalid_request] {str(exc.code).removeprefix('error: ')}"
    if isinstance(exc, OSError):
        where = " ".join(repr(str(f)) for f in (exc.filename, exc.filename2) if f is not None)
        reason = exc.strerror or str(exc) or type(exc).__name__
        return f"error: [io_error] {reason}" + (f": {where}" if where else "")
    if isinstance(exc, ValueError):
        return f"error: [invalid_request] {exc}"
    return f"error: [internal_error] {type(exc).__name__}: {exc} (set {DEBUG_ENV}=1 for the traceback)"


class _OneLine(logging.Formatter):
    """``module level: message`` (plus ``: ExcType: text`` of an attached exception) on one line.

    The module prefix keeps these context lines apart from the command's own ``error:`` line.
    """

    def __init__(self, *, debug: bool) -> None:
        super().__init__("%(message)s")
        self._debug = debug

    def format(self, record: logging.LogRecord) -> str:
        source = record.name.removeprefix(PACKAGE_LOGGER + ".")
        head = f"{source} {record.levelname.lower()}: "
        if self._debug:
            return head + super().format(record)
        line = head + record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            line += f": {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        return " ".join(line.split("\n"))


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]  # generic only in typeshed
    """Writes to whatever ``sys.stderr`` is at emit time (tests swap it)."""

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


@contextlib.contextmanager
def _package_logs_on_stderr(debug: bool) -> Iterator[None]:
    logger = logging.getLogger(PACKAGE_LOGGER)
    handler = _StderrHandler()
    handler.setFormatter(_OneLine(debug=debug))
    saved = (logger.propagate, logger.level)
    logger.addHandler(handler)
    logger.propagate = False  # a host library's root handler may print to stdout
    logger.setLevel(logging.DEBUG if debug else logging.WARNING)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = saved[0]
        logger.setLevel(saved[1])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
