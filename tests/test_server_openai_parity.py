"""OpenAI parity of the server: token logprobs on chat and completions (streamed and not),
``n`` answers to one prompt, raw completions with ``echo``, ``GET /v1/models/{id}``, and
unsupported fields refused by name.
Real MLX on the tiny dense model, a real server on 127.0.0.1, the ``openai`` SDK."""

from __future__ import annotations

import math

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from abstractruntime_mlx.server import create_app
from test_server_harness import serve_in_thread

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server_url(dense_model):
    from abstractruntime_mlx import create_llm

    llm = create_llm("mlx", model=dense_model, mlx_batching=True, speculation=False)
    with serve_in_thread(create_app(llm)) as url:
        yield url
    llm.unload_model()


@pytest.fixture()
def client(server_url):
    return OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0)


def _check_greedy(entries, *, top: int) -> None:
    for entry in entries:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        assert len(entry.top_logprobs) == top
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        if top:  # greedy: the chosen token is the most likely one (its text is its share of
            # the answer's, the alternatives' each decoded alone: the first may lose its space)
            assert entry.logprob == pytest.approx(max(values), abs=1e-5)
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_chat_logprobs_greedy_are_the_argmax(client, dense_model):
    completion = client.chat.completions.create(
        model=dense_model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body={"thinking": False},
    )
    choice = completion.choices[0]
    content = choice.logprobs.content
    assert len(content) == completion.usage.completion_tokens
    _check_greedy(content, top=4)
    assert "".join(e.token for e in content) == choice.message.content  # the tokens' texts make the answer


def test_chat_without_logprobs_has_none(client, dense_model):
    completion = client.chat.completions.create(
        model=dense_model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        extra_body={"thinking": False},
    )
    assert completion.choices[0].logprobs is None


def test_chat_stream_carries_logprobs_per_chunk(client, dense_model):
    plain = client.chat.completions.create(
        model=dense_model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"thinking": False},
    )
    entries, usage = [], None
    with client.chat.completions.create(
        model=dense_model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"thinking": False},
    ) as stream:
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.logprobs is not None and choice.logprobs.content:
                    entries.extend(choice.logprobs.content)
    assert usage is not None and len(entries) == usage.completion_tokens
    _check_greedy(entries, top=2)
    assert [e.token for e in entries] == [e.token for e in plain.choices[0].logprobs.content]


