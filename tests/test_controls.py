"""controls: every accepted and rejected form, merging, the precedence table, JSON round trips."""

from __future__ import annotations

import json
import pickle

import pytest
from pydantic import ValidationError

from abstractruntime_mlx.controls import (
    UNSET,
    VERIFIED_DEFAULT,
    ResolvedControls,
    Sampling,
    SpeculationControl,
    merge_speculation,
    normalize_max_output_tokens,
    normalize_sampling,
    normalize_speculation,
    normalize_stop,
    normalize_thinking,
    resolve_controls,
    resolve_speculation,
    resolve_thinking,
)
from abstractruntime_mlx.errors import InvalidControls

OFF = SpeculationControl(mode="off")
MTP = SpeculationControl(mode="native_mtp")


def mtp(**fields):
    return SpeculationControl(mode="native_mtp", **fields)


# --------------------------------------------------------------------------- speculation forms


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        (False, OFF),
        (True, MTP),
        ("off", OFF),
        ("none", OFF),
        ("false", OFF),
        (" OFF ", OFF),
        ("mtp", MTP),
        ("native_mtp", MTP),
        ("Native_MTP", MTP),
        ({}, MTP),
        ({"mode": "native_mtp"}, MTP),
        ({"mode": "mtp"}, MTP),
        ({"mode": "off"}, OFF),
        ({"mode": "none"}, OFF),
        ({"mode": "false"}, OFF),
        ({"num_draft_tokens": 3}, mtp(num_draft_tokens=3)),
        ({"require_acceleration": True}, mtp(require_acceleration=True)),
        ({"require_acceleration": False}, mtp(require_acceleration=False)),
        ({"drafter": " org/head "}, mtp(drafter="org/head")),
        (
            {"mode": "native_mtp", "drafter": "h", "num_draft_tokens": 1, "require_acceleration": True},
            mtp(drafter="h", num_draft_tokens=1, require_acceleration=True),
        ),
        ({"mode": "off", "num_draft_tokens": None}, OFF),
        (mtp(num_draft_tokens=4), mtp(num_draft_tokens=4)),
    ],
)
def test_speculation_accepted(value, expected):
    assert normalize_speculation(value) == expected


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("fast", "speculation"),
        ("", "speculation"),
        ("on", "speculation"),
        (1, "speculation"),
        (2.0, "speculation"),
        ([True], "speculation"),
        ({"mode": "eagle"}, "speculation.mode"),
        ({"mode": 1}, "speculation.mode"),
        ({"mode": None}, "speculation.mode"),
        ({"depth": 2}, "speculation.depth"),
        ({"num_draft_tokens": 0}, "speculation.num_draft_tokens"),
        ({"num_draft_tokens": -1}, "speculation.num_draft_tokens"),
        ({"num_draft_tokens": 2.0}, "speculation.num_draft_tokens"),
        ({"num_draft_tokens": True}, "speculation.num_draft_tokens"),
        ({"num_draft_tokens": "2"}, "speculation.num_draft_tokens"),
        ({"require_acceleration": 1}, "speculation.require_acceleration"),
        ({"require_acceleration": "true"}, "speculation.require_acceleration"),
        ({"drafter": ""}, "speculation.drafter"),
        ({"drafter": 5}, "speculation.drafter"),
        ({"mode": "off", "num_draft_tokens": 2}, "speculation"),
        ({"mode": "off", "require_acceleration": True}, "speculation"),
    ],
)
def test_speculation_rejected(value, field):
    with pytest.raises(InvalidControls) as info:
        normalize_speculation(value)
    assert info.value.field == field
    assert info.value.code == "invalid_controls"
    assert info.value.to_dict()["details"]["field"] == field


def test_rejection_field_prefix_is_configurable():
    with pytest.raises(InvalidControls) as info:
        normalize_speculation({"num_draft_tokens": 0}, field="params.speculation")
    assert info.value.field == "params.speculation.num_draft_tokens"
    assert info.value.value == 0


def test_model_is_frozen_and_strict():
    control = mtp(num_draft_tokens=2)
    with pytest.raises(ValidationError):
        control.num_draft_tokens = 3  # type: ignore[misc]
    for bad in ({"num_draft_tokens": True}, {"num_draft_tokens": 0}, {"require_acceleration": 1}, {"extra": 1}):
        with pytest.raises(ValidationError):
            SpeculationControl(mode="native_mtp", **bad)
    with pytest.raises(ValidationError):
        SpeculationControl(mode="off", drafter="x")


