"""Argument types shared by the commands' parsers."""

from __future__ import annotations

import argparse
import math
import re
import string
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from ..default_limits import (
    DEFAULT_CODE_MEMORY_MIB,
    DEFAULT_CODE_RESULT_MIB,
    DEFAULT_CODE_TIME_S,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_STEPS,
    DEFAULT_MAX_WALL_S,
)
from ..json_values import parse_ascii_int

if TYPE_CHECKING:
    from ..runtime_plugin.hosting import DriveLimits


def integer(text: str) -> int:
    """``type=integer`` for an integer option: ASCII digits only, as every edge reads numbers
    (``int()`` would also take ``"٣"`` as 3)."""
    value = parse_ascii_int(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r} (ASCII digits 0-9)")
    return value


_DECIMAL: Final = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def number(text: str) -> float:
    """``type=number`` for a decimal option (``2``, ``0.5``, ``1e3``): ASCII digits only, as
    ``integer`` (``float()`` would also take ``"٣"`` as 3, ``"1_0"``, ``"nan"`` and ``"inf"``)."""
    word = text.strip(string.whitespace)
    value = float(word) if _DECIMAL.fullmatch(word) else math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"invalid number {text!r} (ASCII digits 0-9, finite)")
    return value


def help_handler(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """The handler of a command group called without a subcommand: its help, exit status 2."""

    def handler(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    return handler


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The limits a driven run runs under (``runtime_plugin.DriveLimits``), for ``run`` and ``runs resume``."""
    parser.add_argument(
        "--max-steps",
        type=integer,
        default=DEFAULT_MAX_STEPS,
        metavar="N",
        help="node steps a run tree may take, subflows and agents included; past it "
        f"the run fails with step_limit (default {DEFAULT_MAX_STEPS})",
    )
    parser.add_argument(
        "--max-depth",
        type=integer,
        default=DEFAULT_MAX_DEPTH,
        metavar="N",
        help="how deep subflow and agent runs may nest; deeper, the run "
        f"fails with depth_limit (default {DEFAULT_MAX_DEPTH})",
    )
    parser.add_argument(
        "--max-wall-s",
        type=float,
        default=DEFAULT_MAX_WALL_S,
        metavar="SECONDS",
        help="wall-clock time a run may take, checked between steps; past it the run "
        f"fails with wall_time_limit (default {DEFAULT_MAX_WALL_S:g})",
    )
    parser.add_argument(
        "--max-code-s",
        type=float,
        default=DEFAULT_CODE_TIME_S,
        metavar="SECONDS",
        help="time one code node call may take; past it the run fails with "
        f"code_time_limit (default {DEFAULT_CODE_TIME_S:g})",
    )
    parser.add_argument(
        "--max-code-mib",
        type=integer,
        default=DEFAULT_CODE_MEMORY_MIB,
        metavar="MIB",
        help="memory one code node call may take; past it the run fails with "
        f"code_memory_limit (default {DEFAULT_CODE_MEMORY_MIB})",
    )
    parser.add_argument(
        "--max-code-result-mib",
        type=integer,
        default=DEFAULT_CODE_RESULT_MIB,
        metavar="MIB",
        help="size of the JSON of one code node call's result; past it the run fails "
        f"with code_result_limit (default {DEFAULT_CODE_RESULT_MIB})",
    )


def drive_limits(args: argparse.Namespace, *, max_timer_wait_s: float) -> DriveLimits:
    """The ``DriveLimits`` of ``add_limit_arguments``' flags; a value out of range exits, naming it."""
    from ..runtime_plugin.hosting import DriveLimits

    try:
        return DriveLimits(
            max_timer_wait_s=max_timer_wait_s,
            max_steps=args.max_steps,
            max_depth=args.max_depth,
            max_wall_s=args.max_wall_s,
            max_code_s=args.max_code_s,
            max_code_mib=args.max_code_mib,
            max_code_result_mib=args.max_code_result_mib,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
