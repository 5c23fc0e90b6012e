"""``mlx_prefill_buckets``: the text lane pads prompt chunks to a few lengths, warms those shapes
at load, and gives the same tokens as upstream's unpadded chunks."""

from __future__ import annotations

import pytest

from abstractruntime_mlx import errors
from abstractruntime_mlx.engine.model.prefill_shapes import Buckets, length_buckets, width_buckets
from test_call_harness import together

# Word counts chosen so that the batch's longest prompt is no bucket's length.
CALLS = [
    {"prompt": "word " * 9 + "end.", "thinking": False, "max_output_tokens": 10},
    {"prompt": "word " * 23 + "end.", "thinking": False, "max_output_tokens": 7, "temperature": 0.9, "seed": 5},
    {"prompt": "word " * 41 + "end.", "thinking": False, "max_output_tokens": 9, "repetition_penalty": 1.3},
]


def test_length_and_width_buckets():
    assert length_buckets(256) == (32, 64, 128, 256)
    assert length_buckets(100) == (32, 64, 100)  # the chunk size is the last bucket
    assert length_buckets(16) == (16,)
    assert width_buckets(4) == (1, 2, 4) and width_buckets(6) == (1, 2, 4)
    buckets = Buckets(prefill_step_size=256, max_batch_size=4)
    assert [buckets.length(n) for n in (1, 32, 33, 200, 256)] == [32, 32, 64, 256, 256]


class _Shapes:
    """Records the input shape of every prompt forward (more than one token a row) of a model class."""

    def __init__(self, monkeypatch, cls):
        self.seen: list[tuple[int, int]] = []
        call = cls.__call__

        def spy(model, inputs, *args, **kwargs):
            if inputs.ndim == 2 and inputs.shape[1] > 1:
                self.seen.append((int(inputs.shape[0]), int(inputs.shape[1])))
            return call(model, inputs, *args, **kwargs)

        monkeypatch.setattr(cls, "__call__", spy)


def batched(make_llm, model, buckets):
    return make_llm(
        model,
        mlx_batching=True,
        mlx_max_batch_size=4,
        mlx_batch_wait_ms=200,
        mlx_single_lane=False,
        speculation=False,
        mlx_prefill_buckets=buckets,
    )


@pytest.mark.slow
def test_bucketed_chunks_give_the_same_tokens_in_bucket_shapes(make_llm, dense_model, monkeypatch):
    plain = batched(make_llm, dense_model, False)
    assert plain._engine._lanes.buckets is None
    plain.generate("Hello.", thinking=False, max_output_tokens=2)  # builds the lane's model, on the worker
    shapes = _Shapes(monkeypatch, type(plain._engine._lanes._text_lm))
    unpadded = together(plain, CALLS)
    plain_shapes = list(shapes.seen)
    plain.unload_model()

    shapes.seen.clear()
    llm = batched(make_llm, dense_model, True)
    warmed = set(shapes.seen)  # run at load, on the worker
    buckets = llm._engine._lanes.buckets
    assert warmed == {(w, n) for w in buckets.widths for n in buckets.lengths}
    shapes.seen.clear()
    padded = together(llm, CALLS)

    assert {r.metadata["execution"]["path"] for r in padded} == {"text_batch"}
    assert [r.token_ids for r in padded] == [r.token_ids for r in unpadded]
    assert [r.finish_reason for r in padded] == [r.finish_reason for r in unpadded]
    assert [r.usage for r in padded] == [r.usage for r in unpadded]
    assert shapes.seen and all(n in buckets.lengths for _, n in shapes.seen)
    assert any(n not in buckets.lengths for _, n in plain_shapes)  # upstream pads to the longest row


def test_bucketed_chunks_of_a_long_prompt(make_llm, dense_model):
    """A prompt longer than a chunk: full chunks are the last bucket, the rest pads up."""
    plain = make_llm(dense_model, mlx_batching=True, mlx_single_lane=False, mlx_prefill_step_size=64, speculation=False)
    calls = [{"prompt": "word " * 150, "thinking": False, "max_output_tokens": 6}, CALLS[0]]
    unpadded = together(plain, calls)
    plain.unload_model()
    llm = make_llm(
        dense_model,
        mlx_batching=True,
        mlx_single_lane=False,
        mlx_prefill_step_size=64,
        speculation=False,
        mlx_prefill_buckets=True,
    )
    padded = together(llm, calls)
    assert [r.token_ids for r in padded] == [r.token_ids for r in unpadded]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_bucket_option_is_refused(make_llm, dense_model, value):
    with pytest.raises(errors.InvalidControls) as info:
        make_llm(dense_model, mlx_batching=True, mlx_prefill_buckets=value)
    assert info.value.code == "invalid_controls" and info.value.field == "mlx_prefill_buckets"
