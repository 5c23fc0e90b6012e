"""Prefix-reuse benchmark: an 8-turn conversation with and without ``prompt_cache_key``.

    python bench/prefix.py --repeats 1        # ~27M model, 8 turns (~30 min on 2 busy cores: ~100 s a cold turn)
    python bench/prefix.py --quick            # tiny model, 1 repeat (~20 s)
    python bench/prefix.py --json out.json    # also write every figure

In ONE process, on the random-weight ~27M ``qwen3`` checkpoint of ``bench/_models.py`` (the
tiny model with ``--quick``), one provider (``mlx_batching=True``, ``speculation=False``,
``mlx_cache_disk_path`` in a private temporary directory) runs one conversation: a long
system prompt (a ~1,500-token reference text) and 8 user turns of ~40 tokens, each answer
(greedy, 32 new tokens) appended to the history, so the prompt grows past 2,000 tokens. Each
turn is sent twice with the same ``messages``, in alternating order: without a key (the
baseline: the whole conversation is prefilled) and with ``prompt_cache_key`` (only the new
turn is). Each repeat uses a fresh key, so no repeat reuses another's snapshots.

Figures per turn (medians over repeats): prompt tokens, the cached run's
``usage.cached_input_tokens`` / prompt tokens, TTFT of both (``metadata.execution.ttft_s``:
from submission to the first token) and their ratio, and the most RAM the cache held
(``prompt_cache.apc.resident_bytes``) against its budget. Greedy tokens of the two runs
must be identical (checked, not assumed).

Then the provider is unloaded (flushing the SSD tier) and a second process loads the same
model on the same path and sends the conversation's next turn under the same key: its first
turn's cached / prompt ratio and TTFT, against a cold turn in that process.

A last phase runs the conversation again under a budget smaller than one snapshot
(``mlx_cache_memory_max_gb``: a quarter of the most the cache held, or ``--tight-mib``) to show
the budget holds: resident bytes stay under it and the next turn reports ``degraded_reason``.

Targets: from turn 2, cached/prompt >= 0.9; from turn 4, cached TTFT <= 1/5 of uncached; the
second process's first turn >= 0.9 cached; resident bytes never above the budget.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TURNS = 8
MAX_NEW = 32
QUESTIONS = [
    "Question {i}: summarise the part of the reference about {topic} "
    "in two sentences, and say what it means for a server.",
    "Question {i}: which trade-off does the reference describe for {topic}, and when would you accept it in practice?",
    "Question {i}: give one concrete failure the reference warns "
    "about for {topic}, and how an operator notices it early.",
]
TOPICS = [
    "eviction",
    "time-to-live",
    "write-back",
    "batching",
    "prefetching",
    "sharding",
    "snapshots",
    "warm restarts",
    "budgets",
]
SENTENCES = [
    "A cache keeps the results of earlier work close at hand so that "
    "later requests can reuse them instead of recomputing.",
    "Every cache needs a rule for what to drop when it is full, and "
    "least-recently-used is the rule most systems start from.",
    "A time-to-live bounds how stale an entry may become, trading freshness against the number of trips to the source.",
    "Write-back caches acknowledge a write before it reaches the "
    "backing store, which is fast but loses data on a crash.",
    "Batching many small requests into one larger step amortises fixed "
    "costs, at the price of waiting for the batch to fill.",
    "Prefetching guesses what will be needed next; a wrong guess wastes "
    "bandwidth and evicts entries that were still useful.",
    "Sharding spreads keys over several nodes so that no single node "
    "holds everything, but a hot key still lands on one.",
    "A snapshot of expensive intermediate state lets a restarted "
    "process skip work that a previous process already did.",
    "Budgets in bytes, not in entries, keep memory predictable when entries differ greatly in size.",
    "Operators watch hit ratios, eviction counts and tail latency together, because each alone can hide a regression.",
]


def system_prompt(target_tokens: int, encode: Any) -> str:
    """A reference text of about ``target_tokens`` tokens, built from fixed sentences."""
    parts: list[str] = ["You are a caching expert. Answer from this reference only.\n\nReference:\n"]
    i = 0
    while len(encode("".join(parts))) < target_tokens:
        parts.append(f"{i + 1}. {SENTENCES[i % len(SENTENCES)]}\n")
        i += 1
    return "".join(parts)


def question(i: int) -> str:
    return QUESTIONS[i % len(QUESTIONS)].format(i=i + 1, topic=TOPICS[i % len(TOPICS)])


def call(llm: Any, messages: list[dict[str, Any]], key: str | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(messages=messages, max_output_tokens=MAX_NEW, temperature=0, thinking=False)
    if key is not None:
        kwargs["prompt_cache_key"] = key
    result = llm.generate("", **kwargs)
    cache = result.metadata.get("prompt_cache") or {}
    apc = cache.get("apc") or {}
    return {
        "content": result.content,
        "tokens": list(result.token_ids),
        "prompt_tokens": result.usage["prompt_tokens"],
        "cached_tokens": result.usage.get("cached_input_tokens", 0),
        "ttft_s": result.metadata["execution"]["ttft_s"],
        "outcome": cache.get("outcome"),
        "disk_hits": apc.get("disk_hits"),
        "resident_bytes": apc.get("resident_bytes"),
        "memory_max_bytes": apc.get("memory_max_bytes"),
        "degraded_reason": cache.get("degraded_reason"),
    }


def conversation(
    llm: Any, system: str, key: str, *, log: Any, baseline: bool = True, turns: int = TURNS
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run the conversation; per turn the keyed call and (if ``baseline``) the keyless one."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    rows = []
    for turn in range(turns):
        messages = messages + [{"role": "user", "content": question(turn)}]
        order = [key, None] if turn % 2 else [None, key]
        got: dict[str | None, dict[str, Any]] = {}
        for k in order if baseline else [key]:
            got[k] = call(llm, messages, k)
        cached = got[key]
        row = {"turn": turn + 1, "cached": cached}
        if baseline:
            plain = got[None]
            row["plain"] = plain
            row["identical"] = plain["tokens"] == cached["tokens"]
            log(
                f"  turn {turn + 1}: prompt {cached['prompt_tokens']:5d}  cached {cached['cached_tokens']:5d} "
                f"({cached['cached_tokens'] / cached['prompt_tokens']:.3f})  ttft {plain['ttft_s'] * 1000:7.1f} -> "
                f"{cached['ttft_s'] * 1000:6.1f} ms  identical={row['identical']}"
            )
        rows.append(row)
        messages = messages + [{"role": "assistant", "content": cached["content"]}]
    return rows, messages


CHILD = (
    """
