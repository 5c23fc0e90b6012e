"""First-seen forward input shapes: how many (batch, length) pairs a benchmark point met for the
first time in this process.

MLX's CUDA backend pays a per-shape setup the first time a forward runs at a (width, length)
pair (about 60-130 ms on the H200 for a 4B model, against ~30 ms for the same forward again),
so a serving loop that forms batches of new shapes pays it on every new pair. ``ShapeLog``
wraps the ``__call__`` of the checkpoint's language-model classes (mlx-lm's ``Model`` and
mlx-vlm's ``LanguageModel``: every target here calls one of them) and records the (batch,
length) of each call's input in one process-wide set; a ``window`` counts what was new while
it was open. A length above 1 is a prefill (or a chunk of one); a length of 1 is a decode step.

    log = ShapeLog()
    log.watch(path)              # before or after the targets load: the classes are patched
    with log.window() as seen:   # one target at one point
        ...
    seen.new_prefill, seen.new_decode, seen.used
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Shape = tuple[int, int]


@dataclass
class Window:
    """The shapes one window met: all of them, and those first seen in the process."""

    used: set[Shape] = field(default_factory=set)
    new: set[Shape] = field(default_factory=set)
    prefill_calls: int = 0  # forwards over more than one position per row
    decode_calls: int = 0  # forwards over one position per row (decode steps)

    @property
    def new_prefill(self) -> int:
        return sum(1 for _, length in self.new if length > 1)

    @property
    def new_decode(self) -> int:
        return sum(1 for _, length in self.new if length == 1)

    def add(self, other: Window) -> Window:
        return Window(
            self.used | other.used,
            self.new | other.new,
            self.prefill_calls + other.prefill_calls,
            self.decode_calls + other.decode_calls,
        )


class ShapeLog:
    """One process-wide set of forward input shapes, fed by wrapped model classes."""

    def __init__(self) -> None:
        self.seen: set[Shape] = set()
        self._open: list[Window] = []
        self._lock = threading.Lock()
        self._patched: dict[type[Any], Callable[..., Any]] = {}

    def record(self, shape: Shape) -> None:
        with self._lock:
            first = shape not in self.seen
            if first:
                self.seen.add(shape)
            for window in self._open:
                window.used.add(shape)
                if shape[1] > 1:
                    window.prefill_calls += 1
                else:
                    window.decode_calls += 1
                if first:
                    window.new.add(shape)

    @contextlib.contextmanager
    def window(self) -> Iterator[Window]:
        seen = Window()
        with self._lock:
            self._open.append(seen)
        try:
            yield seen
        finally:
            with self._lock:
                self._open.remove(seen)

    def watch(self, path: Path) -> list[str]:
        """Wrap the language-model classes that load ``path``; returns their names."""
        names = []
        for cls in _model_classes(path):
            if cls not in self._patched:
                self._patched[cls] = cls.__call__
                cls.__call__ = _recording(cls.__call__, self)
            names.append(f"{cls.__module__}.{cls.__qualname__}")
        return names

    def unwatch(self) -> None:
        for cls, original in self._patched.items():
            cls.__call__ = original
        self._patched.clear()


def _recording(call: Callable[..., Any], log: ShapeLog) -> Callable[..., Any]:
    @functools.wraps(call)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        shape = input_shape(args, kwargs)
        if shape is not None:
            log.record(shape)
        return call(self, *args, **kwargs)

    return wrapper


def input_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shape | None:
    """(batch, length) of a language model's input: token ids (B, L) or embeddings (B, L, D)."""
    inputs = args[0] if args else kwargs.get("inputs")
    if inputs is None:
        inputs = kwargs.get("input_embeddings", kwargs.get("inputs_embeds"))
    shape = getattr(inputs, "shape", None)
    if shape is None or len(shape) < 2:
        return None
    return int(shape[0]), int(shape[1])


def _model_classes(path: Path) -> list[type[Any]]:
    """mlx-lm's model class and mlx-vlm's language-model class for the checkpoint at ``path``."""
    config = json.loads((Path(path) / "config.json").read_text())
    classes: list[type[Any]] = []
    with contextlib.suppress(Exception):
        from mlx_lm.utils import _get_classes

        classes.append(_get_classes(config)[0])
    with contextlib.suppress(Exception):
        from mlx_vlm.utils import get_model_and_args

        module, _ = get_model_and_args(config)
        classes.append(_vlm_language_model(module))
    return classes


def _vlm_language_model(module: Any) -> type[Any]:
    """mlx-vlm's language-model class (what its ``BatchGenerator`` calls), else its ``Model``."""
    for name in (module.__name__, module.Model.__module__, f"{module.__name__}.language"):
        with contextlib.suppress(ImportError):
            found = getattr(importlib.import_module(name), "LanguageModel", None)
            if isinstance(found, type):
                return found
    outer: type[Any] = module.Model
    return outer
