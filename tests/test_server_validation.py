"""Strict validation at the HTTP edge: every bad value is a 400 naming its field, and the
provider never sees the request.

The rules run before the provider, so a scripted fake provider behind Starlette's
in-process client is enough here; ``test_server_fuzz.py`` drives a real server.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from abstractruntime_mlx.errors import InvalidControls
from abstractruntime_mlx.request import MAX_PROMPT_CACHE_KEY_CHARS, GenerationRequest
from abstractruntime_mlx.server import create_app
from abstractruntime_mlx.server.app import MAX_BODY_BYTES
from abstractruntime_mlx.server.schemas import MAX_JSON_DEPTH, MAX_MESSAGES
from test_server_harness import FakeProvider, serve_in_thread

USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


@pytest.fixture()
def fake() -> FakeProvider:
    return FakeProvider()


@pytest.fixture()
def client(fake: FakeProvider) -> Any:
    with TestClient(create_app(fake)) as c:
        yield c


def post_raw(client: Any, path: str, raw: str | bytes) -> Any:
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


def assert_bad(reply: Any, field: str, *, code: str = "invalid_request", status: int = 400) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code
    assert error["details"]["field"] == field
    assert field in error["message"]
    return dict(error)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('{"messages": %s, "temperature": NaN}', "temperature"),
        ('{"messages": %s, "top_p": Infinity}', "top_p"),
        ('{"messages": %s, "top_p": -Infinity}', "top_p"),
        ('{"messages": %s, "min_p": 1e999}', "min_p"),
        ('{"messages": %s, "logit_bias": {"5": NaN}}', "logit_bias.5"),
        ('{"messages": %s, "metadata": {"deep": [1, NaN]}}', "metadata.deep.1"),
    ],
)
def test_non_finite_numbers_are_rejected_anywhere(client: Any, fake: FakeProvider, raw: str, field: str) -> None:
    import json

    assert_bad(post_raw(client, CHAT, raw % json.dumps(USER)), field)
    assert fake.calls == []


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 10.0}, "max_tokens"),
        ({"max_completion_tokens": "5"}, "max_completion_tokens"),
        ({"seed": "1"}, "seed"),
        ({"seed": False}, "seed"),
        ({"top_k": 2.5}, "top_k"),
        ({"n": True}, "n"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
        ({"stop": 5}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"model": "m" * 256}, "model"),
        ({"model": 5}, "model"),
        ({"prompt_cache_key": 7}, "prompt_cache_key"),
    ],
)
def test_numbers_and_strings_are_strict(client: Any, fake: FakeProvider, extra: dict[str, Any], field: str) -> None:
    assert_bad(client.post(CHAT, json={"messages": USER, **extra}), field)
    assert fake.calls == []


def test_accepted_numbers_reach_the_provider_unchanged(client: Any, fake: FakeProvider) -> None:
    reply = client.post(CHAT, json={"messages": USER, "max_tokens": 7, "temperature": 1, "top_p": 0.5, "seed": 3})
    assert reply.status_code == 200, reply.text
    call = fake.calls[0]
    assert call["max_output_tokens"] == 7 and call["seed"] == 3 and call["top_p"] == 0.5
    assert call["temperature"] == 1.0 and isinstance(call["temperature"], float)


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "user", "content": "a\ud800b"}, "messages.0.content"),
        ({"role": "user", "content": [{"type": "text", "text": "\udfff"}]}, "messages.0.content.0.text"),
        ({"role": "user", "content": "x", "name": "\ud83d"}, "messages.0.name"),
    ],
)
def test_lone_surrogates_are_rejected(client: Any, fake: FakeProvider, message: dict[str, Any], field: str) -> None:
    import json

    raw = json.dumps({"messages": [message]})  # ensure_ascii keeps the lone surrogate as an escape
    assert_bad(post_raw(client, CHAT, raw), field)
    assert fake.calls == []


def test_an_error_quoting_a_lone_surrogate_still_reaches_the_client(client: Any) -> None:
    reply = post_raw(client, CHAT, '{"messages": [{"role": "user", "content": "x"}], "metadata": {"\\ud800": 1}}')
    assert_bad(reply, "metadata.\ufffd")
    assert "\ud800" not in reply.text


def test_lone_surrogate_sent_as_raw_bytes_is_rejected(client: Any) -> None:
    raw = b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'  # CESU-8 of U+D800
    reply = post_raw(client, CHAT, raw)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request"


def test_a_paired_surrogate_is_a_normal_character(client: Any, fake: FakeProvider) -> None:
    reply = post_raw(client, CHAT, '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert reply.status_code == 200, reply.text
    assert fake.calls[0]["messages"][0]["content"] == "\U0001f600"


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_deeply_nested_json_is_a_400(client: Any, fake: FakeProvider, depth: int) -> None:
    raw = '{"messages": [{"role": "user", "content": "x"}], "metadata": ' + "[" * depth + "]" * depth + "}"
    reply = post_raw(client, CHAT, raw)
    assert reply.status_code == 400, reply.text
    assert "nested deeper" in reply.json()["error"]["message"]
    assert fake.calls == []


def test_nesting_up_to_the_limit_is_accepted(client: Any) -> None:
    depth = MAX_JSON_DEPTH - 2  # the body object and the metadata key are two levels
    raw = '{"messages": [{"role": "user", "content": "x"}], "metadata": %s}' % ("[" * depth + "]" * depth)
    assert post_raw(client, CHAT, raw).status_code == 200


@pytest.mark.parametrize(
    ("tool_calls", "field"),
    [
        ([{"function": "x"}], "messages.1.tool_calls.0.function"),
        ([{"function": {"arguments": "{}"}}], "messages.1.tool_calls.0.function.name"),
        ([{"id": "c1", "arguments": "{}"}], "messages.1.tool_calls.0"),
        ([{"name": 5}], "messages.1.tool_calls.0.name"),
        ([{"type": "web", "function": {"name": "f"}}], "messages.1.tool_calls.0.type"),
        (["f"], "messages.1.tool_calls.0"),
        ({"function": {"name": "f"}}, "messages.1.tool_calls"),
    ],
)
def test_malformed_tool_calls_are_rejected(client: Any, fake: FakeProvider, tool_calls: Any, field: str) -> None:
    messages = [*USER, {"role": "assistant", "content": "", "tool_calls": tool_calls}]
    assert_bad(client.post(CHAT, json={"messages": messages}), field)
    assert fake.calls == []


@pytest.mark.parametrize(
    "call",
    [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}},
        {"call_id": "c1", "name": "add", "arguments": {"a": 1}},  # AbstractCore's flat form
    ],
)
def test_well_formed_tool_calls_reach_the_template(client: Any, fake: FakeProvider, call: dict[str, Any]) -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    assert client.post(CHAT, json={"messages": messages}).status_code == 200
    assert fake.calls[0]["messages"][1]["tool_calls"] == [call]


def test_message_count_is_limited(client: Any, fake: FakeProvider) -> None:
    reply = client.post(CHAT, json={"messages": USER * (MAX_MESSAGES + 1)})
    assert_bad(reply, "messages")
    assert fake.calls == []


def test_an_oversized_body_is_a_413(client: Any) -> None:
    reply = post_raw(client, CHAT, b" " * (MAX_BODY_BYTES + 1))
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/acore/models/load", {"model": "m" * 256}, "model"),
        ("/acore/models/load", {"model": "x", "pin": "yes"}, "pin"),
        ("/acore/models/unload", {"model": "m" * 256}, "model"),
        ("/acore/prompt_cache/key_meta", {"key": "k", "model": "m" * 256}, "model"),
        ("/acore/prompt_cache/clear", {"key": 5}, "key"),
    ],
)
def test_acore_routes_validate_their_bodies(client: Any, path: str, body: dict[str, Any], field: str) -> None:
    assert_bad(client.post(path, json=body), field)


def test_key_meta_rejects_non_finite_values(client: Any) -> None:
    reply = post_raw(client, "/acore/prompt_cache/key_meta", '{"key": "k", "meta": {"score": Infinity}}')
    assert_bad(reply, "meta.score")
    assert client.get("/acore/prompt_cache/key_meta", params={"key": "k"}).status_code == 404


def test_capabilities_model_name_is_length_limited(client: Any) -> None:
    reply = client.get("/v1/models/execution-capabilities", params={"model_name": "a" * 300})
    assert_bad(reply, "model_name")


def test_numbers_in_text_are_ascii_digits_on_a_real_server(fake: FakeProvider) -> None:
    """``"²".isdigit()`` is true yet ``int("²")`` raises (it was a 500), and ``int("٣")`` is 3:
    a number written in text is read in ASCII digits only, everywhere, as a typed 400."""
    with serve_in_thread(create_app(fake)) as url:
        for key in ("²", "٣"):
            reply = httpx.post(f"{url}{CHAT}", json={"messages": USER, "logit_bias": {key: 1}}, timeout=30)
            assert_bad(reply, f"logit_bias.{key}", code="invalid_controls")
        for depth in ("²", "٣"):
            load = httpx.post(
                f"{url}/acore/models/load", json={"model": "fake-model", "speculation": depth}, timeout=30
            )
            assert_bad(load, "speculation", code="invalid_controls")
        assert fake.calls == []
        # What was accepted before still is: the served model, and token ids in ASCII digits.
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]] == ["fake-model"]
        reply = httpx.post(f"{url}{CHAT}", json={"messages": USER, "logit_bias": {"5": 1, "12": -2}}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert fake.calls[0]["logit_bias"] == {"5": 1.0, "12": -2.0}


@pytest.mark.slow
def test_a_prompt_cache_key_longer_than_the_limit_is_refused_and_never_stored(fake: FakeProvider) -> None:
    """Keys are held in memory for as long as the cache knows them: their length is bounded."""
    longest, too_long, huge = "k" * MAX_PROMPT_CACHE_KEY_CHARS, "k" * (MAX_PROMPT_CACHE_KEY_CHARS + 1), "k" * 10_000_000
    with serve_in_thread(create_app(fake)) as url:
        stored = httpx.post(f"{url}/acore/prompt_cache/key_meta", json={"key": longest, "meta": {"n": 1}}, timeout=30)
        assert stored.status_code == 200, stored.text
        for key in (too_long, huge):
            chat = httpx.post(f"{url}{CHAT}", json={"messages": USER, "prompt_cache_key": key}, timeout=60)
            error = assert_bad(chat, "prompt_cache_key", code="invalid_controls")
            assert f"the limit is {MAX_PROMPT_CACHE_KEY_CHARS}" in error["message"]
            assert len(chat.content) < 2_000  # the error does not echo the key back
            meta = httpx.post(f"{url}/acore/prompt_cache/key_meta", json={"key": key, "meta": {"n": 2}}, timeout=60)
            assert_bad(meta, "key")
            cleared = httpx.post(f"{url}/acore/prompt_cache/clear", json={"key": key}, timeout=60)
            assert_bad(cleared, "key")
        assert fake.calls == []
        # What was accepted before is still there, and a key at the limit still works.
        kept = httpx.get(f"{url}/acore/prompt_cache/key_meta", params={"key": longest}, timeout=30)
        assert kept.status_code == 200 and kept.json()["meta"] == {"n": 1}
        chat = httpx.post(f"{url}{CHAT}", json={"messages": USER, "prompt_cache_key": longest}, timeout=30)
        assert chat.status_code == 200, chat.text
        assert fake.calls[0]["prompt_cache_key"] == longest


def test_the_prompt_cache_key_limit_holds_at_the_python_edge() -> None:
    assert GenerationRequest.from_kwargs(
        "", messages=[], prompt_cache_key="k" * MAX_PROMPT_CACHE_KEY_CHARS
    ).prompt_cache_key
    with pytest.raises(InvalidControls) as info:
        GenerationRequest.from_kwargs("", messages=[], prompt_cache_key="k" * (MAX_PROMPT_CACHE_KEY_CHARS + 1))
    assert info.value.code == "invalid_controls" and info.value.field == "prompt_cache_key"
    assert len(str(info.value.details["value"])) <= 65
