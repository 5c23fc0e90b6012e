"""Stop strings: one automaton matches them (``engine/core/stops.py``) with the old matcher's results,
and the list is bounded (``controls.MAX_STOP_STRINGS`` / ``MAX_STOP_BYTES``): a typed
``StopTooLarge`` in-process, a 400 ``stop_too_large`` at a real server, rebuilt by the remote client.
What ended an answer (the stop string that matched, or the end-of-sequence token) is reported by
every lane (``metadata["stop_reason"]``) and on the OpenAI routes as vLLM's ``stop_reason``."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from abstractruntime_mlx.controls import MAX_STOP_BYTES, MAX_STOP_STRINGS, normalize_stop
from abstractruntime_mlx.engine.core.stops import StopMatcher
from abstractruntime_mlx.errors import InvalidControls, StopTooLarge
from abstractruntime_mlx.remote_client import RemoteClient
from abstractruntime_mlx.request import GenerationRequest
from abstractruntime_mlx.server import create_app
from test_server_harness import serve_in_thread


class ListMatcher:
    """The reference: every stop string searched in the held text plus the new piece."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            # of the stops that begin at the cut, the one that ends first
            self.matched = min((s for s in self.stops if buf.find(s) == cut), key=len)
            return buf[:cut], True
        hold = max((n for s in self.stops for n in range(1, len(s)) if buf.endswith(s[:n])), default=0)
        self.held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def trace(matcher: Any, pieces: list[str]) -> list[tuple[str, bool] | str | None]:
    out: list[tuple[str, bool] | str | None] = []
    for piece in pieces:
        emitted, stopped = matcher.feed(piece)
        out.append((emitted, stopped))
        if stopped:
            return [*out, matcher.matched]
    return [*out, matcher.flush(), matcher.matched]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    stops=st.lists(st.text("ab <", min_size=1, max_size=5), min_size=1, max_size=8).map(tuple),
    pieces=st.lists(st.text("ab <c", max_size=4), max_size=12),
)
def test_the_automaton_emits_and_stops_where_the_list_search_does(stops: tuple[str, ...], pieces: list[str]) -> None:
    assert trace(StopMatcher(stops), pieces) == trace(ListMatcher(stops), pieces)


def test_the_earliest_starting_stop_wins_and_the_held_text_is_the_longest_open_prefix() -> None:
    # "bc" ends first, "abcd" starts first: the cut is where "abcd" begins, as the list search cuts
    assert trace(StopMatcher(("abcd", "bc")), ["xab", "cd"]) == [("x", False), ("", True), "abcd"]
    # of two stops beginning at the cut, the one that ends first is the match
    assert trace(StopMatcher(("abc", "ab")), ["xabc"]) == [("x", True), "ab"]
    matcher = StopMatcher(("</tool>", "</s>"))
    assert matcher.feed("text </") == ("text ", False)  # "</" may begin either
    assert matcher.feed("t") == ("", False)  # "</t" may begin "</tool>"
    assert matcher.feed("x") == ("</tx", False)  # begins neither: all of it is text
    assert matcher.matched is None
    assert matcher.feed("é</s>after") == ("é", True)
    assert matcher.matched == "</s>"


def test_a_matcher_is_independent_of_another_with_the_same_stops() -> None:
    first, second = StopMatcher(("END",)), StopMatcher(("END",))  # one automaton, two states
    assert first.feed("xEN") == ("x", False)
    assert second.feed("yE") == ("y", False)
    assert first.feed("D") == ("", True)
    assert second.feed("!") == ("E!", False)


