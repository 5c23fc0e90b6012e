"""The measuring parts of bench/concurrency.py: the shape log, the pure-forward loop and the
client-side mode, on the tiny model (real MLX on CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import client_side  # noqa: E402 - bench/ is not a package: its scripts import each other by name
from forward import ForwardLoop  # noqa: E402
from shapes import ShapeLog  # noqa: E402


class _Prompt:
    def __init__(self, ids: list[int], text: str = "") -> None:
        self.ids = ids
        self.text = text


def test_shape_log_counts_shapes_first_seen_in_the_process(dense_model: str) -> None:
    import mlx.core as mx
    import mlx_lm

    log = ShapeLog()
    watched = log.watch(Path(dense_model))
    assert "mlx_lm.models.qwen3.Model" in watched
    assert any(name.endswith("LanguageModel") for name in watched)  # mlx-vlm's, which our engine calls
    model, _ = mlx_lm.load(dense_model)
    try:
        with log.window() as first:
            model(mx.array([[1, 2, 3, 4, 5]]))
            model(mx.array([[5, 4, 3, 2, 1]]))
            model(mx.array([[1], [2]]))
        assert first.used == {(1, 5), (2, 1)}
        assert first.new == first.used
        assert (first.new_prefill, first.new_decode) == (1, 1)
        assert (first.prefill_calls, first.decode_calls) == (2, 1)
        with log.window() as second:
            model(mx.array([[1, 2, 3, 4, 5]]))
            model(mx.array([[1, 2, 3, 4, 5]] * 3))
        assert second.used == {(1, 5), (3, 5)}
        assert second.new == {(3, 5)}  # (1, 5) was seen in the first window
    finally:
        log.unwatch()
    with log.window() as after:
        model(mx.array([[7, 7]]))
    assert after.used == set()  # unwatched: the class's own __call__ again


def test_forward_loop_runs_waves_of_c_rows(dense_model: str) -> None:
    loop = ForwardLoop()
    loop.setup(Path(dense_model))
    try:
        prompts = [_Prompt(list(range(3, 3 + n))) for n in (6, 7, 8, 9, 10)]
        tokens, seconds, steps = loop.run(prompts, 2, 4)  # ceil(5 / 2) = 3 waves of 2 rows
    finally:
        loop.teardown()
    assert (tokens, steps) == (3 * 2 * 4, 3 * 4)
    assert seconds > 0


def test_phases_add_up_to_the_request_time() -> None:
    got = client_side.Phases(
        call=1.0, submit=1.002, admit=1.005, first=1.015, finish=1.095, first_seen=1.016, end=1.096
    )
    got.parts = {"template": 0.0005, "tokenise": 0.001}
    ms = got.split_ms()
    assert sum(ms[k] for k in client_side.PHASES) == pytest.approx(ms["total"])
    assert ms["total"] == pytest.approx(96.0)
    assert ms["template"] == pytest.approx(0.5)


@pytest.mark.slow
def test_client_mode_measures_every_target(dense_model: str, policy_file: Path) -> None:
    from transformers import AutoTokenizer

    sys.path.insert(0, str(BENCH))
    from concurrency import PromptBook

    book = PromptBook(AutoTokenizer.from_pretrained(dense_model))
    log = ShapeLog()
    log.watch(Path(dense_model))
    try:
        points = client_side.bench_client(
            "tiny",
            Path(dense_model),
            ["ours", "stream_generate", "lm_loop"],
            [1, 2],
            lambda tag, c, n: list(book.batch(tag, c, n)),
            lambda c: 3,
            1,
            8,
            lambda msg: None,
            max_batch=2,
            queue_size=32,
            shapes=log,
        )
    finally:
        log.unwatch()
    assert sorted((p.target, p.concurrency) for p in points) == sorted(
        (t, c) for t in ("ours", "stream_generate", "lm_loop") for c in (1, 2)
    )
    for p in points:
        assert p.requests == 3
        assert 0 < p.completion_tokens <= 3 * 8
        for phase in (*client_side.PHASES, "total"):
            assert p.ms[phase] >= 0, (p.target, p.concurrency, phase)  # the moments come in order
        assert p.ms["template"] + p.ms["tokenise"] <= p.ms["before_submit"]
        assert p.prefill_calls is not None and p.prefill_calls >= 1
        assert p.decode_calls is not None and p.decode_calls >= 1
        assert len(p.run_tok_s) == 1
        if p.target in ("ours", "lm_loop"):
            assert p.step_ms is not None and p.upstream_ms is not None and p.tokens_ms is not None
    ours = [p for p in points if p.target == "ours"]
    assert all("controls" in p.ms for p in ours)  # timed inside the provider, on the client thread


def test_pyspy_summary_takes_the_busiest_thread_inclusively(tmp_path: Path) -> None:
    """``bench/pyspy.py`` reads py-spy's folded stacks: the thread with the most samples, each
    function counted once per stack whatever its line, native addresses left out."""
    import pyspy

    raw = tmp_path / "profile.txt"
    raw.write_text(
        "thread (11): worker;run (loop.py:10);step (gen.py:5);eval (libmlx.so) 6\n"
        "thread (11): worker;run (loop.py:10);step (gen.py:7);0x7f00 (libc.so.6) 2\n"
        "thread (11): worker;run (loop.py:12);prompt (gen.py:40) 2\n"
        "thread (12): client;get (queue.py:3) 3\n"
        "not a sample line\n"
    )
    thread, total, shares = pyspy.busiest_thread(raw)
    assert (thread, total) == ("thread (11): worker", 10)
    assert shares == [
        (1.0, "run (loop.py)"),
        (0.8, "step (gen.py)"),
        (0.6, "eval (libmlx.so)"),
        (0.2, "prompt (gen.py)"),
    ]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert pyspy.busiest_thread(empty) == ("", 0, [])


def test_ratios_pair_the_repeats_of_one_run() -> None:
    """``ours / X`` is the pooled tok/s ratio, with each repeat's ratio beside it (the targets of a
    repeat run back to back), sorted; a target without per-repeat figures gives none."""
    from concurrency import Point, ratios

    def point(target: str, tok_s: float, runs: list[float]) -> Point:
        return Point("tiny", target, 4, 8, 512, 1.0, tok_s, None, None, run_tok_s=runs)

    got = ratios(
        [
            point("ours", 110.0, [120.0, 90.0, 100.0]),
            point("raw_lm", 100.0, [100.0, 100.0, 80.0]),
            point("abstractcore", 50.0, []),
        ]
    )
    by = {r["versus"]: r for r in got}
    assert by["raw_lm"]["ratio"] == pytest.approx(1.1)
    assert by["raw_lm"]["runs"] == [0.9, 1.2, 1.25]
    assert by["raw_lm"]["meets"] is True  # c4: >= 1.0
    assert by["abstractcore"]["runs"] == []
