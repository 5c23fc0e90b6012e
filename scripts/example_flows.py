"""Run a directory of AbstractFlow example flows with ``abstractruntime-mlx run FLOW --model M``
and print one table row per flow (flow, class, result, seconds, LLM calls, peak batch), then
one row per agent: its ReAct turns with prompt and cached tokens and TTFT by turn.

    python scripts/example_flows.py FLOWS_DIR --model /tmp/tiny [--ledger runs.sqlite] [--only ID ...]

Each flow is classed from its nodes: ``outside`` when it needs something from outside this
machine (a tool that reaches the network, a provider catalog, a knowledge-graph memory whose
embedder is a service, a recurring schedule), ``human`` when it asks a person (it must end
``waiting`` with its question shown, then complete after ``runs resume --answer``: the first
choice or ``yes``, and for a question asked a third time the words people type to leave a
loop, ``/q``, ``quit``, ``exit``, ``done``, ``no``), else by
what it uses (llm, agent, subflow, memory, timer, event). Flows classed ``outside`` are listed
but not run. Subflows resolve from FLOWS_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from abstractruntime_mlx.runtime_plugin.hosting.host import FlowBundle, kg_memory_uses, network_tool_uses  # noqa: E402

OUTSIDE_NODE_TYPES = {
    "provider_models": "provider catalog",
    "on_schedule": "recurring schedule",
}
MAX_ANSWERS = 8
# What a person types to leave a question loop (chat-style flows loop until one of these).
QUIT_WORDS = ("/q", "quit", "exit", "done", "no")


def classify(bundle: FlowBundle) -> tuple[str, str]:
    """``(class, reason)`` of a flow and everything its subflows use."""
    types = {str(node.get("type")) for _, node in bundle.nodes()}
    network = network_tool_uses(bundle)
    if network:
        return "outside", f"network tool {network[0][2]}"
    for node_type, reason in OUTSIDE_NODE_TYPES.items():
        if node_type in types:
            return "outside", reason
    if kg_memory_uses(bundle):
        return "outside", "knowledge-graph memory"
    if "ask_user" in types:
        return "human", "ask_user"
    if "wait_event" in types or "on_event" in types:
        return "event", "wait_event"
    features = [
        name
        for name, wanted in (
            ("agent", {"agent"}),
            ("subflow", {"subflow"}),
            ("memory", {"memory_note", "memory_query", "memory_rehydrate", "memory_compact", "memory_tag"}),
            ("timer", {"wait_until"}),
            ("event", {"emit_event"}),
            ("llm", {"llm_call"}),
        )
        if types & wanted
    ]
    return ("+".join(features) or "data"), ""


def _cli(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, dict[str, Any] | None, str]:
    cmd = [sys.executable, "-m", "abstractruntime_mlx.cli.main", *args, "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, None, f"timed out after {timeout:.0f}s"
    try:
        data = json.loads(proc.stdout)
        result = data[0] if isinstance(data, list) and data else None
    except json.JSONDecodeError:
        result = None
    err = (proc.stderr.strip().splitlines() or [""])[-1]
    return proc.returncode, result, err


def next_answer(waiting: dict[str, Any], asked: list[str]) -> str:
    """A person's answer: the first choice (or "yes"); the second time, the way out the question
    names ("type /q to quit"); once the same question comes a third time, the words people type
    to leave a loop, one after another, then the remaining choices."""
    choices = [str(c) for c in waiting.get("choices") or []]
    repeats = asked.count(asked[-1])
    named = [
        word
        for word in QUIT_WORDS
        if word in str(waiting.get("prompt") or "").split() or f"type {word}" in str(waiting.get("prompt") or "")
    ]
    if repeats >= 2 and named:  # the question says how to leave ("type /q to quit"): a person does, the second time
        return named[0]
    if repeats < 3:
        return choices[0] if choices else "yes"
    options = [*QUIT_WORDS, *choices[1:]]
    return options[(repeats - 3) % len(options)]


def agent_turns(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each agent's ReAct turns (its ``reason`` calls, in order): prompt tokens, of which
    restored from the prompt cache, and TTFT in ms."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for node in nodes:
        if node.get("node_id") != "reason":
            continue
        result = node.get("result") or {}
        usage = result.get("usage") or {}
        ttft = ((result.get("metadata") or {}).get("execution") or {}).get("ttft_s")
        by_run.setdefault(str(node.get("run_id")), []).append({
            "prompt": usage.get("prompt_tokens"),
            "cached": usage.get("cached_input_tokens") or 0,
            "ttft_ms": None if ttft is None else round(ttft * 1000),
        })  # fmt: skip
    return [{"run": run_id[:8], "turns": turns} for run_id, turns in by_run.items()]


def agent_rows(row: dict[str, Any]) -> list[str]:
    """Markdown rows of ``row``'s agent turns: flow, agent run, turns, then per turn
    ``prompt/cached tokens, TTFT``."""
    out = []
    for agent in row.get("agents") or []:
        turns = agent["turns"]
        cells = "; ".join(f"{t['prompt']}/{t['cached']}, {t['ttft_ms']} ms" for t in turns)
        reused = all(t["cached"] > 0 for t in turns[1:])
        out.append(f"| {row['flow']} | {agent['run']} | {len(turns)} | {cells} | {'yes' if reused else 'NO'} |")
    return out


def run_one(path: Path, cls: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    started = time.perf_counter()
    base = ["--ledger", args.ledger]
    rc, result, err = _cli(
        ["run", str(path), "--model", args.model, "--flows-dir", str(args.flows_dir), *base], env, args.timeout
    )
    answers = 0
    asked: list[str] = []
    while result is not None and result.get("status") == "waiting" and answers < MAX_ANSWERS:
        waiting = result.get("waiting") or {}
        if waiting.get("reason") == "user":
            asked.append(str(waiting.get("prompt")))
            reply = ["--answer", next_answer(waiting, asked)]
        elif waiting.get("reason") == "event" and waiting.get("event"):
            # The event the run waits for, sent as its emitter would (no payload).
            asked.append(f"event {waiting['event']}")
            reply = ["--event", str(waiting["event"])]
        else:
            break
        answers += 1
        rc, result, err = _cli(["runs", "resume", result["run_id"], *reply, *base], env, args.timeout)
    seconds = time.perf_counter() - started
    nodes = (result or {}).get("nodes") or []
    peak = max(
        [
            int(((n.get("result") or {}).get("metadata") or {}).get("execution", {}).get("peak_batch_size") or 0)
            for n in nodes
        ]
        + [0]
    )
    status = (result or {}).get("status") or "error"
    failures = (result or {}).get("failures") or []
    outcome = status if not failures else f"{status}, {len(failures)} node failure{'s' if len(failures) != 1 else ''}"
    if answers:
        outcome += f" after {answers} answer{'s' if answers != 1 else ''}"
    detail = (
        (result or {}).get("error") or (failures[0]["error"] if failures else "") or (err if rc not in (0, 3) else "")
    )
    return {
        "flow": path.stem,
        "class": cls,
        "result": outcome,
        "rc": rc,
        "seconds": round(seconds, 1),
        "llm_calls": len(nodes),
        "peak_batch": peak,
        "detail": " ".join(str(detail).split())[:160],
        "asked": asked[:1],
        "agents": agent_turns(nodes),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("flows_dir", type=Path)
    parser.add_argument("--model", required=True)
    parser.add_argument("--ledger", default="/tmp/example-flows.sqlite")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--only", nargs="*", default=None, help="flow file stems to run")
    parser.add_argument("--jsonl", default=None, help="append one JSON row per flow to this file")
    parser.add_argument(
        "--shard", default="0/1", metavar="I/N", help="run only every N-th flow starting at I (parallel runners)"
    )
    args = parser.parse_args()
    env = dict(os.environ)
    rows = []
    index, count = (int(x) for x in args.shard.split("/"))
    for position, path in enumerate(sorted(args.flows_dir.glob("*.json"))):
        if args.only and path.stem not in args.only:
            continue
        if position % count != index:
            continue
        flow = json.loads(path.read_text(encoding="utf-8"))
        try:
            cls, reason = classify(FlowBundle.resolve(flow, flows_dir=args.flows_dir))
        except ValueError as exc:
            cls, reason = "broken", str(exc)
        if cls in ("outside", "broken"):
            row = {
                "flow": path.stem,
                "class": cls,
                "result": "not run",
                "rc": None,
                "seconds": 0.0,
                "llm_calls": 0,
                "peak_batch": 0,
                "detail": reason,
            }
        else:
            row = run_one(path, cls, args, env)
        rows.append(row)
        print(
            f"| {row['flow']} | {row['class']} | {row['result']} | {row['seconds']} | "
            f"{row['llm_calls']} | {row['peak_batch']} | {row['detail']} |",
            flush=True,
        )
        if args.jsonl:
            with open(args.jsonl, "a", encoding="utf-8") as out:
                out.write(json.dumps(row) + "\n")
    agents = [line for row in rows for line in agent_rows(row)]
    if agents:
        print("\n| flow | agent run | turns | prompt/cached tokens, TTFT by turn | reuses on turns 2.. |")
        print("|---|---|---|---|---|")
        print("\n".join(agents))
    ran = [r for r in rows if r["rc"] is not None]
    ok = [r for r in ran if r["result"].startswith("completed") and "failure" not in r["result"]]
    print(
        f"\n{len(ok)}/{len(ran)} flows that need nothing from outside "
        f"completed; {len(rows) - len(ran)} not run (outside/broken)"
    )
    return 0 if len(ok) == len(ran) else 1


if __name__ == "__main__":
    sys.exit(main())
