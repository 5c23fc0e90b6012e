"""The LLM node: resolve controls once, pick a client, record every phase event, return the result.

    node = LLMNode(ledger=ledger, default_model="/models/qwen")
    request = NodeRequest(prompt="Explain TTL caches.", speculation=False, run_thinking="low",
                          sampling={"temperature": 0}, max_output_tokens=64)
    result = node.run(request, key=NodeKey(run_id, "llm_a", step_id=step_id, attempt=1))
    result.content, result.controls.sources, result.to_runtime_result()

The node payload (``NodeRequest``) is validated once, into a ``GenerationRequest`` carrying the
node's controls as its ``call`` level and the run's as its ``run`` level. Precedence, for
speculation and thinking alike, most specific first: call, run, the provider's constructor
default, the Core policy, the verified default; one resolver (``controls.resolve_controls``)
decides. A local call asks the provider (``provider.resolve_controls(request)``, the same
resolution ``generate`` runs) so what is recorded is what runs. A remote call resolves the
call and run levels here and sends the result as the call's controls; when neither said
anything the keys are omitted and the server's provider/policy decides (its answer's
``speculation.source`` is recorded).

Clients: a local ``MLXProvider`` from a per-process registry keyed by (model, options), so
every node naming the same model and options shares one resident model; calls run
concurrently when the instance says ``supports_concurrent_generation()``, otherwise one at a
time per model behind a lock. A ``base_url`` makes the node use ``remote_client.RemoteClient``
instead (imported lazily).

This module imports neither AbstractRuntime nor the engine; the provider and the remote client
are imported on first use.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Final, Literal, NotRequired, TypedDict

from ..artifacts import size_on_disk
from ..controls import NOTHING_SAID, UNSET, ControlLevel, ResolvedControls, resolve_controls
from ..errors import InvalidControls, InvalidRequest, MLXRuntimeError
from ..json_values import JSONObject, JSONValue, object_at
from ..ledger import Ledger, NodeKey, ProgressEvent, ProgressWriter, progress_idempotency_key
from ..request import OUTPUT_CAP_NAMES, GenerationRequest, Message, ProgressSink
from ..results import FinishReason, GenerationResult
from ..structured import ResponseFormat

if TYPE_CHECKING:
    import httpx

    from ..provider.mlx_provider import MLXProvider
    from ..remote_client import RemoteClient

__all__ = [
    "ClientKind",
    "Concurrency",
    "DEFAULT_PROVIDER_OPTIONS",
    "LLMNode",
    "ModelLoad",
    "NodeRequest",
    "NodeResult",
    "PreparedCall",
    "ProgressRoute",
    "ProviderRegistry",
    "RemoteOptions",
    "RuntimeResult",
    "default_registry",
    "resolve_node_controls",
]

log = logging.getLogger(__name__)

DEFAULT_PROVIDER_OPTIONS: Final[Mapping[str, object]] = {"mlx_batching": True}
"""Options every local provider gets unless the caller overrides them (concurrent batching on)."""

ProgressCallback = ProgressSink


class RemoteOptions(TypedDict, total=False):
    """``RemoteClient`` settings for a node's remote calls (the client's keyword arguments)."""

    api_key: str | None
    timeout: httpx.Timeout
    transport: httpx.BaseTransport | None
    max_retries: int
    backoff_s: float
    limits: httpx.Limits


class ClientKind(StrEnum):
    """What serves a node: an in-process provider or a server over HTTP."""

    LOCAL = "local"
    REMOTE = "remote"


class Concurrency(StrEnum):
    """How a node's call ran next to others (``metadata.client.concurrency``)."""

    CONCURRENT = "concurrent"  # the local engine batches it with other calls
    SERIALIZED = "serialized"  # one call at a time per model, behind a lock
    REMOTE = "remote"  # the server decides


