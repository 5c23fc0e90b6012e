"""/v1/responses, /v1/completions, /v1/embeddings and /metrics on a real server (uvicorn on
127.0.0.1, a tiny random-weight model on the CPU), through the OpenAI SDK and the Prometheus
client's own parser; serve --ledger's records through the ledger's query API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from abstractruntime_mlx.server import create_app
from test_server_harness import serve_in_thread

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(dense_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One server for the module: the tiny model, a serve ledger, and an OpenAI client."""
    from abstractruntime_mlx import create_llm
    from abstractruntime_mlx.ledger import Ledger, sqlite_url
    from abstractruntime_mlx.server.serve_ledger import ServeLedger

    llm = create_llm("mlx", model=dense_model, mlx_batching=True)
    ledger = Ledger(sqlite_url(tmp_path_factory.mktemp("serve-ledger") / "ledger.sqlite"))
    recorder = ServeLedger(ledger)
    app = create_app(llm, stream_interval_ms=0, serve_ledger=recorder)
    try:
        with serve_in_thread(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            yield {"url": url, "client": client, "model": llm.model, "ledger": ledger, "recorder": recorder}
    finally:
        recorder.close()
        ledger.close()
        llm.unload_model()


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus_client: (name, sorted labels) -> value."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# --------------------------------------------------------------------------- /v1/responses


def test_responses_text_counts_tokens(served: dict[str, Any]) -> None:
    response = served["client"].responses.create(
        model=served["model"], input="Say hi", max_output_tokens=5, temperature=0, extra_body={"speculation": False}
    )
    assert response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5 and response.usage.input_tokens > 0
    assert response.output[0].type == "message"
    assert isinstance(response.output_text, str)
    block = response.model_extra["abstractcore"]
    assert block["speculation"]["requested"] is False


def test_responses_stream_matches_the_answer(served: dict[str, Any]) -> None:
    kinds: list[str] = []
    deltas: list[str] = []
    final = None
    with served["client"].responses.create(
        model=served["model"],
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Count"}]}],
        instructions="Be brief.",
        max_output_tokens=6,
        temperature=0,
        stream=True,
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    # Each item opens with its first piece (the tiny template opens a think block: a reasoning item first).
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.content_part.added" in kinds
    assert kinds[-1] == "response.incomplete"
    assert final is not None and final.usage.output_tokens == 6
    assert final.output_text == "".join(deltas)
    last_item_done = max(i for i, kind in enumerate(kinds) if kind == "response.output_item.done")
    assert kinds.index("response.output_text.done") < last_item_done


def test_responses_structured_output_parses(served: dict[str, Any]) -> None:
    response = served["client"].responses.create(
        model=served["model"],
        input="Answer in JSON.",
        max_output_tokens=64,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}},
    )
    assert json.loads(response.output_text) in ({"ok": True}, {"ok": False})
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input.0"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": 3}, "input"),
    ],
)
def test_responses_bad_inputs_are_typed(served: dict[str, Any], body: dict[str, Any], field: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        served["client"].responses.create(model=served["model"], **body)
    error = caught.value.body
    assert error["code"] == "invalid_request"
    assert error["details"]["field"] == field


def test_responses_unknown_fields_are_refused_by_name(served: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        served["client"].responses.create(model=served["model"], input="x", extra_body={"zeta": 1, "frobnicate": True})
    error = caught.value.body
    assert error["code"] == "invalid_request"
    assert error["details"] == {"field": "frobnicate", "fields": ["frobnicate", "zeta"]}
    # a tolerated field still answers
    assert served["client"].responses.create(model=served["model"], input="x", max_output_tokens=2, user="u1").status


def test_responses_bad_controls_and_unknown_model(served: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        served["client"].responses.create(model=served["model"], input="x", extra_body={"speculation": "sometimes"})
    assert caught.value.body["code"] == "invalid_controls"
    with pytest.raises(openai.BadRequestError) as caught:
        served["client"].responses.create(
            model=served["model"],
            input="x",
            text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "nonsense"}}},
        )
    assert caught.value.body["code"] == "invalid_response_schema"
    with pytest.raises(openai.NotFoundError) as missing:
        served["client"].responses.create(model="no-such-model", input="x")
    assert missing.value.body["code"] == "model_not_found"


# --------------------------------------------------------------------------- /v1/completions


