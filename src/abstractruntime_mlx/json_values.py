"""Reading JSON that comes from outside (flow files, effect payloads, run vars), where a value
may be anything: the one place that narrows ``Any`` to an object."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def object_at(source: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``source[key]`` when it is a JSON object, else an empty one."""
    value = source.get(key)
    return value if isinstance(value, Mapping) else {}


def array_at(source: Mapping[str, Any], key: str) -> list[Any]:
    """``source[key]`` when it is a JSON array, else an empty one."""
    value = source.get(key)
    return value if isinstance(value, list) else []
