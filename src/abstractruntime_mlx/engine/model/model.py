"""Loading a target (and its MTP head) once, on whichever upstream serves it.

The MTP head of a resident target is loaded with it when the load asks for it, or attached
later, on the worker between steps, by ``LoadedModel.attach_drafter``: only the head's own
tensors are read (an embedded head's ``mtp.*`` keys, or a companion directory), the target
is not reloaded, and the head shares the target's embeddings and output head, so the
memory it adds is its own parameters (``drafter_bytes``).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from ...errors import ContextTooLong, InvalidControls, ModelNotFound, UpstreamError
from .grammar import GrammarCompiler
from .upstream import tokenizer_parts

log = logging.getLogger(__name__)


class Upstream(StrEnum):
    """Which upstream serves a resident model."""

    NATIVE = "native"  # mlx-vlm: continuous batching, native MTP, images
    MLX_LM = "mlx_lm"  # mlx-lm, one request at a time
    # mlx-vlm's own in-process generation, one request at a time: a non-batched provider
    # (``mlx_batching=False``) whose model has an MTP head and whose default runs it.
    MLX_VLM = "mlx_vlm"


# The upstreams that run one request at a time (the ``serial`` and ``in_process`` lanes).
SERIAL_UPSTREAMS = frozenset({Upstream.MLX_LM, Upstream.MLX_VLM})
# The upstreams that attach an MTP head (mlx-vlm models).
HEAD_UPSTREAMS = frozenset({Upstream.NATIVE, Upstream.MLX_VLM})


@dataclass(slots=True)
class LoadedModel:
    """A resident target and the upstream that serves it."""

    path: Path
    upstream: Upstream
    model: Any
    processor: Any
    tokenizer: Any
    config: dict[str, Any]
    drafter: Any = None
    drafter_source: str | None = None
    # The local MTP head this target attaches (embedded: the checkpoint itself; a companion
    # directory), known at load whether or not it was loaded then; None: no head here.
    head_source: str | None = None
    drafter_bytes: int | None = None  # what the attached head adds to resident memory
    drafter_error: str | None = None  # why attaching the head failed (it is not retried)
    eos_token_ids: frozenset[int] = frozenset()
    _detokenizer: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    _max_token_chars: int | None = None
    _grammars: GrammarCompiler | None = None

    @property
    def vocab_size(self) -> int | None:
        """Rows of the output logits: a token id at or past it is no token of this model."""
        size = _text_setting(self.config, "vocab_size")
        if size is None:
            size = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else None
        return size

    @property
    def context_length(self) -> int | None:
        """Positions the model was trained for (prompt plus output); None when the config has none."""
        return _text_setting(self.config, "max_position_embeddings")

    def check_request(
        self, *, prompt_tokens: int, max_tokens: int, logit_bias: tuple[tuple[int, float], ...] = ()
    ) -> None:
        """Refuse what this model cannot run: bias on a token it does not have (MLX would
        index past the logits) and a prompt plus output cap past its context."""
        vocab = self.vocab_size
        if vocab is not None:
            for token, _bias in logit_bias:
                if not 0 <= token < vocab:
                    raise InvalidControls(
                        f"logit_bias.{token}: token id {token} is outside this model's vocabulary (0..{vocab - 1})",
                        field=f"logit_bias.{token}",
                        value=token,
                    )
        context = self.context_length
        if context is not None and prompt_tokens + max_tokens > context:
            raise ContextTooLong(
                f"the prompt has {prompt_tokens} tokens and the output cap is {max_tokens}: "
                f"{prompt_tokens + max_tokens} exceeds this model's context of {context} tokens; "
                "shorten the conversation or lower max_output_tokens",
                details={"prompt_tokens": prompt_tokens, "max_output_tokens": max_tokens, "context_length": context},
            )

    def min_prompt_tokens(self, text: str) -> int:
        """A lower bound on the tokens ``text`` encodes to, without encoding it.

        Every vocabulary entry spells at most ``max_token_chars`` characters of text, so a text
        of n characters needs at least n / max_token_chars tokens: an oversized prompt is
        refused before the tokenizer spends minutes and gigabytes on it.
        """
        if self._max_token_chars is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_token_chars = max((len(piece) for piece in vocab), default=0) or 0
        longest = self._max_token_chars
        return len(text) // longest if longest else 0

    def attach_drafter(self) -> float | None:
        """Load the MTP head of ``head_source`` onto this resident target (worker thread only).

        Returns the seconds it took, or None when a head is already attached. Raises
        ``UpstreamError`` when the head cannot be loaded or does not fit the target; the error
        is remembered in ``drafter_error`` and every later call raises it again at once.
        """
        if self.drafter is not None:
            return None
        if self.drafter_error is not None:
            raise UpstreamError(self.drafter_error)
        if self.upstream not in HEAD_UPSTREAMS or self.head_source is None:
            raise UpstreamError(f"{self.path} has no MTP head its upstream can attach")
        started = time.perf_counter()
        try:
            drafter = _load_drafter(Path(self.head_source))
            _check_drafter_fits(drafter, self.model)
            _read_weights(drafter)
        except UpstreamError as exc:
            self.drafter_error = exc.message
            raise
        self.drafter = drafter
        self.drafter_source = self.head_source
        self.drafter_bytes = parameter_bytes(drafter)
        return time.perf_counter() - started

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def supports_images(self) -> bool:
        return self.upstream == Upstream.NATIVE and "vision_config" in self.config

    def new_detokenizer(self) -> Any:
        """A fresh streaming detokenizer (one per request: they are stateful)."""
        detok = copy.copy(self._detokenizer)
        detok.reset()
        return detok

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def grammar_compiler(self) -> GrammarCompiler:
        """This model's structured-output compiler, built on first use (it walks the vocabulary)."""
        with self.lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    _hf_tokenizer(self.tokenizer),
                    vocab_rows=self.vocab_size or len(self.tokenizer),
                    eos_token_ids=self.eos_token_ids,
                )
            return self._grammars


