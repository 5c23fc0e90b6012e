"""Stop strings that may span token boundaries, matched by one automaton (Aho-Corasick).

The matcher runs on the engine worker once per generated token of every row, so its cost per
token must not grow with the number of stop strings (``controls.MAX_STOP_STRINGS`` /
``MAX_STOP_BYTES`` bound the list itself). The automaton's state after the text so far is the
longest suffix of that text that begins some stop string: exactly the text to hold back until
it is decided. Each new character costs one transition (amortised over the failure links);
each state knows the longest stop string ending there, so a match is found without looping
over the list. Automata are built once per distinct list (``_automaton`` keeps the recent ones):
requests of one flow node send the same stops.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

_CACHED_AUTOMATA: Final = 64
_ROOT: Final = 0


@dataclass(frozen=True, slots=True)
class _Automaton:
    """``goto[s][ch]``: the trie's edges; ``fail[s]``: the state of the longest proper suffix of
    ``s``'s string that is also in the trie; ``depth[s]``: the length of ``s``'s string;
    ``match[s]``: the length of the longest stop string that ends ``s``'s string (0: none)."""

    goto: tuple[dict[str, int], ...]
    fail: tuple[int, ...]
    depth: tuple[int, ...]
    match: tuple[int, ...]
    longest: int

    def step(self, state: int, ch: str) -> int:
        while True:
            nxt = self.goto[state].get(ch)
            if nxt is not None:
                return nxt
            if state == _ROOT:
                return _ROOT
            state = self.fail[state]


@lru_cache(maxsize=_CACHED_AUTOMATA)
def _automaton(stops: tuple[str, ...]) -> _Automaton:
    goto: list[dict[str, int]] = [{}]
    depth = [0]
    match = [0]
    for stop in stops:
        state = _ROOT
        for ch in stop:
            nxt = goto[state].get(ch)
            if nxt is None:
                nxt = len(goto)
                goto[state][ch] = nxt
                goto.append({})
                depth.append(depth[state] + 1)
                match.append(0)
            state = nxt
        match[state] = len(stop)
    fail = [_ROOT] * len(goto)
    queue = deque(goto[_ROOT].values())
    while queue:  # breadth first: a state's failure link is shorter, so already final
        state = queue.popleft()
        if not match[state]:
            match[state] = match[fail[state]]
        for ch, child in goto[state].items():
            link = fail[state]
            while ch not in goto[link] and link != _ROOT:
                link = fail[link]
            fail[child] = goto[link].get(ch, _ROOT)
            queue.append(child)
    return _Automaton(tuple(goto), tuple(fail), tuple(depth), tuple(match), max(map(len, stops), default=0))


class StopMatcher:
    """Holds back text that could be the start of a stop string until it is decided."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._automaton = _automaton(self.stops) if self.stops else None
        self._state = _ROOT
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once one did

    def feed(self, text: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit, whether a stop string matched). On a match
        the text ends where the earliest-starting stop string begins, and ``matched`` is that
        string."""
        automaton = self._automaton
        if automaton is None:
            return text, False
        buf = self._held + text
        offset = len(self._held)  # where ``text`` starts in ``buf``
        state = self._state
        cut, cut_end = -1, -1
        for i, ch in enumerate(text):
            state = automaton.step(state, ch)
            end = offset + i + 1
            if automaton.match[state]:
                start = end - automaton.match[state]
                if cut < 0 or start < cut:
                    cut, cut_end = start, end
            if cut >= 0 and end - cut >= automaton.longest - 1:
                break  # a match ending later starts after ``cut``
        if cut >= 0:
            self._state, self._held = _ROOT, ""
            self.stopped = True
            self.matched = buf[cut:cut_end]
            return buf[:cut], True
        self._state = state
        hold = automaton.depth[state]
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self, text: str = "") -> str:
        """At the end of generation: everything held is plain text after all."""
        out, stopped = self.feed(text)
        if stopped:
            return out
        out, self._held, self._state = out + self._held, "", _ROOT
        return out
