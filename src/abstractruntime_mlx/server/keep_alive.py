"""Keep-alive: how long a model stays resident after its last request, in Ollama's forms.

``keep_alive`` (a chat body field, ``serve --keep-alive``, ``/acore/models/load``'s body) is a
number of seconds or a duration string (``"30s"``, ``"5m"``, ``"1h"``, ``"1h30m"``, ``"250ms"``);
``0`` unloads the model as soon as it is idle; a negative value (``-1``, ``"-1m"``) keeps it
until memory is needed for another model. Numbers in a string are ASCII digits (``"٣"`` is
refused, as at every edge). ``parse_keep_alive`` returns seconds, or ``None`` for "no idle unload".
"""

from __future__ import annotations

import math
import re
from typing import Final

from ..errors import InvalidRequest

MAX_KEEP_ALIVE_S: Final = 365 * 24 * 3600.0
# ASCII digits only: ``\d`` and ``float()`` would also read "٣" as 3.
_NUMBER: Final = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_PART: Final = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_UNIT_S: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: object, *, field: str = "keep_alive") -> float | None:
    """Seconds a model stays resident once idle (``None``: until memory is needed). ``InvalidRequest``
    (400, ``details.field``) for anything else than a number or a duration string."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _invalid(field, value)
    if isinstance(value, str):
        seconds = _duration_s(value.strip(), field)
    else:
        seconds = float(value)
    if not math.isfinite(seconds):
        raise _invalid(field, value)
    if seconds < 0:
        return None
    if seconds > MAX_KEEP_ALIVE_S:
        raise InvalidRequest(
            f"{field} is longer than a year; use a negative value to keep the model until memory is needed",
            details={"field": field},
        )
    return seconds


def format_keep_alive(seconds: float | None) -> str:
    """The wire form of a parsed keep-alive: ``"forever"`` or seconds (``"300s"``)."""
    return "forever" if seconds is None else f"{seconds:g}s"


def _duration_s(text: str, field: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text[1:] if sign < 0 else text
    if _NUMBER.fullmatch(body):
        return sign * float(body)
    parts = _PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise _invalid(field, text)
    return sign * sum(float(number) * _UNIT_S[unit] for number, unit in parts)


def _invalid(field: str, value: object) -> InvalidRequest:
    shown = repr(value) if len(repr(value)) <= 64 else repr(value)[:61] + "..."
    return InvalidRequest(
        f"{field} must be seconds (a number) or a duration such as '30s', "
        f"'5m', '1h' (negative: no idle unload), not {shown}",
        details={"field": field},
    )
