"""Sampled requests in the shared batch: throughput against exclusive sampling and greedy batching,
flow runs before/after, and sibling-prefetch hit rate on flows shaped like the real ones.

    python bench/sampled.py                  # tiny + ~27M model, c = 1, 4, 8, flows (~6 min on 2 cores)
    python bench/sampled.py --quick          # tiny model, c = 1, 4, 8, 1 repeat, flows
    python bench/sampled.py --json out.json  # also write every figure

In ONE process, on the random-weight checkpoints of ``bench/_models.py`` (the package's tiny
dense model and a 27M-parameter qwen3):

1. Requests. Each concurrency c sends 2c requests (distinct 30-60-token prompts, thinking off,
   48 new tokens) from c client threads to ``create_llm("mlx", mlx_batching=True,
   mlx_max_batch_size=8, speculation=False)``, as:
   - ``greedy``: temperature 0 (the continuous lane as before);
   - ``sampled``: temperature 0.7 and a distinct seed per request, the controls of most LLM
     nodes in the public example flows (now continuous);
   - ``sampled_top_p``: the same with top_p 0.9 (adds a sort over the vocabulary per step);
   - ``exclusive``: the ``sampled`` calls under ``mlx_sampled_exclusive=True`` (the seed's
     behaviour: one at a time).
   Aggregate tok/s = completion tokens over wall time, first submit to last completion,
   summed over ``--repeats`` (targets in a rotating order per repeat).
   Targets: sampled >= 0.9x greedy at c8, sampled >= 2x exclusive at c4.
2. Flow runs. N concurrent runs (``run_flow``) of a fan-out flow: a ``parallel`` node with four
   ``llm_call`` branches that name no temperature (the compiler's default, 0.7) and take their
   prompts from the start node's pins. ``before`` = ``mlx_sampled_exclusive=True``, ``after`` =
   the default. Each node writes up to ``--flow-max-tokens`` (128) tokens. runs/s and the
   engine's peak batch. Target: after >= 2.5x before at 4 runs.
3. Prefetch hit rate on flows shaped like the public AbstractFlow examples: a ``sequence`` of
   independent ``llm_call`` branches over start-node inputs (a pin wired straight in, a
   ``concat`` of a literal and a pin, ``include_context: false`` as the editor writes it), then a
   branch that depends on the earlier answers (not predictable). Hit rate = prefetches used /
   later independent branches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _models  # bench/_models.py (``python bench/X.py`` puts bench/ first on sys.path)

from abstractruntime_mlx.runtime_plugin import run_flow

MAX_TOKENS = 48
FLOW_MAX_TOKENS = 128  # LLM nodes of real flows write paragraphs (they set no cap: 1024)
MAX_BATCH = 8
WORDS = (
    "rivers cities music planets gardens engines history language weather bridges markets "
    "forests oceans trains libraries mountains short clear kind careful useful honest quick"
).split()


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 45))) for i in range(n)]


# --- 1. requests ----------------------------------------------------------------------------


def calls_for(target: str, n: int) -> list[dict[str, Any]]:
    if target == "greedy":
        return [{"temperature": 0}] * n
    extra = {"top_p": 0.9} if target == "sampled_top_p" else {}
    return [{"temperature": 0.7, "seed": 1000 + i, **extra} for i in range(n)]


def run_point(llm: Any, target: str, c: int, seed: int, *, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    texts = prompts(2 * c, seed)
    calls = calls_for(target, len(texts))
    start = threading.Barrier(c)
    jobs = list(zip(texts, calls))
    lock = threading.Lock()
    results: list[Any] = []

    def client(k: int) -> None:
        start.wait()
        while True:
            with lock:
                if not jobs:
                    return
                text, call = jobs.pop(0)
            r = llm.generate(text, thinking=False, max_output_tokens=max_tokens, **call)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=c) as pool:
        list(pool.map(client, range(c)))
    wall = time.perf_counter() - t0
    modes = sorted({r.metadata["execution"]["mode"] for r in results})
    return {
        "tokens": sum(r.usage["completion_tokens"] for r in results),
        "wall_s": wall,
        "peak_batch": max(r.metadata["execution"]["peak_batch_size"] for r in results),
        "modes": modes,
    }


def bench_requests(models: dict[str, str], concurrency: list[int], repeats: int) -> list[dict[str, Any]]:
    from abstractruntime_mlx import create_llm

    rows: list[dict[str, Any]] = []
    targets = ["greedy", "sampled", "sampled_top_p", "exclusive"]
    for name, path in models.items():
        totals = {
            (t, c): {"tokens": 0, "wall_s": 0.0, "peak_batch": 0, "modes": set()} for t in targets for c in concurrency
        }
        options = {"mlx_batching": True, "mlx_max_batch_size": MAX_BATCH, "speculation": False}
        for repeat in range(repeats + 1):  # repeat 0 warms up every width (4 tokens per request)
            order = targets[repeat % len(targets) :] + targets[: repeat % len(targets)]
            for target in order:
                exclusive = target == "exclusive"
                llm = create_llm("mlx", model=path, mlx_sampled_exclusive=exclusive, **options)
                try:
                    for c in concurrency:
                        point = run_point(llm, target, c, seed=repeat * 100 + c, max_tokens=MAX_TOKENS if repeat else 4)
                        if repeat == 0:
                            continue
                        acc = totals[(target, c)]
                        acc["tokens"] += point["tokens"]
                        acc["wall_s"] += point["wall_s"]
                        acc["peak_batch"] = max(acc["peak_batch"], point["peak_batch"])
                        acc["modes"].update(point["modes"])
                finally:
                    llm.unload_model()
        for c in concurrency:
            row: dict[str, Any] = {"model": name, "concurrency": c}
            for t in targets:
                acc = totals[(t, c)]
                row[t] = {
                    "tok_s": round(acc["tokens"] / acc["wall_s"], 1),
                    "peak_batch": acc["peak_batch"],
                    "modes": sorted(acc["modes"]),
                }
            row["sampled_vs_greedy"] = round(row["sampled"]["tok_s"] / row["greedy"]["tok_s"], 2)
            row["sampled_vs_exclusive"] = round(row["sampled"]["tok_s"] / row["exclusive"]["tok_s"], 2)
            row["top_p_vs_greedy"] = round(row["sampled_top_p"]["tok_s"] / row["greedy"]["tok_s"], 2)
            rows.append(row)
            print(
                f"{name:5s} c{c}: greedy {row['greedy']['tok_s']:7.1f} tok/s (peak {row['greedy']['peak_batch']})  "
                f"sampled {row['sampled']['tok_s']:7.1f} (peak {row['sampled']['peak_batch']})  "
                f"top_p {row['sampled_top_p']['tok_s']:7.1f}  "
                f"exclusive {row['exclusive']['tok_s']:7.1f} (peak {row['exclusive']['peak_batch']})  "
                f"sampled/greedy {row['sampled_vs_greedy']:.2f}  sampled/exclusive {row['sampled_vs_exclusive']:.2f}  "
                f"top_p/greedy {row['top_p_vs_greedy']:.2f}",
                flush=True,
            )
    return rows


@contextlib.contextmanager
def _pack(ledger: str, model: str, options: dict[str, Any]) -> Iterator[Any]:
    """A pack over its own provider registry, so its resident model is unloaded at the end."""
    from abstractruntime_mlx.nodes import ProviderRegistry
    from abstractruntime_mlx.runtime_plugin import build_pack

    registry = ProviderRegistry()
    try:
        with build_pack(ledger, model=model, force_model=True, provider_options=options, registry=registry) as pack:
            yield pack
    finally:
        registry.close()


# --- 2. flow runs -------------------------------------------------------------------------


def fanout_flow(max_tokens: int = FLOW_MAX_TOKENS) -> dict[str, Any]:
    """Four sampled branches (no temperature: the compiler's 0.7) over start-node pins."""
    topics = ["caches", "queues", "indexes", "schedulers"]
    nodes: list[dict[str, Any]] = [
        {
            "id": "start",
            "type": "on_flow_start",
            "data": {"outputs": [{"id": "exec-out", "type": "execution"}, {"id": "topic", "type": "string"}]},
        },
        {
            "id": "fan",
            "type": "parallel",
            "data": {
                "outputs": [{"id": f"then:{i}", "type": "execution"} for i in range(4)]
                + [{"id": "completed", "type": "execution"}]
            },
        },
        {"id": "end", "type": "on_flow_end", "data": {"inputs": [{"id": "exec-in", "type": "execution"}]}},
    ]
    edges: list[dict[str, Any]] = [
        {"source": "start", "sourceHandle": "exec-out", "target": "fan", "targetHandle": "exec-in"},
        {"source": "fan", "sourceHandle": "completed", "target": "end", "targetHandle": "exec-in"},
    ]
    for i, topic in enumerate(topics):
        nodes.append(
            {
                "id": f"llm{i}",
                "type": "llm_call",
                "data": {
                    "effectConfig": {"provider": "mlx", "max_output_tokens": max_tokens, "thinking": False},
                    "pinDefaults": {"prompt": f"Write three sentences about {topic}."},
                },
            }
        )
        edges.append({"source": "fan", "sourceHandle": f"then:{i}", "target": f"llm{i}", "targetHandle": "exec-in"})
    return {
        "id": "bench_sampled_fanout",
        "name": "bench_sampled_fanout",
        "entryNode": "start",
        "nodes": nodes,
        "edges": edges,
    }


def bench_flows(model: str, runs: list[int], repeats: int, workdir: Path, max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    flow = fanout_flow(max_tokens)
    for n in runs:
        row: dict[str, Any] = {"runs": n}
        for label, exclusive in (("before", True), ("after", False)):
            wall = 0.0
            peak = 0
            modes: set[str] = set()
            for repeat in range(repeats + 1):
                ledger = f"sqlite:///{workdir / f'flows-{label}-{n}-{repeat}.sqlite'}"
                options = {"mlx_batching": True, "mlx_max_batch_size": MAX_BATCH, "mlx_sampled_exclusive": exclusive}
                with _pack(ledger, model, options) as pack:
                    t0 = time.perf_counter()
                    results = run_flow(flow, runs=n, pack=pack)
                    elapsed = time.perf_counter() - t0
                assert all(r.status == "completed" for r in results), [r.error for r in results]
                if repeat == 0:
                    continue  # warm-up
                wall += elapsed
                for r in results:
                    for node in r.nodes:
                        execution = node.result.get("metadata", {}).get("execution", {})
                        peak = max(peak, int(execution.get("peak_batch_size", 0)))
                        modes.add(execution.get("mode", "?"))
            row[label] = {"runs_s": round(n * repeats / wall, 2), "peak_batch": peak, "modes": sorted(modes)}
        row["after_vs_before"] = round(row["after"]["runs_s"] / row["before"]["runs_s"], 2)
        rows.append(row)
        print(
            f"fan-out x{n} ({max_tokens} tokens/node): before {row['before']['runs_s']:.2f} runs/s (peak "
            f"{row['before']['peak_batch']}, {row['before']['modes']})  after {row['after']['runs_s']:.2f} runs/s "
            f"(peak {row['after']['peak_batch']}, {row['after']['modes']})  after/before {row['after_vs_before']:.2f}",
            flush=True,
        )
    return rows


# --- 3. prefetch hit rate ----------------------------------------------------------------


def sequence_flow(flow_id: str, width: int) -> dict[str, Any]:
    """Shaped like the public examples' ``sequence`` flows: ``width`` independent LLM calls over
    start-node inputs, then one that combines their answers through a ``concat``."""
    nodes: list[dict[str, Any]] = [
        {
            "id": "start",
            "type": "on_flow_start",
            "data": {
                "outputs": [
                    {"id": "exec-out", "type": "execution"},
                    {"id": "query", "type": "string"},
                    {"id": "style", "type": "string"},
                ]
            },
        },
        {
            "id": "seq",
            "type": "sequence",
            "data": {"outputs": [{"id": f"then:{i}", "type": "execution"} for i in range(width + 1)]},
        },
        {"id": "intro", "type": "literal_string", "data": {"literalValue": "Answer briefly:"}},
        {
            "id": "ask",
            "type": "concat",
            "data": {
                "inputs": [{"id": "a", "type": "string"}, {"id": "b", "type": "string"}],
                "concatConfig": {"separator": "\\n"},
            },
        },
        {
            "id": "merge",
            "type": "concat",
            "data": {"inputs": [{"id": f"p{i}", "type": "string"} for i in range(width)]},
        },
        {
            "id": "end",
            "type": "on_flow_end",
            "data": {"inputs": [{"id": "exec-in", "type": "execution"}, {"id": "response", "type": "string"}]},
        },
    ]
    edges: list[dict[str, Any]] = [
        {"source": "start", "sourceHandle": "exec-out", "target": "seq", "targetHandle": "exec-in"},
        {"source": "intro", "sourceHandle": "value", "target": "ask", "targetHandle": "a"},
        {"source": "start", "sourceHandle": "query", "target": "ask", "targetHandle": "b"},
    ]
    for i in range(width):
        via_concat = i % 2 == 1
        nodes.append(
            {
                "id": f"m{i}",
                "type": "llm_call",
                "data": {
                    "effectConfig": {
                        "provider": "mlx",
                        "model": f"vendor/model-{i}",
                        "include_context": False,
                        "max_output_tokens": 24,
                    },
                    "pinDefaults": {"system": "Be terse.", "include_context": False},
                },
            }
        )
        edges.append({"source": "seq", "sourceHandle": f"then:{i}", "target": f"m{i}", "targetHandle": "exec-in"})
        source = ("ask", "result") if via_concat else ("start", "query")
        edges.append({"source": source[0], "sourceHandle": source[1], "target": f"m{i}", "targetHandle": "prompt"})
        edges.append({"source": f"m{i}", "sourceHandle": "response", "target": "merge", "targetHandle": f"p{i}"})
    nodes.append(
        {"id": "final", "type": "llm_call", "data": {"effectConfig": {"provider": "mlx", "max_output_tokens": 24}}}
    )
    edges += [
        {"source": "seq", "sourceHandle": f"then:{width}", "target": "final", "targetHandle": "exec-in"},
        {"source": "merge", "sourceHandle": "result", "target": "final", "targetHandle": "prompt"},
        {"source": "final", "sourceHandle": "response", "target": "end", "targetHandle": "response"},
    ]
    return {"id": flow_id, "name": flow_id, "entryNode": "start", "nodes": nodes, "edges": edges}


def bench_prefetch(model: str, widths: list[int], runs: int, workdir: Path) -> list[dict[str, Any]]:
    rows = []
    for width in widths:
        flow = sequence_flow(f"bench_sequence_{width}", width)
        ledger = f"sqlite:///{workdir / f'prefetch-{width}.sqlite'}"
        options = {"mlx_batching": True, "mlx_max_batch_size": MAX_BATCH}
        with _pack(ledger, model, options) as pack:
            t0 = time.perf_counter()
            results = run_flow(flow, runs=runs, pack=pack, vars={"query": "What is a cache?", "style": "plain"})
            wall = time.perf_counter() - t0
            stats = pack.prefetcher.stats.as_dict()
        assert all(r.status == "completed" for r in results), [r.error for r in results]
        predictable = (width - 1) * runs  # every independent branch after the first
        peak = max(
            int(n.result.get("metadata", {}).get("execution", {}).get("peak_batch_size", 0))
            for r in results
            for n in r.nodes
        )
        row = {
            "width": width,
            "runs": runs,
            "predictable": predictable,
            **stats,
            "hit_rate": round(stats["used"] / predictable, 2),
            "peak_batch": peak,
            "wall_s": round(wall, 2),
        }
        rows.append(row)
        print(
            f"sequence of {width}+1 x{runs} runs: prefetched {stats['launched']}, used "
            f"{stats['used']}/{predictable} (hit rate {row['hit_rate']:.2f}), mismatched "
            f"{stats['mismatched']}, throttled {stats['throttled']}, peak batch {peak}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, one repeat")
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--flow-runs", default="1,4")
    parser.add_argument(
        "--flow-max-tokens", type=int, default=FLOW_MAX_TOKENS, help="max_output_tokens of the fan-out flow's nodes"
    )
    parser.add_argument("--skip", default="", help="comma list of parts to skip: requests, flows, prefetch")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.models, args.repeats = "tiny", 1
    skip = set(filter(None, args.skip.split(",")))
    workdir = Path(tempfile.mkdtemp(prefix="bench-sampled-"))
    builders = {"tiny": _models.tiny, "small": _models.small_model}
    models = {name: str(builders[name](workdir / name)) for name in args.models.split(",")}
    concurrency = [int(c) for c in args.concurrency.split(",")]
    print(
        f"# bench/sampled.py  {platform.machine()} {platform.system()}  cpus={os.cpu_count()}  repeats={args.repeats}",
        flush=True,
    )
    out: dict[str, Any] = {"repeats": args.repeats, "max_tokens": MAX_TOKENS}
    if "requests" not in skip:
        out["requests"] = bench_requests(models, concurrency, args.repeats)
    tiny = models.get("tiny") or str(_models.tiny(workdir / "tiny"))
    if "flows" not in skip:
        out["flows"] = bench_flows(
            tiny, [int(n) for n in args.flow_runs.split(",")], args.repeats, workdir, args.flow_max_tokens
        )
    if "prefetch" not in skip:
        out["prefetch"] = bench_prefetch(tiny, [3, 4, 7], runs=2, workdir=workdir)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
