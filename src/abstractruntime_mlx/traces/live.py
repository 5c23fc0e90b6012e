"""Spans sent while runs go on: ``run --otlp URL`` and ``serve --otlp URL``.

    with LiveExport(ledger_url, target, since=started):
        results = run_flow(...)

A thread re-reads the runs created on the ledger since ``since`` (the run's cursor first, its
spans only when it moved) and sends every span that has ended and was not sent with the same
end time: a call's spans when the call ends, a node's when its last step is recorded, a run's
when it ends (a session run of ``serve`` again at each call's end, with its new end time: the
ids are the same, so a receiver keeps the latest). Closing sends what is left, ended or not.
A failed export is a logged warning (once per distinct failure); the spans are sent again at
the next poll, and nothing that runs is stopped by it.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading

from ..errors import MLXRuntimeError
from ..ledger import Ledger, RunCursor
from .otlp import OtlpTarget, send_spans
from .spans import TraceSpan, run_spans

__all__ = ["LiveExport"]

log = logging.getLogger(__name__)

DEFAULT_POLL_S = 1.0


class LiveExport:
    """Send the spans of the runs created on the ledger since ``since`` as they end, until closed
    (``content``: with the calls' prompts and answers, ``spans.CONTENT_ATTRIBUTES``)."""

    def __init__(
        self,
        ledger_url: str,
        target: OtlpTarget,
        *,
        since: dt.datetime,
        poll_s: float = DEFAULT_POLL_S,
        service_version: str | None = None,
        content: bool = False,
    ) -> None:
        self.target = target
        self.content = content
        self._url = ledger_url
        self._since = since
        self._poll_s = poll_s
        self._service_version = service_version
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ledger: Ledger | None = None
        self._cursors: dict[str, RunCursor | None] = {}
        self._pending: dict[str, list[TraceSpan]] = {}
        self._sent: dict[str, int] = {}  # span id -> the fingerprint of what was sent
        self._warned: set[str] = set()
        self.num_sent = 0

    def __enter__(self) -> LiveExport:
        self._ledger = Ledger(self._url)
        self._thread = threading.Thread(target=self._follow, name="abstractruntime-mlx-otlp")
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop following, then send every span not sent yet (ended or not). Idempotent."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            self.poll(final=True)
        finally:
            assert self._ledger is not None
            self._ledger.close()

    def _follow(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.poll()

    def poll(self, *, final: bool = False) -> int:
        """Read what moved and send what ended (everything not sent yet when ``final``);
        returns how many spans were sent."""
        assert self._ledger is not None
        try:
            for summary in self._ledger.list_runs(limit=10_000, created_after=self._since):
                cursor = self._ledger.run_cursor(summary.run_id)
                if cursor != self._cursors.get(summary.run_id):
                    self._pending[summary.run_id] = run_spans(self._ledger, summary.run_id, content=self.content)
                    self._cursors[summary.run_id] = cursor
        except MLXRuntimeError as exc:
            self._warn(f"could not read the ledger for the trace export: [{exc.code}] {exc.message}")
            return 0
        due = [
            span
            for spans in self._pending.values()
            for span in spans
            if (span.finished or final) and self._sent.get(span.span_id) != _fingerprint(span)
        ]
        if not due:
            return 0
        try:
            send_spans(due, self.target, service_version=self._service_version)
        except MLXRuntimeError as exc:
            self._warn(f"trace export failed, spans kept for the next try: [{exc.code}] {exc.message}")
            return 0
        for span in due:
            self._sent[span.span_id] = _fingerprint(span)
        self.num_sent += len(due)
        for run_id, spans in list(self._pending.items()):  # a run fully ended and sent is re-read only when it moves
            if all(s.finished for s in spans):
                del self._pending[run_id]
        return len(due)

    def _warn(self, text: str) -> None:
        if text not in self._warned:
            self._warned.add(text)
            log.warning("%s", text)


def _fingerprint(span: TraceSpan) -> int:
    """What a receiver would see change: a span re-read with a later end, new attributes or a new status is sent again."""
    return hash(repr((span.end_ns, span.name, span.status, span.status_message, span.attributes, len(span.events))))
