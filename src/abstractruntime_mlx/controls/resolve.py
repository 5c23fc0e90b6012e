"""The precedence resolver: call (node) → run → provider (constructor) → policy → verified default.

One mechanism for every control: walk the levels from the least specific to the most
specific, lay each level that says something onto what is below it, and remember the most
specific level that said something: that level *decided* and is reported as the source.

- speculation: a level's partial object merges onto the levels below it
  (``merge_speculation``), so ``{"num_draft_tokens": 3}`` at the call inherits
  ``require_acceleration`` from the run/provider/policy; off at the deciding level wins; a
  more specific ``native_mtp`` overrides a less specific off. Nothing said anywhere:
  ``verified_default=True`` gives optional native MTP (source ``"verified_default"``), otherwise
  off (source ``"off"``). After resolving, a native-MTP value always carries a depth
  (``DEFAULT_DRAFT_TOKENS`` when no level names one) and ``require_acceleration`` is a bool,
  so what is reported is exactly what runs.
- thinking: scalar, so the most specific level that says something wins outright. Nothing
  said anywhere: ``None`` (the model's own chat-template default), source ``"model_default"``.

Every place that reports or runs these controls (the node, the provider, ``capabilities``,
the server) calls ``resolve_controls`` with the levels it knows; there is no other copy.

``UNSET`` (argument not given) and ``None`` both mean "this level says nothing, inherit";
``False`` means off. ``UNSET`` exists so a caller forwarding controls can tell "not passed"
from "passed null" (e.g. to omit a key from a wire payload); the resolver treats both alike.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, TypeVar, cast

from ..errors import InvalidControls
from ..json_values import JSONObject
from .models import SpeculationControl, ThinkingValue, merge_speculation, normalize_speculation, normalize_thinking

LEVELS: Final[tuple[str, ...]] = ("call", "run", "provider", "policy")
"""Most specific first. ``call`` is the node/call level."""

SPECULATION_SOURCES: Final[tuple[str, ...]] = (*LEVELS, "verified_default", "off")
THINKING_SOURCES: Final[tuple[str, ...]] = (*LEVELS, "model_default")
LAYER_KEYS: Final[frozenset[str]] = frozenset({"speculation", "thinking"})


class _Unset(enum.Enum):
    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


UNSET: Final = _Unset.UNSET
"""Sentinel: the argument was not given (inherit). Distinct from ``None`` only for forwarding."""

Unset = Literal[_Unset.UNSET]
"""The type of ``UNSET``, for annotations: ``value: int | None | Unset = UNSET``."""

DEFAULT_DRAFT_TOKENS: Final = 2
"""The MTP depth when native MTP is on and no level names a depth."""

VERIFIED_DEFAULT: Final = SpeculationControl(
    mode="native_mtp", num_draft_tokens=DEFAULT_DRAFT_TOKENS, require_acceleration=False
)
"""What a model with verified MTP support runs when nobody configured anything."""

SPECULATION_OFF_REASONS: Final[Mapping[str, str]] = {
    "call": "disabled_for_this_call",
    "run": "disabled_for_this_run",
    "provider": "disabled_by_provider_default",
    "policy": "disabled_by_policy",
    "off": "no_verified_mtp_default",
}
"""``speculation.reason`` when the resolved value is off, by the level that switched it off."""


@dataclass(frozen=True, slots=True)
class ControlLevel:
    """What one level (call, run, provider, policy) says; ``None`` says nothing (inherit).

    Build it with ``ControlLevel.parse`` from any accepted input form (validated once there).
    """

    speculation: SpeculationControl | None = None
    thinking: ThinkingValue = None

    @classmethod
    def parse(cls, *, speculation: object = None, thinking: object = None, prefix: str = "") -> ControlLevel:
        """Validate both controls; ``prefix`` is prepended to the field named in errors."""
        return cls(
            speculation=normalize_speculation(speculation, field=f"{prefix}speculation"),
            thinking=normalize_thinking(thinking, field=f"{prefix}thinking"),
        )

    def to_dict(self) -> JSONObject:
        """JSON form with only what this level says."""
        out: JSONObject = {}
        if self.speculation is not None:
            out["speculation"] = self.speculation.to_wire()
        if self.thinking is not None:
            out["thinking"] = self.thinking
        return out


NOTHING_SAID: Final = ControlLevel()

LevelInput = ControlLevel | Mapping[str, object] | None

T = TypeVar("T")


def _walk(
    levels: Mapping[str, object],
    *,
    normalize: Callable[[object], T | None],
    merge: Callable[[T | None, T | None], T | None],
) -> tuple[T | None, str | None]:
    """Merge every level that says something, least specific first; return (value, deciding level)."""
    value: T | None = None
    decided: str | None = None
    for name in reversed(LEVELS):
        raw = levels.get(name, UNSET)
        if raw is UNSET:
            continue
        said = normalize(raw)
        if said is None:
            continue
        value = merge(value, said)
        decided = name
    return value, decided


def resolve_speculation(
    *,
    call: object = UNSET,
    run: object = UNSET,
    provider: object = UNSET,
    policy: object = UNSET,
    verified_default: bool,
) -> tuple[SpeculationControl, str]:
    """Effective speculation and the level that decided it (a name in ``SPECULATION_SOURCES``).

    Each level accepts any form ``normalize_speculation`` accepts. The result is never ``None``:
    off is ``SpeculationControl(mode="off")``; when on, ``require_acceleration`` is a bool.
    """
    value, decided = _walk(
        {"call": call, "run": run, "provider": provider, "policy": policy},
        normalize=normalize_speculation,
        merge=merge_speculation,
    )
    if value is None or decided is None:
        if verified_default:
            return VERIFIED_DEFAULT, "verified_default"
        return SpeculationControl.off(), "off"
    if value.enabled:
        value = value.model_copy(
            update={
                "num_draft_tokens": value.num_draft_tokens or DEFAULT_DRAFT_TOKENS,
                "require_acceleration": bool(value.require_acceleration),
            }
        )
    return value, decided


def resolve_thinking(
    *,
    call: object = UNSET,
    run: object = UNSET,
    provider: object = UNSET,
    policy: object = UNSET,
) -> tuple[ThinkingValue, str]:
    """Effective thinking and the level that decided it (a name in ``THINKING_SOURCES``)."""
    value, decided = _walk(
        {"call": call, "run": run, "provider": provider, "policy": policy},
        normalize=normalize_thinking,
        merge=lambda _below, above: above,
    )
    if decided is None:
        return None, "model_default"
    return cast(ThinkingValue, value), decided


@dataclass(frozen=True)
class ResolvedControls:
    """The effective controls of one call and where each came from (``sources``)."""

    speculation: SpeculationControl
    thinking: ThinkingValue
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def speculation_source(self) -> str:
        return self.sources["speculation"]

    @property
    def thinking_source(self) -> str:
        return self.sources["thinking"]

    @property
    def speculation_off_reason(self) -> str | None:
        """Why speculation is off (``None`` when it is on)."""
        if self.speculation.enabled:
            return None
        return SPECULATION_OFF_REASONS[self.speculation_source]

    def to_metadata(self) -> JSONObject:
        """JSON: ``{"speculation", "speculation_source", "thinking", "thinking_source"}``."""
        return {
            "speculation": self.speculation.to_wire(),
            "speculation_source": self.sources["speculation"],
            "thinking": self.thinking,
            "thinking_source": self.sources["thinking"],
        }

    @classmethod
    def from_metadata(cls, data: Mapping[str, object]) -> ResolvedControls:
        """Inverse of ``to_metadata`` (exact round trip)."""
        speculation = normalize_speculation(data["speculation"])
        if speculation is None:
            raise InvalidControls("resolved speculation cannot be null", field="speculation", value=None)
        source = data["speculation_source"]
        thinking_source = data["thinking_source"]
        if not isinstance(source, str) or source not in SPECULATION_SOURCES:
            raise InvalidControls(f"unknown speculation source {source!r}", field="speculation_source", value=source)
        if not isinstance(thinking_source, str) or thinking_source not in THINKING_SOURCES:
            raise InvalidControls(
                f"unknown thinking source {thinking_source!r}", field="thinking_source", value=thinking_source
            )
        return cls(
            speculation=speculation,
            thinking=normalize_thinking(data["thinking"]),
            sources={"speculation": source, "thinking": thinking_source},
        )


def resolve_controls(
    *,
    call: LevelInput = None,
    run: LevelInput = None,
    provider: LevelInput = None,
    policy: LevelInput = None,
    verified_default: bool,
) -> ResolvedControls:
    """Resolve speculation and thinking across the levels: the one resolver.

    Each level is ``None`` (says nothing), a ``ControlLevel``, or a mapping with keys from
    ``{"speculation", "thinking"}`` (validated here; unknown keys raise ``InvalidControls``).
    """
    layers = {name: _layer(value, name) for name, value in zip(LEVELS, (call, run, provider, policy))}
    speculation, speculation_source = resolve_speculation(
        **{name: layer.speculation for name, layer in layers.items()},
        verified_default=verified_default,
    )
    thinking, thinking_source = resolve_thinking(
        **{name: layer.thinking for name, layer in layers.items()},
    )
    return ResolvedControls(
        speculation=speculation,
        thinking=thinking,
        sources={"speculation": speculation_source, "thinking": thinking_source},
    )


def control_level(value: object, *, level: str) -> ControlLevel:
    """``value`` as one level of ``resolve_controls``, validated the same way: ``None`` (or
    ``UNSET``) says nothing; a ``ControlLevel`` as is; a mapping of ``LAYER_KEYS``. Anything else
    raises ``InvalidControls`` naming ``level``."""
    return _layer(value, level)


def _layer(value: object, level: str) -> ControlLevel:
    if value is UNSET or value is None:
        return NOTHING_SAID
    if isinstance(value, ControlLevel):
        return value
    if not isinstance(value, Mapping):
        raise InvalidControls(
            f"{level} controls must be an object with keys {sorted(LAYER_KEYS)}; got {type(value).__name__}",
            field=level,
            value=value,
        )
    for key in value:
        if key not in LAYER_KEYS:
            raise InvalidControls(
                f"unknown control {key!r} at the {level} level; accepted: {sorted(LAYER_KEYS)}",
                field=str(key),
                value=value[key],
            )
    return ControlLevel.parse(speculation=value.get("speculation"), thinking=value.get("thinking"))
