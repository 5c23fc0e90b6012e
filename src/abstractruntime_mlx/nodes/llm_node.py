"""The LLM node: resolve controls once, pick a client, record every phase event, return the result.

    node = LLMNode(ledger=ledger, default_model="/models/qwen")
    request = NodeRequest(prompt="Explain TTL caches.", speculation=False, run_thinking="low",
                          sampling={"temperature": 0, "max_output_tokens": 64})
    result = node.run(request, key=NodeKey(run_id, "llm_a", step_id=step_id, attempt=1))
    result.content, result.controls.sources, result.to_runtime_result()

Precedence, for speculation and thinking alike, most specific first: the node (``call``), the
run (``_runtime``), the provider's constructor default (local only), the Core policy (local
only, and only when the provider has no constructor default, as the provider itself decides),
then the verified default. The node resolves the chain itself so the deciding level is known
and recorded, and passes the effective value to the client as its call-level setting
(``False`` for off, the native-MTP object otherwise). A remote call sends only what the node or
the run said; when neither said anything the key is omitted and the server's provider/policy
decides (its answer's ``speculation.source`` is recorded).

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
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ..controls import (
    UNSET,
    ResolvedControls,
    normalize_speculation,
    normalize_thinking,
    resolve_speculation,
    resolve_thinking,
)
from ..errors import InvalidRequest, MLXRuntimeError
from ..ledger import Ledger, NodeKey, ProgressEvent, ProgressWriter, progress_idempotency_key
from ..results import GenerationResult

__all__ = [
    "DEFAULT_PROVIDER_OPTIONS",
    "LLMNode",
    "NodeRequest",
    "NodeResult",
    "PreparedCall",
    "ProgressRoute",
    "ProviderRegistry",
    "default_registry",
    "resolve_node_controls",
]

log = logging.getLogger(__name__)

DEFAULT_PROVIDER_OPTIONS: Final[Mapping[str, Any]] = {"mlx_batching": True}
"""Options every local provider gets unless the caller overrides them (concurrent batching on)."""

_SPECULATION_OFF_REASONS: Final[Mapping[str, str]] = {
    "call": "disabled_for_this_call",
    "run": "disabled_for_this_run",
    "provider": "disabled_by_provider_default",
    "policy": "disabled_by_policy",
    "off": "no_verified_mtp_default",
}

ProgressCallback = Callable[[dict[str, Any]], Any]


# --------------------------------------------------------------------------------------
# Inputs and outputs
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeRequest:
    """What one LLM node asks for.

    ``speculation``/``thinking`` are the node (call) level, ``run_speculation``/
    ``run_thinking`` the run level; ``UNSET`` or ``None`` inherit, ``False`` is off.
    ``sampling`` holds generation knobs (``temperature``, ``seed``, ``max_output_tokens``,
    ``top_p``, ``stop`` ...). ``base_url`` selects the remote client.
    """

    prompt: str = ""
    messages: list[dict[str, Any]] | None = None
    system_prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    media: list[Any] | None = None
    provider: str = "mlx"
    model: str | None = None
    base_url: str | None = None
    speculation: Any = UNSET
    thinking: Any = UNSET
    run_speculation: Any = UNSET
    run_thinking: Any = UNSET
    sampling: Mapping[str, Any] = field(default_factory=dict)
    prompt_cache_key: str | None = None


@dataclass(frozen=True, slots=True)
class PreparedCall:
    """A resolved call, ready to execute: the client, the effective controls and the exact
    ``generate`` arguments. ``fingerprint`` is the sha256 of everything that determines the
    answer, so two prepared calls with equal fingerprints make the same request."""

    client_kind: str  # "local" | "remote"
    client_id: str
    provider: str
    model: str | None
    base_url: str | None
    controls: ResolvedControls
    speculation_sent: bool
    kwargs: Mapping[str, Any]
    fingerprint: str


@dataclass(slots=True)
class NodeResult:
    """The answer of one node and how it was produced."""

    generation: GenerationResult
    prepared: PreparedCall
    concurrency: str  # "concurrent" | "serialized" | "remote"
    wall_s: float
    num_progress_events: int
    extra_metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def content(self) -> str:
        return self.generation.content

    @property
    def controls(self) -> ResolvedControls:
        return self.prepared.controls

    @property
    def metadata(self) -> dict[str, Any]:
        return self.to_runtime_result()["metadata"]

    def to_runtime_result(self) -> dict[str, Any]:
        """The dict AbstractRuntime's visual compiler reads: ``content``, ``tool_calls``,
        ``finish_reason``, ``usage``, ``model``, ``provider``, ``gen_time`` (ms), ``ttft_ms``,
        ``reasoning`` and ``metadata`` (``execution``, ``speculation``, ``performance``,
        ``prompt_cache``, ``progress`` as the client reported them, with ``speculation.source``
        set to the deciding level, plus ``controls`` and ``client``). JSON only."""
        gen = self.generation
        prepared = self.prepared
        metadata = copy.deepcopy(dict(gen.metadata))
        speculation = _speculation_metadata(metadata.get("speculation"), prepared)
        if speculation is not None:
            metadata["speculation"] = speculation
        controls = prepared.controls.to_metadata()
        if not prepared.speculation_sent:
            # A remote server decided; report what it says it ran.
            controls["speculation_source"] = (speculation or {}).get("source", "server")
            controls["speculation"] = _wire_from_metadata(speculation)
        metadata["controls"] = controls
        client: dict[str, Any] = {"kind": prepared.client_kind, "concurrency": self.concurrency}
        if prepared.base_url:
            client["base_url"] = prepared.base_url
        metadata["client"] = client
        metadata.setdefault("progress", {})
        if isinstance(metadata["progress"], dict):
            metadata["progress"]["recorded_events"] = self.num_progress_events
        metadata.update(copy.deepcopy(self.extra_metadata))
        out: dict[str, Any] = {
            "content": gen.content,
            "tool_calls": list(gen.tool_calls or []),
            "finish_reason": gen.finish_reason,
            "usage": dict(gen.usage),
            "model": gen.model or prepared.model,
            "provider": prepared.provider,
            "gen_time": round(self.wall_s * 1000.0, 3),
            "metadata": metadata,
        }
        ttft = (metadata.get("execution") or {}).get("ttft_s")
        if isinstance(ttft, (int, float)) and not isinstance(ttft, bool):
            out["ttft_ms"] = round(float(ttft) * 1000.0, 3)
        if gen.reasoning is not None:
            out["reasoning"] = gen.reasoning
        return out


def _speculation_metadata(raw: Any, prepared: PreparedCall) -> dict[str, Any] | None:
    if not isinstance(raw, Mapping):
        return None
    meta = dict(raw)
    if not prepared.speculation_sent:
        return meta
    source = prepared.controls.sources["speculation"]
    meta["source"] = source
    if not prepared.controls.speculation.enabled:
        meta["reason"] = _SPECULATION_OFF_REASONS.get(source, meta.get("reason"))
    return meta


def _wire_from_metadata(meta: Mapping[str, Any] | None) -> Any:
    if not meta or not meta.get("requested"):
        return False
    out: dict[str, Any] = {"mode": meta.get("mode", "native_mtp")}
    for name in ("num_draft_tokens", "require_acceleration"):
        if name in meta:
            out[name] = meta[name]
    return out


# --------------------------------------------------------------------------------------
# Precedence
# --------------------------------------------------------------------------------------


def resolve_node_controls(
    request: NodeRequest,
    *,
    provider_default: Any = UNSET,
    policy: Any = UNSET,
    verified_default: bool = False,
) -> ResolvedControls:
    """Effective speculation and thinking of ``request`` and the level that decided each.

    ``provider_default`` is the local provider's constructor setting (``None``/``UNSET``:
    none); ``policy`` the Core policy, consulted only when the provider has no default.
    """
    provider_level = normalize_speculation(None if provider_default is UNSET else provider_default)
    levels: dict[str, Any] = {
        "call": _said(request.speculation, "speculation"),
        "run": _said(request.run_speculation, "_runtime.speculation"),
    }
    if provider_level is not None:
        levels["provider"] = provider_level
    elif policy is not UNSET:
        levels["policy"] = policy
    speculation, speculation_source = resolve_speculation(**levels, verified_default=verified_default)
    thinking, thinking_source = resolve_thinking(
        call=_said_thinking(request.thinking, "thinking"),
        run=_said_thinking(request.run_thinking, "_runtime.thinking"),
    )
    return ResolvedControls(
        speculation=speculation,
        thinking=thinking,
        sources={"speculation": speculation_source, "thinking": thinking_source},
    )


def _said(value: Any, name: str) -> Any:
    return UNSET if value is UNSET or value is None else normalize_speculation(value, field=name)


def _said_thinking(value: Any, name: str) -> Any:
    return UNSET if value is UNSET or value is None else normalize_thinking(value, field=name)


# --------------------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _LocalEntry:
    provider: Any
    verified: bool
    lock: threading.Lock | None  # None: the instance schedules concurrent calls itself


class ProviderRegistry:
    """Resident clients of this process: local providers keyed by (model, options), remote
    clients by base URL. Thread-safe; ``close()`` unloads what it created."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local: dict[tuple[str, str], _LocalEntry] = {}
        self._model_locks: dict[str, threading.Lock] = {}
        self._remote: dict[str, Any] = {}
        self._loading: dict[tuple[str, str], threading.Lock] = {}

    def local(self, model: str, options: Mapping[str, Any] | None = None) -> _LocalEntry:
        """The shared local provider for ``model`` with ``options`` (loaded on first use)."""
        merged = {**DEFAULT_PROVIDER_OPTIONS, **dict(options or {})}
        key = (model, _canonical(merged))
        with self._lock:
            entry = self._local.get(key)
            if entry is not None:
                return entry
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:  # one load per key; other keys load in parallel
            with self._lock:
                entry = self._local.get(key)
                if entry is not None:
                    return entry
            entry = self._load(model, merged)
            with self._lock:
                self._local[key] = entry
                self._loading.pop(key, None)
        return entry

    def _load(self, model: str, options: dict[str, Any]) -> _LocalEntry:
        from ..artifacts import detect_mtp, resolve_model_path
        from ..provider import create_llm

        provider = create_llm("mlx", model=model, **options)
        head = options.get("mtp_head")
        verified = bool(
            detect_mtp(
                resolve_model_path(model),
                name=model,
                head=resolve_model_path(head) if head else None,
            ).get("verified")
        )
        lock: threading.Lock | None = None
        if not _schedules_concurrently(provider):
            with self._lock:
                lock = self._model_locks.setdefault(str(getattr(provider, "path", model)), threading.Lock())
        return _LocalEntry(provider=provider, verified=verified, lock=lock)

    def remote(self, base_url: str, model: str | None = None, options: Mapping[str, Any] | None = None) -> Any:
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
                client = RemoteClient(url, model=model, **dict(options or {}))
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


