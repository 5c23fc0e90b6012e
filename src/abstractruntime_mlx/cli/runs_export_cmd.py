"""``abstractruntime-mlx runs export``: recorded runs as OpenTelemetry traces (``traces/``).

    abstractruntime-mlx runs export RUN_ID... --otlp http://localhost:4318          # OTLP/HTTP protobuf
    abstractruntime-mlx runs export RUN_ID --otlp URL --otlp-protocol json
    abstractruntime-mlx runs export RUN_ID --json trace.json                        # the OTLP/JSON request

Each ``RUN_ID`` (or unique prefix) is exported with every run below it (subflows, agents).
``--otlp-header KEY=VALUE`` (repeatable) and ``$OTEL_EXPORTER_OTLP_HEADERS`` (``k=v,k2=v2``)
add request headers, e.g. Langfuse's ``Authorization: Basic ...``. Prompts and answers are left
out of the spans unless asked for (the GenAI conventions make them opt-in): ``--otlp-content``,
or ``$OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``; ``--otlp-no-content`` leaves them
out whatever the variable says. ``add_otlp_arguments`` / ``otlp_target`` / ``otlp_content`` give
``run`` and ``serve`` the same flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final
from urllib.parse import unquote

from .ledger_location import default_ledger_url, open_for_inspection, resolve_run_id

if TYPE_CHECKING:
    from ..traces import OtlpTarget

HEADERS_ENV: Final = "OTEL_EXPORTER_OTLP_HEADERS"
CONTENT_ENV: Final = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
CONTENT_ENV_VALUES: Final[Mapping[str, bool]] = {
    "true": True,
    "false": False,
    "span_only": True,
    "span_and_event": True,
    "event_only": False,  # no span events carry content here: nothing on the spans
    "no_content": False,
}
"""What ``$OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` means for the spans (case-insensitive),
as OpenTelemetry's GenAI instrumentations read it."""


def add_parser(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = actions.add_parser(
        "export",
        help="send runs as OpenTelemetry traces (GenAI spans) to an OTLP/HTTP receiver, or write the OTLP/JSON",
    )
    export.add_argument(
        "run_ids", nargs="+", metavar="RUN_ID", help="run id or a unique prefix; its child runs come along"
    )
    export.add_argument("--ledger", default=None, help="ledger URL or SQLite path")
    export.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="write the OTLP/JSON ExportTraceServiceRequest to FILE ('-': stdout)",
    )
    add_otlp_arguments(export, live=False)
    export.set_defaults(handler=_export)


def add_otlp_arguments(parser: argparse.ArgumentParser, *, live: bool = True) -> None:
    """``--otlp URL``, ``--otlp-protocol``, ``--otlp-header``: for ``runs export``, ``run`` and ``serve``."""
    when = " as each call and run ends (a failed export is a warning)" if live else ""
    parser.add_argument(
        "--otlp",
        default=None,
        metavar="URL",
        help=f"send OpenTelemetry spans to this OTLP/HTTP receiver (URL/v1/traces){when}",
    )
    parser.add_argument(
        "--otlp-protocol",
        default="protobuf",
        choices=("protobuf", "json"),
        help="OTLP/HTTP body encoding (default protobuf)",
    )
    parser.add_argument(
        "--otlp-header",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a header for the OTLP receiver (repeatable; also ${HEADERS_ENV})",
    )
    content = parser.add_mutually_exclusive_group()
    content.add_argument(
        "--otlp-content",
        dest="otlp_content",
        action="store_const",
        const=True,
        default=None,
        help="put the prompts and answers in the spans (gen_ai.input.messages "
        f"...; default: left out, or ${CONTENT_ENV})",
    )
    content.add_argument(
        "--otlp-no-content",
        dest="otlp_content",
        action="store_const",
        const=False,
        help=f"leave the prompts and answers out of the spans, whatever ${CONTENT_ENV} says",
    )


def otlp_headers(items: list[str], env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``$OTEL_EXPORTER_OTLP_HEADERS`` (``k=v,k2=v2``, values URL-encoded), then ``--otlp-header`` items."""
    out: dict[str, str] = {}
    for raw in [p for p in env.get(HEADERS_ENV, "").split(",") if p.strip()]:
        key, sep, value = raw.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"error: ${HEADERS_ENV} expects KEY=VALUE,..., got {raw!r}")
        out[unquote(key.strip())] = unquote(value.strip())
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"error: --otlp-header expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def otlp_content(choice: bool | None, env: Mapping[str, str] = os.environ) -> bool:
    """Whether spans carry prompts and answers: ``--otlp-content`` / ``--otlp-no-content``, else
    ``$OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` (``CONTENT_ENV_VALUES``), else no."""
    if choice is not None:
        return choice
    raw = env.get(CONTENT_ENV, "").strip()
    if not raw:
        return False
    value = CONTENT_ENV_VALUES.get(raw.lower())
    if value is None:
        raise SystemExit(f"error: ${CONTENT_ENV} expects one of {', '.join(CONTENT_ENV_VALUES)}, got {raw!r}")
    return value


def otlp_target(args: argparse.Namespace) -> OtlpTarget | None:
    """The receiver ``--otlp`` names (checked: an http(s) URL, the protobuf extra when asked), or None."""
    if args.otlp is None:
        return None
    from ..traces import OtlpTarget

    return OtlpTarget.parse(args.otlp, protocol=args.otlp_protocol, headers=otlp_headers(args.otlp_header))


def _export(args: argparse.Namespace) -> int:
    from ..traces import export_request, send_spans, tree_spans
    from .main import installed_version

    target = otlp_target(args)
    if target is None and args.json is None:
        raise SystemExit("error: runs export needs --otlp URL or --json FILE")
    with open_for_inspection(default_ledger_url(args.ledger)) as ledger:
        run_ids = list(dict.fromkeys(resolve_run_id(ledger, run_id) for run_id in args.run_ids))
        content = otlp_content(args.otlp_content)
        spans = [span for run_id in run_ids for span in tree_spans(ledger, run_id, content=content)]
    version = installed_version()
    if args.json is not None:
        text = json.dumps(export_request(spans, service_version=version), indent=2, ensure_ascii=False)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).expanduser().write_text(text + "\n", encoding="utf-8")
    if target is not None:
        send_spans(spans, target, service_version=version)
    where = target.url if target is not None else args.json
    print(
        f"exported {len(spans)} spans of {len(run_ids)} run{'s' if len(run_ids) != 1 else ''} to {where}",
        file=sys.stderr,
    )
    return 0
