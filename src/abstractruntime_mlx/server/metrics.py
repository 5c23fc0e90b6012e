"""``GET /metrics``: the server in Prometheus' text format, through ``prometheus_client``.

Every series has a ``model`` label. Two sources (the names are listed in ``docs/server.md``):

- what each served call reports when it ends (``CallMeter``, a ``observe.CallObserver``):
  requests by finish reason, prompt / generated / prefix-reused tokens, time to first token,
  inter-token gaps, the batch width the call ran in, MTP drafted and accepted tokens;
- what the resident models say at scrape time (``ResidentCollector``): engine state, queue
  depth, running rows, batch slots, the engine's request counters, prefix-cache bytes,
  entries and lookups (``provider.get_prompt_cache_stats()``, read on a thread: the engine
  answers between two of its steps).

Errors are counted by ``MetricsMiddleware`` from what the client received: the ``code`` of an
error body (status >= 400) or of an error event inside a stream, so a request refused before
it reached a model counts too (with ``model=""``). Loads, load failures and refusals,
evictions, keep-alive expiries and unloads are the pool's counters (``pool.ModelPool.counters``).
Each app has its own ``CollectorRegistry``: two apps in one process never mix their series.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import MLXRuntimeError
from ..json_values import JSONObject, JSONValue, as_float, as_int, object_at
from ..results import GenerationChunk, GenerationResult

log = logging.getLogger(__name__)

PREFIX: Final = "abstractruntime_mlx"
TTFT_BUCKETS_S: Final = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
INTER_TOKEN_BUCKETS_S: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
BATCH_WIDTH_BUCKETS: Final = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
MAX_GAP_OBSERVATIONS: Final = 65_536
"""Most inter-token observations one non-streamed call adds (its mean gap, once per gap)."""
MAX_ERROR_BODY_BYTES: Final = 64 * 1024
"""Error bodies longer than this are not read for their code (ours are far shorter)."""
SSE_ERROR_MARK: Final = b'data: {"error":'
"""How an error event starts in a stream (``sse.data_event`` of ``wire.error_payload``)."""


class HeldModel(Protocol):
    """What the metrics read of one model the server holds (``pool.ResidentModel``)."""

    @property
    def name(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def provider(self) -> object | None: ...


class ModelCounts(Protocol):
    """Per-model load and eviction counts (``pool.ModelCounters``); they only go up."""

    loads: int
    load_failures: int
    evictions: int
    expirations: int
    unloads: int
    refusals: int


class HeldModels(Protocol):
    """The models a server holds (``pool.ModelPool``), read on the event loop."""

    def resident(self) -> Sequence[HeldModel]: ...

    def counters(self) -> Mapping[str, ModelCounts]: ...


@dataclass(slots=True)
class ModelSnapshot:
    """What one resident model said at a scrape (each part absent when the provider has no such hook)."""

    model: str
    in_flight: int = 0
    state: str | None = None
    execution: Mapping[str, object] = field(default_factory=dict)
    prefix_cache: Mapping[str, object] = field(default_factory=dict)


def read_snapshot(model: str, provider: object, *, in_flight: int = 0) -> ModelSnapshot:
    """Ask ``provider`` for its health and stats; a model that cannot answer (failed, unloading)
    gives what it could."""
    snapshot = ModelSnapshot(model=model, in_flight=in_flight)
    health = getattr(provider, "health", None)
    if callable(health):
        state = health()
        if isinstance(state, Mapping) and isinstance(state.get("state"), str):
            snapshot.state = str(state["state"])
    stats_of = getattr(provider, "get_prompt_cache_stats", None)
    if callable(stats_of) and snapshot.state in (None, "ready"):
        try:
            stats = stats_of()
        except MLXRuntimeError as exc:  # it failed or closed between the two questions
            log.debug("metrics: %s gave no stats: %s", model, exc)
            return snapshot
        if isinstance(stats, Mapping):
            snapshot.execution = object_at(stats, "execution")
            snapshot.prefix_cache = stats if stats.get("enabled") else {}
    return snapshot


@dataclass(frozen=True, slots=True)
class Reading:
    """One scrape's view of the held models."""

    snapshots: tuple[ModelSnapshot, ...] = ()
    counters: Mapping[str, ModelCounts] = field(default_factory=dict)


