"""MTP speculation benchmark: one request at depths 1-3 vs off, and load-aware optional MTP
under concurrency, all on one resident model in one process.

    python bench/speculation.py                     # tiny + ~27M hybrid, c = 2, 4, 8
    python bench/speculation.py --quick             # tiny hybrid only, c = 2, 4
    python bench/speculation.py --models small --alpha 0.05 --json out.json
    python bench/speculation.py --shape 4b --dtype bfloat16 --models custom --concurrency 0  # H200, one request

Models (built offline, random weights, the package's tokenizer): a Qwen3.5-style hybrid
(gated-delta and full-attention layers) with an *aligned* MTP head, the construction of
``abstractruntime_mlx.testing.tiny`` (target residual branches scaled by ``--alpha``; the
head predicts from the token embedding), so drafts are accepted part of the time: α=0
accepts every draft, α≈0.05 about half on the tiny shape. Acceptance is measured and
printed, never assumed. Shapes: ``tiny`` (the test model, hidden 128, 4 layers), ``small``
(hidden 512, 8 layers, ~27M parameters), ``4b`` (hidden 2560, 32 layers: the 4B shape, for
an accelerator; ``--dtype bfloat16``).

Part 1, one request: for each repeat, the same prompt with ``speculation=False`` and strict
native MTP at depths 1, 2, 3 (rotating order), greedy, ``--max-tokens`` new tokens. Reported:
decode tokens/s (``metadata.performance.generation_tokens_per_second``: after the first
token), wall tokens/s, acceptance (accepted / drafted draft tokens) and the speedup over off,
all from the same run. Greedy tokens are checked identical on and off.

Part 2, concurrency c: 2c requests from c client threads, alternating an MTP-asking request
and a plain one (``speculation=False``), under three policies on the same resident model:

- ``load_aware``: the MTP requests are optional (``require_acceleration: false``): under load
  they join the continuous batch target-only (``deferred_under_load``), alone they run MTP;
- ``fixed_cohorts``: the MTP requests are strict, so they always wait for an MTP cohort (the
  behaviour before load-aware admission, which strict requests keep);
- ``mtp_off``: every request ``speculation=False``.

Reported per point: aggregate tok/s (completion tokens over wall time, first submit to last
completion), TTFT p50/p95 of all requests and of the MTP-asking ones (the engine's
``execution.ttft_s``: from submission to the first token), and how many MTP requests ran MTP.
Repeats rotate the policy order, so a slow spell of a shared machine hits all alike. On a
shared CPU machine the absolute figures move run to run; read the ratios of one run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "linear_num_value_heads": 8,
        "linear_num_key_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
    },
    "4b": {
        "hidden_size": 2560,
        "intermediate_size": 9216,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_value_heads": 32,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
    },
}
MARKER = "bench_hybrid.json"
BUILDER_VERSION = 1
DEPTHS = (1, 2, 3)
POLICIES = ("load_aware", "fixed_cohorts", "mtp_off")
TOPICS = (
    "TTL caches",
    "LRU caches",
    "prefix caches",
    "batching",
    "speculative decoding",
    "KV caches",
    "tokenizers",
    "attention",
    "recurrent state",
    "chat templates",
    "greedy decoding",
    "beam search",
    "quantization",
    "rope scaling",
    "continuous batching",
    "prefill",
    "stop strings",
    "sampling",
)


# --------------------------------------------------------------------------- the model


def hybrid_model(path: Path, *, shape: str, alpha: float, dtype: str, seed: int = 0) -> Path:
    """Build (or reuse) an aligned hybrid target with an embedded MTP head at ``path``."""
    spec = {
        "shape": shape,
        "overrides": SHAPES[shape],
        "alpha": alpha,
        "dtype": dtype,
        "seed": seed,
        "builder_version": BUILDER_VERSION,
    }
    marker = path / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return path
    if shape == "tiny" and dtype == "float32":
        from abstractruntime_mlx.testing import tiny_model

        tiny_model(path, kind="hybrid-mtp", seed=seed, mtp_alpha=alpha)
        marker.write_text(json.dumps(spec, sort_keys=True))
        return path
    import mlx.core as mx

    from abstractruntime_mlx.testing import tiny as t
    from abstractruntime_mlx.testing.tokenizer import build_tokenizer, save_tokenizer, token_ids

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = token_ids(tokenizer)
    config = t.vlm_config(len(tokenizer), ids)
    config["text_config"].update(SHAPES[shape])
    config["vision_config"]["out_hidden_size"] = config["text_config"]["hidden_size"]
    config["torch_dtype"] = dtype
    weights = t._vlm_weights(config, seed)
    mtp = t._mtp_weights(config["text_config"], seed)
    t._align(weights, mtp, alpha)
    weights.update({f"mtp.{key}": value for key, value in mtp.items()})
    target = getattr(mx, dtype)
    weights = {key: weights[key].astype(target) for key in sorted(weights)}
    mx.eval(weights)
    save_tokenizer(tokenizer, path)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (path / "preprocessor_config.json").write_text(json.dumps(t.preprocessor_config(config["vision_config"])))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    marker.write_text(json.dumps(spec, sort_keys=True))
    return path


def num_parameters(path: Path) -> tuple[int, int]:
    """(target parameters, MTP head parameters) from the safetensors headers."""
    from abstractruntime_mlx.artifacts import is_mtp_key, read_safetensors_headers

    target = head = 0
    for header in read_safetensors_headers(path).values():
        for key, info in header.items():
            if key == "__metadata__":
                continue
            n = 1
            for dim in info["shape"]:
                n *= dim
            if is_mtp_key(key):
                head += n
            else:
                target += n
    return target, head


# --------------------------------------------------------------------------- measuring


def prompts(n: int, offset: int) -> list[str]:
    return [
        f"In a few sentences, explain {TOPICS[(offset + i) % len(TOPICS)]} to a new engineer "
        f"(question {offset + i}), and say when it matters."
        for i in range(n)
    ]


def one(llm: Any, prompt: str, max_tokens: int, speculation: Any) -> dict[str, Any]:
    started = time.perf_counter()
    result = llm.generate(prompt, thinking=False, temperature=0, max_output_tokens=max_tokens, speculation=speculation)
    wall = time.perf_counter() - started
    meta = result.metadata
    spec = meta.get("speculation", {})
    return {
        "tokens": result.usage["completion_tokens"],
        "token_ids": list(result.token_ids),
        "wall_s": wall,
        "ttft_s": meta["execution"].get("ttft_s"),
        "mode": meta["execution"].get("mode"),
        "decode_tps": meta.get("performance", {}).get("generation_tokens_per_second"),
        "used": bool(spec.get("used")),
        "reason": spec.get("reason"),
        "accepted": spec.get("accepted_tokens"),
        "drafted": spec.get("drafted_tokens"),
        "rounds": spec.get("rounds"),
    }


def single(llm: Any, *, repeats: int, max_tokens: int) -> dict[str, Any]:
    settings: list[tuple[str, Any]] = [("off", False)] + [
        (f"mtp{d}", {"mode": "native_mtp", "num_draft_tokens": d, "require_acceleration": True}) for d in DEPTHS
    ]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in settings}
    parity = True
    for r in range(repeats):
        (prompt,) = prompts(1, 100 + r)
        order = settings[r % len(settings) :] + settings[: r % len(settings)]
        got = {name: one(llm, prompt, max_tokens, spec) for name, spec in order}
        parity &= all(g["token_ids"] == got["off"]["token_ids"] for g in got.values())
        for name, g in got.items():
            runs[name].append(g)
    out: dict[str, Any] = {"parity": parity}
    for name, rs in runs.items():
        tokens = sum(r["tokens"] for r in rs)
        decode = [r["decode_tps"] for r in rs if r["decode_tps"]]
        row = {
            "wall_tps": tokens / sum(r["wall_s"] for r in rs),
            "decode_tps": statistics.median(decode) if decode else None,
        }
        drafted = sum(r["drafted"] or 0 for r in rs)
        if drafted:
            row["acceptance"] = sum(r["accepted"] or 0 for r in rs) / drafted
            row["tokens_per_round"] = tokens / max(1, sum(r["rounds"] or 0 for r in rs))
        out[name] = row
    for name in runs:
        out[name]["speedup_wall"] = out[name]["wall_tps"] / out["off"]["wall_tps"]
        if out[name]["decode_tps"] and out["off"]["decode_tps"]:
            out[name]["speedup_decode"] = out[name]["decode_tps"] / out["off"]["decode_tps"]
    return out


def policy_speculation(policy: str, depth: int) -> Any:
    if policy == "mtp_off":
        return False
    return {"mode": "native_mtp", "num_draft_tokens": depth, "require_acceleration": policy == "fixed_cohorts"}


def concurrent_point(llm: Any, c: int, policy: str, *, max_tokens: int, depth: int, offset: int) -> dict[str, Any]:
    n = 2 * c
    texts = prompts(n, offset)
    calls = [(texts[i], policy_speculation(policy, depth) if i % 2 == 0 else False, i % 2 == 0) for i in range(n)]
    results: list[tuple[bool, dict[str, Any]]] = []
    lock = threading.Lock()
    started = time.perf_counter()

    def client(k: int) -> None:
        for i in range(k, n, c):
            prompt, spec, asks = calls[i]
            r = one(llm, prompt, max_tokens, spec)
            with lock:
                results.append((asks, r))

    with ThreadPoolExecutor(max_workers=c) as pool:
        list(pool.map(client, range(c)))
    wall = time.perf_counter() - started
    return {"wall_s": wall, "results": results}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def concurrency(llm: Any, levels: list[int], *, repeats: int, max_tokens: int, depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in levels:
        pooled: dict[str, dict[str, Any]] = {p: {"wall_s": 0.0, "results": []} for p in POLICIES}
        for r in range(repeats):
            order = POLICIES[r % 3 :] + POLICIES[: r % 3]
            for policy in order:
                point = concurrent_point(llm, c, policy, max_tokens=max_tokens, depth=depth, offset=1000 * c + 10 * r)
                pooled[policy]["wall_s"] += point["wall_s"]
                pooled[policy]["results"] += point["results"]
        row: dict[str, Any] = {}
        for policy, data in pooled.items():
            results = data["results"]
            asking = [r for asks, r in results if asks]
            ttft_all = [r["ttft_s"] for _, r in results if r["ttft_s"] is not None]
            ttft_mtp = [r["ttft_s"] for r in asking if r["ttft_s"] is not None]
            row[policy] = {
                "aggregate_tps": sum(r["tokens"] for _, r in results) / data["wall_s"],
                "ttft_p50_s": pct(ttft_all, 0.5),
                "ttft_p95_s": pct(ttft_all, 0.95),
                "mtp_ttft_p50_s": pct(ttft_mtp, 0.5),
                "mtp_ttft_p95_s": pct(ttft_mtp, 0.95),
                "mtp_requests": len(asking),
                "ran_mtp": sum(1 for r in asking if r["used"]),
                "deferred": sum(1 for r in asking if r["reason"] == "deferred_under_load"),
            }
        off = row["mtp_off"]["aggregate_tps"]
        for policy in POLICIES:
            row[policy]["vs_off"] = row[policy]["aggregate_tps"] / off
        out[str(c)] = row
    return out


# --------------------------------------------------------------------------- reporting


def print_single(name: str, s: dict[str, Any]) -> None:
    print(f"\n## {name}: one request (greedy tokens identical on/off: {s['parity']})")
    print("| setting | decode tok/s | wall tok/s | acceptance | tokens/round | speedup (decode) | speedup (wall) |")
    print("|---|---|---|---|---|---|---|")
    for key in ("off", *(f"mtp{d}" for d in DEPTHS)):
        r = s[key]
        acc = f"{r['acceptance']:.0%}" if "acceptance" in r else "-"
        tpr = f"{r['tokens_per_round']:.2f}" if "tokens_per_round" in r else "-"
        dec = f"{r['decode_tps']:.1f}" if r["decode_tps"] else "-"
        sd = f"{r['speedup_decode']:.2f}x" if "speedup_decode" in r else "-"
        print(f"| {key} | {dec} | {r['wall_tps']:.1f} | {acc} | {tpr} | {sd} | {r['speedup_wall']:.2f}x |")


def print_concurrency(name: str, cc: dict[str, Any], depth: int) -> None:
    print(f"\n## {name}: half the requests ask for MTP depth {depth}, half plain")
    print(
        "| c | policy | aggregate tok/s | vs MTP off | TTFT p50 / p95 (ms) | "
        "MTP requests' TTFT p50 / p95 (ms) | ran MTP / deferred |"
    )
    print("|---|---|---|---|---|---|---|")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    for c, row in cc.items():
        for policy in POLICIES:
            r = row[policy]
            print(
                f"| {c} | {policy} | {r['aggregate_tps']:.1f} | {r['vs_off']:.2f}x | "
                f"{ms(r['ttft_p50_s'])} / {ms(r['ttft_p95_s'])} | {ms(r['mtp_ttft_p50_s'])} / "
                f"{ms(r['mtp_ttft_p95_s'])} | {r['ran_mtp']}/{r['mtp_requests']} · {r['deferred']} |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,small", help="comma-separated shapes: tiny, small, 4b")
    parser.add_argument("--alpha", type=float, default=0.05, help="head alignment (0: every draft accepted)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--concurrency", default="2,4,8", help="comma-separated levels; 0 skips part 2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2, help="MTP depth of part 2's MTP requests")
    parser.add_argument("--models-dir", default=None, help="where the checkpoints are built (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="tiny only, c = 2, 4, 2 repeats")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.concurrency, args.repeats = "tiny", "2,4", 2
    levels = [int(x) for x in args.concurrency.split(",") if int(x) > 0]
    os.environ.setdefault("ABSTRACTCORE_CONFIG_FILE", str(Path(tempfile.mkdtemp(prefix="bench-spec-")) / "none.json"))

    import mlx.core as mx

    from abstractruntime_mlx import create_llm

    root = Path(args.models_dir or tempfile.mkdtemp(prefix="bench-spec-models-"))
    report: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, MLX device {mx.default_device()}",
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "settings": vars(args),
        "models": {},
    }
    print(f"# MTP speculation bench, {report['date']}: {report['machine']}, load average {report['load_average']}")
    for shape in args.models.split(","):
        started = time.perf_counter()
        path = hybrid_model(
            root / f"hybrid-{shape}-{args.dtype}-a{args.alpha}", shape=shape, alpha=args.alpha, dtype=args.dtype
        )
        target, head = num_parameters(path)
        built = time.perf_counter() - started
        llm = create_llm(
            "mlx", model=str(path), mlx_batching=True, mlx_max_batch_size=max([8, *levels]), speculation=False
        )
        try:
            # Every setting once (an accelerator compiles kernels per shape on first use).
            for d in (0, *DEPTHS):
                warm = one(
                    llm,
                    prompts(1, 0)[0],
                    8,
                    {"mode": "native_mtp", "num_draft_tokens": d, "require_acceleration": True} if d else False,
                )
            for c in levels:  # every batch width once, MTP and not
                with ThreadPoolExecutor(max_workers=c) as pool:
                    list(
                        pool.map(
                            lambda i: one(
                                llm,
                                prompts(1, i)[0],
                                4,
                                policy_speculation("fixed_cohorts", args.depth) if i % 2 else False,
                            ),
                            range(c),
                        )
                    )
            loaded = llm._engine.loaded
            name = (
                f"{shape} hybrid ({target / 1e6:.1f}M target + {head / 1e6:.2f}M "
                f"head params, {args.dtype}, alpha {args.alpha})"
            )
            entry: dict[str, Any] = {
                "path": str(path),
                "target_params": target,
                "head_params": head,
                "head_bytes": loaded.drafter_bytes,
                "build_s": built,
                "warm_mode": warm["mode"],
            }
            print(f"\nmodel: {name}; head adds {loaded.drafter_bytes / 1e6:.2f} MB resident")
            entry["single"] = single(llm, repeats=args.repeats, max_tokens=args.max_tokens)
            print_single(name, entry["single"])
            if levels:
                entry["concurrency"] = concurrency(
                    llm, levels, repeats=args.repeats, max_tokens=args.max_tokens, depth=args.depth
                )
                print_concurrency(name, entry["concurrency"], args.depth)
            report["models"][shape] = entry
        finally:
            llm.unload_model()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
