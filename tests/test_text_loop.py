"""The text lane's own loop (``engine/backends/text_loop.py``): long prompts prefill a chunk a step
between decode steps, rows join and leave with the padding tracked on the host, cancels at
every stage. What it shares with mlx-vlm's loop is in ``test_text_lane.py``."""

from __future__ import annotations

import dataclasses

import pytest

from abstractruntime_mlx import errors
from abstractruntime_mlx.engine.backends.text_loop import TextLoopBackend
from abstractruntime_mlx.engine.core.request import EngineRequest
from test_single_lane import PROMPTS, Stepper

LONG = " ".join(PROMPTS * 6)  # ~190 tokens: 24 chunks of 8


@pytest.fixture()
def make(dense_model):
    made: list[Stepper] = []

    def factory(**config: object) -> Stepper:
        config = {"single_lane": False, "max_batch_size": 4, "prefill_step_size": 8, **config}
        s = Stepper(dense_model, **config)
        made.append(s)
        return s

    yield factory
    for s in made:
        s.engine._close_group()


def loop_of(s: Stepper) -> TextLoopBackend:
    group = s.engine._group
    assert group is not None and isinstance(group.backend, TextLoopBackend)
    return group.backend


def check_padding(backend: TextLoopBackend) -> None:
    """The host's left padding per row is the cache's own, on every layer."""
    pads = [r.pad for r in backend._rows]
    for c in backend._cache:
        assert c.left_padding.tolist() == pads
        assert c.offset.tolist() == [c._idx - p for p in pads]
    if pads:
        assert min(pads) == 0  # no column is padding for every row


def test_a_long_prompt_prefills_a_chunk_a_step_while_rows_decode(make):
    alone = make()
    solo = alone.request(LONG, max_tokens=6)
    alone.drain()

    s = make()
    decoding = [s.request(PROMPTS[0], max_tokens=80), s.request(PROMPTS[1], max_tokens=80)]
    s.until(lambda: all(r.num_output_tokens >= 2 for r in decoding))
    long = s.request(LONG, max_tokens=6)
    chunk_steps = 0
    while long.num_output_tokens == 0:
        before = [r.num_output_tokens for r in decoding]
        s.step()
        backend = loop_of(s)
        if backend._chunked is not None:
            chunk_steps += 1
            # every decoding row got its token this step: the prompt held nobody up
            assert [r.num_output_tokens for r in decoding] == [n + 1 for n in before]
        check_padding(backend)
    s.drain()
    assert chunk_steps >= 20  # ~190 prompt tokens in chunks of 8, one a step
    assert long.token_ids == solo.token_ids and len(long.token_ids) == 6
    assert all(r.outcome is not None and r.outcome.finish_reason == "length" for r in decoding)


def test_rows_join_and_leave_with_the_padding_on_the_host(make):
    s = make()
    # the longer prompt (no padding) finishes first: the others' common padding is shed
    first = [s.request(PROMPTS[0], max_tokens=9), s.request(PROMPTS[2], max_tokens=3)]
    s.until(lambda: s.engine._group is not None and loop_of(s)._rows)
    later = s.request("Hi", max_tokens=5)  # shorter than every row in the cache: padded on the left
    shed = 0
    while s.engine._live:
        before = loop_of(s)._cache[0]._idx if s.engine._group is not None and loop_of(s)._rows else None
        s.step()
        if s.engine._group is not None and loop_of(s)._rows:
            backend = loop_of(s)
            check_padding(backend)
            if before is not None and backend._cache[0]._idx <= before:
                shed += 1
    assert shed >= 1  # the host dropped padding columns without reading the device
    assert [r.num_output_tokens for r in (*first, later)] == [9, 3, 5]


@pytest.mark.parametrize("stage", ["waiting", "chunked", "decoding"])
def test_a_cancel_at_any_stage_leaves_the_others_tokens_unchanged(make, stage):
    """waiting: a long prompt behind another one's chunks (one chunked group at a time)."""
    reference = make()
    ref = [reference.request(PROMPTS[0], max_tokens=10), reference.request(PROMPTS[1], max_tokens=10)]
    reference.drain()

    s = make()
    others = [s.request(PROMPTS[0], max_tokens=10), s.request(PROMPTS[1], max_tokens=10)]
    s.until(lambda: all(r.num_output_tokens >= 1 for r in others))
    if stage == "waiting":
        others.append(s.request(LONG, max_tokens=4))
        s.until(lambda: loop_of(s)._chunked is not None)
    victim = s.request(LONG if stage != "decoding" else PROMPTS[2], max_tokens=10)
    if stage == "waiting":
        s.step()
        assert [r.uid for r in loop_of(s)._waiting] == [victim.uid]
    elif stage == "chunked":
        s.until(lambda: loop_of(s)._chunked is not None)
    else:
        s.until(lambda: victim.num_output_tokens >= 2)
    s.engine.cancel(victim)
    s.drain()
    assert victim.outcome is not None and victim.outcome.finish_reason == "cancelled"
    assert [r.token_ids for r in others[:2]] == [r.token_ids for r in ref]
    assert all(r.outcome is not None and r.outcome.finish_reason == "length" for r in others)
    assert s.engine._live == {} and s.engine._group is None


