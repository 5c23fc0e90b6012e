"""What the loop and a backend exchange: the ``Backend`` protocol, the capabilities only some
backends have (asked with ``isinstance``), and the plain rows that cross it.

No MLX here (arrays and processors are named for the type checker only), so a backend can be
faked without loading MLX (``tests/fake_backend.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

from ...controls import Sampling

if TYPE_CHECKING:
    import mlx.core as mx

    from ..cache.prefix_cache import SerialStore
    from ..model.grammar import GrammarProcessor
    from .keyed_prefix import KeyedPrefix

# Prompt tokens per prefill chunk on the batched lanes, unless told (``EngineConfig.prefill_step_size``).
PREFILL_STEP_SIZE: Final = 256


class LaneName(StrEnum):
    """Where a group runs: one row of ``lanes.LANES`` each, and the ``kind`` of its backend."""

    SERIAL = "serial"  # mlx-lm, one request at a time (``mlx_batching=False``)
    IN_PROCESS = "in_process"  # mlx-vlm's in-process generation, one at a time, MTP included
    SINGLE = "single"  # one row on a plain KV cache; a compatible arrival moves it into a batch
    TEXT = "text"  # the text lane's own loop, plain text rows
    BATCH = "batch"  # mlx-vlm's batch generator: everything else


@dataclass(frozen=True, slots=True)
class SampledLogprob:
    """The drawn token of one position, its log-probability and the ``top`` most likely
    tokens there (``(token_id, logprob)``, most likely first), all read from the distribution
    the row was sampled from: the model's log-softmax after the row's logits processors
    (penalties, bias, grammar), before temperature and truncation (top-k / top-p / min-p).
    ``text``: the token's share of the answer's text, the streaming detokenizer's segment for
    it (set by the engine; the shares of an answer's tokens concatenate to its text)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    text: str | None = None


@dataclass(slots=True)
class TokenEvent:
    uid: int
    token: int
    finish_reason: str | None
    logprob: SampledLogprob | None = None  # only for a row that asked (``RowInput.logprobs``)


@dataclass(slots=True)
class PrefillRow:
    processed: int
    total: int
    cached: int


@dataclass(slots=True)
class StepResult:
    tokens: list[TokenEvent] = field(default_factory=list)
    prompt_done: dict[int, int] = field(default_factory=dict)  # uid -> cached tokens
    prefill: dict[int, PrefillRow] = field(default_factory=dict)
    batch_uids: set[int] = field(default_factory=set)


@dataclass(slots=True)
class DecodingRow:
    """A row that decoded alone (``single.SingleBackend.detach``), for ``BatchBackend.adopt``:
    its cache holds the prompt and every token delivered; ``next_token`` (in flight) is the
    next one to deliver."""

    cache: list[Any]
    next_token: mx.array
    num_tokens: int
    max_tokens: int
    row: Any  # its ``sampling.RowStream`` (None: greedy); not imported: sampling imports these types
    # A keyed row's prefix (its blocks stored already), kept resident for its key when it ends,
    # and the tokens its cache holds (the prompt, then each token delivered).
    keyed: KeyedPrefix | None = None
    tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PrefixReuse:
    """How a keyed row reuses stored prefixes: blocks (or snapshots) are keyed by its tokens
    and ``salt``; ``serial`` is the serialized lane's snapshot store (None elsewhere, where the
    generator's prefix-cache manager holds the blocks)."""

    salt: int
    serial: SerialStore | None = None
    # The request's ``prompt_cache_key``: the single lane keeps a finished row's KV resident
    # for it and starts the key's next row from it (``cache.resident.ResidentKV``).
    key: str | None = None


@dataclass(frozen=True, slots=True)
class RowInput:
    """One request's row, as every backend takes it."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    grammar: GrammarProcessor | None = None
    # The model inputs of a prompt that is more than token ids (an image prompt's embeddings
    # and positions, from the processor); None: the backend embeds ``prompt_ids`` itself.
    prompt_inputs: dict[str, Any] | None = None
    prefix: PrefixReuse | None = None
    # Token logprobs with this many alternatives per position (None: not asked); only a
    # backend whose ``reports_logprobs`` is true computes them.
    logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class RestoredPrefix:
    """A row's prompt cache restored from the prefix cache (the serialized lane's snapshots):
    it already holds the prompt's first ``prefilled`` tokens, ``cached`` of them from a stored
    snapshot (the rest were prefilled for it just now)."""

    prompt_cache: list[Any]
    prefilled: int
    cached: int


class Backend(Protocol):
    """What the engine drives, and what every backend does: ``BatchBackend`` (mlx-vlm),
    ``single.SingleBackend``, ``serial.SerialBackend`` / ``InProcessBackend``,
    ``text_loop.TextLoopBackend`` and ``text_batch.TextBatchBackend``. What only some do is
    a capability of its own below (``HandsOff``, ``Adopts``, ``Speculates``,
    ``PrefillsPartially``), asked with ``isinstance``."""

    # Which lane this is: what the scheduler plans with, its row of ``lanes.LANES``.
    kind: LaneName
    # Whether its rows' tokens carry logprobs (``RowInput.logprobs``): only the samplers that
    # see each step's distribution compute them (a speculative batch draws without it).
    reports_logprobs: bool

    def insert(self, row: RowInput) -> int: ...
    def free_slots(self) -> int: ...
    def remove(self, uid: int) -> bool:
        """Drop a row; False when upstream cannot drop it yet (mid multi-row prefill)."""
        ...

    def forget(self, uid: int) -> None:
        """The row finished on its own (stop or length): let go of what it held."""
        ...

    @property
    def prefilling(self) -> bool:
        """A prompt is mid-prefill (its prefix-cache blocks are leased until it ends)."""
        ...

    def step(self, *, observe_prefill: bool) -> StepResult: ...
    def close(self) -> None: ...


@runtime_checkable
class HandsOff(Protocol):
    """A lane whose one decoding row can move into a batch as is (the single lane's)."""

    @property
    def can_hand_off(self) -> bool:
        """Its row decodes, its next token in flight: it can move now."""
        ...

    def detach(self) -> tuple[int, DecodingRow]:
        """Give up the decoding row (only while ``can_hand_off``); the lane is empty afterwards."""
        ...


@runtime_checkable
class Adopts(Protocol):
    """A batch that takes a row another lane decoded (``HandsOff.detach``), its cache as is."""

    def adopt(self, row: DecodingRow) -> int: ...


@runtime_checkable
class Speculates(Protocol):
    """A lane that may draft with an MTP head and counts its rounds."""

    def speculation_counters(self) -> tuple[int, float, int] | None:
        """The drafter's lifetime (rounds, accepted, drafted) counters, or None without one."""
        ...


@runtime_checkable
class PrefillsPartially(Protocol):
    """A batch that must be told to admit a late prompt while its other rows decode."""

    def allow_partial_prefill(self) -> None: ...


def speculation_counters(backend: Backend) -> tuple[int, float, int] | None:
    """``backend``'s MTP counters; None for a lane that never drafts."""
    return backend.speculation_counters() if isinstance(backend, Speculates) else None


@dataclass(slots=True)
class Drafter:
    model: Any
    kind: str = "mtp"