def load_model(
    path: Path, *, upstream: Upstream, head_source: Path | None = None, load_head: bool = False
) -> LoadedModel:
    """Load ``path`` on ``upstream``. ``head_source`` is its local MTP head (the checkpoint itself
    for an embedded head, a companion directory, or None for no head); ``load_head`` loads it
    now, else it is attached on first use (``LoadedModel.attach_drafter``)."""
    config = _read_config(path)
    if upstream == Upstream.MLX_LM:
        return _load_mlx_lm(path, config)
    loaded = _load_native(path, config)
    loaded.upstream = upstream
    loaded.head_source = str(head_source) if head_source is not None else None
    if load_head and head_source is not None:
        try:
            loaded.attach_drafter()
        except UpstreamError as exc:
            # A damaged or mismatched head does not fail the load: optional MTP runs
            # target-only and names the outcome (``mtp_head_attach_failed``, the error kept in
            # ``drafter_error``); a strict request fails with it (``SpeculationUnavailable``).
            log.warning("the MTP head of %s was not attached; MTP requests run target-only: %s", path, exc.message)
    return loaded


def parameter_bytes(module: Any) -> int:
    """Bytes of a module's parameters (what loading it adds to resident memory)."""
    from mlx.utils import tree_flatten

    leaves: Any = tree_flatten(module.parameters())
    return sum(int(value.nbytes) for _name, value in leaves)


def _read_weights(module: Any) -> None:
    """Read every tensor of ``module`` now: MLX loads lazily, so a head file cut short or
    holding bad data fails here, at attach, rather than in the middle of a request."""
    import mlx.core as mx

    try:
        mx.eval(module.parameters())
    except Exception as exc:  # noqa: BLE001 - MLX raises RuntimeError/ValueError
        raise UpstreamError(f"the MTP head's weights could not be read: {type(exc).__name__}: {exc}") from exc


