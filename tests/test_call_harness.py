"""Helpers shared by the engine tests that need several calls in one batch (no tests here)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def together(llm: Any, calls: list[dict[str, Any]]) -> list[Any]:
    """Submit ``calls`` at once from as many threads (each a dict of generate kwargs); results in order."""
    start = threading.Barrier(len(calls))

    def one(kwargs: dict[str, Any]) -> Any:
        start.wait()
        return llm.generate(**kwargs)

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(one, calls))