@pytest.mark.parametrize(
    ("control", "wire"),
    [
        (OFF, False),
        (MTP, {"mode": "native_mtp"}),
        (mtp(num_draft_tokens=2), {"mode": "native_mtp", "num_draft_tokens": 2}),
        (
            mtp(drafter="d", num_draft_tokens=5, require_acceleration=False),
            {"mode": "native_mtp", "drafter": "d", "num_draft_tokens": 5, "require_acceleration": False},
        ),
    ],
)
def test_wire_and_json_round_trip(control, wire):
    assert control.to_wire() == wire
    assert normalize_speculation(json.loads(json.dumps(control.to_wire()))) == control
    assert SpeculationControl.model_validate_json(control.model_dump_json()) == control
    assert pickle.loads(pickle.dumps(control)) == control


# --------------------------------------------------------------------------- merge


@pytest.mark.parametrize(
    ("default", "override", "expected"),
    [
        (None, None, None),
        (mtp(num_draft_tokens=2), None, mtp(num_draft_tokens=2)),
        (None, mtp(num_draft_tokens=2), mtp(num_draft_tokens=2)),
        (mtp(num_draft_tokens=2, require_acceleration=True), OFF, OFF),
        (OFF, mtp(num_draft_tokens=3), mtp(num_draft_tokens=3)),
        (OFF, None, OFF),
        (
            mtp(drafter="d", num_draft_tokens=2, require_acceleration=True),
            mtp(num_draft_tokens=4),
            mtp(drafter="d", num_draft_tokens=4, require_acceleration=True),
        ),
        (
            mtp(num_draft_tokens=2, require_acceleration=True),
            mtp(require_acceleration=False),
            mtp(num_draft_tokens=2, require_acceleration=False),
        ),
        (mtp(drafter="a"), mtp(drafter="b"), mtp(drafter="b")),
    ],
)
def test_merge(default, override, expected):
    assert merge_speculation(default, override) == expected


# --------------------------------------------------------------------------- precedence


def spec(**levels):
    return resolve_speculation(verified_default=levels.pop("verified", False), **levels)


def test_nothing_set_verified_gives_optional_mtp():
    assert spec(verified=True) == (VERIFIED_DEFAULT, "verified_default")
    assert VERIFIED_DEFAULT.to_wire() == {"mode": "native_mtp", "num_draft_tokens": 2, "require_acceleration": False}


def test_nothing_set_unverified_is_off():
    assert spec() == (OFF, "off")
    assert spec(call=None, run=None, provider=None, policy=None) == (OFF, "off")
    assert spec(call=UNSET, run=UNSET, provider=UNSET, policy=UNSET) == (OFF, "off")


@pytest.mark.parametrize(
    ("levels", "expected_depth", "source"),
    [
        (
            {
                "call": {"num_draft_tokens": 1},
                "run": {"num_draft_tokens": 2},
                "provider": {"num_draft_tokens": 3},
                "policy": {"num_draft_tokens": 4},
            },
            1,
            "call",
        ),
        (
            {"run": {"num_draft_tokens": 2}, "provider": {"num_draft_tokens": 3}, "policy": {"num_draft_tokens": 4}},
            2,
            "run",
        ),
        ({"provider": {"num_draft_tokens": 3}, "policy": {"num_draft_tokens": 4}}, 3, "provider"),
        ({"policy": {"num_draft_tokens": 4}}, 4, "policy"),
        ({"call": None, "policy": {"num_draft_tokens": 4}}, 4, "policy"),
    ],
)
def test_each_level_beats_the_next(levels, expected_depth, source):
    for verified in (True, False):
        value, decided = spec(verified=verified, **levels)
        assert value.num_draft_tokens == expected_depth
        assert decided == source
        assert value.require_acceleration is False  # always a bool once resolved


@pytest.mark.parametrize("level", ["call", "run", "provider", "policy"])
def test_off_at_the_deciding_level_wins(level):
    order = ["call", "run", "provider", "policy"]
    levels = {name: {"num_draft_tokens": 3, "require_acceleration": True} for name in order[order.index(level) + 1 :]}
    levels[level] = False
    assert spec(verified=True, **levels) == (OFF, level)


@pytest.mark.parametrize("off_level", ["run", "provider", "policy"])
def test_more_specific_mtp_overrides_less_specific_off(off_level):
    value, source = spec(verified=True, call={"num_draft_tokens": 3}, **{off_level: False})
    assert value == mtp(num_draft_tokens=3, require_acceleration=False)
    assert source == "call"


def test_only_off_switches_a_verified_model_off():
    assert spec(verified=True, policy=None) == (VERIFIED_DEFAULT, "verified_default")
    assert spec(verified=True, policy=False) == (OFF, "policy")