def _schedules_concurrently(provider: Any) -> bool:
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


def _canonical(value: Any) -> str:
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
        self._buffer: list[tuple[float, dict[str, Any]]] | None = [] if buffer else None
        self.num_events = 0

    @property
    def active(self) -> bool:
        return self._writer is not None or self._callback is not None or self._buffer is not None

    def __call__(self, event: dict[str, Any]) -> None:
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


def _call_host(callback: ProgressCallback, event: dict[str, Any]) -> None:
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
        provider_options: Mapping[str, Any] | None = None,
        remote_options: Mapping[str, Any] | None = None,
        record_progress: bool = True,
        policy_reader: Callable[[], Any] | None = None,
    ) -> None:
        self.ledger = ledger
        self._owns_writer = writer is None and ledger is not None and record_progress
        if writer is None and ledger is not None and record_progress:
            writer = ledger.progress_writer()
        self.writer = writer
        self.registry = registry or default_registry()
        self.default_model = default_model
        self.provider_options = dict(provider_options or {})
        self.remote_options = dict(remote_options or {})
        self.record_progress = record_progress
        self._policy_reader = policy_reader

    # -- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the progress writer this node created (drains it). Providers stay resident."""
        if self._owns_writer and self.writer is not None:
            self.writer.stop()

    # -- steps --------------------------------------------------------------------------

    def prepare(self, request: NodeRequest) -> PreparedCall:
        """Resolve the controls and pick the client; loads the local model on first use."""
        provider_name = (request.provider or "mlx").strip().lower()
        model = request.model or self.default_model
        if request.base_url:
            return self._prepare_remote(request, provider_name, model)
        if provider_name != "mlx":
            raise InvalidRequest(
                f"node provider {request.provider!r} is not served here: local nodes run the 'mlx' provider; "
                "give the node or the run a base_url to use a remote server"
            )
        if not model:
            raise InvalidRequest("the node names no model and no default model is configured")
        entry = self.registry.local(model, self.provider_options)
        hook = getattr(entry.provider, "speculation_default", None)
        provider_default = hook() if callable(hook) else None
        controls = resolve_node_controls(
            request,
            provider_default=provider_default,
            policy=self._read_policy() if provider_default is None else UNSET,
            verified_default=entry.verified,
        )
        kwargs = _generate_kwargs(request, controls, send_speculation=True)
        client_id = f"local:{model}:{_canonical({**DEFAULT_PROVIDER_OPTIONS, **self.provider_options})}"
        return _prepared("local", client_id, "mlx", model, None, controls, True, kwargs)

    def _prepare_remote(self, request: NodeRequest, provider_name: str, model: str | None) -> PreparedCall:
        controls = resolve_node_controls(request)
        send = controls.sources["speculation"] in ("call", "run")
        kwargs = _generate_kwargs(request, controls, send_speculation=send)
        base_url = str(request.base_url).rstrip("/")
        return _prepared("remote", f"remote:{base_url}:{model or ''}", provider_name, model, base_url, controls, send, kwargs)

    def execute(
        self,
        prepared: PreparedCall,
        *,
        route: ProgressRoute | None = None,
        cancel_event: threading.Event | None = None,
    ) -> NodeResult:
        """Make the call, sending phase events to ``route``; flush the node's rows before returning."""
        route = route or ProgressRoute()
        kwargs: dict[str, Any] = dict(prepared.kwargs)
        if route.active:
            kwargs["on_progress"] = route
        if cancel_event is not None:
            kwargs["cancel_event"] = cancel_event
        started = time.perf_counter()
        try:
            generation, concurrency = self._call(prepared, kwargs)
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

    def _call(self, prepared: PreparedCall, kwargs: dict[str, Any]) -> tuple[GenerationResult, str]:
        if prepared.client_kind == "remote":
            client = self.registry.remote(str(prepared.base_url), prepared.model, self.remote_options)
            return client.generate(**kwargs), "remote"
        assert prepared.model is not None
        entry = self.registry.local(prepared.model, self.provider_options)
        if entry.lock is None:
            return entry.provider.generate(**kwargs), "concurrent"
        with entry.lock:
            return entry.provider.generate(**kwargs), "serialized"

    def headroom(self, prepared: PreparedCall) -> int | None:
        """How many more requests the local engine behind ``prepared`` can take now (free batch
        slots plus free queue places); ``None`` when unknown (remote clients)."""
        if prepared.client_kind != "local" or prepared.model is None:
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

    def _read_policy(self) -> Any:
        if self._policy_reader is not None:
            return self._policy_reader()
        from ..policy import read_speculation_policy

        return read_speculation_policy()