import json, sys, time
from abstractruntime_mlx import create_llm
model, disk, messages, key = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
t0 = time.perf_counter()
llm = create_llm("mlx", model=model, mlx_batching=True, speculation=False, mlx_cache_disk_path=disk)
load_s = time.perf_counter() - t0
out = {"load_s": load_s}
for name, k in (("cached", key), ("cold", None)):
    kw = dict(messages=messages, max_output_tokens=%d, temperature=0, thinking=False)
    if k: kw["prompt_cache_key"] = k
    r = llm.generate("", **kw)
    out[name] = {"prompt_tokens": r.usage["prompt_tokens"], "cached_tokens": r.usage.get("cached_input_tokens", 0),
                 "ttft_s": r.metadata["execution"]["ttft_s"], "tokens": r.token_ids,
                 "disk_hits": (r.metadata.get("prompt_cache") or {}).get("apc", {}).get("disk_hits")}
llm.unload_model(llm.model)
print(json.dumps(out))
"""  # noqa: UP031 - the child's source has braces of its own
    % MAX_NEW
)


def second_process(model: Path, disk: Path, messages: list[dict[str, Any]], key: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(disk), json.dumps(messages), key],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if done.returncode != 0:
        raise SystemExit(f"second process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median(values: list[float]) -> float:
    return statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 repeat")
    ap.add_argument("--repeats", type=int, default=None, help="conversations per variant (default 3; --quick: 1)")
    ap.add_argument(
        "--system-tokens", type=int, default=1500, help="length of the system prompt in tokens (default 1500)"
    )
    ap.add_argument(
        "--tight-mib",
        type=float,
        default=None,
        help="the too-small budget of the last phase, MiB (default: a quarter of the most RAM the cache held)",
    )
    ap.add_argument("--turns", type=int, default=None, help=f"conversation turns (default {TURNS})")
    ap.add_argument("--tight-turns", type=int, default=3, help="turns of the tight-budget phase (default 3)")
    ap.add_argument(
        "--model-dir", default=None, help="where to build/reuse the checkpoint (default: a temporary directory)"
    )
    ap.add_argument("--json", dest="json_out", default=None, help="write every figure here")
    args = ap.parse_args(argv)
    import _models as models  # bench/_models.py (bench/ is first on sys.path)

    repeats = args.repeats or (1 if args.quick else 3)
    turns = args.turns or TURNS

    def log(msg: str) -> None:
        print(msg, flush=True)

    from abstractruntime_mlx import create_llm

    with contextlib.ExitStack() as scratch:
        root = (
            Path(args.model_dir)
            if args.model_dir
            else Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="bench-prefix-")))
        )
        path = models.tiny(root / "tiny") if args.quick else models.small_model(root / "small")
        params = models.num_parameters(path)
        disk_root = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="bench-prefix-ssd-")))
        disk = disk_root / "cache"
        log(f"model: {path} ({params / 1e6:.1f}M parameters); python {platform.python_version()}; {platform.machine()}")

        llm = create_llm("mlx", model=str(path), mlx_batching=True, speculation=False, mlx_cache_disk_path=str(disk))
        encode = llm._engine.loaded.encode
        system = system_prompt(args.system_tokens, encode)
        call(llm, [{"role": "user", "content": "warm up"}], None)  # load kernels before timing
        runs = []
        last_messages: list[dict[str, Any]] = []
        for r in range(repeats):
            log(f"repeat {r + 1}/{repeats}")
            rows, last_messages = conversation(llm, system, f"bench-{r}", log=log, turns=turns)
            runs.append(rows)
        stats = llm.get_prompt_cache_stats()
        llm.unload_model(llm.model)  # flushes the SSD tier

        table = []
        for t in range(turns):
            per = [run[t] for run in runs]
            prompt = per[0]["cached"]["prompt_tokens"]
            ratio = median([p["cached"]["cached_tokens"] / p["cached"]["prompt_tokens"] for p in per])
            plain = median([p["plain"]["ttft_s"] for p in per])
            cached = median([p["cached"]["ttft_s"] for p in per])
            table.append(
                {
                    "turn": t + 1,
                    "prompt_tokens": prompt,
                    "cached_ratio": round(ratio, 3),
                    "ttft_uncached_ms": round(plain * 1000, 1),
                    "ttft_cached_ms": round(cached * 1000, 1),
                    "ttft_ratio": round(cached / plain, 3),
                    "identical": all(p["identical"] for p in per),
                    "max_resident_bytes": max(p["cached"]["resident_bytes"] or 0 for p in per),
                    "budget_bytes": per[0]["cached"]["memory_max_bytes"],
                }
            )

        next_turn = last_messages + [{"role": "user", "content": question(turns)}]
        log("second process on the same SSD path ...")
        child = second_process(path, disk, next_turn, f"bench-{repeats - 1}")
        child_ratio = child["cached"]["cached_tokens"] / child["cached"]["prompt_tokens"]
        log(
            f"  first turn: prompt {child['cached']['prompt_tokens']}  cached "
            f"{child['cached']['cached_tokens']} ({child_ratio:.3f}, disk hits {child['cached']['disk_hits']})  "
            f"ttft {child['cold']['ttft_s'] * 1000:.1f} (cold) -> {child['cached']['ttft_s'] * 1000:.1f} ms  "
            f"identical={child['cold']['tokens'] == child['cached']['tokens']}"
        )

        tight_mib = args.tight_mib or max(r["max_resident_bytes"] for r in table) / 4 / (1 << 20)
        log(f"tight budget: {tight_mib:.2f} MiB ...")
        tight_llm = create_llm(
            "mlx", model=str(path), mlx_batching=True, speculation=False, mlx_cache_memory_max_gb=tight_mib / 1024
        )
        tight_rows, _ = conversation(tight_llm, system, "tight", log=log, baseline=False, turns=args.tight_turns)
        tight_llm.unload_model(tight_llm.model)
        tight = {
            "budget_bytes": tight_rows[0]["cached"]["memory_max_bytes"],
            "max_resident_bytes": max(r["cached"]["resident_bytes"] or 0 for r in tight_rows),
            "outcomes": [r["cached"]["outcome"] for r in tight_rows],
            "degraded_turns": sum(1 for r in tight_rows if r["cached"]["degraded_reason"]),
            "degraded_reason": next(
                (r["cached"]["degraded_reason"] for r in tight_rows if r["cached"]["degraded_reason"]), None
            ),
        }

    log("")
    log(
        "| turn | prompt tokens | cached / prompt | TTFT uncached (ms) | TTFT cached (ms) "
        "| cached / uncached TTFT | greedy identical | max resident / budget |"
    )
    log("|---:|---:|---:|---:|---:|---:|:---:|---:|")
    for row in table:
        log(
            f"| {row['turn']} | {row['prompt_tokens']} | {row['cached_ratio']:.3f} | {row['ttft_uncached_ms']:.1f} | "
            f"{row['ttft_cached_ms']:.1f} | {row['ttft_ratio']:.3f} | {'yes' if row['identical'] else 'NO'} | "
            f"{row['max_resident_bytes'] / (1 << 20):.1f} / {row['budget_bytes'] / (1 << 20):.0f} MiB |"
        )
    log("")
    checks = {
        "cached/prompt >= 0.9 from turn 2": all(r["cached_ratio"] >= 0.9 for r in table[1:]),
        "TTFT <= 1/5 of uncached from turn 4": all(r["ttft_ratio"] <= 0.2 for r in table[3:]),
        "second process first turn >= 0.9 cached": child_ratio >= 0.9,
        "resident bytes never above the budget": all(r["max_resident_bytes"] <= r["budget_bytes"] for r in table)
        and tight["max_resident_bytes"] <= tight["budget_bytes"],
        "greedy tokens identical with and without the cache": all(r["identical"] for r in table),
    }
    log(
        f"second process: first turn cached {child_ratio:.3f} of {child['cached']['prompt_tokens']} prompt tokens, "
        f"TTFT {child['cached']['ttft_s'] * 1000:.1f} ms vs {child['cold']['ttft_s'] * 1000:.1f} ms cold "
        f"(ratio {child['cached']['ttft_s'] / child['cold']['ttft_s']:.3f}); load {child['load_s']:.2f} s"
    )
    log(
        f"tight budget {tight['budget_bytes'] / (1 << 20):.1f} MiB: max resident "
        f"{tight['max_resident_bytes'] / (1 << 20):.2f} MiB, outcomes "
        f"{tight['outcomes']}, turns with degraded_reason: {tight['degraded_turns']}"
    )
    for name, ok in checks.items():
        log(f"target {'met   ' if ok else 'MISSED'}: {name}")
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "model": str(path),
                    "parameters": params,
                    "repeats": repeats,
                    "turns": table,
                    "second_process": {**child, "cached_ratio": child_ratio},
                    "tight_budget": tight,
                    "cache_stats_at_unload": stats,
                    "targets": checks,
                },
                indent=2,
                default=str,
            )
        )
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
