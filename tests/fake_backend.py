"""A backend with no model behind it, for testing the engine's loop (no MLX here).

Each row's tokens are a function of its prompt and position (``token_at``), so every test
knows what a request must receive whatever lane it ran on or moved between. A row prefills
for ``prefill_steps`` steps (one observation each) before its first token. ``FakeLanes`` is
the engine's ``backend_factory``: it builds a ``FakeSingle`` (hands its decoding row off) or
a ``FakeBatch`` (adopts one) for each new group, counts the steps of all of them, and raises
``fail_with`` on step ``fail_at``. ``FakeModel`` stands in for ``LoadedModel``: letters for
tokens, ``EOS`` ends a row.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from abstractruntime_mlx.engine.backends.rows import DecodingRow, LaneName, PrefillRow, RowInput, StepResult, TokenEvent
from abstractruntime_mlx.engine.core.loop import Engine, EngineConfig
from abstractruntime_mlx.engine.core.request import EngineRequest
from abstractruntime_mlx.engine.core.scheduler import NewGroup
from abstractruntime_mlx.engine.model.model import LoadedModel, Upstream

LETTERS = "abcdefghijklmnopqrstuvwxyz"
EOS = len(LETTERS)  # no text; a row whose next token is EOS stops


def token_at(prompt_ids: list[int], position: int) -> int:
    """The token a row of ``prompt_ids`` generates at ``position`` (0: its first)."""
    return (prompt_ids[-1] + position) % len(LETTERS)


def expected_tokens(prompt_ids: list[int], n: int) -> list[int]:
    return [token_at(prompt_ids, i) for i in range(n)]


def text_of(tokens: list[int]) -> str:
    return "".join(LETTERS[t] for t in tokens if t != EOS)


@dataclass(slots=True)
class FakeRow:
    uid: int
    prompt_ids: list[int]
    max_tokens: int
    prefill_left: int
    prefill_steps: int
    num_tokens: int = 0
    eos_at: int | None = None  # the position at which this row generates EOS

    @property
    def prefilling(self) -> bool:
        return self.prefill_left > 0


class FakeBackend:
    """What every backend does (``backend.Backend``), on ``FakeRow``s."""

    def __init__(self, lanes: FakeLanes, kind: LaneName, max_batch_size: int) -> None:
        self.lanes = lanes
        self.kind = kind
        self.reports_logprobs = False
        self.max_batch_size = max_batch_size
        self.rows: dict[int, FakeRow] = {}  # in insertion order
        self.uids: set[int] = set()  # held slots: rows until the engine forgets or removes them
        self.removed: list[int] = []
        self.closed = False

    def insert(self, row: RowInput) -> int:
        uid = next(self.lanes.uids)
        steps = self.lanes.prefill_steps
        eos_at = self.lanes.eos_at.get(tuple(row.prompt_ids))
        self.rows[uid] = FakeRow(uid, list(row.prompt_ids), row.max_tokens, steps, steps, eos_at=eos_at)
        self.uids.add(uid)
        return uid

    def free_slots(self) -> int:
        return self.max_batch_size - len(self.uids)

    def remove(self, uid: int) -> bool:
        """As upstream's batch: a row cannot be dropped mid multi-row prefill (``pin_prefill``)."""
        row = self.rows.get(uid)
        if row is not None and row.prefilling and self.lanes.pin_prefill:
            return False
        self.rows.pop(uid, None)
        self.uids.discard(uid)
        self.removed.append(uid)
        return True

    def forget(self, uid: int) -> None:
        self.uids.discard(uid)

    @property
    def prefilling(self) -> bool:
        return any(row.prefilling for row in self.rows.values())

    def step(self, *, observe_prefill: bool) -> StepResult:
        self.lanes.count_step()
        result = StepResult(batch_uids=set(self.rows))
        for uid, row in list(self.rows.items()):
            if row.prefilling:
                row.prefill_left -= 1
                if observe_prefill:
                    done = len(row.prompt_ids) * (row.prefill_steps - row.prefill_left) // row.prefill_steps
                    result.prefill[uid] = PrefillRow(
                        processed=min(done, len(row.prompt_ids) - 1), total=len(row.prompt_ids), cached=0
                    )
                continue
            if row.num_tokens == 0:
                result.prompt_done[uid] = 0
            result.tokens.append(self._next_token(row))
        return result

    def _next_token(self, row: FakeRow) -> TokenEvent:
        position = row.num_tokens
        row.num_tokens += 1
        if position == row.eos_at:
            token, reason = EOS, "stop"
        else:
            token = token_at(row.prompt_ids, position)
            reason = "length" if row.num_tokens >= row.max_tokens else None
        if reason is not None:
            self.rows.pop(row.uid)  # upstream ends the row; the engine forgets it
        return TokenEvent(row.uid, token, reason)

    def close(self) -> None:
        self.closed = True
        self.rows.clear()
        self.uids.clear()


