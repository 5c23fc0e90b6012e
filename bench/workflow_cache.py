"""Workflow-aware prefix-cache eviction against LRU: N concurrent runs of a multi-agent flow.

    python bench/workflow_cache.py                 # 8 runs of a 4-agent chain, 2 turns an agent
    python bench/workflow_cache.py --runs 4 --agents 3 --budget-fraction 0.33 --json out.json

The flow (built here, VisualFlow JSON): start -> agent_1 -> ... -> agent_K -> end. Each agent
has its own long system prompt (the same in every run, so in one cache scope the runs share its
blocks) and runs ``--turns`` turns: the first sends the system prompt, the run's task and the
previous agent's answer; each later turn re-sends that transcript plus the answer and a tool
observation, as an agent does. Every (run, agent) has its own ``prompt_cache_key``, as the host
derives one per node. The runs start together, each a little behind the previous one
(``--stagger-ms``), so at any time they are at different agents.

The same workload runs twice in one process, each on its own resident model with a prefix-cache
budget of ``--budget-fraction`` of the workload's working set (what the cache holds after the
workload on a roomy budget, measured first):

- ``lru``: upstream's eviction (least recently released first);
- ``graph``: before each call the run sends its eviction hints (``prompt_cache_hints``): the
  steps from the current agent to every agent of the flow, from the flow's graph
  (``prediction.steps_to_llm_nodes``): the current agent's key 0, a later agent's key its edge
  count, an earlier agent's key None (no live run reaches it again); and an agent's key is
  pinned between its turns (``prompt_cache_pin``), released after its last turn. When a run
  ends, its keys are hinted None.

Printed: aggregate node TTFT (the sum over every call of ``metadata.execution.ttft_s``), the
cached-token ratio (restored / prompt tokens, all calls), wall time, the ratio graph/LRU, and
whether every greedy answer was the same in both modes. Target: LRU's aggregate TTFT >= 1.5x
the graph-aware one's.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MAX_NEW = 8
PIN_TTL_S = 120.0
ROLES = ["planner", "researcher", "coder", "reviewer", "writer", "tester"]
RULE = "Rule {i} for the {role}: read the whole task, keep every answer short and exact, and say what you checked. "
OBSERVATION = "observation {n}: the tool returned status ok with {m} lines from service-{s}; nothing else changed. "


def flow_of(agents: int) -> dict[str, Any]:
    nodes = [{"id": "start", "type": "on_flow_start"}]
    nodes += [{"id": f"agent_{k}", "type": "agent"} for k in range(1, agents + 1)]
    nodes.append({"id": "end", "type": "on_flow_end"})
    ids = [n["id"] for n in nodes]
    edges = [
        {"source": a, "sourceHandle": "exec-out", "target": b, "targetHandle": "exec-in"} for a, b in zip(ids, ids[1:])
    ]
    return {"id": "bench-workflow-cache", "nodes": nodes, "edges": edges}


def system_prompt(k: int, rules: int) -> str:
    role = ROLES[(k - 1) % len(ROLES)]
    return f"You are agent {k}, the {role}. " + "".join(RULE.format(i=i, role=role) for i in range(rules))


def run_workload(
    llm: Any, *, mode: str, runs: int, agents: int, turns: int, rules: int, stagger_s: float, pins: bool = True
) -> dict[str, Any]:
    from abstractruntime_mlx.runtime_plugin.prefetch.prediction import steps_to_llm_nodes

    flow = flow_of(agents)
    nodes = [f"agent_{k}" for k in range(1, agents + 1)]
    steps_from = {node: steps_to_llm_nodes(flow, node) for node in nodes}
    calls: list[dict[str, Any]] = []
    answers: dict[tuple[int, str, int], list[int]] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def hints_at(run: int, node: str) -> dict[str, int | None]:
        reach = steps_from[node]
        return {f"run{run}/{n}": (0 if n == node else reach.get(n)) for n in nodes}

    def one_run(run: int) -> None:
        try:
            time.sleep(run * stagger_s)
            previous = f"Task {run}: summarise what changed in release {run}.{run}."
            for k, node in enumerate(nodes, start=1):
                key = f"run{run}/{node}"
                if mode == "graph":
                    llm.prompt_cache_hints(hints_at(run, node))
                messages = [
                    {"role": "system", "content": system_prompt(k, rules)},
                    {"role": "user", "content": f"Run {run}. {previous}"},
                ]
                for turn in range(turns):
                    result = llm.generate(
                        "",
                        messages=messages,
                        max_output_tokens=MAX_NEW,
                        thinking=False,
                        temperature=0.0,
                        prompt_cache_key=key,
                    )
                    if mode == "graph" and pins and turn < turns - 1:
                        llm.prompt_cache_pin(key, PIN_TTL_S)  # between its turns (a tool call's wait)
                    with lock:
                        answers[(run, node, turn)] = list(result.token_ids)
                        calls.append(
                            {
                                "ttft_s": float(result.metadata["execution"]["ttft_s"]),
                                "prompt": int(result.usage["prompt_tokens"]),
                                "cached": int(result.usage.get("cached_input_tokens", 0)),
                            }
                        )
                    messages = messages + [
                        {"role": "assistant", "content": result.content},
                        {"role": "user", "content": OBSERVATION.format(n=turn, m=run + turn, s=k) * 3},
                    ]
                if mode == "graph" and pins:
                    llm.prompt_cache_release(key)
                previous = f"The previous agent answered: {result.content}"
            if mode == "graph":
                llm.prompt_cache_hints({f"run{run}/{n}": None for n in nodes})
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
            errors.append(exc)

    started = time.perf_counter()
    threads = [threading.Thread(target=one_run, args=(r,)) for r in range(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    prompt = sum(c["prompt"] for c in calls)
    cached = sum(c["cached"] for c in calls)
    stats = llm.get_prompt_cache_stats()
    return {
        "mode": mode,
        "calls": len(calls),
        "aggregate_ttft_s": round(sum(c["ttft_s"] for c in calls), 4),
        "cached_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "wall_s": round(wall, 3),
        "eviction": stats.get("eviction"),
        "resident_bytes": stats["memory"]["resident_bytes"],
        "max_bytes": stats["memory"]["max_bytes"],
        "answers": answers,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=8, help="concurrent runs (default 8)")
    ap.add_argument("--agents", type=int, default=4, help="agents in the chain (default 4)")
    ap.add_argument("--turns", type=int, default=2, help="turns an agent (default 2)")
    ap.add_argument("--rules", type=int, default=24, help="rules in each system prompt (default 24: ~600 tokens)")
    ap.add_argument(
        "--budget-fraction", type=float, default=1 / 3, help="prefix-cache budget / working set (default 1/3)"
    )
    ap.add_argument("--stagger-ms", type=float, default=40.0, help="delay between run starts (default 40 ms)")
    ap.add_argument(
        "--pins",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="graph mode pins an agent between its turns (default on)",
    )
    ap.add_argument(
        "--model", default=None, help="a checkpoint directory (default: the tiny dense-long model, built offline)"
    )
    ap.add_argument("--json", dest="json_out", default=None, help="write every figure here")
    args = ap.parse_args(argv)

    from abstractruntime_mlx import create_llm
    from abstractruntime_mlx.testing import tiny_model

    scratch = tempfile.TemporaryDirectory(prefix="bench-workflow-cache-")
    model = Path(args.model) if args.model else tiny_model(Path(scratch.name) / "dense-long", kind="dense-long")

    def load(budget_gb: float | None) -> Any:
        options: dict[str, Any] = {"mlx_batching": True, "mlx_max_batch_size": args.runs, "speculation": False}
        if budget_gb is not None:
            options["mlx_cache_memory_max_gb"] = budget_gb
        return create_llm("mlx", model=str(model), **options)

    # The working set: what the cache holds after the workload on a roomy budget (nothing evicted).
    roomy = load(None)
    try:
        run_workload(
            roomy,
            mode="lru",
            runs=args.runs,
            agents=args.agents,
            turns=args.turns,
            rules=args.rules,
            stagger_s=args.stagger_ms / 1000,
        )
        working_set = int(roomy.get_prompt_cache_stats()["memory"]["resident_bytes"])
    finally:
        roomy.unload_model()
    budget = int(working_set * args.budget_fraction)
    print(
        f"model {model}; python {platform.python_version()} {platform.machine()}; runs "
        f"{args.runs}, agents {args.agents}, turns {args.turns}; working set "
        f"{working_set / 1e6:.2f} MB; budget {budget / 1e6:.2f} MB ({args.budget_fraction:.2f})",
        flush=True,
    )
    results = {}
    for mode in ("lru", "graph"):
        llm = load(budget / (1 << 30))
        try:
            results[mode] = run_workload(
                llm,
                mode=mode,
                runs=args.runs,
                agents=args.agents,
                turns=args.turns,
                rules=args.rules,
                stagger_s=args.stagger_ms / 1000,
                pins=args.pins,
            )
        finally:
            llm.unload_model()
        r = results[mode]
        print(
            f"{mode:>5}: {r['calls']} calls, aggregate TTFT {r['aggregate_ttft_s']:.3f} s, cached "
            f"{r['cached_tokens']}/{r['prompt_tokens']} ({r['cached_ratio']:.1%}), wall {r['wall_s']:.2f} "
            f"s, resident {r['resident_bytes'] / 1e6:.2f}/{r['max_bytes'] / 1e6:.2f} MB",
            flush=True,
        )
    lru, graph = results["lru"], results["graph"]
    identical = lru["answers"] == graph["answers"]
    speedup = lru["aggregate_ttft_s"] / graph["aggregate_ttft_s"] if graph["aggregate_ttft_s"] else float("inf")
    print(
        f"aggregate TTFT LRU / graph-aware: {speedup:.2f}x (target >= 1.5x); greedy "
        f"answers identical: {identical}; graph eviction: {graph['eviction']}"
    )
    if args.json_out:
        figures = {k: {n: v for n, v in r.items() if n != "answers"} for k, r in results.items()}
        figures.update(
            speedup=round(speedup, 3),
            identical=identical,
            budget_bytes=budget,
            working_set_bytes=working_set,
            args=vars(args),
        )
        Path(args.json_out).write_text(json.dumps(figures, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
