"""What a model needs and what the machine has: the numbers ``serve``'s memory check compares.

A model's need is estimated before it is loaded, from its files alone:

- **weights**: the bytes of its ``*.safetensors`` files (what loading maps into memory);
- **KV reserve**: bytes per token of its attention cache (``2 x attention layers x KV heads x
  head dim x dtype bytes``, read from ``config.json``) times the tokens its batch may hold
  (``max_batch_size`` rows of ``min(context length, kv_tokens_per_row)`` tokens).

The machine's memory is the accelerator's working set as the prefix cache reads it
(``engine.prefix_cache.working_set``: Metal's recommended working set of unified memory, a CUDA
device's memory, else physical RAM) and the memory available now (``psutil``, else
``/proc/meminfo``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

DEFAULT_KV_TOKENS_PER_ROW: Final = 4096
"""Tokens per batch row the KV reserve counts (fewer when the model's context is shorter)."""

_FULL_PRECISION: Final = frozenset({"float32", "fp32"})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS: Final = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}


@dataclass(frozen=True, slots=True)
class Footprint:
    """A model's estimated resident bytes: ``weights_bytes + kv_bytes``."""

    weights_bytes: int
    kv_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes

    def to_dict(self) -> dict[str, int]:
        return {"weights_bytes": self.weights_bytes, "kv_bytes": self.kv_bytes, "total_bytes": self.total_bytes}


@dataclass(frozen=True, slots=True)
class MachineMemory:
    """``working_set_bytes``: what the models may use at most; ``available_bytes``: free now."""

    working_set_bytes: int | None
    available_bytes: int | None
    source: str

    def to_dict(self) -> dict[str, int | str | None]:
        return {
            "working_set_bytes": self.working_set_bytes,
            "available_bytes": self.available_bytes,
            "source": self.source,
        }


def parse_byte_size(text: str) -> int:
    """``"8GiB"``, ``"512MiB"``, ``"2G"``, ``"1.5gb"``, ``"1000000"`` → bytes (``KiB``/``MiB``/``GiB``/
    ``TiB`` are powers of 1024, ``K``/``M``/``G``/``T`` of 1000). ``ValueError`` names the text."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size (examples: 8GiB, 512MiB, 2000000000)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    scale = 1024 ** ("kmgt".index(unit[0]) + 1) if "i" in unit else _UNITS[unit[:1]]
    value = number * scale
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{text!r} is not a positive size")
    return int(value)


def estimate_footprint(
    path: Path, *, max_batch_size: int, kv_tokens_per_row: int = DEFAULT_KV_TOKENS_PER_ROW
) -> Footprint:
    """The estimate for the checkpoint directory ``path`` (no file is loaded; missing files count 0)."""
    weights = 0
    if path.is_dir():
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors") if f.is_file())
    config = _read_config(path / "config.json")
    per_token = kv_bytes_per_token(config)
    context = _text_setting(config, "max_position_embeddings") or kv_tokens_per_row
    return Footprint(weights, per_token * max(1, max_batch_size) * min(context, kv_tokens_per_row))


def kv_bytes_per_token(config: dict[str, object]) -> int:
    """Bytes one token adds to the attention cache (0 when the config does not say)."""
    text = config.get("text_config")
    source = text if isinstance(text, dict) and text.get("num_hidden_layers") else config
    layers = _int(source.get("num_hidden_layers"))
    heads = _int(source.get("num_attention_heads"))
    kv_heads = _int(source.get("num_key_value_heads")) or heads
    head_dim = _int(source.get("head_dim")) or (_int(source.get("hidden_size")) // heads if heads else 0)
    layer_types = source.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        # Hybrid models: linear-attention layers keep a fixed-size state, not a per-token cache.
        layers = sum(1 for kind in layer_types if isinstance(kind, str) and "linear" not in kind)
    dtype = str(source.get("torch_dtype") or source.get("dtype") or config.get("torch_dtype") or "").lower()
    width = 4 if dtype in _FULL_PRECISION else 2
    return 2 * layers * kv_heads * head_dim * width


def machine_memory() -> MachineMemory:
    """The working set (``engine.prefix_cache.working_set``) and the memory available now."""
    from ..engine.api import working_set

    total, source = working_set()
    return MachineMemory(total, available_memory(), source)


def available_memory() -> int | None:
    """Bytes the OS could give now: ``psutil``'s ``available``, else ``/proc/meminfo``'s ``MemAvailable``."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - psutil missing or unsupported here: try the next source
        pass
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_config(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _text_setting(config: dict[str, object], name: str) -> int:
    text = config.get("text_config")
    for source in (config, text if isinstance(text, dict) else {}):
        value = _int(source.get(name))
        if value:
            return value
    return 0


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
