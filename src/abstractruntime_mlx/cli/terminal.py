"""Text from flow files and the ledger, made safe to print on a terminal.

Flow ids, node ids, labels, statuses and error messages are written by whoever wrote the flow
or the run. Printed raw, an ESC or CSI sequence in one of them would drive the terminal (move
the cursor, clear the screen, set the window title, hide what follows). Every view of the CLI
passes what it prints through ``printable``.
"""

from __future__ import annotations

import functools
from typing import Final

_C0_AND_DEL: Final = [*range(0x00, 0x20), 0x7F]
_C1: Final = list(range(0x80, 0xA0))


def printable(text: str, *, keep: str = "\n") -> str:
    """``text`` with every control character (C0, DEL, C1; ESC included) written as its escape
    (``\\x1b``), except those in ``keep``: the newline that separates the lines of a view (a
    model's reply keeps its tabs too: ``keep="\\n\\t"``)."""
    return text.translate(_escapes(keep))


@functools.cache
def _escapes(keep: str) -> dict[int, str]:
    kept = {ord(c) for c in keep}
    return {code: f"\\x{code:02x}" for code in (*_C0_AND_DEL, *_C1) if code not in kept}