# --------------------------------------------------------------------------------------
# Inputs and outputs
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeRequest:
    """What one LLM node asks for.

    ``speculation``/``thinking`` are the node (call) level, ``run_speculation``/
    ``run_thinking`` the run level; ``UNSET`` or ``None`` inherit, ``False`` is off.
    ``sampling`` holds generation knobs (``temperature``, ``seed``, ``top_p``, ``stop`` ...);
    ``max_output_tokens`` is the output cap (a positive integer; ``None``: the provider's
    default). ``base_url`` selects the remote client. ``response_schema``
    (a JSON Schema, named ``response_schema_name``) asks for a structured answer: the result's
    ``data`` holds it, parsed and valid. ``affinity_key`` (the run's session id, else its run
    id) is sent to a remote server as the ``X-Session-Affinity`` header, so a load balancer keeps
    a run on one server; it does not change the answer.
    """

    prompt: str = ""
    messages: Sequence[Message] | None = None
    system_prompt: str | None = None
    tools: Sequence[object] | None = None  # tool schemas as given; ``GenerationRequest.build`` checks them
    media: Sequence[object] | None = None
    provider: str = "mlx"
    model: str | None = None
    base_url: str | None = None
    # Control values as given (validated by ``ControlLevel.parse``).
    speculation: object = UNSET
    thinking: object = UNSET
    run_speculation: object = UNSET
    run_thinking: object = UNSET
    sampling: Mapping[str, object] = field(default_factory=dict)
    max_output_tokens: object = None  # as given; validated by ``generation_request``
    prompt_cache_key: str | None = None
    response_schema: Mapping[str, object] | None = None
    response_schema_name: str | None = None
    affinity_key: str | None = None


@dataclass(frozen=True, slots=True)
class PreparedCall:
    """A resolved call, ready to execute: the client, the effective controls and the validated
    request. ``fingerprint`` is the sha256 of everything that determines the answer, so two
    prepared calls with equal fingerprints make the same request."""

    client_kind: ClientKind
    client_id: str
    provider: str
    model: str | None
    base_url: str | None
    controls: ResolvedControls
    speculation_sent: bool
    request: GenerationRequest
    fingerprint: str


class RuntimeResult(TypedDict):
    """What an LLM node returns to AbstractRuntime (see ``NodeResult.to_runtime_result``)."""

    content: str
    tool_calls: list[JSONObject]
    finish_reason: FinishReason | None
    usage: dict[str, int]
    model: str | None
    provider: str
    gen_time: float
    metadata: JSONObject
    ttft_ms: NotRequired[float]
    reasoning: NotRequired[str]
    data: NotRequired[JSONValue]  # the parsed structured answer, when the node asked for one


