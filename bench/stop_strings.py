"""What stop strings cost per generated token on the engine worker: the automaton
(``engine/core/stops.py``) against the list search it replaced, in one run over the same text.

    python bench/stop_strings.py                  # 1, 16 and 128 stops (the most allowed), and the old attack sizes
    python bench/stop_strings.py --tokens 4000

The text is a stream of tokens of 1-8 characters (random words and spaces); the stop strings
are random 4-12 character words that never occur in it, so no row stops early and every token
pays the full check (the case a long stop list makes slow). The last list fills
``MAX_STOP_BYTES`` with ``MAX_STOP_STRINGS`` strings of equal length. Figures are the median of ``--repeats`` passes, in
microseconds per token (``feed`` of one token's text), and the automaton's build time for a
list it has not seen (later requests with the same list reuse it). The old matcher runs the
10,000- and 100,000-string lists that ``MAX_STOP_STRINGS`` now refuses, for comparison.
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import time

from abstractruntime_mlx.controls import MAX_STOP_BYTES, MAX_STOP_STRINGS
from abstractruntime_mlx.engine.core import stops as stops_module
from abstractruntime_mlx.engine.core.stops import StopMatcher


class ListMatcher:
    """The matcher before the automaton: every stop string searched on every token."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return buf[:cut], True
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), 0, -1):
                if buf.endswith(stop[:n]):
                    best = max(best, n)
                    break
        self._held = buf[len(buf) - best :] if best else ""
        return buf[: len(buf) - best], False


def token_texts(count: int, rng: random.Random) -> list[str]:
    letters = "etaoinshrdlu"  # the stops use other letters too, so prefixes are held now and then
    return ["".join(rng.choice(letters + " ") for _ in range(rng.randint(1, 8))) for _ in range(count)]


def stop_list(count: int, rng: random.Random, *, length: tuple[int, int] = (4, 12)) -> tuple[str, ...]:
    # each starts with 'z', absent from the text: no match, yet their tails share the text's letters
    return tuple(
        "z" + "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(*length) - 1)) for _ in range(count)
    )


def per_token_us(
    make: type[StopMatcher] | type[ListMatcher], stops: tuple[str, ...], tokens: list[str], repeats: int
) -> float:
    runs = []
    for _ in range(repeats):
        matcher = make(stops)
        start = time.perf_counter()
        for text in tokens:
            matcher.feed(text)
        runs.append((time.perf_counter() - start) / len(tokens) * 1e6)
    return statistics.median(runs)


def build_ms(stops: tuple[str, ...]) -> float:
    stops_module._automaton.cache_clear()
    start = time.perf_counter()
    StopMatcher(stops)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = token_texts(args.tokens, rng)
    lists = {f"{n} stops": stop_list(n, rng) for n in (1, 16, MAX_STOP_STRINGS)}
    width = MAX_STOP_BYTES // MAX_STOP_STRINGS
    lists[f"{MAX_STOP_STRINGS} x {width} B ({MAX_STOP_BYTES} B)"] = stop_list(
        MAX_STOP_STRINGS, rng, length=(width, width)
    )
    print(f"{args.tokens} tokens, median of {args.repeats} passes; µs per token")
    print("| stop list | automaton | list search (old) | old / new | build (ms) |")
    print("|---|---|---|---|---|")
    for name, stops in lists.items():
        new = per_token_us(StopMatcher, stops, tokens, args.repeats)
        old = per_token_us(ListMatcher, stops, tokens, args.repeats)
        print(f"| {name} | {new:.2f} | {old:.2f} | {old / new:.1f}x | {build_ms(stops):.2f} |")
    for n in (10_000, 100_000):
        old = per_token_us(ListMatcher, stop_list(n, rng), tokens[: max(20, args.tokens // (n // 100))], 1)
        print(f"| {n:,} stops (now refused) | - | {old:.0f} | - | - |")


if __name__ == "__main__":
    main()
