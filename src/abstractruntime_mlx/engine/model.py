"""Loading a target (and its MTP head) once, for whichever lane serves it."""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ModelNotFound, UpstreamError


@dataclass(slots=True)
class LoadedModel:
    """A resident target. ``lane`` is "native" (mlx-vlm: batching, MTP, images) or "mlx_lm"."""

    path: Path
    lane: str
    model: Any
    processor: Any
    tokenizer: Any
    config: dict[str, Any]
    drafter: Any = None
    drafter_source: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    _detokenizer: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def supports_images(self) -> bool:
        return self.lane == "native" and "vision_config" in self.config

    def new_detokenizer(self) -> Any:
        """A fresh streaming detokenizer (one per request: they are stateful)."""
        detok = copy.copy(self._detokenizer)
        detok.reset()
        return detok

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def load_model(path: Path, *, lane: str, head: Path | None = None, load_drafter: bool = True) -> LoadedModel:
    config = _read_config(path)
    if lane == "mlx_lm":
        return _load_mlx_lm(path, config)
    return _load_native(path, config, head=head, load_drafter=load_drafter)


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFound(f"{path} has no config.json; it is not a model checkpoint directory")
    return json.loads(config_file.read_text())


def _load_native(path: Path, config: dict[str, Any], *, head: Path | None, load_drafter: bool) -> LoadedModel:
    import mlx_vlm

    try:
        model, processor = mlx_vlm.load(str(path))
    except Exception as exc:  # noqa: BLE001 - upstream raises plain exceptions
        raise UpstreamError(f"mlx-vlm could not load {path}: {type(exc).__name__}: {exc}") from exc
    tokenizer = processor.tokenizer if hasattr(processor, "tokenizer") else processor
    drafter, source = (None, None)
    if load_drafter:
        drafter, source = _load_drafter(path, head)
    return LoadedModel(
        path=path,
        lane="native",
        model=model,
        processor=processor,
        tokenizer=tokenizer,
        config=config,
        drafter=drafter,
        drafter_source=source,
        eos_token_ids=_eos_ids(config, tokenizer),
        _detokenizer=processor.detokenizer,
    )


def _load_drafter(path: Path, head: Path | None) -> tuple[Any, str | None]:
    """Load an embedded MTP head, or a companion head directory; (None, None) if neither."""
    from ..artifacts import detect_mtp

    source = str(head) if head is not None else None
    if head is None:
        info = detect_mtp(path)
        if not info.get("embedded"):
            return None, None
        source = str(path)
    from mlx_vlm.speculative.drafters import load_drafter

    try:
        drafter, _kind = load_drafter(source, kind="mtp")
    except Exception as exc:  # noqa: BLE001
        raise UpstreamError(f"mlx-vlm could not load the MTP head at {source}: {type(exc).__name__}: {exc}") from exc
    return drafter, source


def _load_mlx_lm(path: Path, config: dict[str, Any]) -> LoadedModel:
    import mlx_lm

    try:
        model, tokenizer = mlx_lm.load(str(path))
    except Exception as exc:  # noqa: BLE001
        raise UpstreamError(f"mlx-lm could not load {path}: {type(exc).__name__}: {exc}") from exc
    return LoadedModel(
        path=path,
        lane="mlx_lm",
        model=model,
        processor=tokenizer,
        tokenizer=tokenizer._tokenizer,
        config=config,
        eos_token_ids=frozenset(int(t) for t in tokenizer.eos_token_ids),
        _detokenizer=tokenizer._detokenizer,
    )


def _eos_ids(config: dict[str, Any], tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (config.get("eos_token_id"), config.get("text_config", {}).get("eos_token_id")):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(t) for t in source)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
