"""Workflow-aware prefix caching against LRU: N concurrent runs of a multi-agent flow.

    python bench/workflow_cache.py                 # 8 runs of a 4-agent chain, 4 turns an agent
    python bench/workflow_cache.py --repeats 3 --runs 4 --agents 3 --json out.json
    python bench/workflow_cache.py --turns 2 --tool-ms 0 --no-private-prompts   # the chain of shared prompts

The flow (built here, VisualFlow JSON): start -> agent_1 -> ... -> agent_K -> end. Each agent
has its own long system prompt (by default opening with the run's own context, as a prompt
naming its customer or date does, so runs share no block of it; ``--no-private-prompts``: the
same in every run, so in one cache scope the runs share its blocks) and runs ``--turns`` turns,
a tool call between two (``--tool-ms``): the first sends the system prompt, the run's task and the
previous agent's answer; each later turn re-sends that transcript plus the answer and a tool
observation, as an agent does. Every (run, agent) has its own ``prompt_cache_key``, as the host
derives one per node. The runs start together, each a little behind the previous one
(``--stagger-ms``), so at any time they are at different agents. Between two agents a run
spends ``--gap-ms`` outside the model (the runtime's tick, a tool or code node), and between two
turns of an agent ``--tool-ms`` (the tool call the agent waits on), in every mode.

Each mode runs on its own resident model with a prefix-cache budget of ``--budget-fraction`` of
the workload's working set, measured first on a roomy budget: what it read back, not all the
cache stored (each key's last prompt and every finished agent's transcript are stored and never
read again, most of it): the blocks a lookup restored at least once (``memory.reused_bytes``)
plus the resident KV later turns started from, at its peak (``memory.resident_kv.
reused_peak_bytes``: the most bytes of such entries held at one time). With shared prompts and
no tool waits (``--turns 2 --tool-ms 0 --no-private-prompts``) the runs move in step, LRU keeps
what the next call needs and caches as much as nothing evicted does: no keeping policy can
gain there. Agents waiting on tools are LRU's worst case: the entry a run needs next is the one
it left longest ago.

- ``lru``: upstream's eviction (least recently released first);
- ``graph``: before each call the run sends its eviction hints (``prompt_cache_hints``): the
  steps from the current agent to every agent of the flow, from the flow's graph
  (``prediction.steps_to_llm_nodes``): the current agent's key 0, a later agent's key its edge
  count, an earlier agent's key None (no live run reaches it again); and (``--pins``) an agent's
  key is pinned between its turns (``prompt_cache_pin``), released after its last turn. When a
  run ends, its keys are hinted None.
- ``prefetch``: ``graph``, and when an agent finishes, the next agent's prefix (its system
  prompt: what the runtime can predict before the answer is wired in) is warmed
  (``prompt_cache_warm``) during the gap, as the runtime plugin does for the nodes a node enables.

Each mode runs ``--repeats`` times, the order rotated every repeat (lru, graph, prefetch; then
graph, prefetch, lru; ...), so drift of the machine falls on every mode alike. Printed per mode:
the median aggregate node TTFT (the sum over every call of ``metadata.execution.ttft_s``) with
its range, the cached-token ratio, the prefilled (fed) tokens, the prefetched tokens, wall time;
the ratio LRU / mode of the medians; and whether every greedy answer was the same in every run.
Target: LRU's median aggregate TTFT >= 1.5x the prefetch mode's.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MAX_NEW = 8
MODES = ("lru", "graph", "prefetch")
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


def system_prompt(k: int, rules: int, run: int | None = None) -> str:
    """Agent ``k``'s system prompt; with ``run``, it opens with that run's context, so no two
    runs share a block of it (``--private-prompts``)."""
    role = ROLES[(k - 1) % len(ROLES)]
    context = f"Session {run}: you work for customer {run * 7919 % 1000}. " if run is not None else ""
    return context + f"You are agent {k}, the {role}. " + "".join(RULE.format(i=i, role=role) for i in range(rules))


def run_workload(
    llm: Any,
    *,
    mode: str,
    runs: int,
    agents: int,
    turns: int,
    rules: int,
    stagger_s: float,
    gap_s: float = 0.0,
    tool_s: float = 0.0,
    observation: int = 3,
    pins: bool = True,
    private: bool = False,
) -> dict[str, Any]:
    from abstractruntime_mlx.runtime_plugin.prefetch.prediction import steps_to_llm_nodes

    flow = flow_of(agents)
    nodes = [f"agent_{k}" for k in range(1, agents + 1)]
    steps_from = {node: steps_to_llm_nodes(flow, node) for node in nodes}
    calls: list[dict[str, Any]] = []
    answers: dict[tuple[int, str, int], list[int]] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    warms: list[dict[str, Any]] = []
    aware = mode in ("graph", "prefetch")

    def hints_at(run: int, node: str) -> dict[str, int | None]:
        reach = steps_from[node]
        return {f"run{run}/{n}": (0 if n == node else reach.get(n)) for n in nodes}

    def one_run(run: int) -> None:
        try:
            time.sleep(run * stagger_s)
            previous = f"Task {run}: summarise what changed in release {run}.{run}."
            for k, node in enumerate(nodes, start=1):
                key = f"run{run}/{node}"
                if k > 1:
                    time.sleep(gap_s)  # outside the model: the warm sent below runs here
                if aware:
                    llm.prompt_cache_hints(hints_at(run, node))
                messages = [
                    {"role": "system", "content": system_prompt(k, rules, run if private else None)},
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
                    if aware and pins and turn < turns - 1:
                        llm.prompt_cache_pin(key, PIN_TTL_S)  # between its turns (a tool call's wait)
                    with lock:
                        answers[(run, node, turn)] = list(result.token_ids)
                        calls.append(
                            {
                                "run": run,
                                "node": node,
                                "turn": turn,
                                "ttft_s": float(result.metadata["execution"]["ttft_s"]),
                                "prompt": int(result.usage["prompt_tokens"]),
                                "cached": int(result.usage.get("cached_input_tokens", 0)),
                                "prefetched": int(result.metadata["prompt_cache"].get("prefetched_tokens") or 0),
                            }
                        )
                    if turn < turns - 1:
                        time.sleep(tool_s)  # the tool call this turn asked for
                    messages = messages + [
                        {"role": "assistant", "content": result.content},
                        {"role": "user", "content": OBSERVATION.format(n=turn, m=run + turn, s=k) * observation},
                    ]
                if aware and pins:
                    llm.prompt_cache_release(key)
                if mode == "prefetch" and k < agents:
                    warms.append(
                        llm.prompt_cache_warm(
                            messages=[
                                {"role": "system", "content": system_prompt(k + 1, rules, run if private else None)}
                            ],
                            thinking=False,
                            prompt_cache_key=f"run{run}/agent_{k + 1}",
                        )
                    )
                previous = f"The previous agent answered: {result.content}"
            if aware:
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
    profile = stats["execution"]["step_profile"]
    return {
        "mode": mode,
        "calls": len(calls),
        "aggregate_ttft_s": round(sum(c["ttft_s"] for c in calls), 4),
        "cached_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "fed_tokens": prompt - cached,
        "prefetched_tokens": sum(c["prefetched"] for c in calls),
        "warms_queued": sum(1 for w in warms if w.get("queued")),
        "warms": len(warms),
        "wall_s": round(wall, 3),
        "steps": profile["num_steps"],
        "step_s": round(profile["step_s"], 3),
        "eviction": stats.get("eviction"),
        "resident_bytes": stats["memory"]["resident_bytes"],
        "max_bytes": stats["memory"]["max_bytes"],
        "answers": answers,
        "calls_detail": calls,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=8, help="concurrent runs (default 8)")
    ap.add_argument("--agents", type=int, default=4, help="agents in the chain (default 4)")
    ap.add_argument("--turns", type=int, default=4, help="turns an agent (default 4)")
    ap.add_argument("--rules", type=int, default=24, help="rules in each system prompt (default 24: ~600 tokens)")
    ap.add_argument(
        "--budget-fraction", type=float, default=1 / 3, help="prefix-cache budget / working set (default 1/3)"
    )
    ap.add_argument("--stagger-ms", type=float, default=40.0, help="delay between run starts (default 40 ms)")
    ap.add_argument("--gap-ms", type=float, default=150.0, help="time a run spends between agents (default 150 ms)")
    ap.add_argument(
        "--tool-ms", type=float, default=300.0, help="time an agent waits on its tool between turns (default 300 ms)"
    )
    ap.add_argument(
        "--observation", type=int, default=3, help="lines of a tool's observation, ~30 tokens each (default 3)"
    )
    ap.add_argument(
        "--private-prompts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each run's system prompts open with its own context, so runs share no prompt blocks (default on)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode, order rotated (default 2)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"modes to run (default {','.join(MODES)})")
    ap.add_argument(
        "--pins",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="graph modes pin an agent between its turns (default on)",
    )
    ap.add_argument(
        "--model", default=None, help="a checkpoint directory (default: the tiny dense-long model, built offline)"
    )
    ap.add_argument("--json", dest="json_out", default=None, help="write every figure here")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes takes some of {', '.join(MODES)}")

    from abstractruntime_mlx import create_llm
    from abstractruntime_mlx.testing import tiny_model

    scratch = tempfile.TemporaryDirectory(prefix="bench-workflow-cache-")
    model = Path(args.model) if args.model else tiny_model(Path(scratch.name) / "dense-long", kind="dense-long")
    workload = {
        "runs": args.runs,
        "agents": args.agents,
        "turns": args.turns,
        "rules": args.rules,
        "stagger_s": args.stagger_ms / 1000,
        "gap_s": args.gap_ms / 1000,
        "tool_s": args.tool_ms / 1000,
        "observation": args.observation,
        "private": args.private_prompts,
    }

    def load(budget_gb: float | None) -> Any:
        options: dict[str, Any] = {"mlx_batching": True, "mlx_max_batch_size": args.runs, "speculation": False}
        if budget_gb is not None:
            options["mlx_cache_memory_max_gb"] = budget_gb
        return create_llm("mlx", model=str(model), **options)

    # The working set: what the cache holds after the workload on a roomy budget (nothing evicted).
    roomy = load(None)
    try:
        ceiling = run_workload(roomy, mode="lru", **workload)
        memory = roomy.get_prompt_cache_stats()["memory"]
        # What the workload reuses (blocks a lookup restored), not all it stored: most of that
        # (each key's last prompt, an agent's transcript once it is done) is never read again.
        stored = int(memory["resident_bytes"])
        reused_blocks = int(memory["reused_bytes"])
        reused_resident = int(memory["resident_kv"]["reused_peak_bytes"])
        working_set = reused_blocks + reused_resident
    finally:
        roomy.unload_model()
    budget = int(working_set * args.budget_fraction)
    print(
        f"model {model}; python {platform.python_version()} {platform.machine()}; runs "
        f"{args.runs}, agents {args.agents}, turns {args.turns}, gap {args.gap_ms:g} ms, tool {args.tool_ms:g} ms; working set "
        f"(reused) {working_set / 1e6:.2f} MB (blocks {reused_blocks / 1e6:.2f}, resident KV at its peak "
        f"{reused_resident / 1e6:.2f}) of {stored / 1e6:.2f} MB stored; budget {budget / 1e6:.2f} MB ({args.budget_fraction:.2f}); "
        f"{args.repeats} repeats, order rotated; nothing evicted (the ceiling): cached "
        f"{ceiling['cached_ratio']:.1%}, fed {ceiling['fed_tokens']}, aggregate TTFT {ceiling['aggregate_ttft_s']:.3f} s",
        flush=True,
    )
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for repeat in range(args.repeats):
        for mode in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:
            llm = load(budget / (1 << 30))
            try:
                r = run_workload(llm, mode=mode, pins=args.pins, **workload)
            finally:
                llm.unload_model()
            results[mode].append(r)
            print(
                f"  #{repeat + 1} {mode:>8}: aggregate TTFT {r['aggregate_ttft_s']:.3f} s, cached "
                f"{r['cached_tokens']}/{r['prompt_tokens']} ({r['cached_ratio']:.1%}), fed {r['fed_tokens']}, "
                f"prefetched {r['prefetched_tokens']} (warms {r['warms_queued']}/{r['warms']} queued), wall "
                f"{r['wall_s']:.2f} s, {r['steps']} steps ({r['step_s']:.2f} s)",
                flush=True,
            )
    reference = results[modes[0]][0]["answers"]
    identical = all(r["answers"] == reference for rs in results.values() for r in rs)
    summary: dict[str, dict[str, Any]] = {}
    for mode, rs in results.items():
        ttfts = [r["aggregate_ttft_s"] for r in rs]
        summary[mode] = {
            "median_ttft_s": round(statistics.median(ttfts), 4),
            "min_ttft_s": min(ttfts),
            "max_ttft_s": max(ttfts),
            "median_cached_ratio": round(statistics.median(r["cached_ratio"] for r in rs), 4),
            "median_fed_tokens": statistics.median(r["fed_tokens"] for r in rs),
            "median_prefetched_tokens": statistics.median(r["prefetched_tokens"] for r in rs),
            "median_wall_s": round(statistics.median(r["wall_s"] for r in rs), 3),
        }
    for mode, m in summary.items():
        speedup = ""
        if "lru" in summary and m["median_ttft_s"]:
            speedup = f", LRU / {mode}: {summary['lru']['median_ttft_s'] / m['median_ttft_s']:.2f}x"
            m["speedup_vs_lru"] = round(summary["lru"]["median_ttft_s"] / m["median_ttft_s"], 3)
        print(
            f"{mode:>8}: median aggregate TTFT {m['median_ttft_s']:.3f} s (range {m['min_ttft_s']:.3f}-"
            f"{m['max_ttft_s']:.3f}), cached {m['median_cached_ratio']:.1%}, fed {m['median_fed_tokens']:g}, "
            f"prefetched {m['median_prefetched_tokens']:g}, wall {m['median_wall_s']:.2f} s{speedup}"
        )
    if "lru" in summary:
        # What keeping alone can give at most: LRU against nothing evicted (one run, on the roomy budget).
        print(f" ceiling: LRU / nothing evicted {summary['lru']['median_ttft_s'] / ceiling['aggregate_ttft_s']:.2f}x")
    print(f"greedy answers identical in every run: {identical} (target: LRU / prefetch >= 1.5x)")
    if args.json_out:
        figures = {
            "summary": summary,
            "runs": {k: [{n: v for n, v in r.items() if n != "answers"} for r in rs] for k, rs in results.items()},
            "identical": identical,
            "budget_bytes": budget,
            "working_set_bytes": working_set,
            "stored_bytes": stored,
            "ceiling": {n: v for n, v in ceiling.items() if n != "answers"},
            "args": vars(args),
        }
        Path(args.json_out).write_text(json.dumps(figures, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