@pytest.mark.parametrize(
    ("option", "value"),
    [("mlx_idle_finished_rows", "auto"), ("mlx_idle_finished_rows", 0)],
)
def test_a_bad_loop_option_is_refused(make_llm, dense_model, option, value):
    with pytest.raises(errors.InvalidControls) as info:
        make_llm(dense_model, mlx_batching=True, **{option: value})
    assert info.value.code == "invalid_controls" and info.value.field == option


@pytest.mark.parametrize("value", [None, True, False])
def test_idle_finished_rows_reaches_the_loop(make_llm, dense_model, value):
    llm = make_llm(dense_model, mlx_batching=True, mlx_idle_finished_rows=value)
    assert llm._engine.config.idle_finished_rows is value


def test_every_arrival_joins_a_decoding_batch_at_once(make):
    s = make(max_batch_size=16, prefill_step_size=256)
    decoding = [s.request(PROMPTS[0], max_tokens=20), s.request(PROMPTS[1], max_tokens=20)]
    s.until(lambda: all(r.num_output_tokens >= 1 for r in decoding))
    late = s.request(PROMPTS[2], max_tokens=4)
    s.until(lambda: late.uid is not None)
    assert late.uid in {r.uid for r in loop_of(s)._rows}
    s.drain()


@pytest.mark.parametrize(
    ("option", "value", "replaced_by"),
    [
        ("mlx_own_text_loop", False, "always steps its own loop"),
        ("mlx_own_text_loop", True, "always steps its own loop"),
        ("mlx_admission_wave_steps", 4, "admits whatever arrived"),
        ("mlx_admission_wave_steps", 0, "admits whatever arrived"),
    ],
)
def test_a_removed_loop_option_is_refused_saying_what_replaced_it(make_llm, dense_model, option, value, replaced_by):
    with pytest.raises(errors.OptionRemoved) as info:
        make_llm(dense_model, mlx_batching=True, **{option: value})
    assert info.value.code == "option_removed" and info.value.field == option and info.value.http_status == 400
    assert replaced_by in info.value.message and replaced_by in info.value.details["replacement"]


@pytest.mark.parametrize("field", ["own_text_loop", "admission_wave_steps"])
def test_the_engine_config_refuses_the_removed_fields(field):
    from abstractruntime_mlx.engine.core.config import EngineConfig

    with pytest.raises(errors.OptionRemoved) as info:
        EngineConfig(**{field: 0})
    assert info.value.field == field
    assert field not in {f.name for f in dataclasses.fields(EngineConfig)}  # not a field any more: nothing reads it


def test_finished_rows_idle_until_half_the_batch_has_finished(make):
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], "Hi"]
    limits = [3, 6, 14, 14]
    reference = make(text_lane=False)  # mlx-vlm's loop
    expected = [reference.request(p, max_tokens=n) for p, n in zip(prompts, limits)]
    reference.drain()

    s = make(idle_finished_rows=True)
    reqs, widths = batch_widths(s, prompts, limits)
    # one finished: its slot idles (4 wide); two of four: one compaction to the two left
    assert (1, 4) in widths and (2, 2) in widths and (1, 3) not in widths
    assert [r.token_ids for r in reqs] == [r.token_ids for r in expected]


def test_finished_rows_drop_at_once_unless_the_host_bounds_the_step(make):
    """The default: rows idle only on MLX's CUDA backend; here (CPU) each step drops its
    finished rows, since an idle row's compute is paid by every step."""
    from abstractruntime_mlx.engine.model import cuda_attention

    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], "Hi"]
    limits = [3, 6, 14, 14]
    reference = make(text_lane=False)  # mlx-vlm's loop
    expected = [reference.request(p, max_tokens=n) for p, n in zip(prompts, limits)]
    reference.drain()

    assert not cuda_attention.available()
    s = make()
    reqs, widths = batch_widths(s, prompts, limits, idle_default=False)
    assert (1, 3) in widths and (2, 2) in widths and (1, 4) not in widths
    assert all(finished + width <= 4 for finished, width in widths)  # never a finished row in the batch
    assert [r.token_ids for r in reqs] == [r.token_ids for r in expected]