class FakeSingle(FakeBackend):
    """The single lane: one row, which moves into a batch once it decodes (``HandsOff``)."""

    @property
    def can_hand_off(self) -> bool:
        return any(row.num_tokens > 0 for row in self.rows.values())

    def detach(self) -> tuple[int, DecodingRow]:
        ((uid, row),) = self.rows.items()
        self.rows.clear()
        self.uids.clear()
        # The fake row rides in the cache; there is no token in flight to carry.
        return uid, DecodingRow(
            cache=[row], next_token=cast(Any, None), num_tokens=row.num_tokens, max_tokens=row.max_tokens, row=None
        )


class FakeBatch(FakeBackend):
    """A batch that adopts a decoding row as is (``Adopts``)."""

    def adopt(self, moving: DecodingRow) -> int:
        (row,) = moving.cache
        uid = next(self.lanes.uids)
        row.uid = uid
        self.rows[uid] = row
        self.uids.add(uid)
        return uid


@dataclass
class FakeLanes:
    """The engine's ``backend_factory``: a fake backend for each group the scheduler starts."""

    prefill_steps: int = 0
    pin_prefill: bool = False
    fail_at: int | None = None  # the engine's step (1-based, over every backend) that raises
    fail_with: BaseException = field(default_factory=lambda: RuntimeError("simulated step failure"))
    eos_at: dict[tuple[int, ...], int] = field(default_factory=dict)  # prompt -> EOS position
    built: list[FakeBackend] = field(default_factory=list)
    num_steps: int = 0
    uids: itertools.count[int] = field(default_factory=itertools.count)
    model_lanes: frozenset[LaneName] = frozenset({LaneName.SINGLE, LaneName.TEXT, LaneName.BATCH})

    def build(self, new: NewGroup, head: EngineRequest | None) -> FakeBackend:
        cls = FakeSingle if new.lane == LaneName.SINGLE else FakeBatch
        backend = cls(self, new.lane, new.max_batch_size)
        self.built.append(backend)
        return backend

    def count_step(self) -> None:
        self.num_steps += 1
        if self.num_steps == self.fail_at:
            raise self.fail_with

    @property
    def kinds(self) -> list[LaneName]:
        return [backend.kind for backend in self.built]


class FakeDetokenizer:
    def __init__(self) -> None:
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = text_of([token])

    def finalize(self) -> None:
        self.last_segment = ""


@dataclass
class FakeModel:
    """What the engine reads of a ``LoadedModel``: its lane, its model (a plain stack of
    layers, so the single and text lanes take its rows), the end-of-sequence ids, a
    detokenizer per request and the check at the door."""

    lane: Upstream = Upstream.NATIVE
    model: Any = field(default_factory=lambda: SimpleNamespace(layers=()))
    eos_token_ids: frozenset[int] = frozenset({EOS})
    drafter: Any = None

    def new_detokenizer(self) -> FakeDetokenizer:
        return FakeDetokenizer()

    def check_request(
        self, *, prompt_tokens: int, max_tokens: int, logit_bias: tuple[tuple[int, float], ...] = ()
    ) -> None:
        pass


def fake_engine(lanes: FakeLanes | None = None, **config: Any) -> Engine:
    """An engine over ``FakeModel`` whose groups run on ``lanes``; not started."""
    return Engine(lambda: cast(LoadedModel, FakeModel()), EngineConfig(**config), backend_factory=lanes or FakeLanes())
