"""Runs as OpenTelemetry traces: ``runs export`` to a real OTLP/HTTP receiver on 127.0.0.1 (a
stdlib HTTP server decoding the protobuf body with ``opentelemetry-proto``), the OTLP/JSON file,
``run --otlp`` and ``serve --otlp`` sending spans live, and the bad inputs (unknown run,
unreachable receiver, a URL that is not http, an error status, the missing extra)."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.ledger import Ledger, sqlite_url
from abstractruntime_mlx.nodes import default_registry
from abstractruntime_mlx.traces import export_request, trace_id_of, tree_spans
from abstractruntime_mlx.traces.otlp import protobuf_body
from test_server_harness import free_port, start_serve

ROOT = Path(__file__).resolve().parents[1]
FLOWS = ROOT / "tests" / "flows"


# -- a real OTLP/HTTP receiver ---------------------------------------------------------


@dataclass
class Received:
    path: str
    content_type: str
    body: bytes


@dataclass
class Receiver:
    url: str
    requests: list[Received] = field(default_factory=list)
    status: int = 200

    def spans(self) -> list[dict[str, object]]:
        """Every span received, decoded: protobuf with opentelemetry-proto, JSON as sent."""
        out: list[dict[str, object]] = []
        for request in self.requests:
            if request.content_type == "application/x-protobuf":
                message = ExportTraceServiceRequest.FromString(request.body)
                for resource in message.resource_spans:
                    for scope in resource.scope_spans:
                        out.extend(_proto_span(s) for s in scope.spans)
            else:
                for resource in json.loads(request.body)["resourceSpans"]:
                    for scope in resource["scopeSpans"]:
                        out.extend(_json_span(s) for s in scope["spans"])
        return out


def _proto_value(value: object) -> object:
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    if kind == "array_value":
        return [_proto_value(v) for v in value.array_value.values]  # type: ignore[attr-defined]
    return getattr(value, kind)


def _proto_span(span: object) -> dict[str, object]:
    s = span
    return {
        "trace_id": s.trace_id.hex(),  # type: ignore[attr-defined]
        "span_id": s.span_id.hex(),  # type: ignore[attr-defined]
        "parent": s.parent_span_id.hex() or None,  # type: ignore[attr-defined]
        "name": s.name,  # type: ignore[attr-defined]
        "kind": s.kind,  # type: ignore[attr-defined]
        "start": s.start_time_unix_nano,  # type: ignore[attr-defined]
        "end": s.end_time_unix_nano,  # type: ignore[attr-defined]
        "status": s.status.code,  # type: ignore[attr-defined]
        "attributes": {a.key: _proto_value(a.value) for a in s.attributes},  # type: ignore[attr-defined]
        "events": [
            {
                "name": e.name,
                "time": e.time_unix_nano,
                "attributes": {a.key: _proto_value(a.value) for a in e.attributes},
            }
            for e in s.events  # type: ignore[attr-defined]
        ],
    }


def _json_value(value: dict[str, object]) -> object:
    ((kind, item),) = value.items()
    if kind == "intValue":
        return int(str(item))
    if kind == "arrayValue":
        return [_json_value(v) for v in item["values"]]  # type: ignore[index]
    return item


def _json_span(s: dict[str, object]) -> dict[str, object]:
    return {
        "trace_id": s["traceId"],
        "span_id": s["spanId"],
        "parent": s.get("parentSpanId"),
        "name": s["name"],
        "kind": s["kind"],
        "start": int(str(s["startTimeUnixNano"])),
        "end": int(str(s["endTimeUnixNano"])),
        "status": s.get("status", {}).get("code", 0),  # type: ignore[attr-defined]
        "attributes": {a["key"]: _json_value(a["value"]) for a in s["attributes"]},  # type: ignore[index]
        "events": [
            {
                "name": e["name"],
                "time": int(e["timeUnixNano"]),
                "attributes": {a["key"]: _json_value(a["value"]) for a in e["attributes"]},
            }
            for e in s.get("events", [])  # type: ignore[attr-defined]
        ],
    }


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    received: list[Received] = []
    box: dict[str, Receiver] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(Received(self.path, self.headers["Content-Type"], body))
            self.send_response(box["r"].status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    box["r"] = Receiver(f"http://127.0.0.1:{server.server_address[1]}", received)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield box["r"]
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- a recorded run with two subflow child runs ---------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, dense_model: str) -> Iterator[tuple[Path, str]]:
    """A ledger holding one run of ``parent.json`` (two subflow runs, one LLM call each)."""
    tmp = tmp_path_factory.mktemp("traces")
    ledger = tmp / "runs.sqlite"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ABSTRACTCORE_CONFIG_FILE", str(tmp / "abstractcore.json"))
        mp.setenv("XDG_CACHE_HOME", str(tmp / "cache"))
        assert main(["run", str(FLOWS / "parent.json"), "--model", dense_model, "--ledger", str(ledger), "--json"]) == 0
        default_registry().close()
    with Ledger(sqlite_url(ledger)) as db:
        (root,) = [r.run_id for r in db.list_runs() if r.parent_run_id is None]
    yield ledger, root


def _ns(when: object) -> int:
    import datetime as dt

    assert isinstance(when, dt.datetime)
    return (when - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1) * 1000


@pytest.mark.slow
def test_export_sends_the_run_tree_as_genai_spans(recorded, receiver, capsys, dense_model) -> None:
    ledger_path, root = recorded
    code, out, err = cli(
        capsys, "runs", "export", root[:8], "--ledger", str(ledger_path), "--otlp", receiver.url, "--otlp-content"
    )
    assert code == 0, err
    assert [(r.path, r.content_type) for r in receiver.requests] == [("/v1/traces", "application/x-protobuf")]
    spans = receiver.spans()
    assert f"exported {len(spans)} spans of 1 run to {receiver.url}/v1/traces" in err
    by_id = {s["span_id"]: s for s in spans}
    assert len(by_id) == len(spans) and {s["trace_id"] for s in spans} == {trace_id_of(root)}
    (run,) = [s for s in spans if s["parent"] is None]
    assert run["name"] == "run t_parent" and run["attributes"]["abstractruntime.run.id"] == root
    assert all(s["parent"] in by_id for s in spans if s is not run)

    with Ledger(sqlite_url(ledger_path)) as db:
        detail = db.get_run(root)
        children = sorted(db.list_runs(parent_run_ids=[root]), key=lambda r: r.created_at)
        last_step = max(s.ended_at or s.started_at for s in db.run_steps(root))
        assert run["start"] == _ns(detail.created_at) and run["end"] == _ns(max(detail.updated_at, last_step))
        child_spans = [s for s in spans if s["name"] == "run t_child"]
        assert sorted(s["attributes"]["abstractruntime.run.id"] for s in child_spans) == sorted(
            c.run_id for c in children
        )
        # each child run hangs under the parent's subflow node that started it
        assert sorted(by_id[s["parent"]]["name"] for s in child_spans) == ["node subflow (sub)", "node subflow (sub2)"]

        # one span per node visit: on_flow_end's two steps (its own and its emit_event) are one visit
        root_steps = db.run_steps(root)
        end_steps = [s for s in root_steps if s.node_id == "end"]
        assert len({s.step_id for s in end_steps}) == 2
        nodes = [s for s in spans if s["parent"] == run["span_id"]]
        assert sorted(s["attributes"]["abstractruntime.node.id"] for s in nodes) == ["end", "sub", "sub2"]
        (end,) = [s for s in nodes if s["attributes"]["abstractruntime.node.id"] == "end"]
        assert end["attributes"]["abstractruntime.step.effects"] == ["emit_event"]
        assert end["start"] == _ns(min(s.started_at for s in end_steps)) and end["end"] == _ns(
            max(s.ended_at for s in end_steps)
        )

        calls = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "chat"]
        assert len(calls) == 2
        for call in calls:
            a = call["attributes"]
            run_id = a["abstractruntime.run.id"]
            complete = [r for r in db.node_timeline(run_id) if r.phase == "complete"][-1]
            assert call["name"] == "chat qwen/qwen3-next-80b" and call["kind"] == 1  # INTERNAL: the model is in-process
            assert a["gen_ai.provider.name"] == "mlx" and "gen_ai.system" not in a  # deprecated by gen_ai.provider.name
            assert a["gen_ai.request.model"] == "qwen/qwen3-next-80b" and a["gen_ai.response.model"] == dense_model
            assert a["gen_ai.request.max_tokens"] == 8 and a["gen_ai.request.temperature"] == 0.0
            assert a["gen_ai.usage.input_tokens"] == complete.prompt_tokens
            assert a["gen_ai.usage.output_tokens"] == complete.generated_tokens == 8
            assert a["gen_ai.usage.cache_read.input_tokens"] == complete.cached_tokens
            assert a["gen_ai.response.finish_reasons"] == [complete.finish_reason]
            assert a["gen_ai.server.time_to_first_token"] == a["gen_ai.response.time_to_first_chunk"] == complete.ttft_s
            assert json.loads(a["gen_ai.input.messages"])[-1]["role"] == "user"
            assert json.loads(a["gen_ai.output.messages"])[0]["finish_reason"] == complete.finish_reason
            # the node visit, the call and its phases, in time order, as the ledger has them
            node, phases = by_id[call["parent"]], {s["name"]: s for s in spans if s["parent"] == call["span_id"]}
            assert node["name"] == "node llm_call" and by_id[node["parent"]]["name"] == "run t_child"
            assert {"prefill", "decode"} <= set(phases)
            prefill, decode = phases["prefill"], phases["decode"]
            assert node["start"] <= call["start"] <= prefill["start"] <= prefill["end"] == decode["start"]
            assert decode["start"] <= decode["end"] == call["end"] <= node["end"]
            assert decode["end"] == _ns(complete.created_at)
            assert (
                decode["start"] - call["start"] >= round(complete.ttft_s * 1e9) - 1_000
            )  # first token after the queue
            assert decode["attributes"]["abstractruntime.decode.generated_tokens"] == 8
            # the call's phase events, as span events of its prefill and decode spans
            rows = [r for r in db.node_timeline(run_id) if r.phase in ("prefill", "generate", "complete")]
            events = [e for name in ("queue", "prefill", "decode") for e in phases.get(name, {}).get("events", [])]
            assert [e["attributes"]["abstractruntime.progress.phase"] for e in events] == [r.phase for r in rows]
            assert {e["name"] for e in events} == {"abstract.progress"}
            assert [e["time"] for e in events] == [_ns(r.created_at) for r in rows]
            for phase in phases.values():  # each on the phase span whose time holds it
                assert all(phase["start"] <= e["time"] <= phase["end"] for e in phase["events"])
            # the last event ends the call, so it is the decode span's; the first token's event lies
            # where its own clock put it, on either side of the prefill/decode boundary
            assert decode["events"][-1]["attributes"]["abstractruntime.progress.phase"] == "complete"
            for event, row in zip(events, rows):
                ea = event["attributes"]
                assert ea.get("abstractruntime.progress.generated_tokens") == row.generated_tokens
                assert ea.get("abstractruntime.progress.prompt_tokens") == row.prompt_tokens
                if row.phase == "generate" and row.generated_tokens is not None:
                    assert ea["abstractruntime.progress.fraction"] == pytest.approx(row.generated_tokens / 8)
                if row.phase == "prefill" and row.prefill_processed_tokens is not None:
                    assert ea["abstractruntime.progress.fraction"] == pytest.approx(
                        row.prefill_processed_tokens / row.prompt_tokens
                    )
                if row.tokens_per_second is not None and row.phase != "prefill":
                    assert ea["abstractruntime.progress.tokens_per_second"] == row.tokens_per_second
            assert decode["events"][-1]["attributes"]["abstractruntime.progress.fraction"] == 1.0  # complete
            child = by_id[node["parent"]]
            assert run["start"] <= by_id[child["parent"]]["start"] <= child["start"] and child["end"] <= run["end"]


@pytest.mark.slow
def test_a_re_export_sends_the_same_spans_and_the_json_file_matches(recorded, receiver, capsys, tmp_path) -> None:
    ledger_path, root = recorded
    for _ in range(2):
        assert cli(capsys, "runs", "export", root, "--ledger", str(ledger_path), "--otlp", receiver.url)[0] == 0
    first, second = receiver.requests
    assert first.body == second.body  # same ids, same times: a receiver keeps one copy
    out_file = tmp_path / "trace.json"
    code, _, err = cli(
        capsys,
        "runs",
        "export",
        root,
        "--ledger",
        str(ledger_path),
        "--json",
        str(out_file),
        "--otlp",
        receiver.url,
        "--otlp-protocol",
        "json",
        "--otlp-header",
        "Authorization=Basic abc",
    )
    assert code == 0, err
    written = json.loads(out_file.read_text())
    assert (
        receiver.requests[-1].content_type == "application/json" and json.loads(receiver.requests[-1].body) == written
    )
    proto = Receiver("", [first]).spans()
    as_json = Receiver("", [receiver.requests[-1]]).spans()
    assert as_json == proto  # the JSON and protobuf encodings say the same
    with Ledger(sqlite_url(ledger_path)) as db:
        spans = tree_spans(db, root)
    assert (
        protobuf_body(
            export_request(spans, service_version=written["resourceSpans"][0]["scopeSpans"][0]["scope"]["version"])
        )
        == first.body
    )


@pytest.mark.slow
def test_bad_inputs_are_typed_errors(recorded, receiver, capsys, monkeypatch) -> None:
    ledger_path, root = recorded
    ledger = ["--ledger", str(ledger_path)]
    code, out, err = cli(capsys, "runs", "export", "nope", *ledger, "--otlp", receiver.url)
    assert code == 1 and err.startswith("error: [run_not_found] no run 'nope'")
    code, _, err = cli(capsys, "runs", "export", root, *ledger, "--otlp", f"http://127.0.0.1:{free_port()}")
    assert code == 1 and err.startswith("error: [trace_export_failed] could not send spans to http://127.0.0.1:"), err
    for url in ("ftp://example.com", "localhost:4318", "http://"):
        code, _, err = cli(capsys, "runs", "export", root, *ledger, "--otlp", url)
        assert code == 1 and err.startswith("error: [invalid_otlp_url]"), err
    receiver.status = 500
    code, _, err = cli(capsys, "runs", "export", root, *ledger, "--otlp", receiver.url)
    assert code == 1 and err.startswith(f"error: [trace_export_failed] {receiver.url}/v1/traces answered 500"), err
    code, _, err = cli(capsys, "runs", "export", root, *ledger)
    assert code == 1 and err.startswith("error: [invalid_request] runs export needs --otlp URL or --json FILE")
    code, _, err = cli(capsys, "runs", "export", root, *ledger, "--otlp", receiver.url, "--otlp-header", "novalue")
    assert code == 1 and "--otlp-header expects KEY=VALUE" in err
    monkeypatch.setitem(sys.modules, "opentelemetry.proto.collector.trace.v1.trace_service_pb2", None)  # not installed
    code, _, err = cli(capsys, "runs", "export", root, *ledger, "--otlp", receiver.url)
    assert code == 1 and err.startswith(
        "error: [missing_extra] OTLP protobuf needs opentelemetry-proto: pip install 'abstractruntime-mlx[otlp]'"
    )


@pytest.mark.slow
def test_run_sends_spans_live_and_an_unreachable_receiver_only_warns(receiver, capsys, cli_env, dense_model) -> None:
    code, out, err = cli(
        capsys, "run", str(FLOWS / "parent.json"), "--model", dense_model, "--json", "--otlp", receiver.url
    )
    assert code == 0, err
    (result,) = json.loads(out)
    with Ledger(sqlite_url(cli_env)) as db:
        expected = {(s.span_id, s.end_ns) for s in tree_spans(db, result["run_id"])}
    received = receiver.spans()
    assert {(s["span_id"], s["end"]) for s in received} >= expected  # the latest of each span is the ledger's
    assert {s["span_id"] for s in received} == {span_id for span_id, _ in expected}

    code, out, err = cli(
        capsys,
        "run",
        str(FLOWS / "parent.json"),
        "--model",
        dense_model,
        "--json",
        "--otlp",
        f"http://127.0.0.1:{free_port()}",
    )
    assert code == 0 and json.loads(out)[0]["status"] == "completed"
    assert "traces.live warning: trace export failed, spans kept for the next try: [trace_export_failed]" in err
    assert err.count("trace export failed") == 1  # once per distinct failure


@pytest.mark.slow
def test_serve_sends_each_call_as_spans(receiver, dense_model, tmp_path) -> None:
    proc, url = start_serve(["--model", f"tiny={dense_model}", "--otlp", receiver.url], tmp_path)
    try:
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=60,
            json={"model": "tiny", "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert reply.status_code == 200
        deadline = time.monotonic() + 30
        while not any(
            s["attributes"].get("gen_ai.operation.name") == "chat" for s in receiver.spans()
        ):  # sent when the call ends
            assert time.monotonic() < deadline, "no call span arrived"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert f"sending OpenTelemetry spans to {receiver.url}/v1/traces" in err
    spans = {s["span_id"]: s for s in receiver.spans()}
    (call,) = [s for s in spans.values() if s["attributes"].get("gen_ai.operation.name") == "chat"]
    assert call["attributes"]["gen_ai.usage.output_tokens"] == reply.json()["usage"]["completion_tokens"]
    assert call["attributes"]["gen_ai.request.max_tokens"] == 3
    node = spans[call["parent"]]
    assert node["name"] == "node chat" and spans[node["parent"]]["name"] == "run serve"
    assert {s["name"] for s in spans.values() if s["parent"] == call["span_id"]} >= {"prefill", "decode"}


# -- prompts and answers are opt-in ------------------------------------------------------

CONTENT_KEYS = {"gen_ai.system_instructions", "gen_ai.input.messages", "gen_ai.output.messages"}
CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"


@pytest.mark.slow
def test_prompts_and_answers_are_sent_only_when_asked(recorded, receiver, capsys, monkeypatch) -> None:
    ledger_path, root = recorded
    cases = [  # (environment value, flag) -> content in the spans
        ((None, None), False),
        (("true", None), True),
        (("SPAN_AND_EVENT", None), True),
        (("false", "--otlp-content"), True),
        (("true", "--otlp-no-content"), False),
        (("no_content", None), False),
    ]
    for (env, flag), expected in cases:
        if env is None:
            monkeypatch.delenv(CONTENT_ENV, raising=False)
        else:
            monkeypatch.setenv(CONTENT_ENV, env)
        receiver.requests.clear()
        code, _, err = cli(
            capsys,
            "runs",
            "export",
            root,
            "--ledger",
            str(ledger_path),
            "--otlp",
            receiver.url,
            *([flag] if flag else []),
        )
        assert code == 0, err
        calls = [s for s in receiver.spans() if s["attributes"].get("gen_ai.operation.name") == "chat"]
        assert len(calls) == 2
        for call in calls:
            keys = set(call["attributes"])
            assert (
                {"gen_ai.input.messages", "gen_ai.output.messages"} <= keys if expected else not CONTENT_KEYS & keys
            ), (env, flag)
            assert call["attributes"]["gen_ai.usage.output_tokens"] == 8  # the rest is there either way
        if not expected:
            assert not any(CONTENT_KEYS & set(s["attributes"]) for s in receiver.spans())
    monkeypatch.setenv(CONTENT_ENV, "maybe")
    code, _, err = cli(capsys, "runs", "export", root, "--ledger", str(ledger_path), "--otlp", receiver.url)
    assert code == 1 and err.startswith(f"error: [invalid_request] ${CONTENT_ENV} expects one of true, false"), err
    with pytest.raises(SystemExit) as usage:
        main(
            [
                "runs",
                "export",
                root,
                "--ledger",
                str(ledger_path),
                "--otlp",
                receiver.url,
                "--otlp-content",
                "--otlp-no-content",
            ]
        )
    assert usage.value.code == 2 and "not allowed with argument --otlp-content" in capsys.readouterr().err


# -- served calls: the HTTP route and the pool's model name ------------------------------


@pytest.mark.slow
def test_served_calls_carry_the_route_and_the_model_name(receiver, dense_model, tmp_path) -> None:
    import datetime as dt

    from abstractruntime_mlx.server.app import create_app
    from abstractruntime_mlx.server.pool import ModelSpec
    from abstractruntime_mlx.server.serve_ledger import ServeLedger
    from abstractruntime_mlx.traces import LiveExport, OtlpTarget
    from test_server_harness import serve_in_thread

    url = sqlite_url(tmp_path / "serve.sqlite")
    ledger = Ledger(url)
    recorder = ServeLedger(ledger)
    app = create_app(
        models=[ModelSpec("tiny", dense_model)], aliases={"x": "tiny"}, serve_ledger=recorder, stream_interval_ms=0
    )
    messages = [{"role": "user", "content": "hi"}]
    asked = {  # path -> (the model as the request names it, body)
        "/v1/chat/completions": ("x", {"max_tokens": 3, "temperature": 0, "messages": messages}),
        "/v1/messages": (dense_model, {"max_tokens": 3, "temperature": 0, "messages": messages}),
        "/api/chat": (
            "tiny",
            {"stream": False, "think": False, "options": {"temperature": 0, "num_predict": 3}, "messages": messages},
        ),
    }
    try:
        with LiveExport(url, OtlpTarget.parse(receiver.url), since=dt.datetime.now(dt.UTC), poll_s=0.2) as exporter:
            with serve_in_thread(app) as base:
                for path, (model, body) in asked.items():
                    reply = httpx.post(f"{base}{path}", json={"model": model, **body}, timeout=60)
                    assert reply.status_code == 200, reply.text
                recorder.drain()
        assert exporter.num_sent > 0
    finally:
        recorder.close()
        ledger.close()
    spans = {s["span_id"]: s for s in receiver.spans()}
    calls = [s for s in spans.values() if s["attributes"].get("gen_ai.operation.name") == "chat"]
    by_route = {s["attributes"]["http.route"]: s for s in calls}
    assert sorted(by_route) == sorted(asked) and len(calls) == 3
    for path, (model, _) in asked.items():
        a = by_route[path]["attributes"]
        assert a["http.request.method"] == "POST" and a["gen_ai.request.stream"] is False
        assert a["gen_ai.request.model"] == model and a["gen_ai.response.model"] == "tiny"  # the pool's one name
        assert by_route[path]["name"] == f"chat {model}"
        assert a["gen_ai.usage.output_tokens"] == 3 and a["gen_ai.provider.name"] == "mlx"
        assert not CONTENT_KEYS & set(a)  # prompts and answers: opt-in
        node = spans[by_route[path]["parent"]]
        assert spans[node["parent"]]["name"] == "run serve"


@pytest.mark.slow
def test_a_call_span_waits_for_its_record_and_a_changed_span_is_sent_again(
    receiver, dense_model, tmp_path, monkeypatch
) -> None:
    """A served call's last phase event reaches the ledger before its terminal record (which names the model):
    the call's span is not ended until that record is written, and one sent early is sent again once it changed."""
    import datetime as dt

    from abstractruntime_mlx.server.app import create_app
    from abstractruntime_mlx.server.pool import ModelSpec
    from abstractruntime_mlx.server.serve_ledger import ServeLedger
    from abstractruntime_mlx.traces import LiveExport, OtlpTarget
    from test_server_harness import serve_in_thread

    flushed, release = threading.Event(), threading.Event()
    record_end = ServeLedger._finish

    def held_finish(self, call, record, status) -> None:  # the phase events written, the record held back
        self.writer.flush(call.key)
        flushed.set()
        assert release.wait(60)
        record_end(self, call, record, status)

    monkeypatch.setattr(ServeLedger, "_finish", held_finish)
    url = sqlite_url(tmp_path / "serve.sqlite")
    ledger = Ledger(url)
    recorder = ServeLedger(ledger)
    app = create_app(models=[ModelSpec("tiny", dense_model)], serve_ledger=recorder, stream_interval_ms=0)

    def chat_spans() -> list[dict[str, object]]:
        return [s for s in receiver.spans() if s["attributes"].get("gen_ai.operation.name") == "chat"]

    body = {"model": "tiny", "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    try:  # poll_s: the exporter's own thread never polls here, the test does
        with LiveExport(url, OtlpTarget.parse(receiver.url), since=dt.datetime.now(dt.UTC), poll_s=3600) as exporter:
            with serve_in_thread(app) as base:
                assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).status_code == 200
                assert flushed.wait(60)
                exporter.poll()
                assert chat_spans() == []  # its phase events are all there, its record is not: not ended
                exporter.poll(final=True)  # sent as it stands
                (early,) = chat_spans()
                assert "gen_ai.request.model" not in early["attributes"]
                release.set()
                recorder.drain()
                exporter.poll()
    finally:
        release.set()
        recorder.close()
        ledger.close()
    early, late = chat_spans()
    assert late["span_id"] == early["span_id"]
    assert (
        late["attributes"]["gen_ai.request.model"] == "tiny" and late["attributes"]["gen_ai.response.model"] == "tiny"
    )
