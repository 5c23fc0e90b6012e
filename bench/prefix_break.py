"""What cache-miss attribution costs on a miss: locating where a prompt broke its key's prefix.

    python bench/prefix_break.py                 # 4 transcript sizes, 20 repeats each (~1 min on 2 busy cores)
    python bench/prefix_break.py --repeats 5 --json out.json

On the tiny model's tokenizer and ChatML template (``abstractruntime_mlx.testing``), an
agent-shaped transcript (a system prompt, 3 tool schemas, then turns of user ask, assistant
tool call, tool result, assistant reply) of 1, 4, 16 and 64 turns is rendered and tokenized
as the provider renders it. A second transcript changes the tool result in the middle turn.
Figures (medians over repeats):

- ``find_break_us``: the worker's share (``prefix_break.find_break`` on the shared prefix the
  cache report already measures): every keyed report pays it, hit or miss;
- ``attribute_ms``: the caller's share, on a miss only (``prefix_break.attribute``: one
  decode of the prompt up to the break, the tools block check, a binary search of prefix
  renders compared as text, three decoded excerpts), with the number of messages and prompt
  tokens.

A hit records no break and pays only ``find_break``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from abstractruntime_mlx.engine.cache.prefix_break import attribute, find_break  # noqa: E402
from abstractruntime_mlx.engine.cache.prefix_cache import GUARD_TOKENS, _common_prefix  # noqa: E402
from abstractruntime_mlx.engine.model.chat import prepare_conversation, render_prompt  # noqa: E402
from abstractruntime_mlx.testing import tiny_model  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": n,
            "description": f"the {n} tool " * 8,
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
    for n in ("search", "fetch", "write")
]


def transcript(turns: int, *, changed_turn: int | None = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent. " + "Answer briefly. " * 40}]
    for t in range(turns):
        result = json.dumps({"turn": t, "hits": [f"docs/page-{t}-{i}.md" for i in range(4)]})
        if t == changed_turn:
            result = f"turn={t} hits=" + ",".join(f"docs/page-{t}-{i}.md" for i in range(4))
        out += [
            {"role": "user", "content": f"Step {t}: look up the cache docs, part {t}."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": f"c{t}", "function": {"name": "search", "arguments": {"q": f"part {t}"}}}],
            },
            {"role": "tool", "content": result, "tool_call_id": f"c{t}"},
            {"role": "assistant", "content": f"Part {t} is about reuse. " * 3},
        ]
    return out


def measure(tokenizer: Any, turns: int, repeats: int) -> dict[str, Any]:
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def render(messages: list[dict[str, Any]]) -> str:
        return render_prompt(tokenizer, messages, tools=TOOLS, thinking=False)

    before = prepare_conversation(transcript(turns))
    after = prepare_conversation(transcript(turns, changed_turn=turns // 2))
    text = render(after)
    previous, prompt = encode(render(before)), encode(text)
    shared = _common_prefix(tuple(previous), prompt)
    find_us, attr_ms = [], []
    located: dict[str, Any] = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        brk = find_break(previous, shared=shared, reused=0, guard=GUARD_TOKENS)
        find_us.append((time.perf_counter() - t0) * 1e6)
        assert brk is not None
        t0 = time.perf_counter()
        located = attribute(
            brk, prompt_ids=prompt, text=text, conversation=after, tokenizer=tokenizer, tools=TOOLS, thinking=False
        )
        attr_ms.append((time.perf_counter() - t0) * 1e3)
    assert located["segment"] == "message" and located["message_index"] == 4 * (turns // 2) + 3, located
    return {
        "turns": turns,
        "messages": len(after),
        "prompt_tokens": len(prompt),
        "break": f"message {located['message_index']} ({located['role']}), token {located['token']}",
        "find_break_us": round(statistics.median(find_us), 2),
        "attribute_ms": round(statistics.median(attr_ms), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model(Path(tmp) / "dense", kind="dense")))
        rows = [measure(tokenizer, turns, args.repeats) for turns in args.turns]
    print(f"{'turns':>5} {'messages':>8} {'prompt tokens':>13} {'find_break µs':>13} {'attribute ms':>12}  break")
    for r in rows:
        print(
            f"{r['turns']:>5} {r['messages']:>8} {r['prompt_tokens']:>13,} "
            f"{r['find_break_us']:>13} {r['attribute_ms']:>12}  {r['break']}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
