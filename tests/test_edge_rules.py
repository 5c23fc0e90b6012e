"""One rule at every edge (Python keywords, a flow node's payload, an HTTP body) for the output
cap's aliases and for the prompt-cache key's form."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from abstractruntime_mlx.errors import InvalidControls
from abstractruntime_mlx.nodes import NodeRequest
from abstractruntime_mlx.nodes.llm_node import generation_request
from abstractruntime_mlx.request import GenerationRequest, check_prompt_cache_key, output_cap
from abstractruntime_mlx.runtime_plugin.adapter.payload import request_from_payload
from abstractruntime_mlx.server import create_app
from test_server_harness import FakeProvider, serve_in_thread

USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


def node_request(params: dict[str, Any], **payload: Any) -> GenerationRequest:
    return generation_request(request_from_payload({"prompt": "hi", "params": params, **payload}, {}))


# --------------------------------------------------------------------------- output cap


def test_output_cap_takes_one_value_or_equal_ones_and_refuses_two_different() -> None:
    assert output_cap() is None
    assert output_cap(max_tokens=5) == 5
    assert output_cap(max_output_tokens=5, max_tokens=5, max_completion_tokens=5) == 5
    with pytest.raises(InvalidControls) as info:
        output_cap(max_output_tokens=5, max_completion_tokens=6)
    assert info.value.code == "invalid_controls" and info.value.field == "max_completion_tokens"
    with pytest.raises(InvalidControls):
        output_cap(max_output_tokens=1, max_tokens=True)  # a boolean is not the number 1


def test_conflicting_caps_are_refused_at_the_python_edge() -> None:
    assert GenerationRequest.from_kwargs("hi", max_output_tokens=4, max_tokens=4).max_output_tokens == 4
    assert GenerationRequest.from_kwargs("hi", max_tokens=3).max_output_tokens == 3
    with pytest.raises(InvalidControls) as info:
        GenerationRequest.from_kwargs("hi", max_output_tokens=4, max_tokens=3)
    assert info.value.code == "invalid_controls" and info.value.field == "max_tokens"


def test_conflicting_caps_are_refused_at_the_node_edge() -> None:
    assert node_request({"max_output_tokens": 4, "max_tokens": 4}).max_output_tokens == 4
    assert node_request({"max_tokens": 3}).max_output_tokens == 3
    with pytest.raises(InvalidControls) as info:
        node_request({"max_output_tokens": 4, "max_tokens": 3})
    assert info.value.code == "invalid_controls" and info.value.field == "max_tokens"
    # a NodeRequest built by hand carries its cap in its own field, never among the sampling knobs
    assert generation_request(NodeRequest(prompt="hi", max_output_tokens=4)).max_output_tokens == 4
    for name in ("max_output_tokens", "max_tokens"):
        with pytest.raises(InvalidControls) as info:
            generation_request(NodeRequest(prompt="hi", sampling={name: 4}))
        assert info.value.field == f"sampling.{name}"


def test_the_node_edge_keeps_the_hosts_precedence_below_the_params() -> None:
    # params first, then the payload's fields, then the run's _limits
    assert node_request({"max_tokens": 3}, max_output_tokens=9).max_output_tokens == 3
    assert node_request({}, max_out_tokens=7).max_output_tokens == 7
    limits = {"_limits": {"max_output_tokens": 11}}
    assert generation_request(request_from_payload({"prompt": "hi", "params": {}}, limits)).max_output_tokens == 11


def test_conflicting_caps_are_refused_over_http_with_the_same_code() -> None:
    fake = FakeProvider()
    with serve_in_thread(create_app(fake)) as url:
        for caps, field in (
            ({"max_tokens": 3, "max_output_tokens": 4}, "max_tokens"),
            ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ):
            reply = httpx.post(f"{url}{CHAT}", json={"messages": USER, **caps}, timeout=30)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["code"] == "invalid_controls" and error["details"]["field"] == field
        assert fake.calls == []
        equal = httpx.post(
            f"{url}{CHAT}", json={"messages": USER, "max_tokens": 3, "max_completion_tokens": 3}, timeout=30
        )
        assert equal.status_code == 200, equal.text
    assert fake.calls[0]["max_output_tokens"] == 3


# --------------------------------------------------------------------------- prompt-cache key


def test_a_key_is_stripped_and_an_all_whitespace_key_is_refused_like_an_empty_one() -> None:
    assert check_prompt_cache_key("  k\n") == "k"
    assert GenerationRequest.from_kwargs("", messages=[], prompt_cache_key=" k").prompt_cache_key == "k"
    for key in ("", "   "):
        with pytest.raises(InvalidControls) as info:
            GenerationRequest.from_kwargs("", messages=[], prompt_cache_key=key)
        assert info.value.code == "invalid_controls" and info.value.field == "prompt_cache_key"


def test_a_node_key_is_stripped_as_at_the_other_edges() -> None:
    assert node_request({"prompt_cache_key": " k "}).prompt_cache_key == "k"


def test_an_all_whitespace_key_is_refused_over_http() -> None:
    fake = FakeProvider()
    with serve_in_thread(create_app(fake)) as url:
        reply = httpx.post(f"{url}{CHAT}", json={"messages": USER, "prompt_cache_key": "  "}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_controls"
    assert reply.json()["error"]["details"]["field"] == "prompt_cache_key"
    assert fake.calls == []


def test_keys_differing_only_in_surrounding_whitespace_are_one_key_over_http(dense_model: str, make_llm: Any) -> None:
    llm = make_llm(dense_model, mlx_batching=True)
    first_turn = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    common = {"temperature": 0, "max_tokens": 4, "speculation": False, "thinking": False}
    with serve_in_thread(create_app(llm)) as url:
        first = httpx.post(
            f"{url}{CHAT}", json={"messages": first_turn, "prompt_cache_key": " k", **common}, timeout=120
        )
        assert first.status_code == 200, first.text
        answer = first.json()["choices"][0]["message"]["content"]
        second_turn = [*first_turn, {"role": "assistant", "content": answer}, {"role": "user", "content": "Another."}]
        second = httpx.post(
            f"{url}{CHAT}", json={"messages": second_turn, "prompt_cache_key": "k", **common}, timeout=120
        )
        assert second.status_code == 200, second.text
    cache = second.json()["abstractcore"]["prompt_cache"]
    assert cache["outcome"] == "hit", cache
    assert cache["key"] == "k"
