"""Sampled requests share the continuous batch: per-row controls and seeded per-row streams."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

from abstractruntime_mlx.engine.backends.sampling import RowStream, make_sampler, sample_rows
from abstractruntime_mlx.engine.core.request import Sampling

PROMPTS = [
    "Explain TTL caches.",
    "Explain LRU caches.",
    "What is a prefix cache?",
    "Why batch requests?",
    "Name a color.",
    "Count to three.",
]

# One request per control, two greedy ones (the last with a penalty, still greedy).
CALLS = [
    {"temperature": 0.7, "seed": 1},
    {"temperature": 1.0, "top_k": 5, "seed": 2},
    {"temperature": 0.9, "top_p": 0.8, "repetition_penalty": 1.3, "seed": 3},
    {"temperature": 1.2, "min_p": 0.05, "logit_bias": {7: 4.0}, "presence_penalty": 0.5, "seed": 4},
    {"temperature": 0},
    {"temperature": 0, "frequency_penalty": 0.8},
]


def together(llm, calls, prompts, **common):
    """Submit every call at once (a barrier aligns the threads) and return the results in order."""
    start = threading.Barrier(len(calls))

    def one(i):
        start.wait()
        return llm.generate(prompts[i], thinking=False, **calls[i], **common)

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(one, range(len(calls))))


@pytest.mark.slow
@pytest.mark.parametrize("model_fixture", ["dense_model", "hybrid_model"])
def test_seeded_rows_same_alone_batched_and_exclusive(make_llm, request, model_fixture):
    model = request.getfixturevalue(model_fixture)
    llm = make_llm(model, mlx_batching=True, mlx_max_batch_size=8, mlx_batch_wait_ms=200, speculation=False)
    alone = [llm.generate(PROMPTS[i], thinking=False, max_output_tokens=16, **CALLS[i]) for i in range(len(CALLS))]
    batched = together(llm, CALLS, PROMPTS, max_output_tokens=16)
    for a, b in zip(alone, batched):
        assert b.metadata["execution"]["mode"] == "continuous"
        assert "reason" not in b.metadata["execution"]
        assert b.token_ids == a.token_ids
    assert max(r.metadata["execution"]["peak_batch_size"] for r in batched) >= 4
    # the controls took effect: different seeds, different draws
    assert (
        alone[0].token_ids
        != llm.generate(PROMPTS[0], thinking=False, max_output_tokens=16, temperature=0.7, seed=9).token_ids
    )

    # the seed's behaviour, restored by the option: alone, one at a time, with the same tokens
    llm.unload_model()
    exclusive = make_llm(
        model,
        mlx_batching=True,
        mlx_max_batch_size=8,
        mlx_batch_wait_ms=200,
        speculation=False,
        mlx_sampled_exclusive=True,
    )
    isolated = together(exclusive, CALLS, PROMPTS, max_output_tokens=16)
    for i, (a, r) in enumerate(zip(alone, isolated)):
        assert r.token_ids == a.token_ids
        execution = r.metadata["execution"]
        if CALLS[i]["temperature"] or i == 5:  # sampled, or greedy with a penalty: not greedy-neutral
            assert execution["mode"] == "exclusive" and execution["reason"] == "sampled_exclusive"
            assert execution["peak_batch_size"] == 1
        else:
            assert execution["mode"] == "continuous"


@pytest.mark.slow
def test_sampled_request_joins_a_running_batch(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=4)
    first = llm.generate(PROMPTS[0], max_output_tokens=300, stream=True)
    next(first)  # the greedy request is decoding
    late = llm.generate(PROMPTS[1], max_output_tokens=8, temperature=0.8, seed=5)
    early = list(first)[-1]
    assert late.metadata["execution"]["mode"] == "continuous"
    assert late.metadata["execution"]["peak_batch_size"] == 2
    assert early.metadata["execution"]["peak_batch_size"] == 2
    assert late.token_ids == llm.generate(PROMPTS[1], max_output_tokens=8, temperature=0.8, seed=5).token_ids


def test_unseeded_rows_draw_independent_streams(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True, mlx_max_batch_size=4, mlx_batch_wait_ms=200)
    calls = [{"temperature": 1.5}] * 3
    results = together(llm, calls, [PROMPTS[0]] * 3, max_output_tokens=24)
    assert max(r.metadata["execution"]["peak_batch_size"] for r in results) >= 2
    assert len({tuple(r.token_ids) for r in results}) == 3


@pytest.mark.slow
def test_sampling_with_speculation_runs_exclusive_and_says_why(make_llm, hybrid_model):
    # Strict: optional MTP would share the batch target-only with the plain request (under load).
    mtp = {"mode": "native_mtp", "num_draft_tokens": 2, "require_acceleration": True}
    llm = make_llm(hybrid_model, mlx_batching=True, mlx_max_batch_size=4, mlx_batch_wait_ms=100, speculation=mtp)
    calls = [{"temperature": 0.8, "seed": 1}, {"temperature": 0}, {"temperature": 0.8, "seed": 2, "speculation": False}]
    results = together(llm, calls, PROMPTS, max_output_tokens=8)
    sampled_mtp, greedy_mtp, sampled_plain = (r.metadata["execution"] for r in results)
    assert sampled_mtp["mode"] == "exclusive" and sampled_mtp["reason"] == "sampled_speculation"
    assert sampled_mtp["peak_batch_size"] == 1
    assert results[0].metadata["speculation"]["used"] is True
    assert greedy_mtp["mode"] == "cohort"
    assert sampled_plain["mode"] == "continuous" and "reason" not in sampled_plain


@pytest.mark.slow
def test_sampled_image_rows_batch_with_text(make_llm, vision_model, tmp_path):
    from abstractruntime_mlx.testing import tiny_image

    image = str(tiny_image(tmp_path / "rb.png", (255, 0, 0), (0, 0, 255)))
    llm = make_llm(vision_model, mlx_batching=True, mlx_max_batch_size=4, mlx_batch_wait_ms=200)
    calls = [
        {"temperature": 0.9, "seed": 3, "media": [image]},
        {"temperature": 0.7, "seed": 4},
        {"temperature": 0, "media": [image]},
    ]
    prompts = ["Describe the image.", PROMPTS[1], "Describe the image."]
    alone = [llm.generate(prompts[i], thinking=False, max_output_tokens=8, **calls[i]).token_ids for i in range(3)]
    batched = together(llm, calls, prompts, max_output_tokens=8)
    assert [r.token_ids for r in batched] == alone
    assert max(r.metadata["execution"]["peak_batch_size"] for r in batched) >= 2
    assert {r.metadata["execution"]["mode"] for r in batched} == {"continuous"}


def test_serialized_lane_says_why_it_is_exclusive(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=False)
    result = llm.generate(PROMPTS[0], max_output_tokens=8, temperature=0.7, seed=1)
    assert result.metadata["execution"]["reason"] == "serialized_lane"
    batched = make_llm(dense_model, mlx_batching=True)
    # the same random stream in every lane
    assert batched.generate(PROMPTS[0], max_output_tokens=8, temperature=0.7, seed=1).token_ids == result.token_ids


def test_sampled_exclusive_must_be_a_boolean(make_llm, dense_model):
    from abstractruntime_mlx import errors

    with pytest.raises(errors.InvalidControls) as info:
        make_llm(dense_model, mlx_batching=True, mlx_sampled_exclusive="yes")
    assert info.value.field == "mlx_sampled_exclusive"


# --- the sampler itself, on hand-made log-probabilities --------------------------------


def logprobs(rows: int, vocab: int = 64, seed: int = 0) -> mx.array:
    x = mx.random.normal((rows, vocab), key=mx.random.key(seed)) * 2
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


SAMPLINGS = [
    Sampling(temperature=0.7, seed=1),
    Sampling(temperature=1.0, top_k=3, seed=2),
    Sampling(temperature=0.9, top_p=0.5, seed=3),
    Sampling(temperature=1.2, min_p=0.3, seed=4),
    Sampling(temperature=0.0),
]


def draws(lp: mx.array, samplings: list[Sampling], steps: int = 30) -> list[list[int]]:
    rows = [RowStream.for_sampling(s) for s in samplings]
    out = [sample_rows(lp, rows).tolist() for _ in range(steps)]
    return [[step[i] for step in out] for i in range(len(samplings))]


def test_each_row_draws_the_same_in_any_batch():
    lp = logprobs(len(SAMPLINGS))
    batch = draws(lp, SAMPLINGS)
    for i, s in enumerate(SAMPLINGS):
        assert draws(lp[i : i + 1], [s]) == [batch[i]]
    # another order, another batch size
    assert draws(mx.stack([lp[3], lp[1]]), [SAMPLINGS[3], SAMPLINGS[1]]) == [batch[3], batch[1]]


def test_row_controls_take_effect():
    lp = logprobs(len(SAMPLINGS))
    probs = mx.softmax(lp, axis=-1)
    order = mx.argsort(-lp, axis=-1).tolist()
    batch = draws(lp, SAMPLINGS, steps=200)
    assert len(set(batch[0])) > 5  # plain temperature spreads
    assert set(batch[1]) <= set(order[1][:3])  # top_k=3
    cumulative = mx.cumsum(mx.take_along_axis(probs[2], mx.array(order[2]), axis=-1)).tolist()
    nucleus = {t for t, c in zip(order[2], cumulative) if c - probs[2, t].item() < 0.5}
    assert set(batch[2]) <= nucleus and len(nucleus) > 1
    floor = 0.3 * probs[3].max().item()
    assert all(probs[3, t].item() >= floor for t in batch[3])
    assert set(batch[4]) == {order[4][0]}  # greedy row: the argmax, every time


def test_one_request_sampler_matches_its_batch_row():
    lp = logprobs(1)
    sampler = make_sampler(SAMPLINGS[2])
    assert [sampler(lp).item() for _ in range(30)] == draws(lp, [SAMPLINGS[2]])[0]
    assert make_sampler(Sampling()).__call__(lp).item() == mx.argmax(lp).item()
    # several positions at once (speculative verification): one draw each
    assert make_sampler(SAMPLINGS[0])(mx.stack([logprobs(3)])).shape == (1, 3)


@pytest.mark.slow
def test_image_rows_report_logprobs_from_the_row_sampler(make_llm, vision_model, tmp_path):
    """The batch lane's per-row sampler gives each asking row its drawn tokens' logprobs;
    asking changes no draw (greedy or seeded)."""
    from abstractruntime_mlx.testing import tiny_image

    image = str(tiny_image(tmp_path / "rb.png", (255, 0, 0), (0, 0, 255)))
    llm = make_llm(vision_model, mlx_batching=True)
    for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 3}):
        call = dict(thinking=False, max_output_tokens=6, media=[image], **sampling)
        plain = llm.generate("Describe the image.", **call)
        scored = llm.generate("Describe the image.", logprobs=2, **call)
        assert scored.token_ids and scored.token_ids == plain.token_ids and plain.logprobs is None
        assert scored.logprobs is not None and len(scored.logprobs) == scored.usage["completion_tokens"]
        assert "".join(e.token for e in scored.logprobs) == scored.content
        for entry in scored.logprobs:
            assert entry.logprob <= 0 and len(entry.top) == 2 and entry.top[0].logprob >= entry.top[1].logprob
            assert entry.logprob <= entry.top[0].logprob + 1e-5
            if not sampling["temperature"]:
                assert entry.token_id == entry.top[0].token_id
