"""Property-based fuzzing of a real server (uvicorn on 127.0.0.1, the tiny dense model).

Hypothesis builds chat bodies (valid shapes with hostile values, wrong types, raw JSON
with NaN, deep nesting, lone surrogates, bytes that are not UTF-8), bodies that pass the
edge with extreme values (token ids past the vocabulary, seeds past 64 bits, huge output
caps, odd controls) so that the provider and the engine are fuzzed too, and bodies and
queries for the other routes. For each one: the answer comes within the client timeout, it is not
a 5xx (nor a 5xx error event inside a stream), and a normal request right after still
answers. Examples are derandomized, so a run is reproducible and CI sees the same ones.
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from abstractruntime_mlx import create_llm
from abstractruntime_mlx.server import create_app
from test_server_harness import serve_in_thread

TIMEOUT_S = 30.0  # a request slower than this counts as a hang
NORMAL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
VOCAB_SIZE = 2000  # the tiny model's
FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)

# ----------------------------------------------------------------------------- strategies

texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\x00", "\ud800", "a\udfffb", "\U0001f600", "<|im_end|>", "<think>", "default", "mlx/"]),
)
big_ints = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 10**28]),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e300, -1.0, 2.0, 100.0, 101.0, math.nan, math.inf, -math.inf]),
)
scalars = st.one_of(st.none(), st.booleans(), big_ints, floats, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)
# Token ids around and far past the vocabulary, seeds past 64 bits: the provider's checks
# against the loaded model.
token_ids = st.one_of(st.integers(min_value=0, max_value=VOCAB_SIZE + 5), big_ints).map(str)
seeds = big_ints
# Output caps stay small when valid, so a valid body never generates for long; the large
# ones are past the tiny model's context.
output_caps = st.one_of(st.integers(min_value=-3, max_value=4), st.sampled_from([10**6, 2**63, 10**28]))

content_parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(texts, json_values)}),
        st.fixed_dictionaries(
            {"type": st.just("image_url"), "image_url": st.one_of(json_values, st.fixed_dictionaries({"url": texts}))}
        ),
        st.dictionaries(texts, json_values, max_size=3),
    ),
    max_size=3,
)
tool_calls = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "id": texts,
                "type": st.just("function"),
                "function": st.fixed_dictionaries({"name": texts, "arguments": st.one_of(texts, json_values)}),
            }
        ),
        json_values,
    ),
    max_size=2,
)
messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
                "content": st.one_of(texts, content_parts, st.none()),
            },
            optional={
                "name": texts,
                "tool_calls": st.one_of(tool_calls, json_values),
                "tool_call_id": texts,
                "reasoning": json_values,
            },
        ),
        st.dictionaries(texts, json_values, max_size=3),
    ),
    min_size=0,
    max_size=4,
)
chat_fields = {
    "model": st.one_of(texts, json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(
        st.fixed_dictionaries({}, optional={"include_usage": json_values, "include_progress": st.booleans()}),
        json_values,
    ),
    "n": json_values,
    "temperature": st.one_of(floats, json_values),
    "top_p": st.one_of(floats, json_values),
    "top_k": st.one_of(big_ints, json_values),
    "min_p": floats,
    "repetition_penalty": floats,
    "presence_penalty": floats,
    "frequency_penalty": floats,
    "logit_bias": st.one_of(
        st.dictionaries(
            st.one_of(token_ids, texts.filter(lambda k: not k.strip().isdigit())),
            st.one_of(floats, json_values),
            max_size=3,
        ),
        json_values,
    ),
    "seed": st.one_of(seeds, json_values),
    "stop": st.one_of(texts, st.lists(texts, max_size=3), json_values),
    "max_output_tokens": st.one_of(output_caps, json_values),
    "max_completion_tokens": st.one_of(output_caps, json_values),
    "speculation": json_values,
    "thinking": json_values,
    "reasoning_effort": json_values,
    "prompt_cache_key": json_values,
    "tools": st.one_of(st.lists(st.dictionaries(texts, json_values, max_size=3), max_size=2), json_values),
    "metadata": json_values,
    "user": json_values,
}
chat_bodies = st.fixed_dictionaries(
    {"messages": st.one_of(messages, json_values), "max_tokens": st.one_of(output_caps, json_values)},
    optional=chat_fields,
)
# Bodies that pass the edge (right types, valid JSON) with extreme values, so that the
# provider's checks and the engine are what is fuzzed.
unicode_texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
finite = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0, 0.5, 1, 2, 1e-9, 1e9]))
engine_fields = {
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_progress": st.booleans(), "include_usage": st.booleans()}
    ),
    "temperature": finite,
    "top_p": finite,
    "top_k": st.one_of(st.integers(min_value=-1, max_value=50), big_ints),
    "min_p": finite,
    "repetition_penalty": finite,
    "presence_penalty": finite,
    "frequency_penalty": finite,
    "logit_bias": st.dictionaries(token_ids, finite, max_size=3),
    "seed": big_ints,
    "stop": st.one_of(unicode_texts, st.lists(unicode_texts, max_size=3)),
    "speculation": st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(["off", "native_mtp", "warp"]),
        st.fixed_dictionaries(
            {"mode": st.sampled_from(["native_mtp", "off", "x"])},
            optional={"num_draft_tokens": big_ints, "require_acceleration": st.booleans()},
        ),
    ),
    "thinking": st.one_of(st.booleans(), st.sampled_from(["low", "medium", "high", "max", ""])),
    "prompt_cache_key": unicode_texts,
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries({"name": unicode_texts}, optional={"parameters": json_values}),
            }
        ),
        max_size=2,
    ),
}
engine_bodies = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": unicode_texts}),
            min_size=1,
            max_size=3,
        ),
        "max_tokens": st.integers(min_value=1, max_value=4),
    },
    optional=engine_fields,
)
raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
            b'{"messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}',
            b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
            b'{"messages": [{"role": "user", "content": "\xff"}]}',
            b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            b"[]",
            b"null",
            b'"text"',
            b"{",
        ]
    ),
)


def dumps(body: Any) -> bytes:
    """JSON as a careless client writes it: NaN/Infinity literals, lone surrogates escaped."""
    return json.dumps(body, allow_nan=True).encode()


# ----------------------------------------------------------------------------- harness


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, dense_model: str) -> Any:
    llm = create_llm("mlx", model=dense_model, mlx_batching=True, mlx_max_batch_size=4)
    try:
        with serve_in_thread(create_app(llm)) as url, httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
            yield client
    finally:
        llm.unload_model(llm.model)


def assert_answered(reply: httpx.Response) -> None:
    assert reply.status_code < 500, reply.text[:500]
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        for line in reply.text.splitlines():
            if line.startswith("data:") and '"error"' in line:
                code = json.loads(line[5:])["error"]["code"]
                assert code not in ("internal_error", "engine_crashed", "backend_error", "upstream_error"), line
    else:
        body = reply.json()
        assert isinstance(body, dict)
        if reply.status_code >= 400:
            assert isinstance(body["error"]["code"], str) and body["error"]["code"] != "internal_error"


def assert_still_serving(client: httpx.Client) -> None:
    assert client.get("/health").json()["loaded"] is True
    reply = client.post("/v1/chat/completions", json=NORMAL)
    assert reply.status_code == 200, reply.text[:500]
    assert reply.json()["usage"]["completion_tokens"] == 1


# ----------------------------------------------------------------------------- properties


@pytest.mark.slow
@FUZZ
@given(body=chat_bodies)
def test_fuzzed_chat_bodies(server: httpx.Client, body: dict[str, Any]) -> None:
    reply = server.post("/v1/chat/completions", content=dumps(body), headers={"Content-Type": "application/json"})
    event(f"status {reply.status_code}")
    assert_answered(reply)
    assert_still_serving(server)


@pytest.mark.slow
@FUZZ
@given(body=engine_bodies)
def test_fuzzed_values_that_reach_the_provider(server: httpx.Client, body: dict[str, Any]) -> None:
    reply = server.post("/v1/chat/completions", content=dumps(body), headers={"Content-Type": "application/json"})
    event(f"status {reply.status_code}")
    assert_answered(reply)
    assert_still_serving(server)


@pytest.mark.slow
@FUZZ
@given(
    raw=raw_bodies,
    path=st.sampled_from(
        ["/v1/chat/completions", "/acore/models/load", "/acore/prompt_cache/key_meta", "/acore/prompt_cache/clear"]
    ),
)
def test_fuzzed_raw_bodies(server: httpx.Client, raw: bytes, path: str) -> None:
    assert_answered(server.post(path, content=raw, headers={"Content-Type": "application/json"}))
    assert_still_serving(server)


other_requests = st.one_of(
    st.tuples(
        st.just("POST"),
        st.just("/acore/models/load"),
        st.fixed_dictionaries(
            {
                "model": st.one_of(
                    texts, st.sampled_from(["/proc/self", "~", "/", "..", "org/name", "a" * 300]), json_values
                )
            },
            optional={
                "provider": json_values,
                "options": st.one_of(
                    st.dictionaries(
                        st.sampled_from(["mlx_max_batch_size", "mtp_head", "speculation", "warp"]),
                        json_values,
                        max_size=2,
                    ),
                    json_values,
                ),
                "task": json_values,
                "pin": json_values,
            },
        ),
    ),
    st.tuples(
        st.just("POST"),
        st.just("/acore/models/unload"),
        st.fixed_dictionaries({"force": st.just(True)}, optional={"model": json_values}),
    ),
    st.tuples(
        st.just("POST"), st.just("/acore/prompt_cache/clear"), st.fixed_dictionaries({}, optional={"key": json_values})
    ),
    st.tuples(
        st.just("POST"),
        st.just("/acore/prompt_cache/key_meta"),
        st.fixed_dictionaries(
            {"key": st.one_of(texts, json_values)},
            optional={"meta": json_values, "model": json_values, "provider": json_values},
        ),
    ),
    st.tuples(
        st.just("GET"), st.just("/acore/prompt_cache/key_meta"), st.fixed_dictionaries({}, optional={"key": texts})
    ),
    st.tuples(
        st.just("GET"),
        st.just("/v1/models/execution-capabilities"),
        st.fixed_dictionaries(
            {},
            optional={
                "model_name": st.one_of(texts, st.sampled_from(["/proc/self", "~", "/etc", "a" * 300])),
                "provider": texts,
            },
        ),
    ),
    st.tuples(st.just("GET"), st.sampled_from(["/v1/models", "/acore/prompt_cache/stats", "/health"]), st.just({})),
)


@pytest.mark.slow
@FUZZ
@given(request=other_requests)
def test_fuzzed_other_routes(server: httpx.Client, request: tuple[str, str, dict[str, Any]]) -> None:
    method, path, payload = request
    if method == "GET":
        params = {k: v.encode("utf-8", "surrogatepass").decode("utf-8", "replace") for k, v in payload.items()}
        reply = server.get(path, params=params)
    else:
        reply = server.post(path, content=dumps(payload), headers={"Content-Type": "application/json"})
    assert_answered(reply)
    assert_still_serving(server)


@pytest.mark.slow
def test_the_strategies_reach_hostile_values() -> None:
    """The fuzzer really sends what the edge must refuse (else the properties prove little)."""
    seen = {"nan": False, "surrogate": False, "big": False}

    @settings(max_examples=300, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(value=json_values)
    def probe(value: Any) -> None:
        text = json.dumps(value, allow_nan=True)
        seen["nan"] |= "NaN" in text or "Infinity" in text
        seen["surrogate"] |= "\\ud8" in text or "\\udf" in text
        seen["big"] |= any(isinstance(v, int) and abs(v) > 2**64 for v in _leaves(value))

    probe()
    assert all(seen.values()), seen


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value] if not (isinstance(value, float) and math.isnan(value)) else []
