"""The one call path of the generating routes (``server/calls.py``): chat, responses and
completions answer through the same pump and SSE record loop, each in its own wire. A real
server on 127.0.0.1: the tiny random-weight model on the CPU for what a call gives, the
scripted provider for a failure after the first byte."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from abstractruntime_mlx.errors import QueueFull
from abstractruntime_mlx.server import create_app
from test_server_harness import FakeProvider, serve_in_thread

ROUTES = {
    # route: (path, body fields beside the prompt, the object of the answer, its usage key of output tokens)
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4},
        "chat.completion",
        "completion_tokens",
    ),
    "responses": ("/v1/responses", {"input": "Say hi", "max_output_tokens": 4}, "response", "output_tokens"),
    "completions": ("/v1/completions", {"prompt": "Say hi", "max_tokens": 4}, "text_completion", "completion_tokens"),
}


def sse_records(text: str) -> list[tuple[str | None, str]]:
    """``(event name or None, data)`` for each SSE record."""
    out: list[tuple[str | None, str]] = []
    for record in text.split("\n\n"):
        if not record:
            continue
        name: str | None = None
        data = ""
        for line in record.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
        out.append((name, data))
    return out


@pytest.fixture(scope="module")
def url(dense_model: str) -> Iterator[str]:
    from abstractruntime_mlx import create_llm

    llm = create_llm("mlx", model=dense_model, mlx_batching=True)
    try:
        with serve_in_thread(create_app(llm, stream_interval_ms=0)) as base:
            yield base
    finally:
        llm.unload_model()


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_non_streamed_call_with_progress_is_sse_with_its_result(url: str, route: str) -> None:
    """A non-streamed call asking for phase events: progress records, then one ``result``
    event holding the route's own non-streamed body (``[DONE]`` on the OpenAI-style wires)."""
    path, fields, kind, output_key = ROUTES[route]
    body = {**fields, "temperature": 0, "speculation": False, "stream_options": {"include_progress": True}}
    response = httpx.post(url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    records = sse_records(response.text)
    phases = [json.loads(data)["phase"] for name, data in records if name == "progress"]
    assert phases[0] == "prefill" and phases[-1] == "complete"
    results = [json.loads(data) for name, data in records if name == "result"]
    assert len(results) == 1
    assert results[0]["object"] == kind
    assert results[0]["usage"][output_key] == 4
    names = [name for name, _ in records]
    assert names.index("result") > max(i for i, name in enumerate(names) if name == "progress")
    assert (records[-1] == (None, "[DONE]")) is (route != "responses")


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_streamed_text_goes_out_once_and_whole(url: str, route: str) -> None:
    """The deltas of a stream, the terminal chunk's text included, add up to the answer the
    route reports at its end, and the answer holds as many tokens as the cap allowed."""
    path, fields, _kind, output_key = ROUTES[route]
    # Thinking off: the tiny template would open a think block, whose text streams apart (a
    # plain completion has no template, and refuses the control).
    quiet = {} if route == "completions" else {"thinking": False}
    body = {**fields, "temperature": 0, "speculation": False, "stream": True, **quiet}
    response = httpx.post(url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    records = sse_records(response.text)
    if route == "responses":
        deltas = [json.loads(data)["delta"] for name, data in records if name == "response.output_text.delta"]
        done = [json.loads(data) for name, data in records if name == "response.output_text.done"]
        assert [d["text"] for d in done] == ["".join(deltas)]
        final = json.loads(records[-1][1])["response"]
        assert records[-1][0] == "response.incomplete" and final["usage"][output_key] == 4
        assert final["output"][0]["content"][0]["text"] == "".join(deltas)
        return
    assert records[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in records[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"][output_key] == 4
    if route == "chat":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all("content" in c["choices"][0]["delta"] for c in chunks[1:-1])
    else:
        assert chunks[-1]["choices"][0]["text"] == ""


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_failure_after_the_first_byte_is_the_routes_error_record(route: str) -> None:
    """The provider fails after its first chunk: the text sent stays sent, then the error in
    the route's wire: ``data: {"error"}`` and ``[DONE]``, or a Responses ``error`` event."""
    fake = FakeProvider(texts=("Hello", " world"), error=QueueFull("the engine queue is full"), fail_after=1)
    path, fields, _kind, _output_key = ROUTES[route]
    with serve_in_thread(create_app(fake, stream_interval_ms=0)) as base:
        response = httpx.post(base + path, json={**fields, "stream": True}, timeout=30)
    assert response.status_code == 200
    records = sse_records(response.text)
    text = response.text
    assert "Hello" in text and " world" not in text
    if route == "responses":
        name, data = records[-1]
        assert name == "error"
    else:
        assert records[-1] == (None, "[DONE]")
        name, data = records[-2]
        assert name is None
    error: dict[str, Any] = json.loads(data)["error"]
    assert error["code"] == "queue_full"
