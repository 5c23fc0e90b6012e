"""Stop strings that may span token boundaries."""

from __future__ import annotations


class StopMatcher:
    """Holds back text that could be the start of a stop string until it is decided."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit, whether a stop string matched)."""
        if not self.stops:
            return text, False
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self.stopped = True
            return buf[:cut], True
        hold = self._partial_suffix(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self, text: str = "") -> str:
        """At the end of generation: everything held is plain text after all."""
        out, stopped = self.feed(text)
        if stopped:
            return out
        out, self._held = out + self._held, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), 0, -1):
                if buf.endswith(stop[:n]):
                    best = max(best, n)
                    break
        return best
