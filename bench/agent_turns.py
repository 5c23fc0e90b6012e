"""Agent turns: a ReAct-shaped conversation with prefix reuse on and off, 1, 4 and 8 sessions at once.

    python bench/agent_turns.py                 # tiny dense-long model, 8 turns, sessions 1/4/8, in process + serve
    python bench/agent_turns.py --quick         # 4 turns, sessions 1/4, in process only
    python bench/agent_turns.py --json out.json # also write every figure
    python bench/agent_turns.py --profile --turns 20  # one session: where each ms of a keyed turn goes
    python bench/agent_turns.py --restart       # turns, a restart on the same SSD dir, the next turn
    python bench/agent_turns.py --targets       # the resident-turn targets: 20 turns at 1 and 4, and --restart

The conversation has the shape of the host's ReAct agent: a system prompt and tool schema of
about 2,500 tokens (instructions plus 8 tool definitions, rendered by the chat template), the
task, then each turn the agent's answer (greedy, 16 new tokens) and a tool observation of
about 350 tokens, so the prompt grows from ~2,500 to ~5,000 tokens over 8 turns. Every turn
re-sends the whole transcript, as the agent does.

Each concurrency runs every session's conversation (the sessions start together; each runs
its turns one after another) twice in one process, on one resident model
(``mlx_batching=True``, ``mlx_max_batch_size=8``): reuse off (no ``prompt_cache_key``: the
whole transcript is prefilled every turn) and reuse on (one key per session, as the host
derives it). The prompt cache is cleared before each phase, so no phase finds another's
blocks; sessions of one phase share the system prompt and tools, like N runs of one flow.
``--serve`` repeats both phases through ``abstractruntime-mlx serve`` (a subprocess on
127.0.0.1) with the remote client.

Figures, per concurrency and path: TTFT by turn (median over sessions, the engine's
``metadata.execution.ttft_s``) with and without reuse and their ratio; TTFT growth from turn 2
to the last turn; cached / prompt tokens of every session's first turn (the leader prefills
the shared prefix, the others restore it); aggregate generated tok/s over the phase's wall
time; the most RAM the cache held against its budget; and whether every greedy answer was the
same with reuse and without.

Targets: turn k >= 2 TTFT with reuse <= 1/4 of without; TTFT turn 2 -> last <= 1.5x with
reuse; sessions 2..N find >= 80% of their first prompt cached; aggregate tok/s with reuse >=
without at every concurrency; resident cache bytes within the budget.
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

MAX_NEW = 16
TOOL_NAMES = [
    "list_files",
    "read_file",
    "write_file",
    "edit_file",
    "search_files",
    "run_tests",
    "fetch_issue",
    "post_comment",
]
RULES = [
    "Think about which tool moves the task forward, call exactly one tool, then wait for its observation.",
    "Never invent an observation: only the tool's own output tells you what happened.",
    "Keep arguments small; read a file before you edit it, and edit with the smallest change that works.",
    "When the task is done, answer with a short summary of what changed and where, and call no tool.",
    "If a tool fails twice with the same error, stop and explain what you tried and what you need.",
    "Prefer reading the tests first: they say what the code is supposed to do better than its comments.",
]
OBSERVATION = (
    "line {n}: def handler_{n}(request, context): return dispatch(request.kind, context.user, limit={n}) "
    "# retries {r} times, logs to service-{s}.log, owner team-{t}\n"
)


def tools() -> list[dict[str, Any]]:
    out = []
    for i, name in enumerate(TOOL_NAMES):
        description = (
            f"{name.replace('_', ' ').capitalize()}. Use it when the task needs it; it returns the result as text. "
            "Arguments are checked before anything runs; a bad argument returns an error naming it."
        )
        out.append({
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": f"the path or identifier the {name} call works on"},
                        "query": {"type": "string", "description": "what to look for, as plain words or a pattern"},
                        "limit": {"type": "integer", "description": f"at most this many results (default {10 + i})"},
                    },
                    "required": ["path"],
                },
            },
        })  # fmt: skip
    return out


def system_prompt(label: str, target_tokens: int, count: Any) -> str:
    parts = [f"[{label}] You are a software agent working in a repository through tools.\n\nRules:\n"]
    i = 0
    while count(parts) < target_tokens:
        parts.append(f"{i + 1}. {RULES[i % len(RULES)]}\n")
        i += 1
    return "".join(parts)


def observation(session: int, turn: int, lines: int) -> str:
    return "".join(OBSERVATION.format(n=turn * 100 + k, r=k % 5, s=session, t=(session + k) % 7) for k in range(lines))


def run_session(
    generate: Any,
    session: int,
    system: str,
    tool_schema: list[dict[str, Any]],
    *,
    turns: int,
    key: str | None,
    obs_lines: int,
) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Task {session}: find why handler_{session} times out and fix it."},
    ]
    rows = []
    for turn in range(turns):
        kwargs: dict[str, Any] = dict(
            messages=messages, tools=tool_schema, max_output_tokens=MAX_NEW, temperature=0, thinking=False
        )
        if key is not None:
            kwargs["prompt_cache_key"] = key
        result = generate(**kwargs)
        cache = result.metadata.get("prompt_cache") or {}
        apc = cache.get("apc") or {}
        rows.append({
            "turn": turn + 1,
            "prompt_tokens": result.usage["prompt_tokens"],
            "cached_tokens": result.usage.get("cached_input_tokens") or 0,
            "completion_tokens": result.usage["completion_tokens"],
            "ttft_s": result.metadata["execution"]["ttft_s"],
            "tokens": list(result.token_ids) if result.token_ids else result.content,
            "resident_bytes": apc.get("resident_bytes"),
            "memory_max_bytes": apc.get("memory_max_bytes"),
        })  # fmt: skip
        messages = messages + [
            {"role": "assistant", "content": result.content},
            {"role": "user", "content": f"Observation from the tool:\n{observation(session, turn, obs_lines)}"},
        ]
    return rows


def run_phase(
    generate: Any,
    sessions: int,
    system: str,
    tool_schema: list[dict[str, Any]],
    *,
    turns: int,
    reuse: bool,
    label: str,
    obs_lines: int,
) -> dict[str, Any]:
    results: list[list[dict[str, Any]]] = [[] for _ in range(sessions)]
    start = threading.Barrier(sessions)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        start.wait()
        try:
            results[i] = run_session(
                generate,
                i,
                system,
                tool_schema,
                turns=turns,
                key=f"session:{label}-{i}" if reuse else None,
                obs_lines=obs_lines,
            )
        except BaseException as exc:  # noqa: BLE001 - reported after the phase
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(sessions)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    generated = sum(r["completion_tokens"] for rows in results for r in rows)
    return {"sessions": results, "wall_s": wall, "tok_s": generated / wall}


def summarize(off: dict[str, Any], on: dict[str, Any], turns: int) -> dict[str, Any]:
    def ttft(phase: dict[str, Any], turn: int) -> float:
        return statistics.median(rows[turn - 1]["ttft_s"] for rows in phase["sessions"])

    by_turn = []
    for turn in range(1, turns + 1):
        a, b = ttft(off, turn), ttft(on, turn)
        by_turn.append(
            {
                "turn": turn,
                "ttft_off_ms": a * 1000,
                "ttft_on_ms": b * 1000,
                "ratio": b / a,
                "prompt_tokens": statistics.median(rows[turn - 1]["prompt_tokens"] for rows in on["sessions"]),
                "cached_tokens": statistics.median(rows[turn - 1]["cached_tokens"] for rows in on["sessions"]),
            }
        )
    firsts = sorted(rows[0]["cached_tokens"] / rows[0]["prompt_tokens"] for rows in on["sessions"])
    resident = [r["resident_bytes"] for rows in on["sessions"] for r in rows if r["resident_bytes"] is not None]
    budget = next((r["memory_max_bytes"] for rows in on["sessions"] for r in rows if r["memory_max_bytes"]), None)
    identical = all(
        a["tokens"] == b["tokens"] for ra, rb in zip(off["sessions"], on["sessions"]) for a, b in zip(ra, rb)
    )
    return {
        "by_turn": by_turn,
        "growth_on": by_turn[-1]["ttft_on_ms"] / by_turn[1]["ttft_on_ms"] if turns > 1 else None,
        "growth_off": by_turn[-1]["ttft_off_ms"] / by_turn[1]["ttft_off_ms"] if turns > 1 else None,
        "first_turn_cached": firsts,
        "tok_s_off": off["tok_s"],
        "tok_s_on": on["tok_s"],
        "max_resident_bytes": max(resident) if resident else 0,
        "budget_bytes": budget,
        "identical": identical,
    }


def report(name: str, sessions: int, s: dict[str, Any], log: Any) -> None:
    log(f"\n{name}, {sessions} session(s):")
    log("  turn  prompt  cached   TTFT off ms   TTFT on ms   on/off")
    for row in s["by_turn"]:
        log(
            f"  {row['turn']:4d}  {row['prompt_tokens']:6.0f}  {row['cached_tokens']:6.0f}   "
            f"{row['ttft_off_ms']:11.1f}   {row['ttft_on_ms']:10.1f}   {row['ratio']:6.3f}"
        )
    later = [row["ratio"] for row in s["by_turn"][1:]]
    followers = s["first_turn_cached"][1:] if sessions > 1 else []
    checks = [
        (
            "turn >= 2 TTFT on/off <= 0.25",
            bool(later) and max(later) <= 0.25,
            f"worst {max(later):.3f}" if later else "-",
        ),
        (
            "TTFT growth turn 2 -> last <= 1.5x (on)",
            s["growth_on"] is not None and s["growth_on"] <= 1.5,
            f"{s['growth_on']:.2f}x on, {s['growth_off']:.2f}x off" if s["growth_on"] else "-",
        ),
        (
            "sessions 2..N first turn >= 80% cached",
            all(f >= 0.8 for f in followers),
            ", ".join(f"{f:.2f}" for f in s["first_turn_cached"]),
        ),
        (
            "aggregate tok/s on >= off",
            s["tok_s_on"] >= s["tok_s_off"],
            f"{s['tok_s_on']:.1f} vs {s['tok_s_off']:.1f} ({s['tok_s_on'] / s['tok_s_off']:.2f}x)",
        ),
        (
            "resident cache bytes <= budget",
            s["budget_bytes"] is None or s["max_resident_bytes"] <= s["budget_bytes"],
            f"{s['max_resident_bytes'] / 2**20:.1f} MiB of {(s['budget_bytes'] or 0) / 2**20:.0f} MiB",
        ),
        ("greedy answers identical on/off", s["identical"], ""),
    ]
    for label, ok, detail in checks:
        log(f"  [{'ok' if ok else 'MISSED'}] {label}: {detail}")


def restart(model: Path, system: str, schema: list[dict[str, Any]], turns: int, args: Any, log: Any) -> dict[str, Any]:
    """Turns 1..N-1 on one engine with an SSD tier, then the engine closes (the tier flushes)
    and turn N runs on a new engine over the same directory; turn N again on a fresh engine
    with no cache is the cold figure. Turn N+1 runs on the restarted engine: what turn N read
    from the SSD tier it restores from RAM."""
    from abstractruntime_mlx import create_llm

    disk = tempfile.TemporaryDirectory(prefix="bench-agent-turns-disk-")
    options: dict[str, Any] = dict(mlx_batching=True, speculation=False)
    engines = [create_llm("mlx", model=str(model), mlx_cache_disk_path=disk.name, **options)]
    out: dict[str, Any] = {}

    def generate(**kwargs: Any) -> Any:
        calls = out.setdefault("calls", 0) + 1
        out["calls"] = calls
        if calls < turns:
            return engines[0].generate(**kwargs)
        if calls > turns:  # the turn after the restart, on the restarted engine
            result = engines[-1].generate(**kwargs)
            out["next_disk_hits"] = int(result.metadata["prompt_cache"]["apc"].get("disk_hits", 0))
            engines[-1].unload_model(engines[-1].model)
            return result
        engines[0].unload_model(engines[0].model)  # flushes the SSD tier, releases its lock
        restarted = create_llm("mlx", model=str(model), mlx_cache_disk_path=disk.name, **options)
        engines.append(restarted)
        result = restarted.generate(**kwargs)
        out["disk_hits"] = int(result.metadata["prompt_cache"]["apc"].get("disk_hits", 0))
        asked.update(kwargs=kwargs, tokens=list(result.token_ids or []))
        return result

    asked: dict[str, Any] = {}
    rows = run_session(
        generate, 0, system, schema, turns=turns + 1, key="session:restart", obs_lines=args.observation_lines
    )
    cold_llm = create_llm("mlx", model=str(model), **options)  # turn N on no cache at all (one model a process)
    cold = cold_llm.generate(**asked["kwargs"])
    cold_llm.unload_model(cold_llm.model)
    out["cold_ttft_ms"] = cold.metadata["execution"]["ttft_s"] * 1000
    out["identical"] = asked["tokens"] == list(cold.token_ids or [])
    last, following = rows[-2], rows[-1]
    out["previous_prompt_tokens"] = rows[-3]["prompt_tokens"] if len(rows) > 2 else 0
    disk.cleanup()
    out.update(
        turn=turns,
        prompt_tokens=last["prompt_tokens"],
        cached_tokens=last["cached_tokens"],
        cached_fraction=last["cached_tokens"] / last["prompt_tokens"],
        restarted_ttft_ms=last["ttft_s"] * 1000,
        next_prompt_tokens=following["prompt_tokens"],
        next_cached_tokens=following["cached_tokens"],
        next_ttft_ms=following["ttft_s"] * 1000,
    )
    out["ratio"] = out["restarted_ttft_ms"] / out["cold_ttft_ms"]
    log(
        f"\nrestart: turn {turns} on a new engine over the same SSD dir: {out['cached_tokens']}/{out['prompt_tokens']} "
        f"cached ({out['cached_fraction']:.1%}; the previous turn's prompt was {out['previous_prompt_tokens']}; "
        f"{out['disk_hits']} SSD reads); TTFT {out['restarted_ttft_ms']:.1f} ms vs cold "
        f"{out['cold_ttft_ms']:.1f} ms ({out['ratio']:.3f}); greedy identical to cold: {out['identical']}"
    )
    log(
        f"  turn {turns + 1} on the restarted engine: {out['next_cached_tokens']}/{out['next_prompt_tokens']} cached, "
        f"{out['next_disk_hits']} SSD reads (what turn {turns} read is in RAM), TTFT {out['next_ttft_ms']:.1f} ms"
    )
    log(f"  [{'PASS' if out['cached_fraction'] >= 0.9 else 'FAIL'}] restart: >= 90% of the prompt cached")
    log(f"  [{'PASS' if out['ratio'] <= 0.25 else 'FAIL'}] restart: TTFT <= 1/4 of cold")
    return out


def resident_targets(figures: dict[str, Any], log: Any) -> None:
    """The resident-turn targets, over the in-process runs of ``--targets``."""
    log("\ntargets (CPU, tiny model, ratios within one run):")
    for run in figures["runs"]:
        if run["path"] != "in process":
            continue
        later = [row["ratio"] for row in run["by_turn"][1:]]
        worst = max(later) if later else float("inf")
        log(
            f"  [{'PASS' if worst <= 1 / 8 else 'FAIL'}] {run['sessions']} session(s): turn >= 2 TTFT on/off <= 1/8: worst {worst:.3f}"
        )
        by_turn = run["by_turn"]
        if len(by_turn) >= 20:
            growth = by_turn[19]["ttft_on_ms"] / by_turn[1]["ttft_on_ms"]
            log(
                f"  [{'PASS' if growth <= 1.2 else 'FAIL'}] {run['sessions']} session(s): TTFT growth turn 2 -> 20 "
                f"<= 1.2x (on): {growth:.2f}x ({by_turn[1]['ttft_on_ms']:.0f} -> {by_turn[19]['ttft_on_ms']:.0f} ms)"
            )


def profile(llm: Any, system: str, schema: list[dict[str, Any]], turns: int, args: Any, log: Any) -> list[Any]:
    """One keyed session, turn by turn, with the reuse path's pieces timed (``_turn_profile``)."""
    import _turn_profile  # bench/_turn_profile.py

    _turn_profile.install()
    rows: list[dict[str, Any]] = []

    def generate(**kwargs: Any) -> Any:
        result = llm.generate(**kwargs)
        rows.append({"ttft_ms": result.metadata["execution"]["ttft_s"] * 1000, "pieces": _turn_profile.take()})
        return result

    llm.prompt_cache_clear()
    _turn_profile.take()
    sessions = run_session(
        generate, 0, system, schema, turns=turns, key="session:profile", obs_lines=args.observation_lines
    )
    labels = [label for label, *_ in _turn_profile.PIECES]
    shown = [t for t in (2, 8, 20) if t <= turns]
    log(f"\nprofile, 1 session, ms per piece (MLX synchronized after each; turns {shown}):")
    log("  " + "piece".ljust(54) + "".join(f"turn {t:>3}".rjust(10) for t in shown))
    for label in labels:
        if any(rows[t - 1]["pieces"].get(label) for t in shown):
            log("  " + label.ljust(54) + "".join(f"{rows[t - 1]['pieces'].get(label, 0.0):10.1f}" for t in shown))
    log(
        "  "
        + "TTFT (engine, submit to first token)".ljust(54)
        + "".join(f"{rows[t - 1]['ttft_ms']:10.1f}" for t in shown)
    )
    log("  " + "prompt / cached tokens".ljust(54) + "".join(
        f"{sessions[t - 1]['prompt_tokens']:>5}/{sessions[t - 1]['cached_tokens']:<4}" for t in shown
    ))  # fmt: skip
    return [{**row, **{k: v for k, v in s.items() if k != "tokens"}} for row, s in zip(rows, sessions)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 turns, sessions 1 and 4, in process only")
    ap.add_argument("--turns", type=int, default=None, help="turns per session (default 8; --quick: 4)")
    ap.add_argument("--sessions", type=int, nargs="+", default=None, help="concurrencies (default 1 4 8; --quick: 1 4)")
    ap.add_argument(
        "--system-tokens",
        type=int,
        default=300,
        help="system prompt tokens before the tool schema (default 300: ~2,500 with the tools)",
    )
    ap.add_argument(
        "--observation-lines",
        type=int,
        default=4,
        help="lines of a tool observation (default 4: ~350 new tokens a turn)",
    )
    ap.add_argument(
        "--serve",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also through serve (default: on; --quick: off)",
    )
    ap.add_argument(
        "--model", default=None, help="a checkpoint directory (default: the tiny dense-long model, built offline)"
    )
    ap.add_argument(
        "--shape",
        choices=["0.6b", "4b"],
        default=None,
        help="build a random bf16 checkpoint of this Qwen3 shape (32k context) instead",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="one session with reuse: the ms of each piece of a keyed turn (bench/_turn_profile.py)",
    )
    ap.add_argument(
        "--restart",
        action="store_true",
        help="one keyed session with an SSD tier: its last turn runs on a new engine over the same directory",
    )
    ap.add_argument(
        "--targets",
        action="store_true",
        help="20 turns at sessions 1 and 4 in process, then --restart; PASS/FAIL per target",
    )
    ap.add_argument("--json", dest="json_out", default=None, help="write every figure here")
    args = ap.parse_args(argv)
    turns = args.turns or (20 if args.targets else 4 if args.quick else 8)
    levels = args.sessions or ([1, 4] if args.quick or args.targets else [1, 4, 8])
    serve = (not (args.quick or args.targets)) if args.serve is None else args.serve

    def log(msg: str) -> None:
        print(msg, flush=True)

    from abstractruntime_mlx import create_llm
    from abstractruntime_mlx.testing import tiny_model

    scratch = tempfile.TemporaryDirectory(prefix="bench-agent-turns-")
    if args.model:
        model = Path(args.model)
    elif args.shape:
        import _models  # bench/_models.py (``python bench/X.py`` puts bench/ first on sys.path)

        model = _models.small_model(
            Path(scratch.name) / args.shape, shape={**_models.SHAPES[args.shape], "max_position_embeddings": 32768}
        )
    else:
        model = tiny_model(Path(scratch.name) / "dense-long", kind="dense-long")
    batch = max(levels)
    llm = create_llm("mlx", model=str(model), mlx_batching=True, mlx_max_batch_size=batch, speculation=False)
    encode = llm._engine.loaded.encode
    schema = tools()
    log(f"model: {model}; python {platform.python_version()}; {platform.machine()}; turns {turns}; sessions {levels}")
    figures: dict[str, Any] = {"turns": turns, "levels": levels, "runs": []}

    def count(parts: list[str]) -> int:
        return len(encode("".join(parts)))

    def measure(name: str, client: Any) -> None:
        for sessions in levels:
            phases = {}
            label = f"{name}-c{sessions}"
            system = system_prompt(label, args.system_tokens, count)
            for reuse in (False, True):
                client.prompt_cache_clear()  # each phase starts cold (reuse off stores nothing anyway)
                phases[reuse] = run_phase(
                    client.generate,
                    sessions,
                    system,
                    schema,
                    turns=turns,
                    reuse=reuse,
                    label=label,
                    obs_lines=args.observation_lines,
                )
            summary = summarize(phases[False], phases[True], turns)
            report(name, sessions, summary, log)
            figures["runs"].append({"path": name, "sessions": sessions, **summary})

    if args.restart and not args.targets:
        llm.unload_model(llm.model)
        figures["restart"] = restart(
            model, system_prompt("restart", args.system_tokens, count), schema, turns, args, log
        )
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(figures, indent=2, default=str))
        scratch.cleanup()
        return 0
    if args.profile:
        figures["profile"] = profile(llm, system_prompt("profile", args.system_tokens, count), schema, turns, args, log)
        llm.unload_model(llm.model)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(figures, indent=2, default=str))
        scratch.cleanup()
        return 0
    measure("in process", llm)
    llm.unload_model(llm.model)
    if args.targets:
        figures["restart"] = restart(
            model, system_prompt("restart", args.system_tokens, count), schema, min(turns, 8), args, log
        )
        resident_targets(figures, log)
    if serve:
        from http_serving import _free_port, _start_server  # bench/http_serving.py: serve on 127.0.0.1

        from abstractruntime_mlx.remote_client import RemoteClient

        port = _free_port()
        proc = _start_server(model, port, batch, interval_ms=5.0)
        try:
            with RemoteClient(f"http://127.0.0.1:{port}") as client:
                measure("through serve", client)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=2, default=str))
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