def test_partial_call_inherits_require_acceleration_from_each_level():
    strict = {"mode": "native_mtp", "num_draft_tokens": 2, "require_acceleration": True}
    for level in ("run", "provider", "policy"):
        value, source = spec(call={"num_draft_tokens": 3}, **{level: strict})
        assert value == mtp(num_draft_tokens=3, require_acceleration=True)
        assert source == "call"


def test_explicit_require_acceleration_overrides_inherited():
    value, _ = spec(call={"require_acceleration": False}, run={"num_draft_tokens": 4, "require_acceleration": True})
    assert value == mtp(num_draft_tokens=4, require_acceleration=False)


def test_drafter_and_depth_inherit_through_the_chain():
    value, source = spec(
        call={"require_acceleration": True},
        run={"num_draft_tokens": 5},
        provider={"drafter": "org/head"},
        policy=False,
    )
    assert value == mtp(drafter="org/head", num_draft_tokens=5, require_acceleration=True)
    assert source == "call"


def test_seed_policy_under_constructor_default():
    seed = {"mode": "native_mtp", "num_draft_tokens": 2, "require_acceleration": False}
    value, source = spec(provider={"mode": "native_mtp", "num_draft_tokens": 3}, policy=seed)
    assert (value.num_draft_tokens, source) == (3, "provider")


def test_unverified_model_honours_explicit_request():
    assert spec(call=True) == (mtp(num_draft_tokens=2, require_acceleration=False), "call")


def test_invalid_level_names_the_field():
    with pytest.raises(InvalidControls) as info:
        spec(run={"num_draft_tokens": 0})
    assert info.value.field == "speculation.num_draft_tokens"


# --------------------------------------------------------------------------- thinking


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        (True, True),
        (False, False),
        ("on", True),
        ("true", True),
        ("off", False),
        ("false", False),
        ("none", False),
        ("auto", None),
        ("minimal", "minimal"),
        ("low", "low"),
        ("MEDIUM", "medium"),
        (" high ", "high"),
        ("xhigh", "xhigh"),
    ],
)
def test_thinking_accepted(value, expected):
    assert normalize_thinking(value) == expected


@pytest.mark.parametrize("value", ["max", "", "yes", 1, 0, 0.5, {"level": "low"}, ["low"]])
def test_thinking_rejected(value):
    with pytest.raises(InvalidControls) as info:
        normalize_thinking(value)
    assert info.value.field == "thinking"


def test_thinking_precedence():
    assert resolve_thinking() == (None, "model_default")
    assert resolve_thinking(call="high", run=False, provider=True, policy="low") == ("high", "call")
    assert resolve_thinking(call=None, run=False, provider=True) == (False, "run")
    assert resolve_thinking(call="auto", provider="on") == (True, "provider")
    assert resolve_thinking(policy="low") == ("low", "policy")


# --------------------------------------------------------------------------- resolve_controls


def test_resolve_controls_records_sources_and_round_trips():
    resolved = resolve_controls(
        call={"speculation": {"num_draft_tokens": 3}},
        run={"thinking": "high"},
        provider=None,
        policy={"speculation": {"mode": "native_mtp", "num_draft_tokens": 2, "require_acceleration": True}},
        verified_default=False,
    )
    assert resolved.speculation == mtp(num_draft_tokens=3, require_acceleration=True)
    assert resolved.thinking == "high"
    assert resolved.sources == {"speculation": "call", "thinking": "run"}
    metadata = resolved.to_metadata()
    assert metadata == {
        "speculation": {"mode": "native_mtp", "num_draft_tokens": 3, "require_acceleration": True},
        "speculation_source": "call",
        "thinking": "high",
        "thinking_source": "run",
    }
    assert ResolvedControls.from_metadata(json.loads(json.dumps(metadata))) == resolved


def test_resolve_controls_defaults():
    resolved = resolve_controls(verified_default=True)
    assert resolved.to_metadata() == {
        "speculation": {"mode": "native_mtp", "num_draft_tokens": 2, "require_acceleration": False},
        "speculation_source": "verified_default",
        "thinking": None,
        "thinking_source": "model_default",
    }
    off = resolve_controls(call={"speculation": False, "thinking": False}, verified_default=True)
    assert off.to_metadata()["speculation"] is False
    assert ResolvedControls.from_metadata(off.to_metadata()) == off


@pytest.mark.parametrize(
    ("layer", "field"),
    [({"temperature": 0}, "temperature"), ("fast", "call"), ({"speculation": "x"}, "speculation")],
)
def test_resolve_controls_rejects_bad_layers(layer, field):
    with pytest.raises(InvalidControls) as info:
        resolve_controls(call=layer, verified_default=False)
    assert info.value.field == field


