"""The demo (`scripts/demo.sh`, i.e. `abstractruntime-mlx demo`) says what it shows, in under 60 lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from abstractruntime_mlx.cli.demo_cmd import speculation_outcome, speculation_why
from abstractruntime_mlx.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_demo_fits_a_screen_and_explains_its_mtp_outcomes(cli_env, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the demo names examples/fanout.json, as scripts/demo.sh runs it
    code = main(["demo", "--ledger", str(cli_env)])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert code == 0, err
    assert len(lines) < 60, out
    # step 1: three runs, four nodes of the first, each with its own call time (not the 5 ms a
    # prefetched sibling's step takes): every call of the batch lasts more than its queue
    rows = [line.split() for line in lines if re.match(r"\s+(plain|mtp2|inherit|think)\s+\d+ms", line)]
    batched, alone = rows[:4], rows[4:]
    assert len(batched) == 4 and len(alone) == 4
    assert all(int(r[1].removesuffix("ms")) >= int(r[2].removesuffix("ms")) for r in batched)
    assert {r[5] for r in batched} == {"4"} and {r[5] for r in alone} == {"1"}
    # an MTP node deferred under load says why; alone it speculates
    mtp_batched = next(line for line in lines if re.match(r"\s+mtp2\s", line))
    assert "not used: deferred_under_load" in mtp_batched
    assert any("MTP asked for, not used (deferred_under_load)" in line for line in lines)
    assert re.search(r"mtp2 .* used, \d+/\d+ drafted tokens accepted", "\n".join(lines[lines.index(mtp_batched) + 1 :]))
    assert sum("mlx_fanout" in line and "completed" in line for line in lines) == 4  # runs list: 3 + 1


def test_speculation_outcomes_in_words():
    assert speculation_outcome({"requested": False}) == "off"
    used = {
        "requested": True,
        "mode": "native_mtp",
        "num_draft_tokens": 2,
        "used": True,
        "accepted_tokens": 14.0,
        "drafted_tokens": 35,
    }
    assert speculation_outcome(used) == "native_mtp(2) used, 14/35 drafted tokens accepted"
    deferred = {
        "requested": True,
        "mode": "native_mtp",
        "num_draft_tokens": 2,
        "used": False,
        "reason": "deferred_under_load",
    }
    assert speculation_outcome(deferred) == "native_mtp(2) not used: deferred_under_load"
    assert speculation_why("deferred_under_load") != speculation_why("some_other_reason")
    assert speculation_why("no_mtp_drafter_for_model") == "see docs/provider.md"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no-such-flow.json"], r"error: .*no-such-flow\.json"),
        (["--runs", "0"], r"error: \[invalid_request\] --runs must be >= 1"),
        (["--runs", "many"], None),
    ],
)
def test_bad_demo_arguments_are_one_error(cli_env, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(ROOT)
    if message is None:  # argparse refuses it before the command runs
        with pytest.raises(SystemExit) as exc:
            main(["demo", *argv, "--ledger", str(cli_env)])
        assert exc.value.code == 2
        return
    code = main(["demo", *argv, "--ledger", str(cli_env)])
    _, err = capsys.readouterr()
    assert code == 1 and re.search(message, err), err
    assert not cli_env.exists()  # nothing ran, no ledger written
