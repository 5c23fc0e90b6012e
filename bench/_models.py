"""Benchmark checkpoints built offline: the package's tiny model, a ~27M-parameter one, and
random-weight bf16 checkpoints of Qwen3-0.6B's and Qwen3-4B's shapes (for a GPU).

``small_model(path)`` writes a random-weight ``qwen3`` checkpoint (hidden 512, 8 layers,
intermediate 1536, 8 query / 4 KV heads of 64, untied head; about 27M parameters, 108 MB
in float32) that reuses the tiny model's tokenizer and chat template, so prompts tokenise
the same for both. ``shaped_model(path, "0.6b" | "4b")`` writes the real model's shape in
bfloat16 (tied embeddings, vocabulary 151936) with the tiny tokenizer padded to that
vocabulary: the padding tokens are letter strings the tokenizer never produces, so every
id a random model emits decodes to text. All load with ``mlx_lm.load`` and ``mlx_vlm.load``.
A marker file written last makes a second call with the same arguments return at once.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

MARKER = "bench_model.json"
BUILDER_VERSION = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

SMALL_SHAPE: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


# The real models' shapes (Qwen3-0.6B, Qwen3-4B configs), in bfloat16 with tied embeddings.
SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": {
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
    },
    "4b": {
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "intermediate_size": 9728,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
    },
}


def shaped_model(path: str | Path, name: str, seed: int = 0) -> Path:
    """Build (or reuse) a random-weight checkpoint of ``SHAPES[name]`` at ``path``."""
    return small_model(path, seed=seed, shape=SHAPES[name])


def tiny(path: str | Path, seed: int = 0) -> Path:
    from abstractruntime_mlx.testing import tiny_model

    return tiny_model(path, kind="dense", seed=seed)


def small_model(path: str | Path, seed: int = 0, shape: dict[str, Any] | None = None) -> Path:
    """Build (or reuse) the ~27M-parameter qwen3 checkpoint at ``path``."""
    path = Path(path)
    shape = dict(SMALL_SHAPE if shape is None else shape)
    spec = {"seed": int(seed), "shape": shape, "builder_version": BUILDER_VERSION}
    marker = path / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    staging.chmod(0o755)
    try:
        _build(staging, seed, shape)
        (staging / MARKER).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _build(out: Path, seed: int, shape: dict[str, Any]) -> None:
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import _get_classes, save_config, save_model

    shape = dict(shape)
    dtype = shape.pop("dtype", "float32")
    with tempfile.TemporaryDirectory() as scratch:
        src = tiny(Path(scratch) / "tiny", seed=seed)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)
        base = json.loads((src / "config.json").read_text())
    vocab = int(shape.pop("vocab_size", base["vocab_size"]))  # default: the tiny tokenizer's size
    if vocab > base["vocab_size"]:
        _pad_tokenizer(out / "tokenizer.json", vocab)
    config = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        **shape,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "eos_token_id": base["eos_token_id"],
        "torch_dtype": dtype,
    }
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    target = getattr(mx, dtype)
    model.update(tree_map(lambda p: p.astype(target), model.parameters()))
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")


def _pad_tokenizer(path: Path, vocab: int) -> None:
    """Grow a BPE ``tokenizer.json`` to ``vocab`` ids with letter strings no merge produces."""
    import itertools
    import string

    data = json.loads(path.read_text())
    table: dict[str, int] = data["model"]["vocab"]
    taken = set(table) | {t["content"] for t in data.get("added_tokens", [])}
    used = set(table.values()) | {int(t["id"]) for t in data.get("added_tokens", [])}
    free = (i for i in itertools.count() if i not in used)
    names = ("".join(p) for n in itertools.count(3) for p in itertools.product(string.ascii_lowercase, repeat=n))
    need = vocab - len(used)
    for name in names:
        if need <= 0:
            break
        if name in taken:
            continue
        table[name] = next(free)
        need -= 1
    path.write_text(json.dumps(data, ensure_ascii=False))


def num_parameters(path: str | Path) -> int:
    import mlx.core as mx

    total = 0
    for file in Path(path).glob("*.safetensors"):
        total += sum(v.size for v in mx.load(str(file)).values())
    return total


if __name__ == "__main__":  # python bench/_models.py DIR: build both and check they load
    import sys

    root = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="bench-models-"))
    for p in (tiny(root / "tiny"), small_model(root / "small")):
        import mlx_lm
        import mlx_vlm

        mlx_lm.load(str(p))
        mlx_vlm.load(str(p))
        print(p, f"{num_parameters(p) / 1e6:.1f}M parameters; mlx_lm.load and mlx_vlm.load OK")
