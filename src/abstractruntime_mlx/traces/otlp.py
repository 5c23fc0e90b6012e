"""Spans as an OTLP ``ExportTraceServiceRequest``, sent over OTLP/HTTP.

    target = OtlpTarget.parse("http://localhost:4318", protocol="protobuf")
    send_spans(spans, target)           # POST http://localhost:4318/v1/traces
    body = export_request(spans)        # the OTLP/JSON document (``runs export --json``)

``export_request`` writes the OTLP/JSON encoding (hex trace and span ids, 64-bit integers and
times as decimal strings, enums as integers). The protobuf body is the same request parsed
into ``opentelemetry-proto``'s message (the ``otlp`` extra). A receiver that cannot be reached
or answers with an error status raises ``TraceExportFailed``.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import httpx

from ..errors import InvalidOtlpUrl, MissingExtra, TraceExportFailed
from ..json_values import JSONObject, JSONValue
from .spans import AttributeValue, SpanStatus, TraceSpan

__all__ = ["OtlpProtocol", "OtlpTarget", "export_request", "protobuf_body", "send_spans", "traces_url"]

OtlpProtocol = Literal["protobuf", "json"]
PROTOCOLS: tuple[OtlpProtocol, ...] = ("protobuf", "json")
TRACES_PATH = "/v1/traces"
DEFAULT_TIMEOUT_S = 10.0
MAX_SPANS_PER_REQUEST = 512
SERVICE_NAME = "abstractruntime-mlx"
SCOPE_NAME = "abstractruntime_mlx.traces"
CONTENT_TYPES: Mapping[OtlpProtocol, str] = {"protobuf": "application/x-protobuf", "json": "application/json"}


def traces_url(url: str) -> str:
    """The traces endpoint of an OTLP/HTTP base URL: ``URL/v1/traces`` (a URL that already ends
    in ``/v1/traces`` is kept). Raises ``InvalidOtlpUrl`` unless it is http(s) with a host."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidOtlpUrl(
            f"--otlp {url!r} is not an http:// or https:// URL (the OTLP/HTTP receiver, e.g. http://localhost:4318)",
            details={"field": "--otlp", "url": url[:255]},
        )
    path = parts.path.rstrip("/")
    if not path.endswith(TRACES_PATH):
        path += TRACES_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


@dataclass(frozen=True, slots=True)
class OtlpTarget:
    """Where and how spans are sent: the traces endpoint, the body's encoding, extra headers
    (``Authorization`` for Langfuse ...), the request timeout."""

    url: str
    protocol: OtlpProtocol = "protobuf"
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def parse(
        cls,
        url: str,
        *,
        protocol: str = "protobuf",
        headers: Mapping[str, str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> OtlpTarget:
        if protocol not in PROTOCOLS:
            raise InvalidOtlpUrl(
                f"OTLP protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}", details={"field": "--otlp-protocol"}
            )
        checked: OtlpProtocol = "json" if protocol == "json" else "protobuf"
        if checked == "protobuf":
            _proto_request_class()  # the missing extra is said before anything runs
        return cls(traces_url(url), checked, tuple((headers or {}).items()), timeout_s)


# --------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------


def _any_value(value: AttributeValue) -> JSONObject:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list):
        return {"arrayValue": {"values": [{"stringValue": str(v)} for v in value]}}
    return {"stringValue": str(value)}


def _attributes(attributes: Mapping[str, AttributeValue]) -> list[JSONValue]:
    return [{"key": key, "value": _any_value(value)} for key, value in attributes.items()]


def _span(span: TraceSpan) -> JSONObject:
    out: JSONObject = {
        "traceId": span.trace_id,
        "spanId": span.span_id,
        "name": span.name,
        "kind": int(span.kind),
        "startTimeUnixNano": str(span.start_ns),
        "endTimeUnixNano": str(span.end_ns),
        "attributes": _attributes(span.attributes),
    }
    if span.events:
        out["events"] = [
            {"timeUnixNano": str(e.time_ns), "name": e.name, "attributes": _attributes(e.attributes)}
            for e in span.events
        ]
    if span.parent_span_id is not None:
        out["parentSpanId"] = span.parent_span_id
    if span.status != SpanStatus.UNSET:
        status: JSONObject = {"code": int(span.status)}
        if span.status_message:
            status["message"] = span.status_message
        out["status"] = status
    return out


def export_request(spans: Sequence[TraceSpan], *, service_version: str | None = None) -> JSONObject:
    """The OTLP/JSON ``ExportTraceServiceRequest`` of ``spans``: one resource
    (``service.name = abstractruntime-mlx``), one instrumentation scope."""
    resource: dict[str, AttributeValue] = {"service.name": SERVICE_NAME}
    scope: JSONObject = {"name": SCOPE_NAME}
    if service_version:
        resource["service.version"] = service_version
        scope["version"] = service_version
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": _attributes(resource)},
                "scopeSpans": [{"scope": scope, "spans": [_span(s) for s in spans]}],
            }
        ]
    }


