"""Does a batch formed by the single lane's hand-off decode slower than one started as a batch?

    python bench/handoff.py --model tiny --joiners 7 --pause-ms 30
    python bench/handoff.py --model 4b --joiners 15 --pause-ms 100     # a GPU

One scenario, with the single lane on and off (``mlx_burst_gap_ms=0``, in one process): one
request of 48 greedy tokens starts alone (on the single lane when it is on); ``--pause-ms``
later, ``--joiners`` requests of 96 tokens arrive at once and join it. For each measured repeat
it prints the median duration of the worker's decode steps while the first row is still in the
batch (with the lane on, the row that moved in with its KV cache) and after it left.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _models  # bench/_models.py (``python bench/X.py`` puts bench/ first on sys.path)
from burst import prompt  # the same distinct 40-word prompts as the burst bench


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.2f}" if values else "-"


def scenario(path: Path, *, single_lane: bool, joiners: int, pause_s: float, repeats: int) -> None:
    from abstractruntime_mlx import create_llm

    llm = create_llm(
        "mlx",
        model=str(path),
        mlx_batching=True,
        mlx_max_batch_size=max(4, joiners + 1),
        mlx_max_queue_size=max(32, 2 * joiners),
        speculation=False,
        mlx_single_lane=single_lane,
        mlx_burst_gap_ms=0,
    )
    engine = llm._engine
    steps: list[tuple[int, float]] = []  # (rows decoding, seconds) of steps with no prompt batch
    step_group = engine._step_group

    def timed_step() -> None:
        group = engine._group
        start = time.perf_counter()
        step_group()
        gen = getattr(group.backend, "_gen", None)
        if gen is not None and gen._prompt_batch is None:
            steps.append((len(gen._generation_batch), time.perf_counter() - start))

    engine._step_group = timed_step

    def call(i: int, tag: str, max_tokens: int) -> None:
        for _ in llm.generate(prompt(i, tag), stream=True, thinking=False, temperature=0, max_output_tokens=max_tokens):
            pass

    try:
        for rep in range(repeats + 1):  # the first is a warm-up
            steps.clear()
            first = threading.Thread(target=call, args=(999, f"first{rep}", 48))
            first.start()
            time.sleep(pause_s)
            with ThreadPoolExecutor(joiners) as pool:
                list(pool.map(lambda i: call(i, f"join{rep}", 96), range(joiners)))
            first.join()
            if rep == 0:
                continue
            with_first = [s for n, s in steps if n == joiners + 1]
            after = [s for n, s in steps if n == joiners]
            print(
                f"| {'on' if single_lane else 'off'} | {rep} | {len(with_first)} | {median_ms(with_first)} "
                f"| {len(after)} | {median_ms(after)} |",
                flush=True,
            )
    finally:
        llm.unload_model()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", *_models.SHAPES])
    ap.add_argument("--joiners", type=int, default=7)
    ap.add_argument("--pause-ms", type=float, default=30.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="lane on then off, this many times")
    ap.add_argument("--model-dir", default="/tmp/bench-models")
    args = ap.parse_args(argv)

    root = Path(args.model_dir)
    path = _models.tiny(root / "tiny") if args.model == "tiny" else _models.shaped_model(root / args.model, args.model)
    print(
        f"# hand-off, {args.model}: 1 request, then {args.joiners} after "
        f"{args.pause_ms:.0f} ms; median ms per decode step"
    )
    print("| single lane | repeat | steps with the first row | median ms | steps after it left | median ms |")
    print("|---|---|---|---|---|---|")
    for _ in range(args.rounds):
        for single_lane in (True, False):
            scenario(
                path, single_lane=single_lane, joiners=args.joiners, pause_s=args.pause_ms / 1000, repeats=args.repeats
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