@dataclass(slots=True)
class NodeResult:
    """The answer of one node and how it was produced."""

    generation: GenerationResult
    prepared: PreparedCall
    concurrency: Concurrency
    wall_s: float
    num_progress_events: int
    extra_metadata: JSONObject = field(default_factory=dict)

    @property
    def content(self) -> str:
        return self.generation.content

    @property
    def controls(self) -> ResolvedControls:
        return self.prepared.controls

    @property
    def metadata(self) -> JSONObject:
        return self.to_runtime_result()["metadata"]

    def to_runtime_result(self) -> RuntimeResult:
        """The dict AbstractRuntime's visual compiler reads: ``content``, ``tool_calls``,
        ``finish_reason``, ``usage``, ``model``, ``provider``, ``gen_time`` (ms), ``ttft_ms``,
        ``reasoning`` and ``metadata`` (``execution``, ``speculation``, ``performance``,
        ``prompt_cache``, ``progress`` as the client reported them, with ``speculation.source``
        set to the deciding level, plus ``controls`` and ``client``). JSON only."""
        gen = self.generation
        prepared = self.prepared
        metadata = copy.deepcopy(dict(gen.metadata))
        speculation = found if isinstance(found := metadata.get("speculation"), Mapping) else None
        controls = prepared.controls.to_metadata()
        if prepared.client_kind == ClientKind.REMOTE:
            if prepared.speculation_sent and speculation is not None:
                # The server saw our resolution as its call level; the deciding level is ours.
                speculation = {**speculation, "source": prepared.controls.speculation_source}
                metadata["speculation"] = speculation
            elif not prepared.speculation_sent:
                # The server decided; report what it says it ran.
                controls["speculation_source"] = (speculation or {}).get("source", "server")
                controls["speculation"] = _wire_from_metadata(speculation)
        metadata["controls"] = controls
        client: JSONObject = {"kind": prepared.client_kind, "concurrency": self.concurrency}
        if prepared.base_url:
            client["base_url"] = prepared.base_url
        metadata["client"] = client
        metadata.setdefault("progress", {})
        if isinstance(metadata["progress"], dict):
            metadata["progress"]["recorded_events"] = self.num_progress_events
        metadata.update(copy.deepcopy(self.extra_metadata))
        out: RuntimeResult = {
            "content": gen.content,
            "tool_calls": list(gen.tool_calls or []),
            "finish_reason": gen.finish_reason,
            "usage": dict(gen.usage),
            "model": gen.model or prepared.model,
            "provider": prepared.provider,
            "gen_time": round(self.wall_s * 1000.0, 3),
            "metadata": metadata,
        }
        ttft = object_at(metadata, "execution").get("ttft_s")
        if isinstance(ttft, (int, float)) and not isinstance(ttft, bool):
            out["ttft_ms"] = round(float(ttft) * 1000.0, 3)
        if gen.reasoning is not None:
            out["reasoning"] = gen.reasoning
        parsed = gen.parsed_json()
        if parsed is not None:
            # The host's visual compiler reads the structured answer from ``data``.
            out["data"] = parsed
        return out


def _wire_from_metadata(meta: Mapping[str, JSONValue] | None) -> JSONValue:
    if not meta or not meta.get("requested"):
        return False
    out: JSONObject = {"mode": meta.get("mode", "native_mtp")}
    for name in ("num_draft_tokens", "require_acceleration"):
        if name in meta:
            out[name] = meta[name]
    return out


# --------------------------------------------------------------------------------------
# The node payload, validated once
# --------------------------------------------------------------------------------------


def generation_request(request: NodeRequest) -> GenerationRequest:
    """The typed request of a node payload (raises ``InvalidControls``/``InvalidRequest``
    naming the bad field). ``sampling`` may also hold the limit ``stop``; the output cap is
    ``request.max_output_tokens``, not a sampling knob."""
    call, run = _levels(request)
    sampling = {name: value for name, value in request.sampling.items() if value is not None}
    for name in OUTPUT_CAP_NAMES:
        if name in sampling:
            raise InvalidControls(
                f"sampling.{name}: the output cap is the request's own field; pass max_output_tokens=",
                field=f"sampling.{name}",
                value=sampling[name],
            )
    stop = sampling.pop("stop", None)
    messages = copy.deepcopy(request.messages)
    if messages is None and request.prompt_cache_key is not None:
        messages = []  # a node's prompt and system prompt are its whole conversation
    return GenerationRequest.build(
        prompt=request.prompt or "",
        messages=messages,
        system_prompt=request.system_prompt,
        tools=copy.deepcopy(request.tools),
        media=request.media,
        sampling=copy.deepcopy(sampling),
        max_output_tokens=request.max_output_tokens,
        stop=stop,
        speculation=call.speculation,
        thinking=call.thinking,
        run=run,
        response_format=(
            None
            if request.response_schema is None
            else ResponseFormat.build(request.response_schema, name=request.response_schema_name)
        ),
        prompt_cache_key=request.prompt_cache_key,
        affinity_key=request.affinity_key,
    )


def resolve_node_controls(
    request: NodeRequest,
    *,
    provider_default: ControlLevel | None = None,
    policy: ControlLevel | None = None,
    verified_default: bool = False,
) -> ResolvedControls:
    """Effective speculation and thinking of ``request`` and the level that decided each,
    given the provider and policy levels (``controls.resolve_controls`` over all four)."""
    call, run = _levels(request)
    return resolve_controls(
        call=call, run=run, provider=provider_default, policy=policy, verified_default=verified_default
    )


