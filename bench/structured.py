"""Structured output: what a grammar costs in the shared batch, and how long schemas take to compile.

    python bench/structured.py                 # tiny + ~27M model, c = 1 and 8, 2 repeats
    python bench/structured.py --quick         # tiny model only, 1 repeat
    python bench/structured.py --json out.json

In ONE process, on the random-weight checkpoints of ``bench/_models.py``, against
``create_llm("mlx", mlx_batching=True, mlx_max_batch_size=8, speculation=False)``:

1. Throughput. Each concurrency c sends 2c requests (distinct prompts, thinking off, greedy,
   ``--max-tokens`` new tokens each) from c client threads, as
   - ``free``: no schema (the baseline);
   - ``half``: every other request carries a JSON Schema (a record with strings, numbers, an
     enum and a nested array), the rest free;
   - ``all``: every request carries the schema.
   The schema's strings are unbounded, so a random-weight model writes until the budget closes
   the answer: constrained and free requests write about as many tokens, and the figure is
   the cost of masking, not of shorter answers. Aggregate tok/s = completion tokens over wall
   time (first submit to last completion), summed over repeats in a rotating order.
   Target: ``half`` >= 0.85x ``free`` at c8 (a grammar costs <= 15%).
2. Compile time of each schema of ``SCHEMAS``: cold (first request with it) and cached, as the
   requests' ``metadata.structured.compile_s`` reports it, and the llguidance tokenizer build.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _models  # bench/_models.py (``python bench/X.py`` puts bench/ first on sys.path)

MAX_BATCH = 8
WORDS = "rivers cities music planets gardens engines history language weather bridges markets forests".split()

RECORD = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "summary": {"type": "string"},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "label": {"enum": ["good", "bad", "unknown"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"k": {"type": "string"}, "v": {"type": "number"}},
                "required": ["k", "v"],
            },
        },
    },
    "required": ["title", "summary", "score", "label", "items"],
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "record": RECORD,
    "enum": {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]},
    "recursive": {
        "$defs": {
            "n": {
                "type": "object",
                "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                "required": ["v"],
            }
        },
        "$ref": "#/$defs/n",
    },
    "flow_like": {
        "type": "object",
        "properties": {
            **{f"field_{i}": {"type": "string"} for i in range(6)},
            "steps": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "done": {"type": "boolean"},
                        "weight": {"type": "number"},
                    },
                    "required": ["name", "done"],
                },
            },
            "verdict": {"enum": ["accept", "reject", "revise"]},
        },
        "required": ["field_0", "field_1", "verdict"],
    },
}


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 45))) for i in range(n)]


def run_load(llm: Any, c: int, mode: str, max_tokens: int, seed: int) -> dict[str, float]:
    calls = prompts(2 * c, seed)
    start = threading.Barrier(c)

    def one(i: int) -> Any:
        constrained = mode == "all" or (mode == "half" and i % 2 == 1)
        extra = {"response_schema": RECORD} if constrained else {}
        return llm.generate(calls[i], thinking=False, temperature=0, max_output_tokens=max_tokens, **extra)

    def client(k: int) -> list[Any]:
        start.wait()
        return [one(i) for i in range(k, 2 * c, c)]

    began = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        results = [r for rs in pool.map(client, range(c)) for r in rs]
    wall = time.perf_counter() - began
    tokens = sum(r.usage["completion_tokens"] for r in results)
    return {"tokens": tokens, "wall_s": wall}


def bench_model(name: str, path: Path, *, concurrencies: list[int], repeats: int, max_tokens: int) -> dict[str, Any]:
    from abstractruntime_mlx import create_llm

    llm = create_llm("mlx", model=str(path), mlx_batching=True, mlx_max_batch_size=MAX_BATCH, speculation=False)
    try:
        began = time.perf_counter()
        llm.generate("warm", thinking=False, temperature=0, max_output_tokens=8, response_schema=SCHEMAS["enum"])
        first_call_s = time.perf_counter() - began  # includes the llguidance tokenizer build
        compile_rows = {}
        for schema_name, schema in SCHEMAS.items():
            cold = llm.generate("x", thinking=False, temperature=0, max_output_tokens=96, response_schema=schema)
            warm = llm.generate("y", thinking=False, temperature=0, max_output_tokens=96, response_schema=schema)
            compile_rows[schema_name] = {
                "cold_ms": round(cold.metadata["structured"]["compile_s"] * 1000, 3),
                "cached_ms": round(warm.metadata["structured"]["compile_s"] * 1000, 3),
                "cached": warm.metadata["structured"]["grammar_cached"],
            }
        modes = ["free", "half", "all"]
        table: dict[str, dict[str, float]] = {}
        for c in concurrencies:
            run_load(llm, c, "half", max_tokens, seed=99)  # warm this width
            totals = {m: {"tokens": 0.0, "wall_s": 0.0} for m in modes}
            for r in range(repeats):
                order = modes[r % 3 :] + modes[: r % 3]
                for mode in order:
                    got = run_load(llm, c, mode, max_tokens, seed=r)
                    totals[mode]["tokens"] += got["tokens"]
                    totals[mode]["wall_s"] += got["wall_s"]
            table[f"c{c}"] = {m: round(t["tokens"] / t["wall_s"], 1) for m, t in totals.items()}
        return {"model": name, "first_call_s": round(first_call_s, 3), "compile": compile_rows, "tok_s": table}
    finally:
        llm.unload_model()


def print_report(report: dict[str, Any]) -> None:
    print(f"\n## {report['model']}  (first structured call, tokenizer build included: {report['first_call_s']} s)")
    print("\n| schema | cold compile ms | cached ms |\n|---|---|---|")
    for name, row in report["compile"].items():
        print(f"| {name} | {row['cold_ms']} | {row['cached_ms']} |")
    print("\n| c | free tok/s | half tok/s | all tok/s | half/free | all/free |\n|---|---|---|---|---|---|")
    for c, row in report["tok_s"].items():
        print(
            f"| {c} | {row['free']} | {row['half']} | {row['all']} | "
            f"{row['half'] / row['free']:.2f} | {row['all'] / row['free']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only, 1 repeat unless --repeats")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per point (default 2; 1 with --quick)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args()
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 2)
    print(f"# bench/structured.py  ({platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
    with tempfile.TemporaryDirectory(prefix="arm-bench-structured-") as tmp:
        models = [("tiny", _models.tiny(Path(tmp) / "tiny"))]
        if not args.quick:
            models.append(("small-27M", _models.small_model(Path(tmp) / "small")))
        reports = [
            bench_model(n, p, concurrencies=[1, 8], repeats=repeats, max_tokens=args.max_tokens) for n, p in models
        ]
    for report in reports:
        print_report(report)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
