"""Grammar engines for JSON-Schema-constrained decoding: llguidance against xgrammar.

    python bench/grammar_engines.py                         # both engines, both tokenizers, 4 schemas
    python bench/grammar_engines.py --repeats 3 --json out.json
    python bench/grammar_engines.py --tokenizer-dir DIR     # a model dir with tokenizer.json

Needs a venv with ``llguidance``, ``xgrammar`` (it pulls in torch), ``transformers``,
``tokenizers`` and ``numpy``; an engine that cannot be imported is skipped with a note. Nothing
here is imported by the tests, and nothing touches a model hub: the tokenizer comes from
``--tokenizer-dir`` (default ``/tmp/xg-tiny``, made by the project's
``abstractruntime_mlx.testing.tiny_model('/tmp/xg-tiny', kind='dense')``).

Two tokenizers:

- ``tiny``: the project's tiny byte-level BPE tokenizer (2,000 entries).
- ``qwen-size``: the same tokenizer with its BPE vocabulary padded to 151,936 entries (Qwen3's
  vocabulary rows) by extra byte-level entries: deterministic random 1-8 character strings
  (lower-case words, half with a leading space, some capitalised, digits, punctuation runs,
  a few accented letters), written in the byte-level alphabet straight into ``model.vocab``
  (no merges: the encoder never makes them, but a grammar engine sees them as ordinary
  vocabulary and must mask every one of them at every step).

Four schemas: ``flat`` (a 4-field record), ``nested`` (a pattern, an array of enums with
minItems/maxItems, a nested object), ``tree`` (recursive through ``$defs``/``$ref``) and
``flow`` (6 strings, an array of 3-field objects, an enum).

Figures per engine x tokenizer x schema (medians over ``--repeats``):

- ``tok_s``: building the engine's tokenizer object (once per resident model).
- ``compile_cold_s``: JSON Schema to a grammar with nothing cached. llguidance:
  ``grammar_from_json_schema`` + ``validate_grammar`` with the tokenizer (what the project's
  ``GrammarCompiler.compile`` does). xgrammar: ``compile_json_schema`` after ``clear_cache()``.
- ``compile_cached_s``: the same again where the engine has a cache (xgrammar's compiler
  cache). llguidance has none: the project keeps the grammar string, so "n/a".
- ``matcher_s``: a matcher for one request from the compiled grammar (``LLMatcher(...)``:
  llguidance builds its lexer/parser here; ``GrammarMatcher(...)`` plus its own bitmask
  tensor from ``allocate_token_bitmask``).
- ``mask_us``: per-token mask computation, the mean over one decode of ``--steps`` tokens.
  Tokens are picked the same way for both engines: ``random.Random(seed)``; with
  probability 1/3 the first allowed of (EOS, ``"``, ``]``, ``}``, ``,``) — so strings
  close and documents end — else a uniform pick among the allowed ids. When a document is
  complete (the matcher stopped, or xgrammar's ``is_completed``) a fresh matcher starts (not
  timed) until ``--steps`` masks are counted. Same masks and same seed give the same tokens;
  ``same_path`` says whether the two engines' decodes were identical token for token. (They are
  not, on this tokenizer: inside a JSON string xgrammar 0.2.9 also allows the added tokens such
  as ``<think>`` and raw control bytes like TAB or NUL, but not the lone ``\\`` token, which
  llguidance allows.)
- ``mask_first_us`` / ``mask_max_us``: the first mask of a fresh matcher (llguidance builds
  lexer states lazily, so its first masks carry part of the compile) and the slowest one.
- ``apply_us``: applying the mask to a numpy float32 logits row of the vocabulary's size:
  ``np.unpackbits`` of the 32-bit words (little bit order) and ``np.where(.., logits, -inf)``.
- ``gil_x``: two threads each replaying a recorded decode (mask + consume only) on their own
  matcher, serial time / threaded time (median of 3). ~2 on 2+ idle cores means the mask
  computation runs without the GIL; ~1 means it holds it (or the cores are busy: on a loaded
  machine this figure is noise).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np  # noqa: E402

QWEN_ROWS = 151_936
EOS_TEXT = "<|im_end|>"

# -- schemas -------------------------------------------------------------------------------

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
            "color": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "count", "ok", "color"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
            "tags": {
                "type": "array",
                "items": {"enum": ["alpha", "beta", "gamma", "delta"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "meta": {
                "type": "object",
                "properties": {
                    "owner": {"type": "string", "maxLength": 16},
                    "level": {"type": "integer", "minimum": 1, "maximum": 5},
                    "active": {"type": "boolean"},
                },
                "required": ["owner", "level", "active"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "tags", "meta"],
        "additionalProperties": False,
    },
    "tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "maxLength": 8},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3},
                },
                "required": ["label", "children"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "flow": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "summary": {"type": "string"},
            "author": {"type": "string"},
            "language": {"type": "string"},
            "next_step": {"type": "string"},
            "notes": {"type": "string"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "quantity": {"type": "integer"},
                        "unit": {"type": "string"},
                    },
                    "required": ["name", "quantity", "unit"],
                    "additionalProperties": False,
                },
            },
            "priority": {"enum": ["low", "medium", "high"]},
        },
        "required": ["title", "summary", "author", "language", "next_step", "notes", "items", "priority"],
        "additionalProperties": False,
    },
}

# -- tokenizers ----------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (what ByteLevel BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _random_piece(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.80:
        word = "".join(
            rng.choice("etaoinshrdlcumwfgypbvkjxqz"[: rng.randint(10, 26)]) for _ in range(rng.randint(2, 8))
        )
        if rng.random() < 0.2:
            word = word.capitalize()
        return (" " if rng.random() < 0.5 else "") + word
    if kind < 0.88:
        return (" " if rng.random() < 0.3 else "") + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4)))
    if kind < 0.96:
        return "".join(rng.choice('{}[]":,.;-_()!?/\\\n\t ') for _ in range(rng.randint(1, 4)))
    return "".join(rng.choice("éèàüöñçßø") + rng.choice("abcdefghij") for _ in range(rng.randint(1, 3)))


def build_large_tokenizer(tokenizer_json: str, out_dir: str, rows: int = QWEN_ROWS, seed: int = 1234) -> str:
    """``tokenizer_json`` with its BPE vocabulary padded to ``rows`` entries; returns the new file."""
    with open(tokenizer_json, encoding="utf-8") as f:
        data = json.load(f)
    vocab: dict[str, int] = data["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in data.get("added_tokens", [])}
    next_id = max(max(vocab.values()), max((t["id"] for t in data.get("added_tokens", [])), default=0)) + 1
    alphabet = _bytes_to_unicode()
    rng = random.Random(seed)
    while next_id < rows:
        piece = "".join(alphabet[b] for b in _random_piece(rng).encode("utf-8"))
        if piece in taken:
            continue
        taken.add(piece)
        vocab[piece] = next_id
        next_id += 1
    path = os.path.join(out_dir, "tokenizer.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
    return path


def load_hf(tokenizer_json: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, eos_token=EOS_TEXT)


# -- engines -------------------------------------------------------------------------------
# Each engine gives: tokenizer(hf, rows, eos) -> tok; compile_cold(tok, schema) -> compiled;
# compile_cached(tok, schema) -> compiled or None; matcher(tok, compiled) -> m;
# mask(m) -> np.uint32 words; consume(m, token); done(m) -> bool.


class Llguidance:
    name = "llguidance"

    def __init__(self) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.version = getattr(llguidance, "__version__", _dist_version("llguidance"))

    def tokenizer(self, hf: Any, rows: int, eos: int) -> Any:
        return self.llg.hf.from_tokenizer(hf, n_vocab=rows, eos_token=eos)

    def compile_cold(self, tok: Any, schema: dict[str, Any]) -> str:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
        error = self.llg.LLMatcher.validate_grammar(grammar, tok)
        if error:
            raise ValueError(error)
        return grammar

    def compile_cached(self, tok: Any, schema: dict[str, Any]) -> None:
        return None  # no engine-side cache: the project caches the grammar string itself

    def matcher(self, tok: Any, compiled: str) -> Any:
        m = self.llg.LLMatcher(tok, compiled)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m: Any) -> np.ndarray:
        return np.frombuffer(m.compute_bitmask(), dtype=np.uint32)

    def consume(self, m: Any, token: int) -> None:
        m.consume_token(token)
        if m.is_error():
            raise RuntimeError(m.get_error())

    def done(self, m: Any) -> bool:
        return bool(m.is_stopped())


class Xgrammar:
    name = "xgrammar"

    def __init__(self) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.version = getattr(xgrammar, "__version__", _dist_version("xgrammar"))
        self._compilers: dict[int, Any] = {}

    def tokenizer(self, hf: Any, rows: int, eos: int) -> Any:
        info = self.xgr.TokenizerInfo.from_huggingface(hf, vocab_size=rows, stop_token_ids=[eos])
        self._compilers[id(info)] = self.xgr.GrammarCompiler(info, cache_enabled=True)
        return info

    def _compile(self, tok: Any, schema: dict[str, Any]) -> Any:
        # Compact JSON like llguidance's whitespace_flexible=False: no free whitespace, "," / ":".
        return self._compilers[id(tok)].compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def compile_cold(self, tok: Any, schema: dict[str, Any]) -> Any:
        self._compilers[id(tok)].clear_cache()
        return self._compile(tok, schema)

    def compile_cached(self, tok: Any, schema: dict[str, Any]) -> Any:
        return self._compile(tok, schema)

    def matcher(self, tok: Any, compiled: Any) -> Any:
        m = self.xgr.GrammarMatcher(compiled)
        m._bitmask = self.xgr.allocate_token_bitmask(1, tok.vocab_size)  # its own (1, words) int32 tensor
        return m

    def mask(self, m: Any) -> np.ndarray:
        m.fill_next_token_bitmask(m._bitmask, 0)
        return m._bitmask[0].numpy().view(np.uint32)

    def consume(self, m: Any, token: int) -> None:
        if not m.accept_token(token):
            raise RuntimeError(f"xgrammar rejected token {token}")

    def done(self, m: Any) -> bool:
        # is_completed: the document is whole (llguidance stops there by itself, "NoExtension");
        # is_terminated: EOS was consumed.
        return bool(m.is_terminated() or m.is_completed())


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# -- measuring -----------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def apply_mask(words: np.ndarray, logits: np.ndarray) -> np.ndarray:
    allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[: logits.shape[0]].astype(np.bool_)
    return np.where(allowed, logits, np.float32(-np.inf))


def decode(
    engine: Any, tok: Any, compiled: Any, *, rows: int, steps: int, seed: int, closers: list[int]
) -> dict[str, Any]:
    """``steps`` masks along a pseudo-random path; returns timings and the path."""
    rng = random.Random(seed)
    logits = np.random.default_rng(seed).standard_normal(rows, dtype=np.float32)
    mask_s: list[float] = []
    apply_s: list[float] = []
    path: list[int] = []
    docs = 1
    m = engine.matcher(tok, compiled)
    while len(mask_s) < steps:
        if engine.done(m):
            m = engine.matcher(tok, compiled)
            docs += 1
        words, dt = timed(lambda: engine.mask(m))
        mask_s.append(dt)
        masked, dt = timed(lambda: apply_mask(words, logits))
        apply_s.append(dt)
        allowed = np.flatnonzero(np.isfinite(masked))
        if allowed.size == 0:
            raise RuntimeError("empty mask")
        pick = None
        if rng.random() < 1 / 3:
            pick = next((c for c in closers if _bit(words, c)), None)
        if pick is None:
            pick = int(allowed[rng.randrange(allowed.size)])
        engine.consume(m, pick)
        path.append(pick)
    return {"mask_s": mask_s, "apply_s": apply_s, "path": path, "docs": docs}


def _bit(words: np.ndarray, token: int) -> bool:
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def replay(engine: Any, tok: Any, compiled: Any, path: list[int], eos: int) -> None:
    m = engine.matcher(tok, compiled)
    for token in path:
        if engine.done(m):
            m = engine.matcher(tok, compiled)
        engine.mask(m)
        engine.consume(m, token)


def gil_ratio(engine: Any, tok: Any, compiled: Any, path: list[int], eos: int, budget_s: float = 0.2) -> float:
    """Serial time of two workloads / time of the same two on two threads. A workload is as
    many replays of ``path`` as take ~``budget_s`` (after a warm-up replay)."""
    _, once = timed(lambda: replay(engine, tok, compiled, path, eos))
    rounds = max(3, int(budget_s / max(once, 1e-6)))
    work = lambda: [replay(engine, tok, compiled, path, eos) for _ in range(rounds)]  # noqa: E731
    _, serial = timed(lambda: (work(), work()))
    threads = [threading.Thread(target=work) for _ in range(2)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return serial / (time.perf_counter() - started)


def bench_one(
    engine: Any,
    tok: Any,
    tok_s: float,
    schema: dict[str, Any],
    *,
    rows: int,
    eos: int,
    closers: list[int],
    repeats: int,
    steps: int,
) -> dict[str, Any]:
    cold, cached, matcher, mask_us, mask_first_us, mask_max_us, apply_us = [], [], [], [], [], [], []
    paths: list[list[int]] = []
    docs: list[int] = []
    compiled = None
    for r in range(repeats):
        compiled, dt = timed(lambda: engine.compile_cold(tok, schema))
        cold.append(dt)
        again, dt = timed(lambda: engine.compile_cached(tok, schema))
        if again is not None:
            cached.append(dt)
        _, dt = timed(lambda: engine.matcher(tok, compiled))
        matcher.append(dt)
        d = decode(engine, tok, compiled, rows=rows, steps=steps, seed=r, closers=closers)
        mask_us.append(1e6 * statistics.fmean(d["mask_s"]))
        mask_max_us.append(1e6 * max(d["mask_s"]))
        mask_first_us.append(1e6 * d["mask_s"][0])
        apply_us.append(1e6 * statistics.fmean(d["apply_s"]))
        paths.append(d["path"])
        docs.append(d["docs"])
    return {
        "tok_s": tok_s,
        "compile_cold_s": statistics.median(cold),
        "compile_cached_s": statistics.median(cached) if cached else None,
        "matcher_s": statistics.median(matcher),
        "mask_us": statistics.median(mask_us),
        "mask_first_us": statistics.median(mask_first_us),
        "mask_max_us": statistics.median(mask_max_us),
        "apply_us": statistics.median(apply_us),
        "docs_per_decode": statistics.median(docs),
        "gil_x": statistics.median(gil_ratio(engine, tok, compiled, paths[0], eos) for _ in range(3)),
        "paths": paths,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer-dir", default="/tmp/xg-tiny")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", help="also write every figure here")
    args = parser.parse_args()

    base = os.path.join(args.tokenizer_dir, "tokenizer.json")
    if not os.path.exists(base):
        print(f"no {base}: make it with abstractruntime_mlx.testing.tiny_model({args.tokenizer_dir!r}, kind='dense')")
        return 2

    engines = []
    for cls in (Llguidance, Xgrammar):
        try:
            engines.append(cls())
        except Exception as exc:  # noqa: BLE001 - ImportError, or a broken native library
            print(f"note: {cls.name} skipped: {type(exc).__name__}: {exc}")
    if not engines:
        print("no engine importable")
        return 2
    print("engines: " + ", ".join(f"{e.name} {e.version}" for e in engines))

    tmp = tempfile.mkdtemp(prefix="grammar-engines-")
    tokenizers: dict[str, str] = {"tiny": base, "qwen-size": build_large_tokenizer(base, tmp)}

    results: list[dict[str, Any]] = []
    for tok_name, tok_path in tokenizers.items():
        hf = load_hf(tok_path)
        rows = max(len(hf), hf.backend_tokenizer.get_vocab_size(with_added_tokens=True))
        eos = hf.convert_tokens_to_ids(EOS_TEXT)
        closers = [eos] + [hf.convert_tokens_to_ids(t) for t in ('"', "]", "}", ",")]
        print(f"tokenizer {tok_name}: {rows} rows, eos {eos}, closers {closers}")
        for engine in engines:
            tok, tok_s = timed(lambda: engine.tokenizer(hf, rows, eos))
            for schema_name, schema in SCHEMAS.items():
                row = {"engine": engine.name, "tokenizer": tok_name, "schema": schema_name}
                try:
                    row.update(
                        bench_one(
                            engine,
                            tok,
                            tok_s,
                            schema,
                            rows=rows,
                            eos=eos,
                            closers=closers,
                            repeats=args.repeats,
                            steps=args.steps,
                        )
                    )
                except Exception as exc:  # noqa: BLE001 - one engine failing a schema is a result row
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                results.append(row)
                print("  " + _line(row), flush=True)

    # Did both engines walk the same tokens (same masks along the way)?
    by_key = {(r["engine"], r["tokenizer"], r["schema"]): r for r in results}
    for r in results:
        other = by_key.get(("xgrammar" if r["engine"] == "llguidance" else "llguidance", r["tokenizer"], r["schema"]))
        if other and "paths" in r and "paths" in other:
            r["same_path"] = r["paths"] == other["paths"]

    print()
    print(_table(results))
    first = next((r for r in results if "paths" in r and r["tokenizer"] == "tiny"), None)
    if first is not None:
        hf = load_hf(base)
        for r in results:
            if r["tokenizer"] == "tiny" and "paths" in r:
                print(f"sample {r['engine']}/{r['schema']}: {hf.decode(r['paths'][0])[:160]!r}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"engines": {e.name: e.version for e in engines}, "results": results}, f, indent=1)
    return 0


def _fmt(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['engine']:10} {r['tokenizer']:9} {r['schema']:6} FAILED: {r['error']}"
    return (
        f"{r['engine']:10} {r['tokenizer']:9} {r['schema']:6} compile {_fmt(r['compile_cold_s'], 1e3)} ms"
        f" (cached {_fmt(r['compile_cached_s'], 1e3, 3)}) matcher {_fmt(r['matcher_s'], 1e3, 3)} ms"
        f" mask {_fmt(r['mask_us'], 1, 1)} us (max {_fmt(r['mask_max_us'], 1, 0)}) apply {_fmt(r['apply_us'], 1, 1)} us"
    )


def _table(results: list[dict[str, Any]]) -> str:
    head = (
        "| engine | tokenizer | schema | tokenizer build ms | compile cold ms | compile cached ms | matcher ms | "
        "mask us/token | first mask us | mask max us | apply us/token | GIL x (2 thr) | same path |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['tokenizer']} | {r['schema']} | FAILED: {r['error'][:120]} |")
            continue
        lines.append(
            f"| {r['engine']} | {r['tokenizer']} | {r['schema']} | {_fmt(r['tok_s'], 1e3, 0)} | "
            f"{_fmt(r['compile_cold_s'], 1e3)} | {_fmt(r['compile_cached_s'], 1e3, 3)} | "
            f"{_fmt(r['matcher_s'], 1e3, 3)} | {_fmt(r['mask_us'], 1, 1)} | "
            f"{_fmt(r['mask_first_us'], 1, 0)} | {_fmt(r['mask_max_us'], 1, 0)} | "
            f"{_fmt(r['apply_us'], 1, 1)} | {_fmt(r['gil_x'], 1, 2)} | {r.get('same_path', 'n/a')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