def batch_widths(
    s: Stepper, prompts: list[str], limits: list[int], idle_default: bool | None = None
) -> tuple[list[EngineRequest], list[tuple[int, int]]]:
    """Step the prompts to the end: the requests, and after each step (finished requests, rows
    in the batch)."""
    reqs = [s.request(p, max_tokens=n) for p, n in zip(prompts, limits)]
    widths = []
    while s.engine._live:
        s.step()
        if s.engine._group is not None and loop_of(s)._rows:
            backend = loop_of(s)
            if idle_default is not None:
                assert backend._idle_finished is idle_default
            widths.append((sum(r.outcome is not None for r in reqs), len(backend._rows)))
            check_padding(backend)
    return reqs, widths


@pytest.mark.parametrize("prompt", [PROMPTS[0], LONG], ids=["short", "chunked"])
def test_rows_with_one_prompt_prefill_it_once(make, prompt):
    """Rows admitted together with the same prompt share one prefill row (its KV copied to each
    when the prefill ends): the copies report it as cached, and every row decodes as it would alone."""
    reference = make()
    alone = [reference.request(prompt, max_tokens=6), reference.request(PROMPTS[1], max_tokens=6)]
    reference.drain()

    s = make()
    with s.engine.together():
        rows = [s.request(prompt, max_tokens=6), s.request(PROMPTS[1], max_tokens=6), s.request(prompt, max_tokens=6)]
    prefills = []
    while s.engine._live:
        if s.engine._group is not None:
            backend = loop_of(s)
            group = backend._chunked
            if group is not None:
                prefills.append((len(group.rows), len(group.tokens)))
            check_padding(backend)
        s.step()
    if prompt == LONG:  # the long prompt's rows prefill a chunk a step, as one row
        assert prefills and set(prefills) == {(2, 1)}
    num_prompt = len(rows[0].prompt_ids)
    assert [r.cached_tokens for r in rows] == [0, 0, num_prompt - 1]
    assert [r.token_ids for r in rows] == [alone[0].token_ids, alone[1].token_ids, alone[0].token_ids]


def test_a_cancelled_row_of_a_shared_prefill_leaves_its_twin_going(make):
    reference = make()
    alone = reference.request(LONG, max_tokens=5)
    reference.drain()

    s = make()
    with s.engine.together():
        twins = [s.request(LONG, max_tokens=5), s.request(LONG, max_tokens=5)]
    s.until(lambda: s.engine._group is not None and loop_of(s)._chunked is not None)
    s.step()
    s.engine.cancel(twins[0])
    s.step()
    group = loop_of(s)._chunked
    assert group is not None and len(group.rows) == len(group.tokens) == 1 and group.source == [0]
    s.drain()
    assert twins[0].outcome is not None and twins[0].outcome.finish_reason == "cancelled"
    assert twins[1].token_ids == alone.token_ids


def test_a_calls_answers_share_its_prompts_prefill(make_llm, dense_model):
    """``n`` answers are submitted at once: the worker admits them together and the text lane
    prefills the prompt once (the other answers report it as cached)."""
    import asyncio

    from abstractruntime_mlx.request import GenerationRequest

    llm = make_llm(dense_model, mlx_batching=True, speculation=False)
    call = GenerationRequest.build(
        prompt="Tell me a story", max_output_tokens=4, n=4, sampling={"temperature": 0}, thinking=False
    )
    result = asyncio.run(llm.agenerate_request(call))
    assert result.choices is not None and len(result.choices) == 4
    prompt = result.usage["prompt_tokens"]
    assert [c.usage["cached_input_tokens"] for c in result.choices] == [0] + [prompt - 1] * 3
    assert len({tuple(c.token_ids or ()) for c in result.choices}) == 1
    assert result.usage["completion_tokens"] == sum(c.usage["completion_tokens"] for c in result.choices)
    with pytest.raises(errors.InvalidControls) as caught:
        llm.generate_request(call)
    assert caught.value.details["field"] == "n"


def test_the_load_route_refuses_a_removed_option_by_name():
    from abstractruntime_mlx.server.schemas import LoadModelRequest

    body = LoadModelRequest(model="m", options={"mlx_admission_wave_steps": 4})
    with pytest.raises(errors.OptionRemoved) as info:
        body.checked_options()
    assert info.value.code == "option_removed" and info.value.details["field"] == "mlx_admission_wave_steps"
