"""Fused projections: the text lane's model computes q/k/v in one matmul and gate/up in another
(``engine/model/fused_projections.py``), with the tokens of upstream's separate projections, its
weights held once, and no activation kept past its layer."""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache

from abstractruntime_mlx import errors
from abstractruntime_mlx.engine.model.fused_projections import _Part, fuse, fuse_text_model, share_views
from abstractruntime_mlx.engine.model.text_model import language_model
from test_call_harness import together

PROMPTS = [[5 + (i * 7 + j * 13) % 200 for j in range(9 + 3 * i)] for i in range(3)]


def greedy(model, steps=12):
    """Each row's greedy tokens over a left-padded batch cache: the text lane's decode."""
    longest = max(map(len, PROMPTS))
    pads = [longest - len(p) for p in PROMPTS]
    cache = [BatchKVCache(pads) for _ in model.layers]
    y = mx.argmax(model(mx.array([[0] * n + p for n, p in zip(pads, PROMPTS)]), cache=cache)[:, -1], axis=-1)
    out = [y]
    for _ in range(steps - 1):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        out.append(y)
    return mx.stack(out, axis=1).tolist()


def projections(model):
    return {k for k, _ in tree_flatten(model.parameters()) if k.split(".")[-2].endswith("_proj")}


@pytest.fixture()
def pair(dense_model):
    return mlx_lm.load(dense_model)[0], mlx_lm.load(dense_model)[0]


def test_fused_model_gives_upstreams_tokens_with_stacked_weights(pair):
    separate, fused = pair
    views = fuse(fused)
    layers = len(fused.layers)
    assert len(views) == 5 * layers  # q, k, v, gate, up weights of every layer
    names = {k.split(".")[-2] for k in projections(fused)}
    assert names == {"qkv_proj", "gate_up_proj", "o_proj", "down_proj"}
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    ref = separate.layers[0].self_attn
    assert attn.qkv_proj.weight.shape[0] == sum(getattr(ref, n).weight.shape[0] for n in ("q_proj", "k_proj", "v_proj"))
    assert isinstance(attn.q_proj, _Part) and isinstance(mlp.up_proj, _Part)
    assert greedy(fused) == greedy(separate)
    assert fuse(fused) == {}  # nothing left to stack


def test_quantized_projections_stack_too(pair):
    separate, fused = pair
    nn.quantize(separate, group_size=32, bits=4)
    nn.quantize(fused, group_size=32, bits=4)
    assert len(fuse(fused)) == 5 * 3 * len(fused.layers)  # weight, scales, biases
    assert isinstance(fused.layers[0].self_attn.qkv_proj, nn.QuantizedLinear)
    assert greedy(fused) == greedy(separate)


def test_mixed_projection_types_are_left_alone(pair):
    _, model = pair
    attn = model.layers[0].self_attn
    attn.k_proj = nn.QuantizedLinear.from_linear(attn.k_proj, group_size=32, bits=8)
    fuse(model)
    assert not isinstance(attn.q_proj, _Part) and "qkv_proj" not in attn
    assert isinstance(model.layers[0].mlp.gate_proj, _Part)  # its MLP still fused
    assert isinstance(model.layers[1].self_attn.q_proj, _Part)


def test_parts_answer_in_any_order_and_for_any_input(pair):
    separate, fused = pair
    fuse(fused)
    ref, attn = separate.layers[0].self_attn, fused.layers[0].self_attn
    x, other = (
        mx.random.normal((2, 3, ref.q_proj.weight.shape[1]), key=mx.random.key(1)),
        mx.random.normal((1, 2, ref.q_proj.weight.shape[1]), key=mx.random.key(2)),
    )

    def close(a, b):
        return a.shape == b.shape and mx.allclose(a, b, atol=1e-5).item()

    assert close(attn.v_proj(x), ref.v_proj(x))  # the last part first
    assert close(attn.q_proj(x), ref.q_proj(x))
    assert close(attn.q_proj(x), ref.q_proj(x))  # taken twice for one input
    assert close(attn.k_proj(other), ref.k_proj(other))  # another input in between
    assert close(attn.k_proj(x), ref.k_proj(x))
    split = attn.q_proj.split
    assert close(attn.q_proj(other), ref.q_proj(other)) and close(attn.v_proj(other), ref.v_proj(other))
    assert split._input is other
    attn.k_proj(other)
    assert split._input is None and split._outputs == []  # every part taken: nothing kept


