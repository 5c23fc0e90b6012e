"""Speculation, thinking and sampling controls: every accepted input form, validated.

Pure: no I/O, no MLX. Every rejection raises ``InvalidControls`` whose ``field`` names the
offending field (``speculation.num_draft_tokens``, ``thinking``, ``temperature`` ...) and whose
``value`` is what was given.

Wire forms (JSON, shared with AbstractCore):

- speculation: ``null`` (inherit), ``false`` (off), or an object
  ``{"mode": "native_mtp", "drafter"?, "num_draft_tokens"?, "require_acceleration"?}``.
- thinking: ``null`` (inherit), ``true``/``false``, or a level string.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, model_validator

from ..errors import InvalidControls, StopTooLarge
from ..json_values import JSONObject, parse_ascii_int

SPECULATION_MODES: tuple[str, ...] = ("native_mtp", "off")
SPECULATION_KEYS: frozenset[str] = frozenset({"mode", "drafter", "num_draft_tokens", "require_acceleration"})
_OFF_WORDS = frozenset({"off", "none", "false"})
_MTP_WORDS = frozenset({"native_mtp", "mtp"})

THINKING_LEVELS: tuple[str, ...] = ("minimal", "low", "medium", "high", "xhigh")
_THINKING_ON_WORDS = frozenset({"on", "true"})
_THINKING_OFF_WORDS = frozenset({"off", "false", "none"})


# --------------------------------------------------------------------------- speculation


class SpeculationControl(BaseModel):
    """One speculation setting. ``None`` fields are "not said" and inherit when merged.

    ``mode="off"`` carries no other field. ``require_acceleration=None`` means "not said";
    after resolving it is always a bool (``False`` = optional acceleration).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["native_mtp", "off"]
    drafter: str | None = Field(default=None, min_length=1)
    num_draft_tokens: StrictInt | None = Field(default=None, ge=1)
    require_acceleration: StrictBool | None = None

    @model_validator(mode="after")
    def _off_is_bare(self) -> SpeculationControl:
        if self.mode == "off" and (
            self.drafter is not None or self.num_draft_tokens is not None or self.require_acceleration is not None
        ):
            raise ValueError("mode 'off' takes no other fields")
        return self

    @classmethod
    def off(cls) -> SpeculationControl:
        return _OFF

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def strict(self) -> bool:
        """True when the caller requires MTP execution (``require_acceleration=True``)."""
        return self.require_acceleration is True

    def to_wire(self) -> bool | JSONObject:
        """``False`` when off, else a dict with ``mode`` and only the fields that are set."""
        if not self.enabled:
            return False
        return self.model_dump(exclude_none=True)


_OFF = SpeculationControl(mode="off")


