"""Where a request runs: one table of lanes. Plain data, no MLX.

Each ``LaneSpec`` says what rows a lane admits (a predicate over the group's mode, its first
requests and which lanes are open), how its backend is built (a builder over
``LaneBuilders``, which ``lane_factory.LaneFactory`` implements), which lane it adopts a
decoding row from (the hand-off), and what ``execution.path`` its rows report.
``choose_lane`` takes the first lane of ``LANES`` that admits a new group; the scheduler asks
it, and the factory builds what the table names. ``docs/architecture.md`` holds the same
table (``tests/test_lanes.py`` keeps the two equal).

A lane is not an ``ExecutionMode``: the mode says how a group shares its lane (continuous,
cohort, exclusive), the lane which loop runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..backends.rows import LaneName
from .request import DecodePath, EngineRequest, ExecutionMode


@dataclass(frozen=True, slots=True)
class LaneContext:
    """What admission reads besides the rows: the lanes open for the loaded model (its own
    and the engine's options), and whether keyed rows use a resident prefix cache."""

    open: frozenset[LaneName]
    prefix_cache: bool = False  # a prefix cache is resident (keyed requests use it)
    # The single and text lanes restore and store keyed rows' prefixes (a model whose prefixes
    # are shared as blocks: a plain KV cache per layer; from RAM or the SSD tier).
    lanes_restore: bool = False


class LaneBuilders(Protocol):
    """Builds each lane's backend (``lane_factory.LaneFactory``). ``new`` is the
    ``scheduler.NewGroup`` and the result a ``backend.Backend``; typed loosely here so that
    this table imports neither the scheduler nor MLX."""

    def serial(self, new: Any, head: EngineRequest | None) -> Any: ...
    def in_process(self, new: Any, head: EngineRequest | None) -> Any: ...
    def single(self, new: Any, head: EngineRequest | None) -> Any: ...
    def text(self, new: Any, head: EngineRequest | None) -> Any: ...
    def batch(self, new: Any, head: EngineRequest | None) -> Any: ...


Admits = Callable[[ExecutionMode, Sequence[EngineRequest], LaneContext], bool]
Builder = Callable[[LaneBuilders, Any, "EngineRequest | None"], Any]


@dataclass(frozen=True, slots=True)
class LaneSpec:
    name: LaneName
    admits: Admits  # a new group of these requests, in this mode, runs here
    build: Builder
    backend: str  # the class ``build`` returns (what the docs' table names)
    path: DecodePath  # what its rows report as ``execution.path``
    adopts_from: LaneName | None = None  # takes a decoding row from this lane as is (the hand-off)

    @property
    def adopted_path(self) -> DecodePath | None:
        """What a row this lane adopted reports."""
        return DecodePath.SINGLE_THEN_BATCH if self.adopts_from is not None else None


def text_lane_row(request: EngineRequest, *, keyed: bool) -> bool:
    """A row the text lane can run as mlx-vlm's loop would: text; a prefix-cache key only where
    the lane restores prefixes (``keyed``: ``LaneContext.lanes_restore``)."""
    return request.image_prompt is None and (request.prompt_cache_key is None or keyed)


def single_lane_row(request: EngineRequest, ctx: LaneContext) -> bool:
    """A row that can later move into a batch as is: text, no logits processors, grammar or
    logprobs (the text lane computes them, the single lane does not); a prefix-cache key only
    where the lane restores prefixes (``LaneContext.lanes_restore``)."""
    if request.image_prompt is not None or request.sampling.has_logit_processors() or request.grammar is not None:
        return False
    if request.logprobs is not None:
        return False
    return request.prompt_cache_key is None or not ctx.prefix_cache or ctx.lanes_restore


def _serial(mode: ExecutionMode, requests: Sequence[EngineRequest], ctx: LaneContext) -> bool:
    """every request, one at a time, on an mlx-lm model (`mlx_batching=False`)"""
    return LaneName.SERIAL in ctx.open


def _in_process(mode: ExecutionMode, requests: Sequence[EngineRequest], ctx: LaneContext) -> bool:
    """every request, one at a time, on mlx-vlm's in-process generation (`mlx_batching=False` with MTP)"""
    return LaneName.IN_PROCESS in ctx.open


def _single(mode: ExecutionMode, requests: Sequence[EngineRequest], ctx: LaneContext) -> bool:
    """a continuous group of one row that can move into a batch as is (`single_lane_row`)"""
    return (
        LaneName.SINGLE in ctx.open
        and mode == ExecutionMode.CONTINUOUS
        and len(requests) == 1
        and single_lane_row(requests[0], ctx)
    )


def _text(mode: ExecutionMode, requests: Sequence[EngineRequest], ctx: LaneContext) -> bool:
    """a continuous group of text rows, keyed ones where the lane restores prefixes (`text_lane_row`)"""
    return (
        LaneName.TEXT in ctx.open
        and mode == ExecutionMode.CONTINUOUS
        and all(text_lane_row(r, keyed=ctx.lanes_restore) for r in requests)
    )


def _batch(mode: ExecutionMode, requests: Sequence[EngineRequest], ctx: LaneContext) -> bool:
    """every other group: images, prefix-cache keys on hybrid models, MTP cohorts, exclusive requests"""
    return True


# In order: a new group runs on the first lane that admits it.
LANES: dict[LaneName, LaneSpec] = {
    spec.name: spec
    for spec in (
        LaneSpec(
            LaneName.SERIAL, _serial, lambda b, new, head: b.serial(new, head), "SerialBackend", DecodePath.SERIAL
        ),
        LaneSpec(
            LaneName.IN_PROCESS,
            _in_process,
            lambda b, new, head: b.in_process(new, head),
            "InProcessBackend",
            DecodePath.SERIAL,
        ),
        LaneSpec(
            LaneName.SINGLE, _single, lambda b, new, head: b.single(new, head), "SingleBackend", DecodePath.SINGLE
        ),
        LaneSpec(
            LaneName.TEXT,
            _text,
            lambda b, new, head: b.text(new, head),
            "TextLoopBackend",
            DecodePath.TEXT_BATCH,
            LaneName.SINGLE,
        ),
        LaneSpec(
            LaneName.BATCH,
            _batch,
            lambda b, new, head: b.batch(new, head),
            "BatchBackend",
            DecodePath.BATCH,
            LaneName.SINGLE,
        ),
    )
}

# The lanes that run one request at a time: a group there is always exclusive, of one.
ONE_AT_A_TIME = frozenset({LaneName.SERIAL, LaneName.IN_PROCESS})


def choose_lane(mode: ExecutionMode, requests: Sequence[EngineRequest], ctx: LaneContext) -> LaneName:
    """The first lane of ``LANES`` that admits a new group of ``requests`` in ``mode``."""
    for spec in LANES.values():
        if spec.admits(mode, requests, ctx):
            return spec.name
    raise AssertionError("the batch lane admits every group")  # pragma: no cover


def one_at_a_time_lane(ctx: LaneContext) -> LaneName | None:
    """The loaded model's one-at-a-time lane, when it has one (then every request runs there)."""
    for name in ONE_AT_A_TIME:
        if name in ctx.open:
            return name
    return None
