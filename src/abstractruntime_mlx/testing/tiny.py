"""Tiny random-weight checkpoints, built offline in about a second.

``tiny_model(path, kind, seed)`` writes a complete model directory (config, float32
safetensors, tokenizer with a chat template, and for the ``qwen3_5`` kinds an image
processor config) that ``mlx_lm.load`` and/or ``mlx_vlm.load`` accept without network.

Kinds:

- ``dense``: a 2-layer ``qwen3`` model; loads with both mlx-lm and mlx-vlm.
- ``dense-long``: the same weights with a 32768-token context (``LONG_CONTEXT``), for flows
  whose agent prompts (tool definitions plus the turns so far) pass ``dense``'s 4096.
- ``hybrid-mtp``: a Qwen3.5 hybrid (gated-delta and full-attention layers) under the
  ``qwen3_5`` root type, with a small vision tower and embedded ``mtp.*`` weights that
  ``mlx_vlm.speculative.drafters.load_drafter(path, kind="mtp")`` picks up.
  ``mtp_alpha=None`` gives a random MTP head (drafts are never accepted); a float α gives
  the "aligned" construction, where α=0 makes every draft accepted and small α some.
- ``vision``: the same ``qwen3_5`` model with its vision tower, without MTP weights.
- ``hybrid-companion``: the ``hybrid-mtp`` target without its ``mtp.*`` weights, plus the
  same head as a separate companion directory (``model_type: qwen3_5_mtp``, keys without
  the ``mtp.`` prefix), written next to the target under the name the lookup expects
  (``companion_head_path``: ``Model-MTP-4bit`` for ``Model-4bit``, else ``Model-MTP``).
  ``mtp_alpha`` applies as for ``hybrid-mtp``; same seed and α give the same tokens.

Weights and tokenizer depend only on ``seed`` (and the builder version): two builds with
the same seed are byte-identical. A ``tiny_model.json`` marker written last records what
the directory holds, so a second call with the same arguments returns at once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from .tokenizer import build_tokenizer, save_tokenizer, token_ids

BUILDER_VERSION = 1
KINDS = ("dense", "hybrid-mtp", "vision", "dense-long", "hybrid-companion")
MTP_KINDS = ("hybrid-mtp", "hybrid-companion")
LONG_CONTEXT = 32768
MARKER_FILE = "tiny_model.json"
WEIGHTS_FILE = "model.safetensors"

DEFAULT_IMAGE_SIZE = (64, 64)
MTP_BLOCK_SIZE = 3  # mlx-vlm's default for one MTP layer: mtp_num_hidden_layers + 2


def tiny_model(
    path: str | os.PathLike[str],
    kind: str = "dense",
    seed: int = 0,
    *,
    mtp_alpha: float | None = None,
    exist_ok: bool = True,
) -> Path:
    """Build a tiny checkpoint of ``kind`` at ``path`` and return the path.

    With ``exist_ok`` (the default), a complete tiny checkpoint already at ``path`` is
    returned as is when it was built with the same arguments, and rebuilt otherwise.
    ``FileExistsError`` is raised for any other non-empty directory, and for any
    non-empty ``path`` when ``exist_ok`` is false.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {', '.join(KINDS)}")
    if mtp_alpha is not None and kind not in MTP_KINDS:
        raise ValueError(f"mtp_alpha applies to kinds {', '.join(MTP_KINDS)} only, not {kind!r}")
    if mtp_alpha is not None and mtp_alpha < 0:
        raise ValueError(f"mtp_alpha must be >= 0, got {mtp_alpha}")

    path = Path(path)
    spec = _spec(kind, seed, mtp_alpha)
    current = read_marker(path)
    if path.exists() and any(path.iterdir()):
        if not exist_ok:
            raise FileExistsError(f"{path} exists and is not empty")
        if current is None:
            raise FileExistsError(f"{path} is not empty and holds no tiny model; not overwriting it")
        if current == spec and (
            kind != "hybrid-companion" or read_marker(companion_head_path(path)) == _head_spec(spec)
        ):
            return path

    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "hybrid-companion":
        # The head first: a target marked complete always has its head next to it.
        _build_atomic(companion_head_path(path), _head_spec(spec), lambda out: _build_head(out, seed, mtp_alpha))
    _build_atomic(path, spec, lambda out: _build(out, kind, seed, mtp_alpha))
    return path


def companion_head_path(path: str | os.PathLike[str]) -> Path:
    """Where a ``hybrid-companion`` target's head lives: the sibling directory the companion
    lookup finds (``artifacts.companion_candidates``: the ``-MTP-`` form for a quantized name)."""
    from ..artifacts import companion_candidates

    target = Path(path)
    return target.parent / companion_candidates(target.name)[-1]