def _check_drafter_fits(drafter: Any, target: Any) -> None:
    """The head drafts from the target's hidden states: their widths must agree."""
    from mlx_vlm.speculative.drafters import validate_drafter_compatibility

    try:
        validate_drafter_compatibility(target, drafter, "mtp")
    except Exception as exc:  # noqa: BLE001 - upstream raises ValueError
        raise UpstreamError(f"the MTP head does not fit this model: {exc}") from exc


def _text_setting(config: dict[str, Any], name: str) -> int | None:
    for source in (config, config.get("text_config") or {}):
        value = source.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _untyped(loaded: object) -> tuple[Any, ...]:
    """An upstream loader's tuple, whose declared element types are narrower than what the
    loaded checkpoints provide (processors carry a ``detokenizer``, tokenizers are wrapped)."""
    assert isinstance(loaded, tuple)
    return loaded


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face fast tokenizer inside upstream's wrappers (llguidance reads its vocabulary)."""
    for _ in range(3):
        if hasattr(tokenizer, "backend_tokenizer"):
            return tokenizer
        tokenizer = getattr(tokenizer, "_tokenizer", None) or getattr(tokenizer, "tokenizer", None)
    raise InvalidControls(
        "structured output needs a Hugging Face fast tokenizer; this model has none", field="response_format"
    )


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFound(f"{path} has no config.json; it is not a model checkpoint directory")
    config: dict[str, Any] = json.loads(config_file.read_text())
    return config


def _load_native(path: Path, config: dict[str, Any]) -> LoadedModel:
    import mlx_vlm

    try:
        model, processor = _untyped(mlx_vlm.load(str(path)))
    except Exception as exc:  # noqa: BLE001 - upstream raises plain exceptions
        raise UpstreamError(f"mlx-vlm could not load {path}: {type(exc).__name__}: {exc}") from exc
    tokenizer = processor.tokenizer if hasattr(processor, "tokenizer") else processor
    return LoadedModel(
        path=path,
        upstream=Upstream.NATIVE,
        model=model,
        processor=processor,
        tokenizer=tokenizer,
        config=config,
        eos_token_ids=_eos_ids(config, tokenizer),
        _detokenizer=_streaming_detokenizer(processor.detokenizer, tokenizer),
    )


def _load_drafter(source: Path) -> Any:
    from mlx_vlm.speculative.drafters import load_drafter

    try:
        drafter, _kind = load_drafter(str(source), kind="mtp")
    except Exception as exc:  # noqa: BLE001
        raise UpstreamError(f"mlx-vlm could not load the MTP head at {source}: {type(exc).__name__}: {exc}") from exc
    return drafter


def _load_mlx_lm(path: Path, config: dict[str, Any]) -> LoadedModel:
    import mlx_lm

    try:
        model, tokenizer = _untyped(mlx_lm.load(str(path)))[:2]
    except Exception as exc:  # noqa: BLE001
        raise UpstreamError(f"mlx-lm could not load {path}: {type(exc).__name__}: {exc}") from exc
    inner, detokenizer = tokenizer_parts(tokenizer)
    return LoadedModel(
        path=path,
        upstream=Upstream.MLX_LM,
        model=model,
        processor=tokenizer,
        tokenizer=inner,
        config=config,
        eos_token_ids=frozenset(int(t) for t in tokenizer.eos_token_ids),
        _detokenizer=detokenizer,
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


def _streaming_detokenizer(upstream: Any, tokenizer: Any) -> Any:
    """mlx-lm's streaming detokenizer of the kind mlx-vlm picked for this tokenizer.

    mlx-vlm's BPE detokenizer holds a token's text back until the next token starts a word,
    so a stream's first text (and every word) comes a token late; mlx-lm's emits each token's
    text as soon as it decodes. Both give the same text in the end.
    """
    from mlx_lm import tokenizer_utils

    kind = type(upstream).__name__
    if kind == "BPEStreamingDetokenizer":
        return tokenizer_utils.BPEStreamingDetokenizer(tokenizer)
    if kind == "SPMStreamingDetokenizer":
        return tokenizer_utils.SPMStreamingDetokenizer(
            tokenizer, trim_space=bool(getattr(upstream, "trim_space", True))
        )
    return upstream  # the naive detokenizer already decodes every token
