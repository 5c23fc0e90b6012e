"""Benchmark checkpoints built offline: the package's tiny model and a ~27M-parameter one.

``small_model(path)`` writes a random-weight ``qwen3`` checkpoint (hidden 512, 8 layers,
intermediate 1536, 8 query / 4 KV heads of 64, untied head; about 27M parameters, 108 MB
in float32) that reuses the tiny model's tokenizer and chat template, so prompts tokenise
the same for both. It loads with ``mlx_lm.load`` and ``mlx_vlm.load``. A marker file
written last makes a second call with the same arguments return at once.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

MARKER = "bench_model.json"
BUILDER_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

SMALL_SHAPE: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


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

    with tempfile.TemporaryDirectory() as scratch:
        src = tiny(Path(scratch) / "tiny", seed=seed)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)
        base = json.loads((src / "config.json").read_text())
    config = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        **shape,
        "rms_norm_eps": 1e-6,
        "vocab_size": base["vocab_size"],  # the tiny tokenizer's size
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": base["eos_token_id"],
        "torch_dtype": "float32",
    }
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")


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