def _build_atomic(path: Path, spec: dict[str, Any], build: Any) -> None:
    if read_marker(path) == spec:
        return
    if path.exists() and any(path.iterdir()) and read_marker(path) is None:
        raise FileExistsError(f"{path} is not empty and holds no tiny model; not overwriting it")
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    staging.chmod(0o755)  # mkdtemp makes it private
    try:
        build(staging)
        _write_json(staging / MARKER_FILE, spec)  # last: marks the checkpoint complete
        if path.exists():
            shutil.rmtree(path)
        try:
            staging.rename(path)
        except OSError:
            if read_marker(path) != spec:  # lost a race to a different build
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_from_cli(path: str, kind: str, seed: int, *, force: bool = False) -> Path:
    """Entry point for ``abstractruntime-mlx models tiny PATH --kind K --seed N [--force]``.

    Builds into a missing or empty directory; the same tiny model already there is kept. Any
    other non-empty directory (another kind or seed, or files that are no tiny model) is
    refused with ``InvalidRequest`` unless ``force``, which replaces the whole directory.
    """
    from ..errors import InvalidRequest

    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise InvalidRequest(f"{target} is a file, not a directory", details={"path": str(target)})
    if target.is_dir() and any(target.iterdir()):
        current = read_marker(target)
        if current == _spec(kind, seed, None):
            return target
        if not force:
            held = (
                "files that are no tiny model"
                if current is None
                else f"a tiny {current.get('kind')!r} model (seed {current.get('seed')})"
            )
            raise InvalidRequest(
                f"{target} is not empty (it holds {held}); choose an empty directory or pass --force to replace it",
                details={"path": str(target)},
            )
        shutil.rmtree(target)
    return tiny_model(target, kind=kind, seed=seed)


def read_marker(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What the tiny checkpoint at ``path`` was built with, or ``None``."""
    marker = Path(path) / MARKER_FILE
    if not marker.is_file():
        return None
    recipe: dict[str, Any] = json.loads(marker.read_text())
    return recipe


def tiny_image(
    path: str | os.PathLike[str],
    color_left: str | tuple[int, int, int],
    color_right: str | tuple[int, int, int] | None = None,
    size: tuple[int, int] = DEFAULT_IMAGE_SIZE,
) -> Path:
    """Write a PNG whose left and right halves have the given colours; return its path."""
    from PIL import Image

    width, height = size
    image = Image.new("RGB", size, color_left)
    if color_right is not None:
        image.paste(Image.new("RGB", (width - width // 2, height), color_right), (width // 2, 0))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return path


# --- configs -------------------------------------------------------------------------


def dense_config(vocab_size: int, eos_token_id: int) -> dict[str, Any]:
    """A 2-layer ``qwen3`` config (mlx-lm and mlx-vlm both have this architecture)."""
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,  # a random untied head gives varied greedy tokens
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def text_config(vocab_size: int, eos_token_id: int) -> dict[str, Any]:
    """Qwen3.5 hybrid text config: layers 0 and 2 gated-delta, 1 and 3 full attention."""
    return {
        "model_type": "qwen3_5_text",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,  # the aligned MTP construction needs an untied head
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
        },
        "eos_token_id": eos_token_id,
        "mtp_num_hidden_layers": 1,
    }


def vlm_config(vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """``qwen3_5`` root config: the hybrid text model plus a 2-block vision tower."""
    text = text_config(vocab_size, ids["<|im_end|>"])
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {
            "model_type": "qwen3_5",
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": text["hidden_size"],
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "in_channels": 3,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [],
        },
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vocab_size": vocab_size,
        "eos_token_id": [ids["<|im_end|>"]],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def preprocessor_config(vision: dict[str, Any]) -> dict[str, Any]:
    """Image processor settings matching the vision tower (a 64x64 image -> 4 tokens)."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 1024, "longest_edge": 4096},
    }


# --- building ------------------------------------------------------------------------


def _spec(kind: str, seed: int, mtp_alpha: float | None) -> dict[str, Any]:
    return {
        "kind": kind,
        "seed": int(seed),
        "mtp_alpha": None if mtp_alpha is None else float(mtp_alpha),
        "builder_version": BUILDER_VERSION,
    }


def _head_spec(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "part": "mtp_head"}


def head_config(text: dict[str, Any]) -> dict[str, Any]:
    """A companion head's ``config.json`` (what ``mlx_vlm.split_mtp`` writes)."""
    return {
        "model_type": "qwen3_5_mtp",
        "text_config": text,
        "block_size": MTP_BLOCK_SIZE,
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
    }