def test_completions_text_and_stream(served: dict[str, Any]) -> None:
    client = served["client"]
    answer = client.completions.create(model=served["model"], prompt="Once", max_tokens=4, temperature=0)
    assert answer.object == "text_completion"
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 4
    pieces = list(
        client.completions.create(model=served["model"], prompt=["Once"], max_tokens=4, temperature=0, stream=True)
    )
    assert pieces[-1].choices[0].finish_reason == "length"
    assert pieces[-1].usage.completion_tokens == 4
    assert "".join(p.choices[0].text for p in pieces) == answer.choices[0].text  # greedy: the same tokens


@pytest.mark.parametrize(
    ("extra", "field", "code"),
    [
        ({"echo": True, "logprobs": 2}, "echo", "invalid_request"),
        ({"logprobs": 21}, "logprobs", "invalid_controls"),
        ({"suffix": "end"}, "suffix", "invalid_request"),
        ({"n": 9}, "n", "invalid_controls"),
        ({"best_of": 2}, "best_of", "invalid_request"),
        ({"max_tokens": -1}, "max_output_tokens", "invalid_controls"),
    ],
)
def test_completions_bad_inputs_are_typed(served: dict[str, Any], extra: dict[str, Any], field: str, code: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        served["client"].completions.create(model=served["model"], prompt="x", **extra)
    assert caught.value.body["code"] == code
    assert field in json.dumps(caught.value.body)


def test_completions_several_prompts_refused(served: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        served["client"].completions.create(model=served["model"], prompt=["a", "b"], max_tokens=2)
    assert caught.value.body["details"]["field"] == "prompt"


def test_embeddings_say_the_model_cannot_embed(served: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        served["client"].embeddings.create(model=served["model"], input="hello")
    assert caught.value.body["code"] == "embeddings_unsupported"
    assert caught.value.body["details"]["model"] == served["model"]


# --------------------------------------------------------------------------- /metrics


def test_metrics_count_known_requests(served: dict[str, Any]) -> None:
    url, model, client = served["url"], served["model"], served["client"]
    before = metrics(url)
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a"}], max_tokens=3, temperature=0
    )
    list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "b"}], max_tokens=4, temperature=0, stream=True
        )
    )
    client.completions.create(model=model, prompt="c", max_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", echo=True, logprobs=1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    after = metrics(url)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("abstractruntime_mlx_requests_total", model=model, route="chat", finish_reason="length") == 2
    assert grew("abstractruntime_mlx_requests_total", model=model, route="completions", finish_reason="length") == 1
    assert grew("abstractruntime_mlx_generation_tokens_total", model=model) == 3 + 4 + 2
    assert grew("abstractruntime_mlx_prompt_tokens_total", model=model) > 0
    assert grew("abstractruntime_mlx_time_to_first_token_seconds_count", model=model) == 3
    # gaps: 2 + 3 + 1 (the streamed call's are measured, the others' are their mean)
    assert grew("abstractruntime_mlx_inter_token_latency_seconds_count", model=model) == 6
    assert grew("abstractruntime_mlx_batch_width_count", model=model) == 3
    assert grew("abstractruntime_mlx_errors_total", model="", code="invalid_request") == 1
    assert grew("abstractruntime_mlx_errors_total", model="", code="model_not_found") == 1
    # read from the resident model at scrape time
    assert value(after, "abstractruntime_mlx_model_state", model=model, state="ready") == 1
    assert value(after, "abstractruntime_mlx_queue_depth", model=model) == 0
    assert value(after, "abstractruntime_mlx_running_rows", model=model) == 0
    assert value(after, "abstractruntime_mlx_batch_slots", model=model) == 4
    assert grew("abstractruntime_mlx_engine_requests_total", model=model, outcome="completed") == 3
    assert ("abstractruntime_mlx_prefix_cache_bytes", (("model", model), ("tier", "ram"))) in after


def test_errors_inside_streams_are_counted_and_raised() -> None:
    """A failure after the first byte: an error event in each route's stream (the SDK raises
    it), counted by code under the model (a scripted provider fails after one chunk)."""
    from abstractruntime_mlx.errors import EngineCrashed
    from test_server_harness import FakeProvider

    provider = FakeProvider(model="fake", texts=("a", "b", "c"), error=EngineCrashed("boom"), fail_after=1)
    with serve_in_thread(create_app(provider, stream_interval_ms=0)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.APIError) as chat:
            list(client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], stream=True))
        with pytest.raises(openai.APIError) as responses:
            list(client.responses.create(model="fake", input="x", stream=True))
        with pytest.raises(openai.APIError) as completions:
            list(client.completions.create(model="fake", prompt="x", stream=True))
        samples = metrics(url)
    for caught in (chat, responses, completions):
        assert caught.value.body["code"] == "engine_crashed"
    assert value(samples, "abstractruntime_mlx_errors_total", model="fake", code="engine_crashed") == 3
    for route in ("chat", "responses", "completions"):
        assert (
            value(samples, "abstractruntime_mlx_requests_total", model="fake", route=route, finish_reason="error") == 1
        )


