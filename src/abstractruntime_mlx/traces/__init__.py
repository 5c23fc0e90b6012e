"""Runs in the ledger as OpenTelemetry traces (GenAI semantic conventions), sent over OTLP/HTTP.

spans = tree_spans(ledger, run_id)                       # spans.py
send_spans(spans, OtlpTarget.parse("http://localhost:4318"))   # otlp.py
with LiveExport(ledger_url, target, since=started): ...  # live.py: spans as calls and runs end
"""

from __future__ import annotations

from .live import LiveExport
from .otlp import OtlpTarget, export_request, send_spans, traces_url
from .spans import SpanKind, SpanStatus, TraceSpan, root_run_id, run_spans, span_id_of, trace_id_of, tree_spans

__all__ = [
    "LiveExport",
    "OtlpTarget",
    "SpanKind",
    "SpanStatus",
    "TraceSpan",
    "export_request",
    "root_run_id",
    "run_spans",
    "send_spans",
    "span_id_of",
    "trace_id_of",
    "traces_url",
    "tree_spans",
]