class ResidentCollector(Collector):
    """The series read from the held models at scrape time (``ServerMetrics.exposition`` sets ``latest``)."""

    def __init__(self) -> None:
        self.latest = Reading()

    def describe(self) -> Iterable[Metric]:
        return []  # the series depend on what is resident: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        reading = self.latest
        state = GaugeMetricFamily(
            f"{PREFIX}_model_state",
            "1 for each resident model, labelled with its engine state",
            labels=["model", "state"],
        )
        in_flight = GaugeMetricFamily(
            f"{PREFIX}_requests_in_flight",
            "requests holding the model (queued, running or streaming)",
            labels=["model"],
        )
        queue = GaugeMetricFamily(f"{PREFIX}_queue_depth", "requests waiting for a batch slot", labels=["model"])
        running = GaugeMetricFamily(
            f"{PREFIX}_running_rows", "requests admitted to the engine (prefilling or decoding)", labels=["model"]
        )
        slots = GaugeMetricFamily(
            f"{PREFIX}_batch_slots", "the engine's batch slots (max_batch_size)", labels=["model"]
        )
        peak = GaugeMetricFamily(f"{PREFIX}_peak_batch_width", "widest batch since the model loaded", labels=["model"])
        engine = CounterMetricFamily(
            f"{PREFIX}_engine_requests",
            "requests the engine finished since the model loaded, by outcome",
            labels=["model", "outcome"],
        )
        cache_bytes = GaugeMetricFamily(
            f"{PREFIX}_prefix_cache_bytes", "bytes the prefix cache holds, by tier", labels=["model", "tier"]
        )
        entries = GaugeMetricFamily(f"{PREFIX}_prefix_cache_entries", "prefix-cache entries in RAM", labels=["model"])
        lookups = CounterMetricFamily(
            f"{PREFIX}_prefix_cache_lookups",
            "keyed requests by prefix-cache outcome since the model loaded",
            labels=["model", "outcome"],
        )
        loads = CounterMetricFamily(
            f"{PREFIX}_model_loads", "model loads since start, by outcome", labels=["model", "outcome"]
        )
        unloads = CounterMetricFamily(
            f"{PREFIX}_model_unloads", "model unloads since start, by reason", labels=["model", "reason"]
        )
        for snap in reading.snapshots:
            in_flight.add_metric([snap.model], float(snap.in_flight))
            if snap.state is not None:
                state.add_metric([snap.model, snap.state], 1.0)
            ex = snap.execution
            for family, key in (
                (queue, "queued"),
                (running, "active"),
                (slots, "max_batch_size"),
                (peak, "peak_batch_size"),
            ):
                value = as_float(ex.get(key))
                if value is not None:
                    family.add_metric([snap.model], value)
            for outcome in ("completed", "cancelled", "failed", "rejected"):
                value = as_float(ex.get(outcome))
                if value is not None:
                    engine.add_metric([snap.model, outcome], value)
            _add_prefix_cache(snap, cache_bytes, entries, lookups)
        for model, counts in reading.counters.items():
            for outcome, value in (
                ("loaded", counts.loads),
                ("failed", counts.load_failures),
                ("refused", counts.refusals),
            ):
                loads.add_metric([model, outcome], float(value))
            for reason, value in (
                ("evicted", counts.evictions),
                ("keep_alive", counts.expirations),
                ("requested", counts.unloads),
            ):
                unloads.add_metric([model, reason], float(value))
        yield from (
            state,
            in_flight,
            queue,
            running,
            slots,
            peak,
            engine,
            cache_bytes,
            entries,
            lookups,
            loads,
            unloads,
        )