def _levels(request: NodeRequest) -> tuple[ControlLevel, ControlLevel]:
    """The node's (call) and the run's controls, validated."""
    call = ControlLevel.parse(speculation=_said(request.speculation), thinking=_said(request.thinking))
    run = ControlLevel.parse(
        speculation=_said(request.run_speculation), thinking=_said(request.run_thinking), prefix="_runtime."
    )
    return call, run


def _said(value: object) -> object:
    return None if value is UNSET else value


# --------------------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """A local model made resident for a call: told once when the load starts (``state``
    ``loading``) and once when it ends (``loaded`` or ``failed``, with ``seconds``). A call
    that waits for another call's load of the same model is told the same."""

    model: str
    size_bytes: int | None
    state: Literal["loading", "loaded", "failed"]
    seconds: float | None = None

    def event(self) -> JSONObject:
        """The phase event of the load (``phase`` ``load``), as the ledger's progress rows keep it."""
        out: JSONObject = {
            "kind": "load",
            "phase": "load",
            "state": self.state,
            "model": self.model,
            "size_bytes": self.size_bytes,
        }
        if self.seconds is not None:
            out["elapsed_s"] = round(self.seconds, 6)
        return out


OnLoad = Callable[[ModelLoad], None]


@dataclass(slots=True)
class _LocalEntry:
    provider: MLXProvider
    lock: threading.Lock | None  # None: the instance schedules concurrent calls itself