# --------------------------------------------------------------------------- serve --ledger


def test_served_calls_are_ledger_runs(served: dict[str, Any]) -> None:
    url, model, ledger = served["url"], served["model"], served["ledger"]
    session = {"X-Session-Affinity": "session-42"}
    with httpx.Client(timeout=60, headers=session) as http:
        for prompt in ("first", "second"):
            answer = http.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": model,
                    "max_tokens": 3,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": prompt}],
                },
            )
            assert answer.status_code == 200
    loose = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "alone", "max_tokens": 2}, timeout=60)
    assert loose.status_code == 200
    served["recorder"].drain(timeout_s=30)

    from abstractruntime_mlx.server.serve_ledger import session_run_id

    run_id = session_run_id("session-42")
    detail = ledger.get_run(run_id)
    assert detail is not None and detail.status == "completed" and detail.workflow_id == "serve"
    steps = ledger.run_steps(run_id)
    assert [(s.node_id, s.status) for s in steps] == [("chat", "started"), ("chat", "completed")] * 2
    completed = [s for s in steps if s.status == "completed"]
    assert [s.record["result"]["usage"]["completion_tokens"] for s in completed] == [3, 3]
    phases = [row.phase for row in ledger.node_timeline(run_id)]
    assert phases.count("complete") == 2 and "prefill" in phases
    others = [r for r in ledger.list_runs(workflow_id="serve") if r.run_id != run_id]
    assert any(ledger.run_steps(r.run_id)[0].node_id == "completions" for r in others)


def test_a_streamed_call_with_several_answers_records_the_first(served: dict[str, Any]) -> None:
    client, ledger = served["client"], served["ledger"]
    texts: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(
        model=served["model"],
        messages=[{"role": "user", "content": "n"}],
        max_tokens=4,
        temperature=1.0,
        seed=9,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Session-Affinity": "session-n"},
        extra_body={"thinking": False},  # the tiny template opens a think block, whose text streams apart
    ):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    served["recorder"].drain(timeout_s=30)

    from abstractruntime_mlx.server.serve_ledger import session_run_id

    (done,) = [s for s in ledger.run_steps(session_run_id("session-n")) if s.status == "completed"]
    assert done.record["result"]["content"] == texts[0] and texts[0] != texts[0] + texts[1]
    assert done.record["result"]["usage"]["completion_tokens"] == usage.completion_tokens == 8


def test_metrics_mtp_acceptance_and_prefix_reuse_match_the_answers(hybrid_model: str) -> None:
    """MTP drafted/accepted tokens and prefix-reused tokens add up to what the answers reported."""
    from abstractruntime_mlx import create_llm

    llm = create_llm("mlx", model=hybrid_model, mlx_batching=True)
    try:
        with serve_in_thread(create_app(llm)) as url, httpx.Client(base_url=url, timeout=60) as http:
            body = {
                "model": llm.model,
                "max_tokens": 8,
                "temperature": 0,
                "prompt_cache_key": "conversation-1",
                "speculation": {"mode": "native_mtp", "num_draft_tokens": 2},
                "messages": [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "hi"}],
            }
            answers = [http.post("/v1/chat/completions", json=body).json() for _ in range(2)]
            samples = metrics(url)
    finally:
        llm.unload_model()
    speculation = [a["abstractcore"]["speculation"] for a in answers]
    assert all(s["used"] is True for s in speculation)
    drafted = sum(s["drafted_tokens"] for s in speculation)
    accepted = sum(s["accepted_tokens"] for s in speculation)
    assert value(samples, "abstractruntime_mlx_mtp_drafted_tokens_total", model=llm.model) == drafted > 0
    assert value(samples, "abstractruntime_mlx_mtp_accepted_tokens_total", model=llm.model) == accepted
    cached = sum(a["usage"].get("cached_input_tokens", 0) for a in answers)
    assert cached > 0  # the second call reused the first one's prefix
    assert value(samples, "abstractruntime_mlx_prefix_cache_hit_tokens_total", model=llm.model) == cached
    lookups = sum(
        value(samples, "abstractruntime_mlx_prefix_cache_lookups_total", model=llm.model, outcome=o)
        for o in ("hit", "partial", "miss", "not_retained")
    )
    assert lookups == 2