def _add_prefix_cache(
    snap: ModelSnapshot, cache_bytes: GaugeMetricFamily, entries: GaugeMetricFamily, lookups: CounterMetricFamily
) -> None:
    pc = snap.prefix_cache
    if not pc:
        return
    memory, disk = object_at(pc, "memory"), object_at(pc, "disk")
    ram_bytes = as_float(memory.get("resident_bytes"))
    if ram_bytes is not None:
        cache_bytes.add_metric([snap.model, "ram"], ram_bytes)
    disk_bytes = as_float(disk.get("bytes")) if disk.get("enabled") else None
    if disk_bytes is not None:
        cache_bytes.add_metric([snap.model, "disk"], disk_bytes)
    num_entries = as_float(memory.get("entries"))
    if num_entries is not None:
        entries.add_metric([snap.model], num_entries)
    requests = object_at(pc, "requests")
    for outcome, key in (("hit", "hits"), ("partial", "partial"), ("miss", "misses"), ("not_retained", "not_retained")):
        value = as_float(requests.get(key))
        if value is not None:
            lookups.add_metric([snap.model, outcome], value)


class ServerMetrics:
    """One app's metrics: its registry, the per-call series and the resident models' series."""

    def __init__(self, held: HeldModels) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "generation requests that ended, by route and finish reason",
            ["model", "route", "finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "prompt tokens of finished requests", ["model"], registry=r
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "tokens generated by finished requests", ["model"], registry=r
        )
        self.cached_tokens = Counter(
            f"{PREFIX}_prefix_cache_hit_tokens", "prompt tokens reused from the prefix cache", ["model"], registry=r
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "time from submission to the first token",
            ["model"],
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.inter_token = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "gap between two generated tokens",
            ["model"],
            buckets=INTER_TOKEN_BUCKETS_S,
            registry=r,
        )
        self.batch_width = Histogram(
            f"{PREFIX}_batch_width",
            "widest batch each request ran in",
            ["model"],
            buckets=BATCH_WIDTH_BUCKETS,
            registry=r,
        )
        self.mtp_drafted = Counter(f"{PREFIX}_mtp_drafted_tokens", "tokens drafted by MTP heads", ["model"], registry=r)
        self.mtp_accepted = Counter(
            f"{PREFIX}_mtp_accepted_tokens", "drafted tokens the model accepted", ["model"], registry=r
        )
        self.errors = Counter(
            f"{PREFIX}_errors",
            "error answers (HTTP error bodies and in-stream error events) by code",
            ["model", "code"],
            registry=r,
        )
        self._held = held
        self.resident = ResidentCollector()
        r.register(self.resident)
        self._scrape = asyncio.Lock()

    def meter(self, *, model: str, route: str) -> CallMeter:
        return CallMeter(self, model=model, route=route)

    def count_error(self, model: str, code: str) -> None:
        self.errors.labels(model, code).inc()

    async def exposition(self) -> bytes:
        """The text exposition, after reading the resident models (on a thread)."""
        held = [(m.name, m.provider, m.in_flight) for m in self._held.resident() if m.provider is not None]
        counters = dict(self._held.counters())  # both read here, on the event loop, as the pool asks
        async with self._scrape:  # one reading at a time: ``latest`` belongs to this scrape
            snapshots = await asyncio.to_thread(
                lambda: tuple(read_snapshot(name, provider, in_flight=n) for name, provider, n in held)
            )
            self.resident.latest = Reading(snapshots, counters)
            return generate_latest(self.registry)