def _proto_request_class() -> type:
    try:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    except ImportError as exc:
        raise MissingExtra(
            "OTLP protobuf needs opentelemetry-proto: pip install "
            "'abstractruntime-mlx[otlp]' (or send OTLP/JSON: --otlp-protocol json)",
            details={"extra": "otlp", "module": "opentelemetry.proto"},
        ) from exc
    return ExportTraceServiceRequest


def protobuf_body(request: JSONObject) -> bytes:
    """The OTLP/JSON request as protobuf bytes (ids hex → bytes, everything else as parsed)."""
    from google.protobuf import json_format

    message = _proto_request_class()()
    converted = _with_base64_ids(request)
    assert isinstance(converted, dict)
    json_format.ParseDict(converted, message)
    body: bytes = message.SerializeToString()
    return body


def _with_base64_ids(value: JSONValue) -> JSONValue:
    """OTLP/JSON writes ids as hex; protobuf's JSON mapping reads ``bytes`` as base64."""
    if isinstance(value, list):
        return [_with_base64_ids(v) for v in value]
    if not isinstance(value, dict):
        return value
    out: JSONObject = {}
    for key, item in value.items():
        if key in ("traceId", "spanId", "parentSpanId") and isinstance(item, str):
            out[key] = base64.b64encode(bytes.fromhex(item)).decode("ascii")
        else:
            out[key] = _with_base64_ids(item)
    return out


# --------------------------------------------------------------------------------------
# Sending
# --------------------------------------------------------------------------------------


def send_spans(
    spans: Sequence[TraceSpan],
    target: OtlpTarget,
    *,
    service_version: str | None = None,
    transport: httpx.BaseTransport | None = None,
) -> int:
    """POST ``spans`` to ``target`` (``MAX_SPANS_PER_REQUEST`` a request); returns how many were
    sent. Raises ``TraceExportFailed`` when the receiver is unreachable, times out or answers
    with an error status."""
    headers = {"Content-Type": CONTENT_TYPES[target.protocol], **dict(target.headers)}
    with httpx.Client(timeout=target.timeout_s, transport=transport) as client:
        for first in range(0, len(spans), MAX_SPANS_PER_REQUEST):
            request = export_request(spans[first : first + MAX_SPANS_PER_REQUEST], service_version=service_version)
            body = protobuf_body(request) if target.protocol == "protobuf" else _json_bytes(request)
            try:
                response = client.post(target.url, content=body, headers=headers)
            except httpx.HTTPError as exc:
                raise TraceExportFailed(
                    f"could not send spans to {target.url}: {type(exc).__name__}: {exc}", details={"url": target.url}
                ) from exc
            if response.status_code >= 300:
                raise TraceExportFailed(
                    f"{target.url} answered {response.status_code}: {response.text[:200]}",
                    details={"url": target.url, "status": response.status_code},
                )
    return len(spans)


def _json_bytes(request: JSONObject) -> bytes:
    import json

    return json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
