"""The offline tiny-model builder: determinism, loading, generation, MTP, vision, chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
mlx_vlm = pytest.importorskip("mlx_vlm")

from abstractruntime_mlx.testing import (  # noqa: E402
    build_from_cli,
    read_marker,
    tiny_image,
    tiny_model,
)
from abstractruntime_mlx.testing.tokenizer import SPECIAL_TOKENS  # noqa: E402

MAX_TOKENS = 16
PARIS = {"city": "Paris"}
ROME = '{"city": "Rome"}'
USER = [{"role": "user", "content": "Tell me about the weather in Paris."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "dense": tiny_model(root / "dense", "dense"),
        "hybrid-mtp": tiny_model(root / "mtp", "hybrid-mtp"),
        "aligned": tiny_model(root / "mtp-a0", "hybrid-mtp", mtp_alpha=0.0),
        "partial": tiny_model(root / "mtp-a005", "hybrid-mtp", mtp_alpha=0.05),
        "vision": tiny_model(root / "vision", "vision"),
    }


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _between(text: str, start: str, end: str) -> list[str]:
    """Every piece of ``text`` enclosed by ``start`` ... ``end``."""
    return [chunk.split(end)[0] for chunk in text.split(start)[1:]]


def _lm_greedy(path: Path) -> list[int]:
    model, tokenizer = mlx_lm.load(str(path))
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    responses = mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)
    return [r.token for r in responses]


def _vlm_greedy(model, processor, prompt: str, **kwargs) -> list[int]:
    results = list(mlx_vlm.stream_generate(model, processor, prompt, max_tokens=MAX_TOKENS, temperature=0.0, **kwargs))
    return list(results[-1].token_ids)  # the final result; its last per-token yield repeats


# --- building ------------------------------------------------------------------------


def test_same_seed_gives_identical_files(tmp_path):
    for kind, alpha in (("dense", None), ("hybrid-mtp", 0.05)):
        first = tiny_model(tmp_path / f"{kind}-1", kind, seed=3, mtp_alpha=alpha)
        second = tiny_model(tmp_path / f"{kind}-2", kind, seed=3, mtp_alpha=alpha)
        names = sorted(p.name for p in first.iterdir())
        assert names == sorted(p.name for p in second.iterdir())
        for name in names:
            assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_different_seeds_give_different_weights(tmp_path, models):
    other = tiny_model(tmp_path / "dense-seed1", "dense", seed=1)
    base = models["dense"]
    assert (other / "model.safetensors").read_bytes() != (base / "model.safetensors").read_bytes()
    # The tokenizer does not depend on the seed.
    assert (other / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()


def test_existing_checkpoint_is_reused(tmp_path):
    path = tiny_model(tmp_path / "m", "dense")
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert tiny_model(path, "dense") == path
    assert weights.stat().st_mtime_ns == stamp
    assert read_marker(path)["kind"] == "dense"
    with pytest.raises(FileExistsError):
        tiny_model(path, "dense", exist_ok=False)

    # Another seed rebuilds in place; a directory that is not a tiny model is never touched.
    tiny_model(path, "dense", seed=5)
    assert read_marker(path)["seed"] == 5
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        tiny_model(foreign, "dense")
    assert build_from_cli(str(tmp_path / "cli"), "dense", 0) == tmp_path / "cli"


def test_bad_arguments():
    with pytest.raises(ValueError):
        tiny_model("/nonexistent/x", "moe")
    with pytest.raises(ValueError):
        tiny_model("/nonexistent/x", "dense", mtp_alpha=0.0)


def test_token_ids_match_config(models):
    tokenizer = mlx_lm.load(str(models["vision"]))[1]
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    assert sorted(ids.values()) == list(range(len(SPECIAL_TOKENS)))
    config = json.loads((models["vision"] / "config.json").read_text())
    assert config["image_token_id"] == ids["<|image_pad|>"]
    assert config["video_token_id"] == ids["<|video_pad|>"]
    assert config["vision_start_token_id"] == ids["<|vision_start|>"]
    assert config["vision_end_token_id"] == ids["<|vision_end|>"]
    assert config["eos_token_id"] == [ids["<|im_end|>"]]
    assert tokenizer.eos_token_ids == {ids["<|im_end|>"]}
    assert config["text_config"]["vocab_size"] == len(tokenizer.get_vocab())


# --- loading and generating ------------------------------------------------------------


def test_dense_same_tokens_in_mlx_lm_and_mlx_vlm(models):
    lm_ids = _lm_greedy(models["dense"])
    model, processor = mlx_vlm.load(str(models["dense"]))
    prompt = processor.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    vlm_ids = _vlm_greedy(model, processor, prompt)
    assert len(lm_ids) > 0
    assert vlm_ids == lm_ids


def test_hybrid_loads_in_mlx_lm_too(models):
    lm_ids = _lm_greedy(models["hybrid-mtp"])
    model, processor = mlx_vlm.load(str(models["hybrid-mtp"]))
    prompt = processor.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert _vlm_greedy(model, processor, prompt) == lm_ids


@pytest.mark.parametrize("name", ["hybrid-mtp", "aligned", "partial"])
def test_mtp_keeps_greedy_tokens(models, name):
    from mlx_vlm.speculative.drafters import load_drafter

    model, processor = mlx_vlm.load(str(models[name]))
    draft, kind = load_drafter(str(models[name]), kind="mtp")
    assert kind == "mtp"
    prompt = processor.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    plain = _vlm_greedy(model, processor, prompt)
    speculative = _vlm_greedy(model, processor, prompt, draft_model=draft, draft_kind="mtp")
    assert speculative == plain
    accepted, drafted = sum(draft.accept_lens), sum(draft.draft_lens)
    assert drafted > 0
    if name == "aligned":  # alpha = 0: the head predicts exactly what the target does
        assert accepted == drafted
    elif name == "partial":  # alpha = 0.05: the target's context pulls it away at times
        assert 0 < accepted < drafted
    else:  # random head
        assert accepted == 0


def test_vision_different_images_different_tokens(models, tmp_path):
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = mlx_vlm.load(str(models["vision"]))
    prompt = apply_chat_template(processor, model.config, "Describe the image.", num_images=1)
    red_blue = tiny_image(tmp_path / "rb.png", "red", "blue")
    blue_red = tiny_image(tmp_path / "br.png", (0, 0, 255), (255, 0, 0))
    first = _vlm_greedy(model, processor, prompt, image=[str(red_blue)])
    second = _vlm_greedy(model, processor, prompt, image=[str(blue_red)])
    assert len(first) > 0 and len(second) > 0
    assert first != second
    assert _vlm_greedy(model, processor, prompt, image=[str(red_blue)]) == first


# --- chat template -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers(models):
    from transformers import AutoTokenizer

    return {
        "hf": AutoTokenizer.from_pretrained(str(models["dense"])),
        "mlx_lm": mlx_lm.load(str(models["dense"]))[1],
    }


def _render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("which", ["hf", "mlx_lm"])
def test_template_generation_prompt_and_thinking(tokenizers, which):
    tok = tokenizers[which]
    # Each suffix starts at a special token, so it encodes the same alone as in context.
    open_think = _ids(tok, "<|im_start|>assistant\n<think>\n")
    closed_think = _ids(tok, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    end_of_user = _ids(tok, "<|im_end|>\n")

    on = _ids(tok, _render(tok, USER, add_generation_prompt=True, enable_thinking=True))
    off = _ids(tok, _render(tok, USER, add_generation_prompt=True, enable_thinking=False))
    default = _ids(tok, _render(tok, USER, add_generation_prompt=True))
    no_prompt = _ids(tok, _render(tok, USER))

    assert on[-len(open_think) :] == open_think
    assert off[-len(closed_think) :] == closed_think
    assert default == on
    assert no_prompt[-len(end_of_user) :] == end_of_user
    assert on[: len(no_prompt)] == no_prompt == off[: len(no_prompt)]
    assert tok.convert_tokens_to_ids("<think>") not in no_prompt


@pytest.mark.parametrize("which", ["hf", "mlx_lm"])
def test_template_tools_calls_and_results(tokenizers, which):
    tok = tokenizers[which]
    messages = [
        {"role": "system", "content": "Be brief."},
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [  # arguments as an object, and as a JSON string
                {"type": "function", "function": {"name": "get_weather", "arguments": PARIS}},
                {"type": "function", "function": {"name": "get_weather", "arguments": ROME}},
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rainy"},
    ]
    text = _render(tok, messages, tools=TOOLS, add_generation_prompt=True, enable_thinking=False)
    ids = _ids(tok, text)
    turns = _between(text, "<|im_start|>", "<|im_end|>")
    # system (with the tools), user, assistant (two calls), user (two results), open prompt.
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 5
    roles = [turn.split("\n")[0] for turn in turns]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    tools_block = _between(turns[0], "<tools>", "</tools>")[-1]  # [0] is in the instructions
    assert [json.loads(line) for line in tools_block.strip().split("\n")] == TOOLS

    calls = [json.loads(call) for call in _between(turns[2], "<tool_call>", "</tool_call>")]
    assert calls == [
        {"name": "get_weather", "arguments": PARIS},
        {"name": "get_weather", "arguments": json.loads(ROME)},
    ]
    assert _ids(tok, turns[2]).count(tok.convert_tokens_to_ids("<tool_call>")) == 2
    results = [r.strip() for r in _between(turns[3], "<tool_response>", "</tool_response>")]
    assert results == ["sunny", "rainy"]
    assert _ids(tok, turns[3]).count(tok.convert_tokens_to_ids("<tool_response>")) == 2

    other = tokenizers["mlx_lm" if which == "hf" else "hf"]
    assert _render(other, messages, tools=TOOLS) == _render(tok, messages, tools=TOOLS)


@pytest.mark.parametrize("which", ["hf", "mlx_lm"])
def test_template_list_content_with_image(tokenizers, which):
    tok = tokenizers[which]
    content = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
    ids = _ids(tok, _render(tok, [{"role": "user", "content": content}], add_generation_prompt=True))
    expected = _ids(tok, "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?")
    assert ids[: len(expected)] == expected
    assert ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == 1


def test_mlx_lm_detects_thinking_and_tool_calls(tokenizers):
    tok = tokenizers["mlx_lm"]
    assert tok.has_thinking and tok.think_start == "<think>"
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"
