"""Reading JSON that comes from outside (flow files, effect payloads, run vars), where a value
may be anything: the one place that narrows such values to the types code relies on.

Values read from JSON are typed ``object``: a caller narrows a value with the helpers below,
or with ``isinstance``, before using it. JSON the package builds (wire bodies, metadata,
error details, ``to_dict`` forms) is a ``JSONObject``."""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from typing import Final, TypeAlias, TypeVar

JSONValue: TypeAlias = str | int | float | bool | None | Sequence["JSONValue"] | Mapping[str, "JSONValue"]
"""A value JSON can carry. Read-only containers, so a ``dict[str, int]`` or a ``list[dict[str, str]]``
fits where a JSON value is expected; narrow with ``isinstance(value, Mapping)`` to read into it."""

JSONObject: TypeAlias = dict[str, JSONValue]
"""A JSON object this package builds (wire bodies, metadata blocks, error details)."""


V = TypeVar("V")
"""What values of the JSON read are typed as: ``object`` for JSON from outside, ``JSONValue``
for JSON decoded by this package; what is nested inside has the same type."""


def object_at(source: Mapping[str, V], key: str) -> Mapping[str, V]:
    """``source[key]`` when it is a JSON object, else an empty one."""
    value = source.get(key)
    return value if isinstance(value, Mapping) else {}


def array_at(source: Mapping[str, V], key: str) -> list[V]:
    """``source[key]`` when it is a JSON array, else an empty one."""
    value = source.get(key)
    return value if isinstance(value, list) else []


def objects_in(items: Sequence[V]) -> list[Mapping[str, V]]:
    """The JSON objects among ``items`` (an array read with ``array_at``)."""
    return [item for item in items if isinstance(item, Mapping)]


_ASCII_INTEGER: Final = re.compile(r"[+-]?[0-9]+")


def parse_ascii_int(text: str) -> int | None:
    """The integer ``text`` spells in ASCII digits (``"42"``, ``" -3 "``), else ``None``.

    Every integer read from text that comes from outside (query strings, headers, JSON keys,
    flow handles, command-line words) goes through here, because Python's own tests accept any
    Unicode digit: ``"²".isdigit()`` is true yet ``int("²")`` raises, and ``int("٣")`` is 3.
    Underscores (``int("1_0")`` is 10) and numbers too long for ``int()`` are refused too."""
    word = text.strip(string.whitespace)
    if not _ASCII_INTEGER.fullmatch(word):
        return None
    try:
        return int(word)
    except ValueError:  # more digits than int() converts
        return None


def to_float(value: object) -> float:
    """``float(value)`` for a JSON number or a numeric string of ASCII characters. Anything else
    raises as ``float()`` would: ``TypeError`` for a non-number, ``ValueError`` for a string that
    is not one (``"٣"`` included, which ``float()`` itself would read as 3)."""
    if isinstance(value, str) and not value.isascii():
        raise ValueError(f"not a number: {value[:20]!r}")
    if isinstance(value, (int, float, str)):
        return float(value)
    raise TypeError(f"not a number: {type(value).__name__}")


def to_int(value: object) -> int:
    """``int(value)`` for a JSON number or an integer string (ASCII digits, ``parse_ascii_int``),
    raising as ``int()`` would: ``TypeError`` for a non-number, ``ValueError`` for bad text."""
    if isinstance(value, str):
        parsed = parse_ascii_int(value)
        if parsed is None:
            raise ValueError(f"not an integer: {value[:20]!r}")
        return parsed
    if isinstance(value, (int, float)):
        return int(value)
    raise TypeError(f"not an integer: {type(value).__name__}")


def as_int(value: object) -> int | None:
    """An integer (an integral float too) as ``int``; anything else, bools included, ``None``."""
    if type(value) is int:
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def as_float(value: object) -> float | None:
    """A number (not a bool) as ``float``; anything else ``None``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def as_str(value: object) -> str | None:
    """A string as is; anything else ``None``."""
    return value if isinstance(value, str) else None


def as_bool(value: object) -> bool | None:
    """A bool as is; anything else ``None``."""
    return value if isinstance(value, bool) else None


def nests_deeper_than(value: object, limit: int) -> bool:
    """True when ``value`` has objects or arrays nested more than ``limit`` levels deep (no
    recursion: safe on any input)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        members = item.values() if isinstance(item, Mapping) else item if isinstance(item, list) else ()
        for child in members:
            if isinstance(child, (Mapping, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False