def test_the_list_is_bounded_in_count_and_bytes() -> None:
    assert len(normalize_stop([f"s{i}" for i in range(MAX_STOP_STRINGS)])) == MAX_STOP_STRINGS
    assert normalize_stop(["x" * MAX_STOP_BYTES]) == ("x" * MAX_STOP_BYTES,)
    cases = [
        ([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], "max_stop_strings", MAX_STOP_STRINGS),
        ([f"s{i}" for i in range(100_000)], "max_stop_strings", MAX_STOP_STRINGS),
        (["x" * (MAX_STOP_BYTES + 1)], "max_stop_bytes", MAX_STOP_BYTES),
        (["é" * (MAX_STOP_BYTES // 2), "x"], "max_stop_bytes", MAX_STOP_BYTES),  # UTF-8 bytes, not characters
    ]
    for stops, limit, maximum in cases:
        with pytest.raises(StopTooLarge) as info:
            GenerationRequest.from_kwargs("hi", stop=stops)
        assert (
            isinstance(info.value, InvalidControls)
            and info.value.code == "stop_too_large"
            and info.value.http_status == 400
        )
        assert info.value.details == {"field": "stop", "limit": limit, "max": maximum}  # the list is not echoed


# --------------------------------------------------------------------------- what ended the answer
# (before the module's server: a model is resident with one set of options at a time)


LANES = [
    ({"mlx_batching": False}, "serial"),
    ({"mlx_batching": True}, "single"),
    ({"mlx_batching": True, "mlx_single_lane": False}, "text_batch"),
    ({"mlx_batching": True, "mlx_single_lane": False, "mlx_text_lane": False}, "batch"),
]


@pytest.mark.parametrize(("options", "path"), LANES, ids=[path for _, path in LANES])
def test_every_lane_reports_the_stop_string_or_the_end_token_that_ended_the_answer(
    make_llm: Any, dense_model: str, options: dict[str, Any], path: str
) -> None:
    llm = make_llm(dense_model, speculation=False, **options)
    call: dict[str, Any] = {"max_output_tokens": 12, "temperature": 0}
    free = llm.generate("Go", **call)
    assert free.finish_reason == "length" and "stop_reason" not in free.metadata
    assert len(free.content) >= 6, free.content
    stop = free.content[2:5]
    cut = llm.generate("Go", **call, stop=["\x00never", stop])
    assert cut.metadata["execution"]["path"] == path
    assert cut.content == free.content[: free.content.index(stop)] and cut.finish_reason == "stop"
    assert cut.metadata["stop_reason"] == stop
    (eos, *_) = sorted(llm._engine.serving_model().eos_token_ids)
    ended = llm.generate("Go", **call, logit_bias={eos: 100})
    assert ended.finish_reason == "stop" and ended.usage["completion_tokens"] == 0
    assert ended.metadata["stop_reason"] == eos


@pytest.fixture(scope="module")
def served(dense_model: str) -> Any:
    from abstractruntime_mlx import create_llm

    llm = create_llm("mlx", model=dense_model, mlx_batching=True)
    try:
        with serve_in_thread(create_app(llm)) as url:
            yield llm, url
    finally:
        llm.unload_model(llm.model)


@pytest.mark.parametrize(
    ("count", "limit"), [(10_000, "max_stop_strings"), (100_000, "max_stop_strings"), (1, "max_stop_bytes")]
)
def test_the_server_refuses_a_stop_list_over_the_limits_with_a_typed_400(served: Any, count: int, limit: str) -> None:
    _llm, url = served
    stops = ["x" * (MAX_STOP_BYTES + 1)] if count == 1 else [f"stop {i}" for i in range(count)]
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stop": stops},
        timeout=60,
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (
        error["code"] == "stop_too_large" and error["details"]["limit"] == limit and error["details"]["field"] == "stop"
    )
    with RemoteClient(url) as client, pytest.raises(StopTooLarge):
        client.generate("hi", max_output_tokens=4, stop=stops[: MAX_STOP_STRINGS + 1] if count > 1 else stops)


def test_a_stop_among_the_most_stops_allowed_ends_a_real_generation_where_it_begins(served: Any) -> None:
    llm, url = served
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 24, "temperature": 0}
    full = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]["content"]
    assert len(full) >= 8, full
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    decoys = [f"\x00never{i}" for i in range(MAX_STOP_STRINGS - 1)]
    reply = httpx.post(f"{url}/v1/chat/completions", json={**body, "stop": [*decoys, stop]}, timeout=60).json()
    assert reply["choices"][0]["message"]["content"] == full[: full.index(stop)]
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["choices"][0]["stop_reason"] == stop


@pytest.mark.slow
def test_the_openai_routes_send_vllms_stop_reason_and_the_remote_client_keeps_it(served: Any) -> None:
    import openai

    llm, url = served
    (eos, *_) = sorted(llm._engine.serving_model().eos_token_ids)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    messages: Any = [{"role": "user", "content": "Go"}]
    quiet = {"thinking": False}  # the tiny template opens a think block, whose text streams apart
    free = client.chat.completions.create(
        model=llm.model, messages=messages, max_tokens=12, temperature=0, extra_body=quiet
    )
    text = free.choices[0].message.content or ""
    assert free.choices[0].finish_reason == "length" and free.choices[0].model_extra == {"stop_reason": None}
    stop = text[2:5]
    cut = client.chat.completions.create(
        model=llm.model, messages=messages, max_tokens=12, temperature=0, extra_body=quiet, stop=[stop]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and (cut.choices[0].model_extra or {})["stop_reason"] == stop
    chunks = list(
        client.chat.completions.create(
            model=llm.model, messages=messages, max_tokens=12, temperature=0, extra_body=quiet, stop=[stop], stream=True
        )
    )
    terminal = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert [(c.finish_reason, (c.model_extra or {}).get("stop_reason")) for c in terminal] == [("stop", stop)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text[: text.index(stop)]
    ended = client.chat.completions.create(
        model=llm.model, messages=messages, max_tokens=12, temperature=0, extra_body=quiet, logit_bias={str(eos): 100}
    )
    assert ended.choices[0].finish_reason == "stop" and (ended.choices[0].model_extra or {})["stop_reason"] == eos
    # A legacy completion continues the prompt as plain text (no template): its own text and stop.
    plain = client.completions.create(model=llm.model, prompt="Go", max_tokens=12, temperature=0).choices[0].text
    plain_stop = plain[2:5]
    legacy = client.completions.create(model=llm.model, prompt="Go", max_tokens=12, temperature=0, stop=[plain_stop])
    assert legacy.choices[0].text == plain[: plain.index(plain_stop)]
    assert (legacy.choices[0].model_extra or {})["stop_reason"] == plain_stop
    streamed = [
        c.choices[0]
        for c in client.completions.create(
            model=llm.model, prompt="Go", max_tokens=12, temperature=0, stop=[plain_stop], stream=True
        )
        if c.choices
    ]
    assert [(c.model_extra or {}).get("stop_reason") for c in streamed if c.finish_reason is not None] == [plain_stop]
    with RemoteClient(url) as remote:
        assert (
            remote.generate("Go", max_output_tokens=12, temperature=0, thinking=False, stop=[stop]).metadata[
                "stop_reason"
            ]
            == stop
        )
        pieces = list(
            remote.generate("Go", max_output_tokens=12, temperature=0, thinking=False, stop=[stop], stream=True)
        )
        assert pieces[-1].metadata is not None and pieces[-1].metadata["stop_reason"] == stop
        assert "stop_reason" not in remote.generate("Go", max_output_tokens=3, temperature=0).metadata
