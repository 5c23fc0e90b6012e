"""One matmul for a layer's query/key/value projections and one for its MLP's gate/up
projections (``EngineConfig.fused_projections``), in the model the text lane steps.

Why: at 16-64 rows a decode step on MLX's CUDA backend is bound by the host, which builds and
encodes every kernel of every layer; matrix products took 28-33% of that host time on the H200
(``docs/benchmarks.md``). A transformer layer runs seven of them; stacking the projections that
read the same input leaves four, as serving engines stack them (vLLM's ``QKVParallelLinear``).

How: the layer's own ``__call__`` is left as upstream wrote it. Its ``q_proj``, ``k_proj`` and
``v_proj`` (``gate_proj`` and ``up_proj``) become parts of one stacked linear layer, whose
weights are the originals concatenated along the output axis. The first part called computes
the stacked product and splits it; the other parts hand out their slice while they are called
with the same input array. A part called with another input computes its own slice alone, so
any call order stays right. Once every part has been taken the split drops its references, so
no activation outlives its layer. The split holds state between a layer's calls, so one thread
steps a fused model at a time (the engine's worker does).

Which modules: any module with all the named projections, each an ``nn.Linear`` (or each an
``nn.QuantizedLinear`` of one quantisation) over the same input width, with or without bias
alike. Anything else (LoRA layers, mixed types) is left unfused.

Memory: the stacked weights replace the originals in the fused model; ``fuse`` returns the
originals' names with row views of the stacked arrays, so a second model holding the same
arrays (the resident mlx-vlm model the text lane's twin shares weights with) can take the views
and the originals are freed: the weights stay in memory once.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import mlx.core as mx
import mlx.nn

nn: Any = mlx.nn  # mlx.nn ships no type information mypy can read

__all__ = ["GROUPS", "fuse", "fuse_text_model", "share_views"]

log = logging.getLogger(__name__)

# (stacked name, the projections it stacks), tried on every module of the model.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("gate_up_proj", ("gate_proj", "up_proj")),
)


class _Split:
    """The stacked product of one input, handed out part by part."""

    def __init__(self, stacked: Any, sizes: list[int]) -> None:
        self.stacked = stacked
        self.bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self._input: mx.array | None = None
        self._outputs: list[mx.array] = []
        self._left: set[int] = set()

    def part(self, x: mx.array, index: int) -> mx.array:
        if x is not self._input or index not in self._left:
            if self._left and x is self._input:
                return self.alone(x, index)  # a part taken twice for one input
            self._input = x
            self._outputs = list(mx.split(self.stacked(x), self.bounds[1:-1], axis=-1))
            self._left = set(range(len(self._outputs)))
        self._left.discard(index)
        out = self._outputs[index]
        if not self._left:
            self._input, self._outputs = None, []
        return out

    def alone(self, x: mx.array, index: int) -> mx.array:
        """Part ``index`` of ``x`` from its own rows of the stacked weights."""
        lo, hi = self.bounds[index], self.bounds[index + 1]
        out: mx.array = _rows(self.stacked, lo, hi)(x)
        return out


class _Part:
    """Stands where one projection was: ``q_proj(x)`` etc., served by the shared split."""

    def __init__(self, split: _Split, index: int) -> None:
        self.split, self.index = split, index

    def __call__(self, x: mx.array) -> mx.array:
        return self.split.part(x, self.index)


def _arrays(layer: Any) -> dict[str, mx.array]:
    return {k: v for k, v in layer.items() if isinstance(v, mx.array)}


def _stackable(layers: list[Any]) -> bool:
    kind = type(layers[0])
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(layer) is not kind for layer in layers):
        return False
    first = _arrays(layers[0])
    for layer in layers[1:]:
        arrays = _arrays(layer)
        if arrays.keys() != first.keys():
            return False
        if any(arrays[k].shape[1:] != first[k].shape[1:] or arrays[k].dtype != first[k].dtype for k in first):
            return False
    if kind is nn.QuantizedLinear:
        settings = {(layer.group_size, layer.bits, layer.mode) for layer in layers}
        return len(settings) == 1
    return True


def _stack(layers: list[Any]) -> Any:
    """A layer of the same type whose output rows are the layers' rows in order."""
    stacked = copy.copy(layers[0])
    for name in _arrays(layers[0]):
        stacked[name] = mx.concatenate([layer[name] for layer in layers], axis=0)
    return stacked


def _rows(stacked: Any, lo: int, hi: int) -> Any:
    view = copy.copy(stacked)
    for name, value in _arrays(stacked).items():
        view[name] = value[lo:hi]
    return view


def fuse(model: Any) -> dict[str, tuple[mx.array, mx.array]]:
    """Stack the projections of every module of ``model`` that ``GROUPS`` names, in place.

    Returns, for each projection parameter replaced, its name in ``model``'s parameter tree
    with the original array and a view of the stacked array holding it (``share_views``). A
    model already fused has nothing left to stack and returns {}."""
    views: dict[str, tuple[mx.array, mx.array]] = {}
    for path, module in model.named_modules():
        for stacked_name, names in GROUPS:
            if not all(isinstance(module.get(n), nn.Module) for n in names):
                continue
            layers = [module[n] for n in names]
            if not _stackable(layers):
                continue
            stacked = _stack(layers)
            mx.eval(stacked.parameters())
            sizes = [int(layer["weight"].shape[0]) for layer in layers]
            split = _Split(stacked, sizes)
            setattr(module, stacked_name, stacked)
            prefix = f"{path}." if path else ""
            for index, name in enumerate(names):
                rows = _rows(stacked, split.bounds[index], split.bounds[index + 1])
                for param, view in _arrays(rows).items():
                    views[f"{prefix}{name}.{param}"] = (layers[index][param], view)
                setattr(module, name, _Part(split, index))  # drops the module's entry
    mx.eval([view for _, view in views.values()])
    return views


def share_views(model: Any, views: dict[str, tuple[mx.array, mx.array]]) -> int:
    """Point ``model``'s parameters named in ``views`` at their views, in place, where the name
    still holds the very original array ``fuse`` stacked: for a second model that shares the
    fused one's arrays. Returns how many it took."""
    from mlx.utils import tree_flatten

    current = dict(tree_flatten(model.parameters()))
    taken = 0
    for name, (original, view) in views.items():
        if current.get(name) is not original:
            continue
        *path, last = name.split(".")
        node: Any = model
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = view
        taken += 1
    return taken


def fuse_text_model(language_model: Any, resident: Any) -> None:
    """Fuse the text lane's model (mlx-lm's twin of ``resident``, holding its arrays) and hand
    ``resident`` the views, so the originals are freed."""
    views = fuse(language_model)
    owner = getattr(resident, "language_model", resident)
    shared = share_views(owner, views) if owner is not language_model else len(views)
    log.info("fused projections: %d projection arrays stacked, %d shared with the resident model", len(views), shared)