def normalize_speculation(value: object, *, field: str = "speculation") -> SpeculationControl | None:
    """Coerce every accepted speculation form into a ``SpeculationControl`` (``None`` = inherit).

    Accepted: ``None``; ``False`` / ``"off"`` / ``"none"`` / ``"false"`` (off); ``True`` /
    ``"mtp"`` / ``"native_mtp"`` (native MTP); a mapping with keys from ``SPECULATION_KEYS``
    (``mode`` defaults to ``native_mtp``); an existing ``SpeculationControl``. Strings are
    matched case-insensitively after stripping. Anything else raises ``InvalidControls``.
    """
    if value is None:
        return None
    if isinstance(value, SpeculationControl):
        return value
    if isinstance(value, bool):
        return SpeculationControl(mode="native_mtp") if value else _OFF
    if isinstance(value, str):
        return SpeculationControl(mode=_speculation_mode(value, field=field, shown=value))
    if not isinstance(value, Mapping):
        raise InvalidControls(
            f"{field} must be null, a bool, a mode string or an object; got {type(value).__name__}",
            field=field,
            value=value,
        )
    for key in value:
        if key not in SPECULATION_KEYS:
            raise InvalidControls(
                f"unknown key {key!r} in {field}; accepted keys: {sorted(SPECULATION_KEYS)}",
                field=f"{field}.{key}",
                value=value[key],
            )
    raw_mode = value.get("mode", "native_mtp")
    if not isinstance(raw_mode, str):
        raise InvalidControls(
            f"{field}.mode must be one of {list(SPECULATION_MODES)} (aliases 'mtp', 'none', 'false')",
            field=f"{field}.mode",
            value=raw_mode,
        )
    mode = _speculation_mode(raw_mode, field=f"{field}.mode", shown=raw_mode)

    num = value.get("num_draft_tokens")
    if num is not None and (isinstance(num, bool) or not isinstance(num, int) or num < 1):
        raise InvalidControls(
            f"{field}.num_draft_tokens must be an integer >= 1", field=f"{field}.num_draft_tokens", value=num
        )
    required = value.get("require_acceleration")
    if required is not None and not isinstance(required, bool):
        raise InvalidControls(
            f"{field}.require_acceleration must be true or false",
            field=f"{field}.require_acceleration",
            value=required,
        )
    drafter = value.get("drafter")
    if drafter is not None:
        if not isinstance(drafter, str) or not drafter.strip():
            raise InvalidControls(
                f"{field}.drafter must be a non-empty string", field=f"{field}.drafter", value=drafter
            )
        drafter = drafter.strip()
    if mode == "off":
        extra = {
            k: value[k] for k in ("drafter", "num_draft_tokens", "require_acceleration") if value.get(k) is not None
        }
        if extra:
            raise InvalidControls(
                f"{field} with mode 'off' takes no other fields (got {sorted(extra)}); send false to switch MTP off",
                field=field,
                value=dict(value),
            )
        return _OFF
    try:
        return SpeculationControl(
            mode="native_mtp", drafter=drafter, num_draft_tokens=num, require_acceleration=required
        )
    except ValidationError as exc:  # pragma: no cover - every field is checked above
        raise InvalidControls(f"invalid {field}: {exc}", field=field, value=dict(value)) from exc


def parse_speculation_option(value: object, *, field: str = "speculation") -> SpeculationControl | None:
    """A load-time speculation option as ``serve --speculation``, ``run --speculation`` and
    ``/acore/models/load`` take it: every ``normalize_speculation`` form, plus a draft depth
    (an integer N >= 1, or its digits as a string: native MTP at depth N), ``"inherit"``
    (say nothing: ``None``) and, from a command line, an object as JSON text. The same forms
    at every edge."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word == "inherit":
            return None
        depth = parse_ascii_int(word)
        if depth is not None:
            value = depth
        elif word.startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidControls(f"{field} is not a valid JSON object: {exc}", field=field, value=value) from exc
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise InvalidControls(
                f"{field} as a draft depth must be an integer >= 1 (or 'off'); got {value}", field=field, value=value
            )
        return SpeculationControl(mode="native_mtp", num_draft_tokens=value)
    return normalize_speculation(value, field=field)


def _speculation_mode(text: str, *, field: str, shown: str) -> Literal["native_mtp", "off"]:
    word = text.strip().lower()
    if word in _OFF_WORDS:
        return "off"
    if word in _MTP_WORDS:
        return "native_mtp"
    raise InvalidControls(
        f"unknown speculation mode {shown!r}; accepted: 'native_mtp' (alias 'mtp'), 'off' (aliases 'none', 'false')",
        field=field,
        value=shown,
    )


def merge_speculation(
    default: SpeculationControl | None, override: SpeculationControl | None
) -> SpeculationControl | None:
    """Lay ``override`` (more specific) onto ``default`` (less specific).

    - ``override`` None: ``default``.
    - ``override`` off: off (explicit off always wins).
    - ``default`` None or off: ``override`` as given.
    - otherwise each field ``override`` leaves unset (``None``) is inherited from ``default``,
      ``require_acceleration`` included.
    """
    if override is None:
        return default
    if not override.enabled or default is None or not default.enabled:
        return override
    return SpeculationControl(
        mode="native_mtp",
        drafter=override.drafter if override.drafter is not None else default.drafter,
        num_draft_tokens=override.num_draft_tokens
        if override.num_draft_tokens is not None
        else default.num_draft_tokens,
        require_acceleration=override.require_acceleration
        if override.require_acceleration is not None
        else default.require_acceleration,
    )


# --------------------------------------------------------------------------- thinking

ThinkingValue = bool | str | None


def normalize_thinking(value: object, *, field: str = "thinking") -> ThinkingValue:
    """Coerce a thinking control: ``None`` (inherit), a bool, or a reasoning level.

    Accepted strings (case-insensitive, stripped): ``"on"``/``"true"`` → ``True``;
    ``"off"``/``"false"``/``"none"`` → ``False``; ``"auto"`` → ``None`` (inherit / model default);
    levels ``"minimal"``, ``"low"``, ``"medium"``, ``"high"``, ``"xhigh"`` → the level string
    (a level implies thinking on). Everything else raises ``InvalidControls(field="thinking")``.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _THINKING_ON_WORDS:
            return True
        if word in _THINKING_OFF_WORDS:
            return False
        if word == "auto":
            return None
        if word in THINKING_LEVELS:
            return word
    raise InvalidControls(
        f"{field} must be null, true/false, 'on'/'off'/'auto' or a level {list(THINKING_LEVELS)}; got {value!r}",
        field=field,
        value=value,
    )


