"""Rows already decoding while a long prompt is admitted: do they stall?

    python bench/long_prompt.py                       # tiny dense-long model, CPU: about a minute
    python bench/long_prompt.py --prompt-tokens 4096 --rows 4 --repeats 3
    python bench/long_prompt.py --model 4b --model-dir /tmp/models --rows 16   # a GPU (random bf16 Qwen3-4B shape)

``--rows`` streamed requests decode (greedy, 160 tokens each); once each has 16 tokens out, a
request with a ``--prompt-tokens`` prompt arrives. For the decoding rows, the gaps between
their tokens while that prompt is prefilled (from its submit to its first token) are compared
with their gaps before it arrived: p50, p95 and max, and how long the long prompt took to its
first token. Targets: ``ours`` (text rows in the text lane's own loop, which prefills one chunk
of ``mlx_prefill_step_size`` tokens between decode steps) and ``ours_vlm``
(``mlx_text_lane=False``, mlx-vlm's loop). All in one process, alternating, on the same
checkpoint.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _models  # bench/_models.py

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
DECODE_TOKENS = 160
ARRIVE_AFTER = 16  # tokens each decoding row has out when the long prompt arrives


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _long_prompt(tokenizer: Any, tokens: int) -> str:
    text = " ".join(WORDS[(k * 7) % len(WORDS)] for k in range(tokens))
    while len(tokenizer.encode(text)) > tokens:
        text = text[: int(len(text) * 0.95)]
    return text


def one_run(llm: Any, rows: int, long_text: str) -> dict[str, float]:
    arrival: dict[int, list[float]] = {i: [] for i in range(rows)}
    ready = threading.Barrier(rows + 1)
    started = threading.Event()

    def decode(i: int) -> None:
        stream = llm.generate(
            f"row {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(30)),
            thinking=False,
            temperature=0,
            max_output_tokens=DECODE_TOKENS,
            stream=True,
        )
        announced = False
        for chunk in stream:
            if chunk.content:
                arrival[i].append(time.perf_counter())
            if not announced and len(arrival[i]) >= ARRIVE_AFTER:
                announced = True
                ready.wait()

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(rows)]
    for t in threads:
        t.start()
    ready.wait()
    submitted = time.perf_counter()
    long_stream = llm.generate(long_text, thinking=False, temperature=0, max_output_tokens=4, stream=True)
    first = None
    for chunk in long_stream:
        if first is None and (chunk.content or chunk.finish_reason):
            first = time.perf_counter()
    started.set()
    for t in threads:
        t.join()
    assert first is not None
    during: list[float] = []
    before: list[float] = []
    for times in arrival.values():
        for a, b in zip(times, times[1:]):
            if a >= submitted and b <= first:
                during.append(b - a)
            elif b < submitted:
                before.append(b - a)
    return {
        "ttft_long_s": first - submitted,
        "before_p50_ms": 1000 * statistics.median(before),
        "during_p50_ms": 1000 * statistics.median(during) if during else float("nan"),
        "during_p95_ms": 1000 * _percentile(during, 0.95) if during else float("nan"),
        "during_max_ms": 1000 * max(during) if during else float("nan"),
        "gaps_during": len(during),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-step-size", type=int, default=256)
    ap.add_argument(
        "--model",
        default="tiny",
        choices=["tiny", *_models.SHAPES],
        help="tiny: the package's dense-long checkpoint; else a random bf16 checkpoint of that shape",
    )
    ap.add_argument("--model-dir", default=None, help="where to build the checkpoint (default: a temporary directory)")
    args = ap.parse_args(argv)

    from abstractruntime_mlx import create_llm
    from abstractruntime_mlx.testing import tiny_model

    root = Path(args.model_dir or tempfile.mkdtemp(prefix="long-prompt-"))
    if args.model == "tiny":
        path = tiny_model(root / "dense-long", kind="dense-long")
    else:
        path = _models.shaped_model(root / args.model, args.model)
    targets: dict[str, dict[str, bool]] = {
        "ours": {},
        "ours_vlm": {"mlx_text_lane": False},
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    llms: dict[str, Any] = {}
    for name, options in targets.items():
        # One resident model per directory: a second set of options needs its own (file links).
        alias = root / f"{path.name}-{name}"
        alias.mkdir(exist_ok=True)
        for file in Path(path).iterdir():
            if not (alias / file.name).exists():
                (alias / file.name).symlink_to(file.resolve())
        llms[name] = create_llm(
            "mlx",
            model=str(alias),
            mlx_batching=True,
            mlx_max_batch_size=args.rows + 1,
            mlx_prefill_step_size=args.prefill_step_size,
            speculation=False,
            **options,
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    long_text = _long_prompt(tokenizer, args.prompt_tokens)
    for llm in llms.values():  # warm-up: the shapes of one whole run
        one_run(llm, args.rows, long_text)
    for _ in range(args.repeats):
        for name, llm in llms.items():
            results[name].append(one_run(llm, args.rows, long_text))
    print(
        f"\n{args.rows} rows decoding while a {len(tokenizer.encode(long_text))}-token prompt is admitted "
        f"(prefill step {args.prefill_step_size}); medians of {args.repeats} runs\n"
    )
    print("| target | gap before, p50 ms | gap during, p50 ms | p95 ms | max ms | long prompt TTFT s |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():

        def med(key: str) -> float:
            return statistics.median(r[key] for r in runs)

        print(
            f"| {name} | {med('before_p50_ms'):.1f} | {med('during_p50_ms'):.1f} | {med('during_p95_ms'):.1f} | "
            f"{med('during_max_ms'):.1f} | {med('ttft_long_s'):.2f} |"
        )
    for llm in llms.values():
        llm.unload_model()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