class ProviderRegistry:
    """Resident clients of this process: local providers keyed by (model, options), remote
    clients by base URL. Thread-safe; ``close()`` unloads what it created."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local: dict[tuple[str, str], _LocalEntry] = {}
        self._model_locks: dict[str, threading.Lock] = {}
        self._remote: dict[str, RemoteClient] = {}
        self._loading: dict[tuple[str, str], threading.Lock] = {}

    def local(
        self, model: str, options: Mapping[str, object] | None = None, *, on_load: OnLoad | None = None
    ) -> _LocalEntry:
        """The shared local provider for ``model`` with ``options`` (loaded on first use;
        ``on_load`` is told when that load, or the wait for another caller's, starts and ends)."""
        merged = {**DEFAULT_PROVIDER_OPTIONS, **dict(options or {})}
        key = (model, _canonical(merged))
        with self._lock:
            entry = self._local.get(key)
            if entry is not None:
                return entry
            loading = self._loading.setdefault(key, threading.Lock())
        started = time.perf_counter()
        size = size_on_disk(model) if on_load is not None else None
        if on_load is not None:
            on_load(ModelLoad(model, size, "loading"))
        try:
            with loading:  # one load per key; other keys load in parallel
                with self._lock:
                    entry = self._local.get(key)
                if entry is None:
                    entry = self._load(model, merged)
                    with self._lock:
                        self._local[key] = entry
                        self._loading.pop(key, None)
        except BaseException:
            if on_load is not None:
                on_load(ModelLoad(model, size, "failed", time.perf_counter() - started))
            raise
        if on_load is not None:
            on_load(ModelLoad(model, size, "loaded", time.perf_counter() - started))
        return entry

    def resident(self, model: str, options: Mapping[str, object] | None = None) -> _LocalEntry | None:
        """The local provider for ``model`` with ``options`` when it is loaded already (None: not
        loaded; nothing is loaded here)."""
        merged = {**DEFAULT_PROVIDER_OPTIONS, **dict(options or {})}
        with self._lock:
            return self._local.get((model, _canonical(merged)))

    def _load(self, model: str, options: Mapping[str, object]) -> _LocalEntry:
        from ..provider import create_llm

        provider = create_llm("mlx", model=model, **options)
        lock: threading.Lock | None = None
        if not _schedules_concurrently(provider):
            with self._lock:
                lock = self._model_locks.setdefault(str(getattr(provider, "path", model)), threading.Lock())
        return _LocalEntry(provider=provider, lock=lock)

    def remote(self, base_url: str, model: str | None = None, options: RemoteOptions | None = None) -> RemoteClient:
        """The shared ``remote_client.RemoteClient`` for (``base_url``, ``model``)."""
        url = base_url.rstrip("/")
        key = f"{url} {model or ''} {_canonical(dict(options or {}))}"
        with self._lock:
            client = self._remote.get(key)
            if client is None:
                try:
                    from ..remote_client import RemoteClient
                except ImportError as exc:
                    raise InvalidRequest(
                        f"a remote node ({url}) needs abstractruntime_mlx.remote_client, which is not available: {exc}"
                    ) from exc
                client = RemoteClient(url, model=model, **(options or RemoteOptions()))
                self._remote[key] = client
        return client

    def close(self) -> None:
        with self._lock:
            local = list(self._local.values())
            remote = list(self._remote.values())
            self._local.clear()
            self._remote.clear()
        for entry in local:
            try:
                entry.provider.unload_model()
            except MLXRuntimeError:
                log.warning("could not unload %s", getattr(entry.provider, "model", "?"), exc_info=True)
        for client in remote:
            close = getattr(client, "close", None)
            if callable(close):
                close()


def _schedules_concurrently(provider: object) -> bool:
    probe = getattr(provider, "supports_concurrent_generation", None)
    if not callable(probe):
        return False
    try:
        return probe() is True
    except Exception:  # noqa: BLE001 - a broken probe keeps the safe (serialized) path
        log.warning("supports_concurrent_generation() raised; serializing calls", exc_info=True)
        return False


_DEFAULT_REGISTRY = ProviderRegistry()


def default_registry() -> ProviderRegistry:
    """The per-process registry every ``LLMNode`` uses unless given another."""
    return _DEFAULT_REGISTRY


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


# --------------------------------------------------------------------------------------
# Progress routing
# --------------------------------------------------------------------------------------


class ProgressRoute:
    """Where one node's phase events go: the ledger (``writer`` under ``key``), a host callback
    (AbstractRuntime's progress channel), both, or, for a call made before its step exists, a
    buffer that ``attach()`` later writes under the real key with the original timestamps.

    Thread-safe: events arrive on the generating thread, ``attach`` may run on another.
    """

    def __init__(
        self,
        *,
        writer: ProgressWriter | None = None,
        key: NodeKey | None = None,
        callback: ProgressCallback | None = None,
        buffer: bool = False,
    ) -> None:
        if writer is not None and key is None:
            raise ValueError("ProgressRoute: a writer needs the NodeKey its rows belong to")
        self._lock = threading.Lock()
        self._writer = writer
        self._key = key
        self._callback = callback
        self._buffer: list[tuple[float, JSONObject]] | None = [] if buffer else None
        self.num_events = 0

    @property
    def active(self) -> bool:
        return self._writer is not None or self._callback is not None or self._buffer is not None

    def __call__(self, event: Mapping[str, JSONValue]) -> None:
        with self._lock:
            self.num_events += 1
            if self._buffer is not None:
                self._buffer.append((time.time(), dict(event)))
                return
            writer, key, callback = self._writer, self._key, self._callback
        if writer is not None and key is not None:
            writer.put(event, key)
        if callback is not None:
            _call_host(callback, event)

    def attach(
        self,
        *,
        ledger: Ledger | None,
        writer: ProgressWriter | None,
        key: NodeKey | None,
        callback: ProgressCallback | None,
    ) -> int:
        """Stop buffering: write the buffered events (original timestamps, one transaction)
        under ``key``, replay them to ``callback``, and route later events live. Returns how
        many buffered events were handed over."""
        with self._lock:
            buffered = self._buffer or []
            self._buffer = None
            self._writer, self._key, self._callback = writer, key, callback
            if buffered and ledger is not None and key is not None:
                ledger.append_progress(
                    ProgressEvent(key, event, progress_idempotency_key(key, event), at) for at, event in buffered
                )
        if callback is not None:
            for _at, event in buffered:
                _call_host(callback, event)
        return len(buffered)

    def flush(self, *, timeout_s: float = 30.0) -> None:
        """Block until every event of this node routed to the ledger is committed."""
        writer, key = self._writer, self._key
        if writer is not None and key is not None:
            writer.flush(key, timeout_s=timeout_s)


def _call_host(callback: ProgressCallback, event: Mapping[str, JSONValue]) -> None:
    try:
        callback(dict(event))
    except Exception:  # noqa: BLE001 - a host's progress sink is best-effort by its own contract
        log.warning("host progress callback raised; event dropped for that sink", exc_info=True)


# --------------------------------------------------------------------------------------
# The node
# --------------------------------------------------------------------------------------


class LLMNode:
    """Runs LLM nodes: ``prepare`` (resolve + pick client) then ``execute``; ``run`` does both.

    ``ledger`` enables progress rows (a ``ProgressWriter`` is created unless ``writer`` is
    given). ``default_model`` applies to requests without a model; ``provider_options`` are
    the load-time options of local providers (``DEFAULT_PROVIDER_OPTIONS`` underneath);
    ``remote_options`` go to ``RemoteClient``. ``record_progress=False`` turns the ledger rows
    off (the benchmark's baseline) without changing anything else.
    """

    def __init__(
        self,
        *,
        ledger: Ledger | None = None,
        writer: ProgressWriter | None = None,
        registry: ProviderRegistry | None = None,
        default_model: str | None = None,
        provider_options: Mapping[str, object] | None = None,
        remote_options: RemoteOptions | None = None,
        record_progress: bool = True,
    ) -> None:
        self.ledger = ledger
        self._owns_writer = writer is None and ledger is not None and record_progress
        if writer is None and ledger is not None and record_progress:
            writer = ledger.progress_writer()
        self.writer = writer
        self.registry = registry or default_registry()
        self.default_model = default_model
        self.provider_options = dict(provider_options or {})
        self.remote_options: RemoteOptions = remote_options.copy() if remote_options else {}
        self.record_progress = record_progress

    # -- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the progress writer this node created (drains it). Providers stay resident."""
        if self._owns_writer and self.writer is not None:
            self.writer.stop()

    # -- steps --------------------------------------------------------------------------

    def prepare(self, request: NodeRequest, *, on_load: OnLoad | None = None) -> PreparedCall:
        """Validate the payload, resolve the controls and pick the client; loads the local
        model on first use (telling ``on_load``, see ``ModelLoad``)."""
        provider_name = (request.provider or "mlx").strip().lower()
        model = request.model or self.default_model
        typed = generation_request(request)
        if request.base_url:
            return self._prepare_remote(typed, provider_name, model, str(request.base_url).rstrip("/"))
        if provider_name != "mlx":
            raise InvalidRequest(
                f"node provider {request.provider!r} is not served here: local nodes run the 'mlx' provider; "
                "give the node or the run a base_url to use a remote server"
            )
        if not model:
            raise InvalidRequest("the node names no model and no default model is configured")
        entry = self.registry.local(model, self.provider_options, on_load=on_load)
        # The provider's own resolution: the same one its generate() runs.
        controls: ResolvedControls = entry.provider.resolve_controls(typed)
        typed = dataclasses.replace(typed, resolved=controls)  # the provider does not resolve again
        client_id = f"local:{model}:{_canonical({**DEFAULT_PROVIDER_OPTIONS, **self.provider_options})}"
        return _prepared(ClientKind.LOCAL, client_id, "mlx", model, None, controls, True, typed)

    def _prepare_remote(
        self, typed: GenerationRequest, provider_name: str, model: str | None, base_url: str
    ) -> PreparedCall:
        controls = resolve_controls(call=typed.call, run=typed.run, verified_default=False)
        said = {name: source in ("call", "run") for name, source in controls.sources.items()}
        # The wire has one level: send what the node and the run resolved to, nothing else.
        sent = dataclasses.replace(
            typed,
            speculation=controls.speculation if said["speculation"] else None,
            thinking=controls.thinking if said["thinking"] else None,
            run=NOTHING_SAID,
        )
        return _prepared(
            ClientKind.REMOTE,
            f"remote:{base_url}:{model or ''}",
            provider_name,
            model,
            base_url,
            controls,
            said["speculation"],
            sent,
        )

    def execute(
        self,
        prepared: PreparedCall,
        *,
        route: ProgressRoute | None = None,
        cancel_event: threading.Event | None = None,
    ) -> NodeResult:
        """Make the call, sending phase events to ``route``; flush the node's rows before returning."""
        route = route or ProgressRoute()
        request = prepared.request.with_sinks(cancel=cancel_event, progress=route if route.active else None)
        started = time.perf_counter()
        try:
            generation, concurrency = self._call(prepared, request)
        except BaseException:
            try:
                route.flush()
            except MLXRuntimeError:
                log.error("could not flush the progress rows of a failed node", exc_info=True)
            raise
        route.flush()
        return NodeResult(
            generation=generation,
            prepared=prepared,
            concurrency=concurrency,
            wall_s=time.perf_counter() - started,
            num_progress_events=route.num_events,
        )

    def _call(self, prepared: PreparedCall, request: GenerationRequest) -> tuple[GenerationResult, Concurrency]:
        if prepared.client_kind == ClientKind.REMOTE:
            client = self.registry.remote(str(prepared.base_url), prepared.model, self.remote_options)
            return client.generate_request(request), Concurrency.REMOTE
        assert prepared.model is not None
        entry = self.registry.local(prepared.model, self.provider_options)
        if entry.lock is None:
            return entry.provider.generate_request(request), Concurrency.CONCURRENT
        with entry.lock:
            return entry.provider.generate_request(request), Concurrency.SERIALIZED

    def headroom(self, prepared: PreparedCall) -> int | None:
        """How many more requests the local engine behind ``prepared`` can take now (free batch
        slots plus free queue places); ``None`` when unknown (remote clients)."""
        if prepared.client_kind != ClientKind.LOCAL or prepared.model is None:
            return None
        stats = self.registry.local(prepared.model, self.provider_options).provider.get_prompt_cache_stats()
        execution = stats.get("execution") if isinstance(stats, Mapping) else None
        if not isinstance(execution, Mapping):
            return None
        try:
            capacity = int(execution["max_batch_size"]) + int(execution["max_queue_size"])
            in_use = int(execution["queued"]) + int(execution["active"])
        except (KeyError, TypeError, ValueError):
            return None
        return max(0, capacity - in_use)

    def route_for(self, key: NodeKey | None, callback: ProgressCallback | None = None) -> ProgressRoute:
        """The progress route of a node: this node's ledger writer under ``key`` (when recording)
        plus ``callback``."""
        writer = self.writer if (self.record_progress and key is not None) else None
        return ProgressRoute(writer=writer, key=key if writer is not None else None, callback=callback)

    def run(
        self,
        request: NodeRequest,
        *,
        key: NodeKey | None = None,
        on_progress: ProgressCallback | None = None,
        cancel_event: threading.Event | None = None,
    ) -> NodeResult:
        """``prepare`` + ``execute``: phase events go to the ledger under ``key`` (if this node
        has a ledger and ``key`` is given) and to ``on_progress``."""
        prepared = self.prepare(request)
        return self.execute(prepared, route=self.route_for(key, on_progress), cancel_event=cancel_event)


def _prepared(
    kind: ClientKind,
    client_id: str,
    provider: str,
    model: str | None,
    base_url: str | None,
    controls: ResolvedControls,
    sent: bool,
    request: GenerationRequest,
) -> PreparedCall:
    digest = hashlib.sha256(_canonical({"client": client_id, "request": request.to_dict()}).encode("utf-8")).hexdigest()
    return PreparedCall(
        client_kind=kind,
        client_id=client_id,
        provider=provider,
        model=model,
        base_url=base_url,
        controls=controls,
        speculation_sent=sent,
        request=request,
        fingerprint=digest,
    )