# --------------------------------------------------------------------------- sampling

SAMPLING_FIELDS: tuple[str, ...] = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
)
"""The fields of ``Sampling``, in wire order (``max_output_tokens`` and ``stop`` are limits of the request)."""


MAX_SEED = 2**64 - 1  # MLX random keys are unsigned 64-bit
# Far past any context window; the loaded model's context is the real bound (context_too_long).
MAX_OUTPUT_TOKENS = 1_048_576
# Stop strings per request and their total UTF-8 size: the list is compiled into one automaton
# per request (engine/core/stops.py), built on the engine worker.
MAX_STOP_STRINGS = 128
MAX_STOP_BYTES = 4 * 1024


@dataclass(frozen=True, slots=True)
class Sampling:
    """How tokens are drawn; the one definition used from every edge down to the engine.

    ``None`` means "not given": the engine's default applies (greedy for ``temperature``,
    off for every filter and penalty). Build it with ``normalize_sampling(...)``, which
    validates; the constructor does not. ``logit_bias`` is a sorted tuple of
    ``(token_id, bias)`` pairs so the object stays hashable and immutable.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None

    def has_logit_processors(self) -> bool:
        """A penalty or a bias would change the logits (native MTP cannot honor these)."""
        return (
            self.repetition_penalty not in (None, 1)
            or self.presence_penalty not in (None, 0)
            or self.frequency_penalty not in (None, 0)
            or bool(self.logit_bias)
        )

    def logits_neutral(self) -> bool:
        """No filter, penalty or bias would change the logits (MTP requires this)."""
        return self.min_p in (None, 0) and not self.has_logit_processors()

    def is_greedy_neutral(self) -> bool:
        """Greedy (``temperature`` unset or 0) with every logits processor neutral: batchable."""
        return self.temperature in (None, 0) and self.logits_neutral()

    def to_dict(self) -> JSONObject:
        """JSON form with only the fields that are set (``logit_bias`` keys become strings)."""
        out: JSONObject = {}
        for name in SAMPLING_FIELDS:
            value = getattr(self, name)
            if name == "logit_bias":
                if value:
                    out[name] = {str(token): bias for token, bias in value}
            elif value is not None:
                out[name] = value
        return out


def normalize_sampling(**kw: object) -> Sampling:
    """Validate sampling keywords (names in ``SAMPLING_FIELDS``; ``None`` = not given).

    Ranges: temperature >= 0; 0 < top_p <= 1; top_k >= 0 (0 = off); 0 <= min_p <= 1;
    repetition_penalty > 0; presence/frequency penalty in [-2, 2]; logit_bias maps token ids
    (int, or decimal-string keys as JSON sends them) to numbers in [-100, 100]; 0 <= seed < 2**64.
    """
    for name, value in kw.items():
        if name not in SAMPLING_FIELDS:
            raise InvalidControls(
                f"unknown sampling control {name!r}; accepted: {list(SAMPLING_FIELDS)}", field=name, value=value
            )
    get = kw.get
    return Sampling(
        temperature=_number(get("temperature"), "temperature", lo=0.0),
        top_p=_number(get("top_p"), "top_p", lo=0.0, lo_open=True, hi=1.0),
        top_k=_integer(get("top_k"), "top_k", lo=0),
        min_p=_number(get("min_p"), "min_p", lo=0.0, hi=1.0),
        repetition_penalty=_number(get("repetition_penalty"), "repetition_penalty", lo=0.0, lo_open=True),
        presence_penalty=_number(get("presence_penalty"), "presence_penalty", lo=-2.0, hi=2.0),
        frequency_penalty=_number(get("frequency_penalty"), "frequency_penalty", lo=-2.0, hi=2.0),
        logit_bias=_logit_bias(get("logit_bias")),
        seed=_integer(get("seed"), "seed", lo=0, hi=MAX_SEED),
    )


def normalize_max_output_tokens(value: object) -> int | None:
    """``None`` (the provider's default) or an integer >= 1."""
    return _integer(value, "max_output_tokens", lo=1, hi=MAX_OUTPUT_TOKENS)


def normalize_stop(value: object) -> tuple[str, ...]:
    """A string or a list of non-empty strings (``None``: no stop strings)."""
    return _stop(value)


def _number(
    value: object, name: str, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False
) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidControls(f"{name} must be a finite number", field=name, value=value)
    number = float(value)
    if lo is not None and (number < lo or (lo_open and number == lo)):
        raise InvalidControls(f"{name} must be {'>' if lo_open else '>='} {lo:g}", field=name, value=value)
    if hi is not None and number > hi:
        raise InvalidControls(f"{name} must be <= {hi:g}", field=name, value=value)
    return number


def _integer(value: object, name: str, *, lo: int, hi: int | None = None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidControls(f"{name} must be an integer", field=name, value=value)
    if value < lo:
        raise InvalidControls(f"{name} must be >= {lo}", field=name, value=value)
    if hi is not None and value > hi:
        raise InvalidControls(f"{name} must be <= {hi}", field=name, value=value)
    return value


def _token_id(key: str) -> int:
    """A ``logit_bias`` key as JSON sends it (a string of ASCII digits); -1 when it is not one."""
    token = parse_ascii_int(key)
    return -1 if token is None else token


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise InvalidControls("logit_bias must map token ids to numbers", field="logit_bias", value=value)
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, bool):
            token = -1
        elif isinstance(key, int):
            token = key
        elif isinstance(key, str):
            token = _token_id(key)
        else:
            token = -1
        if token < 0:
            raise InvalidControls(
                f"logit_bias.{key}: the key is not a token id (a non-negative integer in ASCII digits)",
                field=f"logit_bias.{key}",
                value=key,
            )
        if bias is None:
            raise InvalidControls(f"logit_bias.{key} must be a number", field=f"logit_bias.{key}", value=bias)
        number = _number(bias, f"logit_bias.{key}", lo=-100.0, hi=100.0)
        assert number is not None
        out[token] = number
    return tuple(sorted(out.items()))


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise InvalidControls("stop must be a string or a list of strings", field="stop", value=value)
    if len(items) > MAX_STOP_STRINGS:
        raise StopTooLarge(
            f"stop holds {len(items)} strings; the limit is {MAX_STOP_STRINGS}",
            limit="max_stop_strings",
            maximum=MAX_STOP_STRINGS,
        )
    out: list[str] = []
    size = 0
    for item in items:
        if not isinstance(item, str) or not item:
            raise InvalidControls("stop entries must be non-empty strings", field="stop", value=item)
        size += len(item.encode("utf-8", "surrogatepass"))
        if size > MAX_STOP_BYTES:
            raise StopTooLarge(
                f"stop strings exceed {MAX_STOP_BYTES} bytes (UTF-8) in all",
                limit="max_stop_bytes",
                maximum=MAX_STOP_BYTES,
            )
        out.append(item)
    return tuple(out)