def test_unset_sentinel():
    assert repr(UNSET) == "UNSET"
    assert not UNSET
    assert UNSET is not None
    assert pickle.loads(pickle.dumps(UNSET)) is UNSET


# --------------------------------------------------------------------------- sampling


def test_sampling_accepts_and_normalizes():
    controls = normalize_sampling(
        temperature=0,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=-0.5,
        frequency_penalty=2,
        logit_bias={"42": -5, 7: 100},
        seed=0,
    )
    assert controls.temperature == 0.0 and isinstance(controls.temperature, float)
    assert controls.logit_bias == ((7, 100.0), (42, -5.0))
    assert normalize_sampling(**json.loads(json.dumps(controls.to_dict()))) == controls
    assert normalize_sampling() == Sampling()
    assert normalize_sampling().to_dict() == {}
    assert hash(controls) == hash(normalize_sampling(**controls.to_dict()))


def test_limits_normalize():
    assert normalize_stop("###") == ("###",)
    assert normalize_stop(["a", "b"]) == ("a", "b")
    assert normalize_stop(None) == ()
    assert normalize_max_output_tokens(16) == 16
    for bad, check in (([""], normalize_stop), (5, normalize_stop), (["a", 1], normalize_stop)):
        with pytest.raises(InvalidControls) as info:
            check(bad)
        assert info.value.field == "stop"
    for bad in (0, True, 2.5):
        with pytest.raises(InvalidControls) as info:
            normalize_max_output_tokens(bad)
        assert info.value.field == "max_output_tokens"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "0"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"a": 1}}, "logit_bias.a"),
        ({"logit_bias": {"-1": 1}}, "logit_bias.-1"),
        ({"logit_bias": {"²": 1}}, "logit_bias.²"),  # "²".isdigit() is true, int("²") raises
        ({"logit_bias": {"٣": 1}}, "logit_bias.٣"),  # int("٣") would be 3
        ({"logit_bias": {"1_0": 1}}, "logit_bias.1_0"),
        ({"logit_bias": {1: 101}}, "logit_bias.1"),
        ({"logit_bias": {1: None}}, "logit_bias.1"),
        ({"seed": -1}, "seed"),
        ({"seed": False}, "seed"),
        ({"stop": "x"}, "stop"),
        ({"max_output_tokens": 5}, "max_output_tokens"),
    ],
)
def test_sampling_rejected(kwargs, field):
    with pytest.raises(InvalidControls) as info:
        normalize_sampling(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0}, True),
        (
            {
                "temperature": 0,
                "min_p": 0,
                "repetition_penalty": 1,
                "presence_penalty": 0,
                "frequency_penalty": 0,
                "logit_bias": {},
                "top_p": 0.5,
                "top_k": 3,
                "seed": 1,
            },
            True,
        ),
        ({}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0, "min_p": 0.1}, False),
        ({"temperature": 0, "repetition_penalty": 1.2}, False),
        ({"temperature": 0, "presence_penalty": 0.1}, False),
        ({"temperature": 0, "frequency_penalty": 0.1}, False),
        ({"temperature": 0, "logit_bias": {1: 1}}, False),
    ],
)
def test_is_greedy_neutral(kwargs, greedy):
    assert normalize_sampling(**kwargs).is_greedy_neutral() is greedy


@pytest.mark.parametrize("name", ["mlx_batch_wait_ms", "mlx_burst_gap_ms"])
@pytest.mark.parametrize("value", [-1, 1001, True, "2"])
def test_collection_windows_are_bounded(dense_model, name, value):
    from abstractruntime_mlx import create_llm

    with pytest.raises(InvalidControls) as info:
        create_llm("mlx", model=dense_model, mlx_batching=True, **{name: value})
    assert info.value.field == name


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("42", 42),
        (" 7 ", 7),
        ("-3", -3),
        ("+3", 3),
        ("²", None),
        ("٣", None),
        ("１", None),
        ("1_000", None),
        ("", None),
        ("4.0", None),
        ("9" * 5000, None),
    ],
)
def test_integers_from_text_are_ascii_digits_only(text, expected):
    from abstractruntime_mlx.json_values import parse_ascii_int

    assert parse_ascii_int(text) == expected


@pytest.mark.parametrize("word", ["²", "٣", "１"])
def test_a_speculation_depth_in_unicode_digits_is_refused(word):
    from abstractruntime_mlx.controls import parse_speculation_option

    with pytest.raises(InvalidControls) as info:
        parse_speculation_option(word)
    assert info.value.code == "invalid_controls" and info.value.field == "speculation"
    assert parse_speculation_option("2") == SpeculationControl(mode="native_mtp", num_draft_tokens=2)