class CallMeter:
    """Observes one call (``observe.CallObserver``) and adds it to the series when it ends."""

    wants_progress: Final = False

    def __init__(self, metrics: ServerMetrics, *, model: str, route: str) -> None:
        self._m = metrics
        self._model = model
        self._route = route
        self._last_token_at: float | None = None
        self._streamed_gaps = 0
        self._final: GenerationChunk | GenerationResult | None = None

    def progress(self, event: JSONObject) -> None:
        pass

    def chunk(self, chunk: GenerationChunk) -> None:
        if chunk.finish_reason is not None:
            self._final = chunk  # its token_ids are the whole answer's, not new tokens
            return
        num_new = len(chunk.token_ids or ())
        if num_new == 0:
            return
        now = time.perf_counter()
        if self._last_token_at is not None:
            gap = (now - self._last_token_at) / num_new  # tokens accepted together share the gap
            histogram = self._m.inter_token.labels(self._model)
            for _ in range(num_new):
                histogram.observe(gap)
            self._streamed_gaps += num_new
        self._last_token_at = now

    def result(self, result: GenerationResult) -> None:
        self._final = result

    def ended(self, error: BaseException | None) -> None:
        m, model = self._m, self._model
        final = self._final
        if error is not None or final is None:
            reason = "cancelled" if getattr(error, "code", None) == "cancelled" else "error"
            m.requests.labels(model, self._route, reason).inc()
            return
        m.requests.labels(model, self._route, final.finish_reason or "stop").inc()
        usage: Mapping[str, int] = final.usage or {}
        metadata: Mapping[str, JSONValue] = final.metadata or {}
        prompt, generated = as_int(usage.get("prompt_tokens")), as_int(usage.get("completion_tokens"))
        if prompt is not None:
            m.prompt_tokens.labels(model).inc(prompt)
        if generated is not None:
            m.generation_tokens.labels(model).inc(generated)
        cached = as_int(usage.get("cached_input_tokens"))
        if cached:
            m.cached_tokens.labels(model).inc(cached)
        execution = object_at(metadata, "execution")
        ttft = as_float(execution.get("ttft_s"))
        if ttft is not None:
            m.ttft.labels(model).observe(ttft)
        width = as_float(execution.get("peak_batch_size"))
        if width is not None:
            m.batch_width.labels(model).observe(width)
        speculation = object_at(metadata, "speculation")
        if speculation.get("used") is True:
            drafted, accepted = (
                as_float(speculation.get("drafted_tokens")),
                as_float(speculation.get("accepted_tokens")),
            )
            if drafted is not None:
                m.mtp_drafted.labels(model).inc(drafted)
            if accepted is not None:
                m.mtp_accepted.labels(model).inc(accepted)
        if self._streamed_gaps == 0 and generated is not None and generated > 1:
            self._observe_mean_gaps(metadata, generated - 1)

    def _observe_mean_gaps(self, metadata: Mapping[str, JSONValue], num_gaps: int) -> None:
        """A call answered in one piece: the engine reports its decode rate, not each gap, so
        each gap is observed as the mean (the sum and the count stay exact)."""
        rate = as_float(object_at(metadata, "performance").get("generation_tokens_per_second"))
        if rate is None or rate <= 0:
            return
        histogram = self._m.inter_token.labels(self._model)
        for _ in range(min(num_gaps, MAX_GAP_OBSERVATIONS)):
            histogram.observe(1.0 / rate)


async def metrics_endpoint(request: Request) -> Response:
    metrics: ServerMetrics = request.app.state.metrics
    return Response(await metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


class MetricsMiddleware:
    """Pure ASGI middleware: counts every error answer by its ``code`` (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, metrics: ServerMetrics) -> None:
        self.app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        watch = _ErrorWatch(scope, self._metrics)

        async def watching_send(message: Message) -> None:
            watch.see(message)
            await send(message)

        await self.app(scope, receive, watching_send)


class _ErrorWatch:
    """Reads one response as it goes out: the error body's code, or error events in a stream."""

    def __init__(self, scope: Scope, metrics: ServerMetrics) -> None:
        self._scope = scope
        self._metrics = metrics
        self._status = 0
        self._stream = False
        self._body = bytearray()

    def _model(self) -> str:
        state = self._scope.get("state")
        model = state.get("served_model") if isinstance(state, Mapping) else None
        return model if isinstance(model, str) else ""

    def see(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._status = int(message["status"])
            headers = dict(message.get("headers") or [])
            self._stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            return
        if message["type"] != "http.response.body":
            return
        chunk: bytes = message.get("body", b"")
        if self._stream:
            if SSE_ERROR_MARK in chunk:
                for line in chunk.split(b"\n"):
                    if line.startswith(SSE_ERROR_MARK):
                        self._count(line[len(b"data: ") :])
            return
        if self._status < 400:
            return
        if len(self._body) + len(chunk) <= MAX_ERROR_BODY_BYTES:
            self._body += chunk
        if not message.get("more_body", False):
            self._count(bytes(self._body))

    def _count(self, raw: bytes) -> None:
        code = f"http_{self._status}"
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if isinstance(body, dict):
            error = body.get("error")
            if isinstance(error, dict) and isinstance(error.get("code"), str):
                code = str(error["code"])
        self._metrics.count_error(self._model(), code)