def _generate_kwargs(request: NodeRequest, controls: ResolvedControls, *, send_speculation: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"prompt": request.prompt or ""}
    if request.messages is not None:
        kwargs["messages"] = copy.deepcopy(list(request.messages))
    if request.system_prompt:
        kwargs["system_prompt"] = request.system_prompt
    if request.tools:
        kwargs["tools"] = copy.deepcopy(list(request.tools))
    if request.media:
        kwargs["media"] = list(request.media)
    if controls.thinking is not None:
        kwargs["thinking"] = controls.thinking
    if send_speculation:
        kwargs["speculation"] = controls.speculation.to_wire()
    if request.prompt_cache_key is not None:
        kwargs["prompt_cache_key"] = request.prompt_cache_key
    for name, value in request.sampling.items():
        if value is not None:
            kwargs[name] = copy.deepcopy(value)
    return kwargs


def _prepared(
    kind: str,
    client_id: str,
    provider: str,
    model: str | None,
    base_url: str | None,
    controls: ResolvedControls,
    sent: bool,
    kwargs: dict[str, Any],
) -> PreparedCall:
    digest = hashlib.sha256(_canonical({"client": client_id, "kwargs": kwargs}).encode("utf-8")).hexdigest()
    return PreparedCall(
        client_kind=kind,
        client_id=client_id,
        provider=provider,
        model=model,
        base_url=base_url,
        controls=controls,
        speculation_sent=sent,
        kwargs=kwargs,
        fingerprint=digest,
    )
