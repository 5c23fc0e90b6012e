"""The inspector's live updates: one poller per app, shared by every open event stream.

A stream subscribes to a topic (the run list under one filter, or one run). One background
task reads, once per poll interval, each topic that has subscribers, however many streams
follow it, and hands a new state to the topic's subscribers. The reads run one after another on
one thread, so open streams never hold more than one thread and one ledger connection that
other requests need. A subscriber keeps only the newest state: a slow client skips states, it
never queues them. Open streams are capped (``max_streams``); one more is refused with
``TooManyStreams`` (503).

The poller knows no ledger: each topic brings its own ``read`` (run on a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from ..default_limits import DEFAULT_MAX_STREAMS
from ..errors import TooManyStreams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A topic's state as its subscribers receive it: SSE records, and whether they are the
    last ones (the stream ends after them). ``marker`` is what the next read compares with."""

    marker: object
    events: tuple[str, ...]
    final: bool = False


Read = Callable[[Snapshot | None], Snapshot | None]
"""``read(last)``: the topic's new state, or ``None`` when it has not changed since ``last``."""


@dataclass(eq=False, slots=True)
class _Topic:
    key: Hashable
    read: Read
    subscribers: set[Subscription] = field(default_factory=set)
    snapshot: Snapshot | None = None
    read_at: float | None = None  # loop time of the last read


class Subscription:
    """One open stream's place at a topic: ``next()`` waits for the topic's newest state."""

    def __init__(self, poller: LivePoller, topic: _Topic) -> None:
        self._poller = poller
        self.topic = topic
        self._pending: Snapshot | None = None
        self._ready = asyncio.Event()

    def offer(self, snapshot: Snapshot) -> None:
        self._pending = snapshot  # replaces a state the client has not taken yet
        self._ready.set()

    async def next(self, timeout_s: float) -> Snapshot | None:
        """The newest state not taken yet, or ``None`` when none came within ``timeout_s``."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        self._ready.clear()
        snapshot, self._pending = self._pending, None
        return snapshot

    def close(self) -> None:
        """Leave the topic (safe to repeat)."""
        self._poller._leave(self)


class LivePoller:
    """The topics of one inspector app and the task that reads them."""

    def __init__(self, *, interval_s: float, max_streams: int = DEFAULT_MAX_STREAMS) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1 (got {max_streams})")
        self.interval_s = interval_s
        self.max_streams = max_streams
        self._topics: dict[Hashable, _Topic] = {}
        self._streams = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def streams(self) -> int:
        return self._streams

    def subscribe(self, key: Hashable, read: Read) -> Subscription:
        """A new stream of topic ``key`` (``read`` is used when the topic is new); on the loop."""
        if self._streams >= self.max_streams:
            raise TooManyStreams(
                f"{self.max_streams} live streams are open, the most this inspector serves; close one "
                f"or retry later (the limit is max_streams={self.max_streams}: runs web --max-streams)",
                limit="max_streams",
                maximum=self.max_streams,
            )
        topic = self._topics.get(key)
        if topic is None:
            topic = self._topics[key] = _Topic(key, read)
        subscription = Subscription(self, topic)
        topic.subscribers.add(subscription)
        self._streams += 1
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()  # of this loop (an app may outlive one)
            self._task = asyncio.create_task(self._run(), name="inspector-live-poller")
        if topic.snapshot is not None:
            subscription.offer(topic.snapshot)
        else:
            self._wake.set()  # read the new topic now, not at the end of the interval
        return subscription

    async def close(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- internals ------------------------------------------------------------------------

    def _leave(self, subscription: Subscription) -> None:
        topic = subscription.topic
        if subscription not in topic.subscribers:
            return
        topic.subscribers.discard(subscription)
        self._streams -= 1
        if not topic.subscribers and self._topics.get(topic.key) is topic:
            del self._topics[topic.key]

    async def _run(self) -> None:
        """Read every due topic, hand out what changed, wait; ends when no topic is left."""
        loop = asyncio.get_running_loop()
        while self._topics:
            self._wake.clear()
            started = loop.time()
            due = [t for t in self._topics.values() if t.read_at is None or started - t.read_at >= self.interval_s]
            for topic in due:
                topic.read_at = started
                try:
                    snapshot = await run_in_threadpool(topic.read, topic.snapshot)
                except Exception:  # noqa: BLE001 - the poller serves every stream: keep the last state, read again
                    log.warning("inspector: reading %r failed", topic.key, exc_info=True)
                    continue
                if snapshot is None:
                    continue
                topic.snapshot = snapshot
                for subscription in topic.subscribers:
                    subscription.offer(snapshot)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
