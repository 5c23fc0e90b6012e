"""RemoteClient / AsyncRemoteClient: request building, decoding, retries, lifecycle, and real
calls against this package's server (uvicorn on 127.0.0.1 over a tiny random model)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any

import httpx
import pytest

from abstractruntime_mlx import create_llm
from abstractruntime_mlx.errors import (
    AuthenticationError,
    EngineCrashed,
    InvalidControls,
    InvalidMedia,
    QueueFull,
    SpeculationUnavailable,
    UpstreamError,
)
from abstractruntime_mlx.remote_client import AsyncRemoteClient, RemoteClient
from abstractruntime_mlx.remote_client._base import ChatCall, build_chat_call, decode_error
from abstractruntime_mlx.request import GenerationRequest
from abstractruntime_mlx.results import GenerationChunk, GenerationResult
from abstractruntime_mlx.server import create_app
from abstractruntime_mlx.testing import tiny_model
from test_server_harness import FakeProvider, engine_stats, png_bytes, serve_in_thread, wait_until

COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok", "reasoning": "hmm"}, "finish_reason": "stop"}
    ],
    "usage": {
        "prompt_tokens": 3,
        "completion_tokens": 1,
        "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 2},
    },
    "abstractcore": {
        "execution": {"mode": "continuous", "peak_batch_size": 2},
        "speculation": {"used": False},
        "trace": {"x": 1},
    },
}
QUEUE_FULL = {"error": {"message": "the waiting queue is full", "type": "capacity_error", "code": "queue_full"}}


# --------------------------------------------------------------------------- request building


def chat_call(*, model: str | None = None, stream: bool = False, prompt: str = "", **kwargs: Any) -> ChatCall:
    """The body the client sends for ``generate(prompt, stream=stream, **kwargs)``."""
    return build_chat_call(GenerationRequest.from_kwargs(prompt, **kwargs), model=model, stream=stream)


def test_body_forwards_controls_like_abstractcore_expects() -> None:
    call = chat_call(
        model="m",
        prompt="Say hi",
        messages=[],
        system_prompt="Be terse.",
        thinking="HIGH",
        speculation=False,
        prompt_cache_key="session:1",
        temperature=0.2,
        seed=7,
        stop="\n\n",
        max_output_tokens=64,
        logit_bias={5: -1},
    )
    assert call.body == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say hi"}],
        "temperature": 0.2,
        "logit_bias": {"5": -1.0},
        "seed": 7,
        "stop": ["\n\n"],
        "max_tokens": 64,
        "thinking": "high",
        "chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": "high"},  # mlx_lm.server's form
        "speculation": False,
        "prompt_cache_key": "session:1",
        "stream": False,
    }
    assert call.sse is False


def test_speculation_none_is_omitted_and_objects_are_sent_as_given() -> None:
    assert "speculation" not in chat_call(prompt="x").body
    mtp = chat_call(prompt="x", speculation={"mode": "native_mtp", "num_draft_tokens": 3}).body
    assert mtp["speculation"] == {"mode": "native_mtp", "num_draft_tokens": 3}
    with pytest.raises(InvalidControls) as info:
        chat_call(prompt="x", speculation={"mode": "warp"})
    assert info.value.field == "speculation.mode"


def test_streams_and_progress_ask_for_sse() -> None:
    streamed = chat_call(prompt="x", stream=True, on_progress=print)
    assert streamed.body["stream"] is True
    assert streamed.body["stream_options"] == {"include_progress": True, "include_usage": True}
    plain_progress = chat_call(prompt="x", on_progress=print)
    assert plain_progress.sse and plain_progress.body["stream"] is False
    assert plain_progress.body["stream_options"] == {"include_progress": True}


def test_media_becomes_inline_data_urls_on_the_last_user_turn(tmp_path: Any) -> None:
    from PIL import Image

    path = tmp_path / "red.png"
    path.write_bytes(png_bytes())
    call = chat_call(
        messages=[
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "what?"},
        ],
        media=[str(path), png_bytes((0, 0, 255)), Image.new("RGB", (4, 4))],
    )
    last = call.body["messages"][-1]["content"]
    assert [p["type"] for p in last] == ["image_url", "image_url", "image_url", "text"]
    assert all(p["image_url"]["url"].startswith("data:image/png;base64,") for p in last[:3])
    assert call.body["messages"][0]["content"] == "first"
    with pytest.raises(InvalidMedia):
        chat_call(prompt="x", media=[b"not an image"])


# --------------------------------------------------------------------------- decoding


def test_error_bodies_rebuild_the_typed_class() -> None:
    assert isinstance(decode_error(503, json.dumps(QUEUE_FULL).encode()), QueueFull)
    # AbstractCore's FastAPI HTTPException shape
    wrapped = {
        "detail": {"error": {"message": "bad image", "type": "invalid_request_error", "code": "native_media_invalid"}}
    }
    assert isinstance(decode_error(400, json.dumps(wrapped).encode()), InvalidMedia)
    strict = decode_error(
        422,
        json.dumps(
            {
                "error": {
                    "message": "no head",
                    "code": "speculation_unavailable",
                    "details": {"reason": "no_mtp_drafter_for_model"},
                }
            }
        ).encode(),
    )
    assert isinstance(strict, SpeculationUnavailable) and strict.reason == "no_mtp_drafter_for_model"
    controls = decode_error(
        400,
        json.dumps(
            {"error": {"message": "m", "code": "invalid_controls", "details": {"field": "top_p", "value": 2}}}
        ).encode(),
    )
    assert isinstance(controls, InvalidControls) and controls.field == "top_p"
    unknown = decode_error(
        500,
        json.dumps(
            {"error": {"message": "boom", "type": "native_runtime_error", "code": "native_runtime_error"}}
        ).encode(),
    )
    assert unknown.code == "backend_error" and unknown.details["server_code"] == "native_runtime_error"
    assert isinstance(decode_error(401, b"Unauthorized"), AuthenticationError)


def _mock(handler: Any) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


def test_nonstream_result_keeps_usage_and_metadata() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=COMPLETION)

    with RemoteClient("http://server/v1", model="m", transport=_mock(handler)) as client:
        result = client.generate("hi", max_output_tokens=5, speculation=False)
    assert isinstance(result, GenerationResult)
    assert (result.content, result.reasoning, result.finish_reason) == ("ok", "hmm", "stop")
    assert result.usage == {
        "prompt_tokens": 3,
        "input_tokens": 3,
        "completion_tokens": 1,
        "output_tokens": 1,
        "total_tokens": 4,
        "cached_input_tokens": 2,
    }
    assert set(result.metadata) == {"execution", "speculation", "remote"}
    assert result.metadata["remote"]["retries"] == 0
    assert seen[0]["speculation"] is False and seen[0]["max_tokens"] == 5


def test_queue_full_is_retried_with_backoff_and_recorded() -> None:
    answers = [
        httpx.Response(503, json=QUEUE_FULL),
        httpx.Response(503, json=QUEUE_FULL),
        httpx.Response(200, json=COMPLETION),
    ]
    with RemoteClient("http://server", model="m", transport=_mock(lambda r: answers.pop(0)), backoff_s=0.001) as client:
        result = client.generate("hi")
    assert result.metadata["remote"]["retries"] == 2


def test_queue_full_without_retries_left_raises() -> None:
    transport = _mock(lambda r: httpx.Response(503, json=QUEUE_FULL))
    with RemoteClient("http://server", model="m", transport=transport, max_retries=1, backoff_s=0.001) as client:
        with pytest.raises(QueueFull):
            client.generate("hi")


def test_other_errors_are_not_retried() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(409, json={"error": {"message": "busy", "code": "owner_busy"}})

    with RemoteClient("http://server", model="m", transport=_mock(handler)) as client:
        with pytest.raises(Exception) as info:
            client.generate("hi")
    assert info.value.code == "owner_busy" and len(calls) == 1  # type: ignore[attr-defined]


def test_connect_errors_are_retried_then_typed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends
    with RemoteClient(f"http://127.0.0.1:{port}", model="m", backoff_s=0.001, max_retries=2) as client:
        with pytest.raises(UpstreamError) as info:
            client.generate("hi")
    assert isinstance(info.value.__cause__, httpx.ConnectError)


def test_lifecycle_guard() -> None:
    client = RemoteClient("http://server", model="m", transport=_mock(lambda r: httpx.Response(200, json=COMPLETION)))
    with client:
        with pytest.raises(RuntimeError, match="more than once"):
            client.__enter__()
    with pytest.raises(RuntimeError, match="closed"):
        client.generate("hi")
    with pytest.raises(RuntimeError, match="closed"):
        with client:
            pass


def test_sse_stream_gives_exactly_one_final_chunk_merging_a_trailing_usage_chunk() -> None:
    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    body = (
        event({"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        + event({"model": "m", "choices": [{"index": 0, "delta": {"content": "He"}, "finish_reason": None}]})
        + ": keep-alive comment\n\n"
        + event(
            {
                "model": "m",
                "choices": [{"index": 0, "delta": {"content": "llo"}, "finish_reason": None}],
                "abstractcore": {"execution": {"mode": "cohort"}},
            }
        )
        + event({"model": "m", "choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}]})
        + event({"model": "m", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}})
        + "data: [DONE]\n\n"
    )
    transport = _mock(lambda r: httpx.Response(200, text=body, headers={"content-type": "text/event-stream"}))
    with RemoteClient("http://server", model="m", transport=transport) as client:
        chunks = list(client.generate("hi", stream=True))
    assert [c.content for c in chunks] == ["He", "llo", "!"]
    assert [c.finish_reason for c in chunks] == [None, None, "stop"]
    assert chunks[-1].usage["completion_tokens"] == 3
    assert chunks[-1].metadata["execution"] == {"mode": "cohort"}


def test_sse_error_event_raises_the_typed_error() -> None:
    body = (
        'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
        'data: {"error":{"message":"worker died","type":"native_runtime_error","code":"engine_crashed"}}\n\n'
        "data: [DONE]\n\n"
    )
    transport = _mock(lambda r: httpx.Response(200, text=body, headers={"content-type": "text/event-stream"}))
    with RemoteClient("http://server", model="m", transport=transport) as client:
        stream = client.generate("hi", stream=True)
        assert next(stream).content == "a"
        with pytest.raises(EngineCrashed):
            next(stream)


def test_a_stream_cut_before_its_terminal_chunk_is_an_error() -> None:
    body = 'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
    transport = _mock(lambda r: httpx.Response(200, text=body, headers={"content-type": "text/event-stream"}))
    with RemoteClient("http://server", model="m", transport=transport) as client:
        with pytest.raises(UpstreamError, match="terminal chunk"):
            list(client.generate("hi", stream=True))


# --------------------------------------------------------------------------- against create_app (ASGI)


def test_async_client_through_asgi_forwards_media_progress_and_errors() -> None:
    fake = FakeProvider()
    app = create_app(fake)

    async def main() -> None:
        async with AsyncRemoteClient("http://asgi", transport=httpx.ASGITransport(app=app)) as client:
            events: list[dict[str, Any]] = []
            stream = await client.generate(
                "look", media=[png_bytes()], stream=True, on_progress=events.append, speculation=False
            )
            chunks = [c async for c in stream]
            assert "".join(c.content for c in chunks) == "Hello world"  # deltas that queued together merge
            assert [c.finish_reason for c in chunks].count("stop") == 1
            assert [e["phase"] for e in events] == ["prefill", "generate", "complete"]
            assert fake.calls[0]["media"] == [png_bytes()]
            assert fake.calls[0]["speculation"] is False
            assert client.model == "fake-model"  # asked GET /v1/models

            events.clear()
            result = await client.generate("again", on_progress=events.append)
            assert result.content == "Hello world" and len(events) == 3
            assert result.usage["cached_input_tokens"] == 2

            fake.error, fake.fail_after = EngineCrashed("worker died"), 1
            stream = await client.generate("x", stream=True)
            with pytest.raises(EngineCrashed):
                async for _ in stream:
                    pass

    asyncio.run(main())


def test_client_api_key_reaches_the_server() -> None:
    app = create_app(FakeProvider(), api_key="k")

    async def main() -> None:
        async with AsyncRemoteClient("http://asgi", api_key="k", transport=httpx.ASGITransport(app=app)) as good:
            assert (await good.generate("hi")).content == "Hello world"
        async with AsyncRemoteClient("http://asgi", model="fake-model", transport=httpx.ASGITransport(app=app)) as bad:
            with pytest.raises(AuthenticationError):
                await bad.generate("hi")

    asyncio.run(main())


# --------------------------------------------------------------------------- against a real server


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tiny_model(tmp_path_factory.mktemp("client-models") / "dense", kind="dense")
    llm = create_llm("mlx", model=str(path), mlx_batching=True, mlx_max_batch_size=4)
    with serve_in_thread(create_app(llm)) as url:
        yield llm, url
    llm.unload_model(llm.model)


def test_sync_generate_and_stream_against_the_server(real: Any) -> None:
    llm, url = real
    with RemoteClient(url) as client:
        result = client.generate("Hi", temperature=0, max_output_tokens=6, speculation=False, thinking=False)
        local = llm.generate("Hi", temperature=0, max_output_tokens=6, speculation=False, thinking=False)
        assert result.content == local.content  # same greedy tokens over HTTP
        assert result.usage["completion_tokens"] == 6
        assert result.metadata["execution"]["mode"] == "continuous"
        assert result.metadata["speculation"]["reason"] == "disabled_for_this_call"
        assert result.metadata["controls"] == local.metadata["controls"]  # each control and its source
        events: list[dict[str, Any]] = []
        chunks = list(
            client.generate(
                "Hi", temperature=0, max_output_tokens=6, stream=True, on_progress=events.append, thinking=False
            )
        )
        assert sum(1 for c in chunks if c.finish_reason) == 1 and chunks[-1].finish_reason == "length"
        assert (
            "".join(c.content for c in chunks)
            == llm.generate("Hi", temperature=0, max_output_tokens=6, thinking=False).content
        )
        # Thinking on: the template opens the think block, the server sends its text apart.
        thought = list(client.generate("Hi", temperature=0, max_output_tokens=6, stream=True, thinking=True))
        assert (
            "".join(c.reasoning or "" for c in thought).strip()
            == llm.generate("Hi", temperature=0, max_output_tokens=6, thinking=True).content.strip()
        )
        assert chunks[-1].metadata["remote"]["ttft_s"] > 0
        assert [e["phase"] for e in events][0] == "prefill" and events[-1]["phase"] == "complete"
        caps = client.get_execution_capabilities()
        assert caps["concurrency"]["supported"] is True
        assert client.health()["loaded"] is True


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_streamed_tool_calls_are_rebuilt_into_chunks(real: Any, choice: Any) -> None:
    _, url = real
    kwargs: dict[str, Any] = dict(
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=choice,
        temperature=0,
        max_output_tokens=60,
        speculation=False,
        thinking=False,
    )
    with RemoteClient(url) as client:
        whole = client.generate(**kwargs)
        chunks = list(client.generate(stream=True, **kwargs))
    assert whole.finish_reason == "tool_calls" and whole.tool_calls is not None
    (expected,) = whole.tool_calls
    if isinstance(choice, dict):
        assert expected["function"]["name"] == "get_time"  # the choice reached the server's grammar
    carrying = [c for c in chunks if c.tool_calls]
    assert len(carrying) == 1  # the call goes out once, on the chunk where it completed
    (call,) = carrying[0].tool_calls or []
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == expected["function"]  # same greedy tokens: same name, same arguments text
    assert json.loads(call["function"]["arguments"])  # a whole JSON object
    assert "".join(c.content for c in chunks).strip() == "" and chunks[-1].finish_reason == "tool_calls"


def test_tool_call_pieces_are_gathered_by_index_until_complete() -> None:
    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def delta(d: dict[str, Any], finish: str | None = None) -> str:
        return event({"model": "m", "choices": [{"index": 0, "delta": d, "finish_reason": finish}]})

    def head(index: int, call_id: str, name: str) -> dict[str, Any]:
        return {
            "tool_calls": [
                {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
            ]
        }

    def args(index: int, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}

    # vLLM's shape: arguments in pieces; the second call never closes its object before the end.
    body = "".join(
        [
            delta({"role": "assistant", "content": ""}),
            delta(head(0, "call_a", "get_weather")),
            delta(args(0, '{"city": ')),
            delta(args(0, '"Paris"}')),
            delta(head(1, "call_b", "get_time")),
            delta(args(1, '{"zone": "UTC"')),
            delta({}, finish="tool_calls"),
            event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}}),
            "data: [DONE]\n\n",
        ]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})

    with RemoteClient("http://server", model="m", transport=_mock(handler)) as client:
        chunks = list(client.generate("hi", stream=True))
    per_chunk = [[c["id"] for c in chunk.tool_calls or []] for chunk in chunks]
    assert per_chunk == [["call_a"], ["call_b"]]
    assert chunks[0].tool_calls == [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ]
    assert chunks[-1].finish_reason == "tool_calls" and chunks[-1].tool_calls is not None
    assert chunks[-1].tool_calls[0]["function"]["arguments"] == '{"zone": "UTC"'  # as sent: the server ended it there


def test_async_concurrent_streams_are_batched_by_the_server(real: Any) -> None:
    _, url = real

    async def one(client: AsyncRemoteClient, i: int) -> GenerationChunk:
        stream = await client.generate(
            f"Question {i}", temperature=0, max_output_tokens=32, stream=True, speculation=False
        )
        last = None
        async for chunk in stream:
            last = chunk
        assert last is not None
        return last

    async def main() -> list[GenerationChunk]:
        async with AsyncRemoteClient(url) as client:
            return list(await asyncio.gather(*[one(client, i) for i in range(4)]))

    finals = asyncio.run(main())
    assert max(f.metadata["execution"]["peak_batch_size"] for f in finals) > 1


def test_cancel_event_stops_the_call_and_frees_the_slot(real: Any) -> None:
    llm, url = real
    cancel = threading.Event()
    before = engine_stats(llm)["cancelled"]
    with RemoteClient(url) as client:
        stream = client.generate(
            "Say something.",
            messages=[],
            temperature=0,
            max_output_tokens=4000,
            stream=True,
            cancel_event=cancel,
            speculation=False,
        )
        first = next(stream)
        assert first.content or first.reasoning
        cancel.set()
        rest = list(stream)
    assert rest[-1].finish_reason == "cancelled" and rest[-1].metadata["remote"]["cancelled"] is True
    assert wait_until(
        lambda: engine_stats(llm)["cancelled"] == before + 1 and engine_stats(llm)["active"] == 0, timeout_s=10
    )


def test_closing_an_abandoned_stream_cancels_it(real: Any) -> None:
    llm, url = real
    before = engine_stats(llm)["cancelled"]
    with RemoteClient(url) as client:
        with client.generate(
            "Say something.", messages=[], temperature=0, max_output_tokens=4000, stream=True
        ) as stream:
            next(stream)
    assert wait_until(
        lambda: engine_stats(llm)["cancelled"] == before + 1 and engine_stats(llm)["active"] == 0, timeout_s=10
    )


@pytest.mark.slow
def test_images_reach_a_vision_model(tmp_path: Any) -> None:
    from abstractruntime_mlx.testing import tiny_image

    path = tiny_model(tmp_path / "vision", kind="vision")
    image = tiny_image(tmp_path / "halves.png", (255, 0, 0), (0, 0, 255))
    llm = create_llm("mlx", model=str(path), mlx_batching=True)
    try:
        with serve_in_thread(create_app(llm)) as url, RemoteClient(url) as client:
            result = client.generate(
                "Describe the image.", media=[str(image)], temperature=0, max_output_tokens=4, speculation=False
            )
            local = llm.generate(
                "Describe the image.", media=[str(image)], temperature=0, max_output_tokens=4, speculation=False
            )
        assert result.content == local.content
        assert result.usage["prompt_tokens"] == local.usage["prompt_tokens"]
    finally:
        llm.unload_model(llm.model)


def test_sse_parser_handles_records_split_across_network_chunks() -> None:
    from abstractruntime_mlx.remote_client._base import SSEParser

    raw = b'data: {"a": 1}\r\n\r\nevent: progress\r\ndata: {"phase":\r\ndata: "x"}\r\n\r\n: comment\n\ndata: [DONE]\n\n'
    for size in (1, 3, 7, len(raw)):
        parser = SSEParser()
        events = []
        for start in range(0, len(raw), size):
            events.extend(parser.feed_bytes(raw[start : start + size]))
        assert [(e.event, e.data) for e in events] == [
            (None, '{"a": 1}'),
            ("progress", '{"phase":\n"x"}'),
            (None, "[DONE]"),
        ]