def test_sampled_logprobs_are_the_sampled_tokens(client, dense_model):
    completion = client.chat.completions.create(
        model=dense_model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=1.5,
        seed=3,
        logprobs=True,
        top_logprobs=0,
        extra_body={"thinking": False},
    )
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    assert all(e.logprob <= 0 and e.top_logprobs == [] for e in content)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"n": 9}, "n"),
        ({"n": 0}, "n"),
    ],
)
def test_chat_refusals_name_the_field(server_url, fields, field):
    answer = httpx.post(
        f"{server_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **fields},
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["details"]["field"] == field


def test_keyed_requests_report_logprobs_as_unkeyed_ones(client, dense_model):
    """A ``prompt_cache_key`` runs on the prefix-cache lane: the same tokens and logprobs, cold
    and when its prefix is reused."""

    # Longer than a block of the prefix cache and its guard tokens: a whole block is reused.
    long = [{"role": "user", "content": "A cache keeps what was computed once, so that it is not computed again. " * 4}]

    def ask(**extra):
        answer = client.chat.completions.create(
            model=dense_model,
            messages=long,
            max_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            extra_body={"thinking": False, **extra},
        )
        return answer, [
            (e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in answer.choices[0].logprobs.content
        ]

    plain, expected = ask()
    for _ in range(2):  # cold, then its prefix reused
        keyed, entries = ask(prompt_cache_key="parity-logprobs")
        assert [(t, top) for t, _, top in entries] == [(t, top) for t, _, top in expected]
        assert [lp for _, lp, _ in entries] == pytest.approx([lp for _, lp, _ in expected], abs=1e-3)
        assert "".join(t for t, _, _ in entries) == keyed.choices[0].message.content == plain.choices[0].message.content
        _check_greedy(keyed.choices[0].logprobs.content, top=3)
    assert keyed.usage.prompt_tokens_details.cached_tokens > 0
    assert keyed.model_extra["abstractcore"]["prompt_cache"]["outcome"] == "hit"
    many = client.chat.completions.create(
        model=dense_model,
        messages=long,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        n=3,
        extra_body={"thinking": False, "prompt_cache_key": "parity-logprobs"},
    )
    assert [[e.token for e in c.logprobs.content] for c in many.choices] == [[t for t, _, _ in expected]] * 3


def test_completions_logprobs_legacy_shape(client, dense_model):
    completion = client.completions.create(
        model=dense_model, prompt="Once upon", max_tokens=6, temperature=0, logprobs=3
    )
    choice = completion.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == completion.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text  # each token's share of the text, none dropped or doubled
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert choice.text[offset : offset + len(token)] == token
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) <= 3  # two tokens may decode to one text
        assert value == pytest.approx(max(top.values()), abs=1e-5)


def test_completions_is_a_raw_continuation_with_echo(client, dense_model, server_url):
    raw = client.completions.create(model=dense_model, prompt="Once upon", max_tokens=6, temperature=0)
    echoed = client.completions.create(model=dense_model, prompt="Once upon", max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon" + raw.choices[0].text
    # No chat template: far fewer prompt tokens than the same text as a chat turn.
    chat = client.chat.completions.create(
        model=dense_model,
        messages=[{"role": "user", "content": "Once upon"}],
        max_tokens=1,
        extra_body={"thinking": False},
    )
    assert raw.usage.prompt_tokens < chat.usage.prompt_tokens
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=dense_model, prompt="Once upon", max_tokens=6, temperature=0, echo=True, stream=True
        )
        if c.choices
    )
    assert streamed == echoed.choices[0].text
    for extra, field in (
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"logprobs": 21}, "logprobs"),
        ({"thinking": False}, "thinking"),
        ({"frobnicate": 1}, "frobnicate"),
    ):
        answer = httpx.post(f"{server_url}/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
        assert answer.status_code == 400, (extra, answer.text)
        assert answer.json()["error"]["details"]["field"] == field


def test_retrieve_model(client, dense_model):
    model = client.models.retrieve(dense_model)
    assert model.id == dense_model and model.object == "model" and model.owned_by == "abstractruntime-mlx"
    with pytest.raises(NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found"


def test_unknown_chat_field_is_refused_with_the_sdk(client, dense_model):
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(
            model=dense_model, messages=[{"role": "user", "content": "x"}], max_tokens=2, extra_body={"frobnicate": 1}
        )
    assert caught.value.body["details"]["field"] == "frobnicate"


def _token_id(dense_model, token: str) -> int:
    from transformers import AutoTokenizer

    return int(AutoTokenizer.from_pretrained(dense_model).convert_tokens_to_ids(token))


@pytest.mark.parametrize(
    ("token", "tokens", "text"),
    [
        # The first token's leading space is not in the text: nor in the token's.
        ("Ġ761", ["761", " 761", " 761"], "761 761 761"),
        # Lone spaces are held by the detokenizer until the next token: their text comes with
        # the last one, less the first (leading) space.
        ("Ġ", ["", "", "  "], "  "),
    ],
)
def test_token_texts_concatenate_to_the_text(client, dense_model, token, tokens, text):
    forced = {str(_token_id(dense_model, token)): 100}
    completion = client.completions.create(
        model=dense_model, prompt="Once upon", max_tokens=3, temperature=0, logprobs=0, logit_bias=forced
    )
    choice = completion.choices[0]
    assert (choice.text, choice.logprobs.tokens) == (text, tokens)
    assert choice.logprobs.text_offset == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
    chat = client.chat.completions.create(
        model=dense_model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        logit_bias=forced,
        stream=True,
        extra_body={"thinking": False},
    )
    pieces, streamed = [], []
    for chunk in chat:
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            if c.logprobs is not None and c.logprobs.content:
                streamed.extend(e.token for e in c.logprobs.content)
    assert ("".join(pieces), streamed) == (text, tokens)


def test_chat_n_greedy_answers_are_identical_and_usage_counts_the_prompt_once(client, dense_model):
    one = client.chat.completions.create(
        model=dense_model,
        messages=HI,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"thinking": False},
    )
    many = client.chat.completions.create(
        model=dense_model,
        messages=HI,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        n=3,
        extra_body={"thinking": False},
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert {c.message.content for c in many.choices} == {one.choices[0].message.content}
    tokens = [[(e.token, e.logprob) for e in c.logprobs.content] for c in many.choices]
    assert tokens[0] == tokens[1] == tokens[2]
    assert [e.token for e in one.choices[0].logprobs.content] == [t for t, _ in tokens[0]]
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens == sum(len(t) for t in tokens)
    assert many.usage.total_tokens == many.usage.prompt_tokens + many.usage.completion_tokens


def test_chat_n_sampled_answer_i_draws_with_seed_plus_i(client, dense_model):
    def ask(seed, n):
        return client.chat.completions.create(
            model=dense_model,
            messages=HI,
            max_tokens=8,
            temperature=1.5,
            seed=seed,
            n=n,
            extra_body={"thinking": False},
        )

    many = [c.message.content for c in ask(5, 3).choices]
    assert many == [ask(5 + i, 1).choices[0].message.content for i in range(3)]
    assert len(set(many)) > 1  # three seeds, 8 tokens at temperature 1.5: not all alike


def test_chat_n_stream_tags_each_chunk_with_its_answer(client, dense_model):
    plain = client.chat.completions.create(
        model=dense_model,
        messages=HI,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        n=3,
        logprobs=True,
        extra_body={"thinking": False},
    )
    texts, entries, finishes, usage = {}, {}, {}, None
    with client.chat.completions.create(
        model=dense_model,
        messages=HI,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        n=3,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"thinking": False},
    ) as stream:
        for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                if c.logprobs is not None and c.logprobs.content:
                    entries.setdefault(c.index, []).extend(e.token for e in c.logprobs.content)
                if c.finish_reason is not None:
                    assert c.index not in finishes  # one finish per answer
                    finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in plain.choices}
    assert entries == {c.index: [e.token for e in c.logprobs.content] for c in plain.choices}
    assert finishes == {c.index: c.finish_reason for c in plain.choices}
    assert (usage.prompt_tokens, usage.completion_tokens) == (plain.usage.prompt_tokens, plain.usage.completion_tokens)


