"""Argument types shared by the commands' parsers."""

from __future__ import annotations

import argparse

from ..json_values import parse_ascii_int


def integer(text: str) -> int:
    """``type=integer`` for an integer option: ASCII digits only, as every edge reads numbers
    (``int()`` would also take ``"٣"`` as 3)."""
    value = parse_ascii_int(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r} (ASCII digits 0-9)")
    return value
