"""Phase events for a host: prefill vs generation, built from real engine observations.

One ``ProgressTracker`` per call. Events are plain JSON-safe dicts; a key with no known
value is absent, never zero. Cost is time-limited, never count-capped: the prefill start,
the first-token event and ``complete`` always fire; every other event is dropped unless
``min_interval_s`` passed since the previous one. No prefill event follows the first token.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InvalidControls
from ..json_values import to_float

log = logging.getLogger(__name__)

DEFAULT_MIN_INTERVAL_S = 0.5

ProgressCallback = Callable[[dict[str, Any]], Any]


def progress_interval_from_env(env: Mapping[str, str] = os.environ) -> float:
    """``ABSTRACTCORE_PROGRESS_MIN_INTERVAL_S`` (shared with AbstractCore), default 0.5 s."""
    raw = env.get("ABSTRACTCORE_PROGRESS_MIN_INTERVAL_S")
    if raw is None or raw.strip() == "":
        return DEFAULT_MIN_INTERVAL_S
    try:
        value = to_float(raw)
    except ValueError:
        raise InvalidControls(
            "ABSTRACTCORE_PROGRESS_MIN_INTERVAL_S must be a number of seconds",
            field="ABSTRACTCORE_PROGRESS_MIN_INTERVAL_S",
            value=raw,
        ) from None
    if value < 0:
        raise InvalidControls(
            "ABSTRACTCORE_PROGRESS_MIN_INTERVAL_S must be >= 0", field="ABSTRACTCORE_PROGRESS_MIN_INTERVAL_S", value=raw
        )
    return value


class ProgressTracker:
    def __init__(
        self,
        callback: ProgressCallback,
        *,
        min_interval_s: float = DEFAULT_MIN_INTERVAL_S,
        clock: Callable[[], float] = time.perf_counter,
        started_at: float | None = None,
    ) -> None:
        self._callback: ProgressCallback | None = callback
        self.min_interval_s = min_interval_s
        self._clock = clock
        self.started_at = clock() if started_at is None else started_at
        self.callback_error: str | None = None
        self.num_events = 0
        self._last_emit: float | None = None
        self._prompt_tokens: int | None = None
        self._cached: int | None = None
        self._processed: int | None = None
        self._first_prefill_obs: tuple[float, int] | None = None
        self._prefill_done_at: float | None = None
        self._generated = 0
        self._first_token_at: float | None = None
        self._finished = False
        self.execution_mode: str | None = None
        # ``speculation_used`` (and ``speculation_reason`` when not), known from admission on.
        self.speculation: dict[str, Any] = {}

    # --- observations ------------------------------------------------------------------
    def start(self, prompt_tokens: int, *, cached: int | None = None) -> None:
        """The call was accepted: the prefill start event (always fires). ``cached``: the
        prompt tokens a lane already knows it restores (the serialized lane's snapshot), put
        on this event; None where it is learnt once prefill starts on the worker."""
        self._grow_prompt(prompt_tokens)
        if cached is not None:
            self._cached = cached
        self._emit({"phase": "prefill"}, force=True)

    def prefill(self, processed: int, total: int, cached: int | None = None) -> None:
        """A real per-chunk observation: ``processed`` prompt tokens are in the KV cache."""
        if self._first_token_at is not None or self._finished:
            return
        self._grow_prompt(total)
        newly_known_cache = cached is not None and self._cached is None
        if cached is not None:
            self._cached = cached
        if self._prompt_tokens is not None:
            processed = min(processed, self._prompt_tokens)
        if self._processed is not None and processed < self._processed:
            processed = self._processed
        now = self._clock()
        if self._first_prefill_obs is None and processed > (self._cached or 0):
            self._first_prefill_obs = (now, processed)
        self._processed = processed
        if self._prompt_tokens is not None and processed >= self._prompt_tokens:
            self._prefill_done_at = now
        event: dict[str, Any] = {"phase": "prefill", "prefill_processed_tokens": processed}
        rate = self._prefill_rate(now)
        if rate is not None:
            event["prefill_tokens_per_second"] = rate
        # A restored prefix is news worth showing at once.
        self._emit(event, force=newly_known_cache and bool(cached))

    def tokens(self, count: int, *, cached: int | None = None) -> None:
        """``count`` tokens were sampled. ``cached``: the prompt tokens the lane restored, known
        once the prompt is done; it reaches the first-token event when no mid-prefill
        observation carried it (a prompt too short to observe)."""
        if count <= 0 or self._finished:
            return
        now = self._clock()
        first = self._first_token_at is None
        if first:
            if cached is not None:
                self._cached = cached
            self._first_token_at = now
            if self._prefill_done_at is None:
                self._prefill_done_at = now
        self._generated += count
        self._emit({"phase": "generate", **({"first_token": True} if first else {})}, force=first)

    def complete(
        self,
        finish_reason: str | None,
        *,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
        generated_tokens: int | None = None,
    ) -> None:
        if self._finished:
            return
        if prompt_tokens is not None:
            self._grow_prompt(prompt_tokens)
        if cached_tokens is not None:
            self._cached = cached_tokens
        if generated_tokens is not None:
            self._generated = generated_tokens
        event: dict[str, Any] = {"phase": "complete", "final": True}
        if finish_reason is not None:
            event["finish_reason"] = finish_reason
        self._emit(event, force=True)
        self._finished = True

    # --- internals -----------------------------------------------------------------------
    def _grow_prompt(self, prompt_tokens: int) -> None:
        # A backend that reports a narrower count (tokens IT processed) is not news.
        if self._prompt_tokens is None or prompt_tokens > self._prompt_tokens:
            self._prompt_tokens = prompt_tokens

    def _prefill_rate(self, now: float) -> float | None:
        if self._first_prefill_obs is None or self._processed is None:
            return None
        t0, p0 = self._first_prefill_obs
        dt = now - t0
        if dt <= 0 or self._processed <= p0:
            return None
        return round((self._processed - p0) / dt, 3)

    def _emit(self, event: dict[str, Any], *, force: bool) -> None:
        callback = self._callback
        if callback is None:
            return
        now = self._clock()
        if not force and self._last_emit is not None and now - self._last_emit < self.min_interval_s:
            return
        full: dict[str, Any] = {"kind": "llm", **event}
        if self.execution_mode is not None:
            full["execution_mode"] = self.execution_mode
        full.update({key: value for key, value in self.speculation.items() if value is not None})
        if self._prompt_tokens is not None:
            full["prompt_tokens"] = self._prompt_tokens
        if self._cached is not None:
            full["cached_tokens"] = self._cached
            if self._prompt_tokens is not None:
                full["fed_tokens"] = max(0, self._prompt_tokens - self._cached)
        if self._first_token_at is not None:
            full["generated_tokens"] = self._generated
            full["ttft_s"] = round(self._first_token_at - self.started_at, 6)
            if self._generated > 1:
                decode_s = now - self._first_token_at
                if decode_s > 0:
                    full["tokens_per_second"] = round((self._generated - 1) / decode_s, 3)
            if self._prompt_tokens and self._prefill_done_at is not None:
                prefill_s = self._prefill_done_at - self.started_at
                if prefill_s > 0:
                    fed = self._prompt_tokens - (self._cached or 0)
                    full["prompt_tokens_per_second"] = round(fed / prefill_s, 3)
        full["elapsed_s"] = round(now - self.started_at, 6)
        full["event_index"] = self.num_events
        full.setdefault("final", False)
        self._last_emit = now
        self.num_events += 1
        try:
            callback(full)
        except Exception as exc:  # noqa: BLE001 - a host's callback must not break generation
            self._callback = None
            self.callback_error = f"{type(exc).__name__}: {exc}"
            log.warning("progress callback raised %s; it is disabled for the rest of this call", self.callback_error)

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {"events": self.num_events}
        if self.callback_error is not None:
            out["callback_error"] = self.callback_error
        return out