def test_completions_n_with_logprobs_and_echo(client, dense_model):
    many = client.completions.create(
        model=dense_model, prompt="Once upon", max_tokens=5, temperature=0, n=2, logprobs=1
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == many.choices[1].text
    for c in many.choices:
        assert "".join(c.logprobs.tokens) == c.text and c.logprobs.text_offset[0] == 0
    assert many.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in many.choices)
    echoed = {}
    for chunk in client.completions.create(
        model=dense_model, prompt="Once upon", max_tokens=5, temperature=0, n=2, echo=True, stream=True
    ):
        for c in chunk.choices:
            echoed[c.index] = echoed.get(c.index, "") + c.text
    assert echoed == {0: "Once upon" + many.choices[0].text, 1: "Once upon" + many.choices[1].text}


def test_n_above_the_bound_is_a_typed_400_with_the_sdk(client, dense_model):
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(model=dense_model, messages=HI, max_tokens=2, n=9)
    assert (caught.value.body["code"], caught.value.body["details"]["field"]) == ("invalid_controls", "n")
    with pytest.raises(BadRequestError) as caught:
        client.completions.create(model=dense_model, prompt="x", max_tokens=2, n=9)
    assert caught.value.body["details"]["field"] == "n"


def test_responses_logprobs_on_output_text(client, dense_model):
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    answer = client.responses.create(
        model=dense_model, input="Hi", max_output_tokens=6, temperature=0, extra_body={"thinking": False}, **asked
    )
    part = answer.output[-1].content[0]
    assert len(part.logprobs) == answer.usage.output_tokens
    assert "".join(e.token for e in part.logprobs) == part.text == answer.output_text
    _check_greedy(part.logprobs, top=2)
    deltas, done, final = [], None, None
    with client.responses.stream(
        model=dense_model, input="Hi", max_output_tokens=6, temperature=0, extra_body={"thinking": False}, **asked
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.extend(e.token for e in event.logprobs)
            elif event.type == "response.output_text.done":
                done = [e.token for e in event.logprobs]
            elif event.type in ("response.completed", "response.incomplete"):  # the output cap may cut it
                final = event.response
    assert deltas == done == [e.token for e in part.logprobs]
    assert [e.token for e in final.output[-1].content[0].logprobs] == deltas
    plain = client.responses.create(model=dense_model, input="Hi", max_output_tokens=2, extra_body={"thinking": False})
    assert plain.output[-1].content[0].logprobs is None


@pytest.mark.parametrize(
    ("fields", "field", "code"),
    [
        ({"include": ["reasoning.encrypted_content"]}, "include.0", "invalid_request"),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_request"),
        ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs", "invalid_controls"),
    ],
)
def test_responses_logprobs_refusals_name_the_field(server_url, fields, field, code):
    answer = httpx.post(f"{server_url}/v1/responses", json={"input": "x", "max_output_tokens": 2, **fields})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["details"]["field"]) == (code, field)