def _build_head(out: Path, seed: int, mtp_alpha: float | None) -> None:
    tokenizer = build_tokenizer()
    ids = token_ids(tokenizer)
    text = vlm_config(len(tokenizer), ids)["text_config"]
    mtp = _mtp_weights(text, seed)
    if mtp_alpha is not None:
        _align_head(mtp)
    save_tokenizer(tokenizer, out)
    _write_json(out / "config.json", head_config(text))
    _save_weights(out / WEIGHTS_FILE, mtp)


def _build(out: Path, kind: str, seed: int, mtp_alpha: float | None) -> None:
    tokenizer = build_tokenizer()
    ids = token_ids(tokenizer)
    vocab_size = len(tokenizer)
    save_tokenizer(tokenizer, out)

    if kind in ("dense", "dense-long"):
        config = dense_config(vocab_size, ids["<|im_end|>"])
        weights = _dense_weights(config, seed)
        if kind == "dense-long":
            config["max_position_embeddings"] = LONG_CONTEXT
    else:
        config = vlm_config(vocab_size, ids)
        weights = _vlm_weights(config, seed)
        if kind == "hybrid-mtp":
            mtp = _mtp_weights(config["text_config"], seed)
            if mtp_alpha is not None:
                _align(weights, mtp, mtp_alpha)
            weights.update({f"mtp.{key}": value for key, value in mtp.items()})
        elif kind == "hybrid-companion" and mtp_alpha is not None:
            _align_target(weights, mtp_alpha)  # the head, aligned alike, is written separately
        _write_json(out / "preprocessor_config.json", preprocessor_config(config["vision_config"]))

    _write_json(out / "config.json", config)
    _save_weights(out / WEIGHTS_FILE, weights)


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed MLX's global generator for model init.

    MLX cannot put a saved state back, so on exit the generator is re-seeded from a
    number drawn from it on entry: the caller's stream still depends only on its own seed.
    """
    import mlx.core as mx

    resume = int(cast(int, mx.random.randint(0, 2**31 - 1, ()).item()))
    mx.random.seed(seed)
    try:
        yield
    finally:
        mx.random.seed(resume)


def _init_params(make_model: Any, seed: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    with _seeded(seed):
        model = make_model()
        params = dict(tree_flatten(model.parameters()))
        mx.eval(params)
    return params


def _dense_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    from mlx_lm.models import qwen3

    return _init_params(lambda: qwen3.Model(qwen3.ModelArgs.from_dict(config)), seed)


def _vlm_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    from mlx_vlm.models import qwen3_5

    return _init_params(lambda: qwen3_5.Model(qwen3_5.ModelConfig.from_dict(config)), seed)


def _mtp_weights(text: dict[str, Any], seed: int) -> dict[str, Any]:
    from mlx_vlm.speculative.drafters import qwen3_5_mtp

    head_config = {"model_type": "qwen3_5_mtp", "text_config": text, "block_size": MTP_BLOCK_SIZE}
    # A different stream from the target's, so the head is not a copy of target layers.
    return _init_params(lambda: qwen3_5_mtp.Model(qwen3_5_mtp.ModelConfig.from_dict(head_config)), seed + 1)


def _align(target: dict[str, Any], mtp: dict[str, Any], alpha: float) -> None:
    """Make the MTP head agree with the target, more so as ``alpha`` goes to 0.

    The target's residual branches (``out_proj``/``o_proj``/``down_proj``) are scaled by
    ``alpha``, so at 0 its next token depends on the current token only, through the
    untied ``lm_head``. The head's ``fc`` keeps just the token embedding (``[I | 0]``) and
    its layer adds nothing (``o_proj``/``down_proj`` zeroed), so it predicts the same.
    """
    _align_target(target, alpha)
    _align_head(mtp)


def _align_target(target: dict[str, Any], alpha: float) -> None:
    for key, value in target.items():
        if key.startswith("language_model.model.layers.") and key.endswith(
            ("out_proj.weight", "o_proj.weight", "down_proj.weight")
        ):
            target[key] = value * alpha


def _align_head(mtp: dict[str, Any]) -> None:
    import mlx.core as mx

    hidden = mtp["fc.weight"].shape[0]
    mtp["fc.weight"] = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)
    for key, value in mtp.items():
        if key.startswith("layers.") and key.endswith(("o_proj.weight", "down_proj.weight")):
            mtp[key] = mx.zeros_like(value)


def _save_weights(file: Path, weights: dict[str, Any]) -> None:
    import mlx.core as mx

    weights = {key: weights[key].astype(mx.float32) for key in sorted(weights)}
    mx.eval(weights)
    mx.save_safetensors(str(file), weights, metadata={"format": "mlx"})


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