def test_no_activation_outlives_its_layer(pair):
    _, fused = pair
    fuse(fused)
    greedy(fused, steps=2)
    splits = [layer.self_attn.q_proj.split for layer in fused.layers] + [
        layer.mlp.gate_proj.split for layer in fused.layers
    ]
    assert all(s._input is None and s._outputs == [] for s in splits)


def test_the_resident_model_takes_views_and_the_weights_are_held_once(dense_model):
    import mlx_vlm

    resident, _ = mlx_vlm.load(dense_model)
    lm = getattr(resident, "language_model", resident)
    tokens = mx.array([PROMPTS[2]])

    def logits():
        out = lm(tokens)
        return getattr(out, "logits", out)

    before = logits()
    mx.eval(before)
    gc.collect()
    held = mx.get_active_memory()
    twin = language_model(Path(dense_model), resident)
    assert type(twin).__module__.startswith("mlx_lm.models.")
    fuse_text_model(twin, resident)
    gc.collect()
    stacked = sum(
        v.nbytes for k, v in tree_flatten(twin.parameters()) if k.split(".")[-2] in ("qkv_proj", "gate_up_proj")
    )
    assert stacked > 0
    # The stacked arrays replaced the originals in both models: memory grew by far less than a copy.
    assert mx.get_active_memory() - held < stacked / 4
    assert mx.array_equal(before, logits()).item()  # the resident model computes as before
    assert not isinstance(lm.layers[0].self_attn.q_proj, _Part)  # its modules are its own, on views


def test_a_checkpoint_mlx_lm_cannot_build_has_no_text_model(vision_model):
    import mlx_vlm

    resident, _ = mlx_vlm.load(vision_model)
    assert language_model(Path(vision_model), resident) is None  # mlx-lm's parameters differ: no text lane


def test_share_views_takes_only_the_arrays_that_were_stacked(pair, dense_model):
    separate, fused = pair
    views = fuse(fused)  # ``separate`` never held these arrays: equal values, other objects
    assert share_views(separate, views) == 0
    twin = mlx_lm.load(dense_model)[0]
    twin.load_weights(list(tree_flatten(separate.parameters())))
    views = fuse(twin)
    name = next(iter(views))
    original, view = views[name]
    assert (
        share_views(separate, {name: (original, view), "model.layers.0.self_attn.nowhere.weight": (original, view)})
        == 1
    )
    assert share_views(separate, views) == len(views) - 1  # the first one is a view already
    assert dict(tree_flatten(separate.parameters()))[name] is view


def test_the_option_keeps_tokens_and_switches_the_model(make_llm, dense_model):
    requests = [
        {"prompt": p, "thinking": False, "max_output_tokens": 10} for p in ("Explain TTL caches.", "Why batch?")
    ]
    runs = {}
    for on in (True, False):
        llm = make_llm(
            dense_model,
            mlx_batching=True,
            mlx_max_batch_size=4,
            mlx_batch_wait_ms=200,
            mlx_single_lane=False,
            speculation=False,
            mlx_fused_projections=on,
        )
        results = together(llm, requests)
        assert {r.metadata["execution"]["path"] for r in results} == {"text_batch"}
        assert all(r.token_ids for r in results)
        runs[on] = ([r.token_ids for r in results], "qkv_proj" in llm._engine._lanes._text_lm.layers[0].self_attn)
        llm.unload_model()
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] and not runs[False][1]


def test_bad_option_is_a_typed_error(make_llm, dense_model):
    with pytest.raises(errors.InvalidControls) as caught:
        make_llm(dense_model, mlx_batching=True, mlx_fused_projections="yes")
    assert caught.value.field == "mlx_fused_projections"
