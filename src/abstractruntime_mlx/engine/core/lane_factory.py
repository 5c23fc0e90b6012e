"""Builds each lane's backend for one loaded model: what ``lanes.LANES`` names, made concrete.

``LaneFactory`` is made on the worker thread once the model is loaded. It knows which lanes the
model has (``model_lanes``, what the scheduler reads), holds the text lane's model (mlx-lm's
class for the checkpoint, built at load so that a model mlx-lm cannot build has no text lane;
fused and routed on first use), and ``build(new, head)`` returns the backend of ``new.lane``.
``Engine`` takes any ``BackendFactory`` in its place (``backend_factory=``), so loop behaviour
can be tested with a fake backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, cast

from ..backends.backend import BatchBackend
from ..backends.rows import Backend, Drafter, LaneName, PrefillRow
from ..backends.serial import InProcessBackend, SerialBackend
from ..backends.single import SingleBackend
from ..backends.text_loop import TextLoopBackend
from ..cache.prefix_cache import PrefixCache
from ..model import cuda_attention
from ..model.fused_projections import fuse_text_model
from ..model.model import LoadedModel, Upstream
from ..model.prefill_shapes import Buckets, warm
from ..model.text_model import language_model, make_cache, supports_model, upstream_kv_cache
from .config import EngineConfig
from .lanes import LANES
from .request import EngineRequest, ExecutionMode
from .scheduler import NewGroup

log = logging.getLogger(__name__)


class BackendFactory(Protocol):
    """What the engine builds a group's backend with (a hand-off builds the adopting lane's),
    and the lanes it has for the loaded model (what the scheduler plans with)."""

    @property
    def model_lanes(self) -> frozenset[LaneName]: ...

    def build(self, new: NewGroup, head: EngineRequest | None) -> Backend: ...


class LaneFactory:
    """The lanes' builders for one loaded model (``lanes.LaneBuilders``)."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        *,
        stream: Any,
        prefix_cache: PrefixCache | None,
        on_prefill: Callable[[int, PrefillRow], bool],
    ) -> None:
        self.loaded = loaded
        self.config = config
        self._stream = stream
        self._prefix_cache = prefix_cache
        self._on_prefill = on_prefill
        # Both the single and the text lane need a plain KV cache per layer and no position ids.
        plain_kv = loaded.upstream == Upstream.NATIVE and supports_model(loaded.model)
        self._text_lm: Any = language_model(loaded.path, loaded.model) if plain_kv and config.text_lane else None
        self._text_ready = False  # fused and routed (on first use)
        self.buckets: Buckets | None = None  # the text lane's prefill shapes, where bounded
        # The lanes this model has (fixed at load; the scheduler reads them every step and closes
        # those the engine's options turn off).
        self.model_lanes = _model_lanes(loaded.upstream, plain_kv=plain_kv, text=self._text_lm is not None)

    def prepare(self) -> None:
        """At load, on the worker: route CUDA attention and warm the prefill shapes (the routing
        first: the warm-up runs the shapes the way serving will)."""
        cuda_attention.enable(decode=self._fused_decode_attention(), prefill=self._prefill_attention_ops())
        self.buckets = self._warmed_buckets()

    def build(self, new: NewGroup, head: EngineRequest | None) -> Backend:
        return cast(Backend, LANES[new.lane].build(self, new, head))

    def close(self) -> None:
        self._text_lm = None  # it shares the resident weights

    # --- the builders (``lanes.LaneBuilders``) -------------------------------------------
    def serial(self, new: NewGroup, head: EngineRequest | None) -> SerialBackend:
        loaded = self.loaded
        return SerialBackend(
            loaded.model,
            loaded.processor,
            prefill_step_size=self.config.serial_prefill_step_size,
            stream=self._stream,
            on_prefill=self._on_prefill,
        )

    def in_process(self, new: NewGroup, head: EngineRequest | None) -> InProcessBackend:
        loaded = self.loaded
        return InProcessBackend(
            loaded.model,
            loaded.tokenizer,
            prefill_step_size=self.config.serial_prefill_step_size,
            stream=self._stream,
            on_prefill=self._on_prefill,
            eos_token_ids=loaded.eos_token_ids,
            drafter=loaded.drafter,
            draft_tokens=new.key.draft_tokens if loaded.drafter is not None else 0,
        )

    def single(self, new: NewGroup, head: EngineRequest | None) -> SingleBackend:
        """The row's forward is the text lane's model where there is one (fused and routed: a
        keyed row's turns run at the text lane's speed); its cache is of the classes the batch
        it may move into merges: mlx-lm's for a text-lane key, mlx-vlm's otherwise."""
        processor = self.loaded.processor
        tokenizer = getattr(processor, "tokenizer", processor)
        lm = self.text_language_model() if self._text_lm is not None else None
        if lm is not None and new.key.lane == LaneName.TEXT:
            cache: Callable[[], list[Any]] | None = lambda: make_cache(lm)  # noqa: E731
        elif lm is not None:
            cache = lambda: upstream_kv_cache(lm)  # noqa: E731
        else:
            cache = None
        return SingleBackend(
            self.loaded.model,
            stop_criteria=tokenizer.stopping_criteria,  # the batch's own eos test
            prefill_step_size=self.config.prefill_step_size,
            stream=self._stream,
            apc_manager=self._cache_manager_for(head),
            make_cache=cache,
            language_model=lm,
        )

    def text(self, new: NewGroup, head: EngineRequest | None) -> TextLoopBackend:
        idle = self.config.idle_finished_rows
        return TextLoopBackend(
            self.loaded.model,
            language_model=self.text_language_model(),
            eos_token_ids=self.loaded.eos_token_ids,
            max_batch_size=new.max_batch_size,
            prefill_step_size=self.config.prefill_step_size,
            stream=self._stream,
            buckets=self.buckets,
            idle_finished=cuda_attention.available() if idle is None else idle,
            apc_manager=self._cache_manager_for(head),
        )

    def batch(self, new: NewGroup, head: EngineRequest | None) -> BatchBackend:
        loaded = self.loaded
        key = new.key
        drafter = Drafter(loaded.drafter) if key.draft_tokens and loaded.drafter is not None else None
        return BatchBackend(
            loaded.model,
            loaded.processor,
            max_batch_size=new.max_batch_size,
            drafter=drafter,
            draft_tokens=key.draft_tokens if drafter is not None else 0,
            speculative_sampling=head.sampling if head is not None and key.mode == ExecutionMode.EXCLUSIVE else None,
            prefill_step_size=self.config.prefill_step_size,
            stream=self._stream,
            apc_manager=self._cache_manager_for(head),
        )

    # --- what the builders share -------------------------------------------------------
    def text_language_model(self) -> Any:
        """What the text lane steps: fused and routed once (it shares the resident weights)."""
        lm = self._text_lm
        assert lm is not None, "only a model with the text lane builds text-lane backends"
        if not self._text_ready:
            if self.config.fused_projections:
                fuse_text_model(lm, self.loaded.model)
            if self._fused_decode_attention() or self._prefill_attention_ops():
                cuda_attention.install(lm)
            self._text_ready = True
        return lm

    def _cache_manager_for(self, head: EngineRequest | None) -> Any:
        """The resident model's prefix-cache manager for a group of keyed requests, else None."""
        if head is None or head.prompt_cache_key is None or self._prefix_cache is None:
            return None
        return self._prefix_cache.manager

    def _fused_decode_attention(self) -> bool:
        return self.config.fused_decode_attention and cuda_attention.available()

    def _prefill_attention_ops(self) -> bool:
        return self.config.prefill_attention_ops and cuda_attention.available()

    def _warmed_buckets(self) -> Buckets | None:
        """The text lane's prefill buckets (``EngineConfig.prefill_buckets``), each shape run once
        here, on the worker thread that will run it; None where they are off."""
        if not self.config.prefill_buckets or LaneName.TEXT not in self.model_lanes:
            return None
        cfg = self.config
        buckets = Buckets(prefill_step_size=cfg.prefill_step_size, max_batch_size=cfg.max_batch_size)
        try:
            warm(self.text_language_model(), buckets)
        except Exception as exc:  # noqa: BLE001 - unwarmed shapes are slower the first time, not wrong
            log.warning("warming the prefill shapes failed: %s", exc)
        return buckets


def _model_lanes(lane: Upstream, *, plain_kv: bool, text: bool) -> frozenset[LaneName]:
    if lane == Upstream.MLX_LM:
        return frozenset({LaneName.SERIAL})
    if lane == Upstream.MLX_VLM:
        return frozenset({LaneName.IN_PROCESS})
    lanes = {LaneName.BATCH}
    if plain_kv:
        lanes.add(LaneName.SINGLE)
    if text:
        lanes.add(LaneName.TEXT)
    return frozenset(lanes)
