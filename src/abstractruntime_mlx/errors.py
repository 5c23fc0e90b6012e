"""The typed error tree.

Every error the package raises on purpose derives from ``MLXRuntimeError`` and carries a
stable ``code`` (part of the public API, never renamed) and an ``http_status``. The engine
raises them, the server renders them as ``{"error": {"message", "type", "code"}}`` and the
remote client rebuilds the same class from ``code``.

    MLXRuntimeError
    ├── InvalidRequest (400, invalid_request)
    │   ├── InvalidControls (400, invalid_controls)
    │   │   └── OptionRemoved (400, option_removed)   an option that no longer exists; the message says what replaced it
    │   │   └── StopTooLarge (400, stop_too_large)   a stop list over its count or byte limit
    │   │   └── InvalidPrefixWarm (400, invalid_prefix_warm)   a prefix warm without a key, or with bad token ids
    │   ├── InvalidMedia (400, native_media_invalid)
    │   ├── ContextTooLong (400, context_too_long)
    │   ├── NoDrafter (400, no_drafter)
    │   ├── RequestTooLarge (413, request_too_large)
    │   ├── InvalidFlow (400, invalid_flow)          ``check`` found problems in a flow
    │   ├── InvalidResponseSchema (400, invalid_response_schema)   a structured-output schema that cannot be compiled
    │   │   └── ResponseSchemaTooLarge (400, schema_too_large)     over a size, node or depth limit
    │   ├── InvalidTools (400, invalid_tools)        malformed ``tools``, or a ``tool_choice`` they do not offer
    │   ├── PromptCachePathUnsafe (400, prompt_cache_path_unsafe)   symlinked or non-private cache dir
    │   ├── EmbeddingsUnsupported (400, embeddings_unsupported)   serve: the model generates text, it cannot embed
    │   ├── TokenCountUnsupported (400, token_count_unsupported)   serve: count_tokens on a provider that cannot count
    │   ├── RemoteNotAllowed (403, remote_not_allowed)   a flow sends prompts to a server the user did not allow
    │   │   └── RemoteAddressForbidden (403, remote_address_forbidden)   a link-local / cloud metadata address
    │   ├── OperatorSetting (403, operator_setting)   serve: a client's load option only the operator may set
    │   └── InvalidOtlpUrl (400, invalid_otlp_url)   ``--otlp``: not an http(s) URL with a host
    ├── PolicyError (400, policy_invalid)            the Core policy file is unreadable
    ├── ModelNotFound (404, model_not_found)         weights are not on this machine
    ├── RunNotFound (404, run_not_found)             the ledger has no such run
    ├── ConflictError (409, conflict)
    │   ├── RequestCancelled (409, cancelled)
    │   ├── OwnerBusy (409, owner_busy)
    │   ├── RuntimeClosed (409, runtime_closed)
    │   ├── ResidencyConflict (409, residency_conflict)
    │   ├── PromptCacheLocked (409, prompt_cache_locked)   another live process owns the SSD namespace
    │   ├── RunLocked (409, run_locked)              another live process drives the run (holds its run lock)
    │   └── RunNotResumable (409, run_not_resumable)   the run does not wait for this (finished, or continued already)
    ├── CapacityError (503, capacity)
    │   ├── QueueFull (503, queue_full)
    │   ├── TooManyStreams (503, too_many_streams)   the inspector's live-stream cap is reached
    │   ├── TooManyConnections (503, too_many_connections)  serve: each connection up to the cap has a request in flight
    │   ├── InsufficientMemory (507, insufficient_memory)   serve: a model does not fit, even after evicting idle ones
    │   └── StreamBackpressure (429, stream_backpressure)
    ├── QueueTimeout (504, queue_timeout)
    ├── RunLimitExceeded (422, run_limit)            a run went past one of its limits
    │   ├── StepLimitExceeded (422, step_limit)
    │   ├── DepthLimitExceeded (422, depth_limit)
    │   ├── WallTimeLimitExceeded (422, wall_time_limit)
    │   ├── CodeTimeLimitExceeded (422, code_time_limit)
    │   ├── CodeMemoryLimitExceeded (422, code_memory_limit)
    │   └── CodeResultLimitExceeded (422, code_result_limit)   a code node's result is larger than --max-code-result-mib
    ├── SpeculationUnavailable (422, speculation_unavailable)
    ├── StructuredOutputInvalid (422, structured_output_invalid)   no schema-valid answer (length cap, retries spent)
    ├── AuthenticationError (401, unauthorized)
    ├── TraceExportFailed (502, trace_export_failed)   the OTLP receiver could not be reached or refused the spans
    ├── MissingExtra (500, missing_extra)         an optional dependency is not installed (the message names the extra)
    ├── LedgerError (500, ledger_error)
    │   ├── LedgerNotFound (404, ledger_not_found)
    │   └── RunLockUnsafe (500, run_lock_unsafe)   the run lock file is a link, a directory, a FIFO or not this user's
    └── EngineError (500, backend_error)
        ├── EngineCrashed (500, engine_crashed)
        ├── UpstreamError (502, upstream_error)
        └── PromptCacheFlushFailed (500, prompt_cache_flush_failed)   unload: the SSD tier did not get every snapshot
"""

from __future__ import annotations

from collections.abc import Mapping

from .json_values import JSONObject, JSONValue


class MLXRuntimeError(Exception):
    code: str = "error"
    http_status: int = 500
    type: str = "runtime_error"

    def __init__(self, message: str, *, details: Mapping[str, JSONValue] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: JSONObject = dict(details or {})

    def to_dict(self) -> JSONObject:
        body: JSONObject = {"message": self.message, "type": self.type, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


class InvalidRequest(MLXRuntimeError):
    code = "invalid_request"
    http_status = 400
    type = "invalid_request_error"


class InvalidControls(InvalidRequest):
    """A control value (speculation, thinking, sampling, scheduler option) is not accepted.

    ``field`` names the offending field and ``value`` is what was given.
    """

    code = "invalid_controls"

    def __init__(self, message: str, *, field: str | None = None, value: object = None) -> None:
        details: JSONObject = {}
        if field is not None:
            details = {"field": field, "value": _json_safe(value)}
        super().__init__(message, details=details)
        self.field = field
        self.value = value


class OptionRemoved(InvalidControls):
    """An engine or ``create_llm`` option that was removed; ``details``: ``field`` (its name)
    and ``replacement`` (what does its job now)."""

    code = "option_removed"

    def __init__(self, name: str, replacement: str) -> None:
        super().__init__(f"{name} was removed: {replacement}; drop the option", field=name)
        self.details = {"field": name, "replacement": replacement}
        self.replacement = replacement


class StopTooLarge(InvalidControls):
    """A ``stop`` list over ``controls.MAX_STOP_STRINGS`` strings or ``MAX_STOP_BYTES`` bytes
    (UTF-8) in all. ``details``: ``field`` (``stop``), ``limit`` (``max_stop_strings`` or
    ``max_stop_bytes``) and ``max`` (its value); the list itself is not echoed."""

    code = "stop_too_large"

    def __init__(self, message: str, *, limit: str, maximum: int) -> None:
        super().__init__(message, field="stop")
        self.details = {"field": "stop", "limit": limit, "max": maximum}
        self.limit = limit
        self.maximum = maximum


class InvalidMedia(InvalidRequest):
    code = "native_media_invalid"


class ContextTooLong(InvalidRequest):
    code = "context_too_long"


class NoDrafter(InvalidRequest):
    code = "no_drafter"


class RequestTooLarge(InvalidRequest):
    """The HTTP body is over the server's size limit."""

    code = "request_too_large"
    http_status = 413


class InvalidFlow(InvalidRequest):
    """A flow cannot run as written; ``details["problems"]`` lists every problem ``check`` found."""

    code = "invalid_flow"


class InvalidResponseSchema(InvalidRequest):
    """A ``response_schema`` / ``response_model`` / ``response_format`` that cannot be compiled to a
    grammar; ``details["path"]`` is the JSON pointer of the offending part (``""``: the whole schema)."""

    code = "invalid_response_schema"

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message, details={"path": path})
        self.path = path


class ResponseSchemaTooLarge(InvalidResponseSchema):
    """A response schema over one of the limits checked before anything else reads it
    (``structured.MAX_SCHEMA_BYTES`` / ``_NODES`` / ``_DEPTH``). ``details``: ``limit`` (the
    limit's name), ``max`` (its value) and ``path`` (where it was crossed; ``""``: the whole schema)."""

    code = "schema_too_large"

    def __init__(self, message: str, *, limit: str, maximum: int, path: str = "") -> None:
        super().__init__(message, path=path)
        self.details.update(limit=limit, max=maximum)
        self.limit = limit
        self.maximum = maximum


class InvalidTools(InvalidRequest):
    """A ``tools`` list that is not a list of function tools (a name of letters, digits, ``_``,
    ``-`` or ``.``; ``parameters`` a JSON Schema object), or a ``tool_choice`` that is not
    ``none`` / ``auto`` / ``required`` or a function of ``tools``. ``details``: ``field``."""

    code = "invalid_tools"

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message, details={"field": field})
        self.field = field


class PromptCachePathUnsafe(InvalidRequest):
    code = "prompt_cache_path_unsafe"

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message, details={"path": path})
        self.path = path


class InvalidPrefixWarm(InvalidControls):
    """A prefix warm (``warm_prefix`` / ``prompt_cache_warm``) the engine cannot run: no key,
    no messages, bad token ids; ``details`` names the field."""

    code = "invalid_prefix_warm"


class EmbeddingsUnsupported(InvalidRequest):
    """``POST /v1/embeddings`` to a server whose models generate text only."""

    code = "embeddings_unsupported"


class LogprobsUnavailable(InvalidRequest):
    """Token logprobs asked of a request the lane it runs on cannot report them for (MTP
    speculation, the serialized lane): the batched lanes' per-row sampler computes them."""

    code = "logprobs_unavailable"


class TokenCountUnsupported(InvalidRequest):
    """``POST /v1/messages/count_tokens`` on a model whose provider cannot render and tokenize a
    prompt without generating (a provider other than the MLX one)."""

    code = "token_count_unsupported"


class RemoteNotAllowed(InvalidRequest):
    """A node would send its prompts to a server the user did not allow (``run --allow-remote``,
    a config file's ``allow_remote``, or a ``--route`` URL). ``details``: ``url``."""

    code = "remote_not_allowed"
    http_status = 403
    type = "permission_error"


class RemoteAddressForbidden(RemoteNotAllowed):
    """A server URL on a link-local or cloud metadata address (169.254.0.0/16, fe80::/10,
    ``metadata.google.internal``...): refused whatever the user allowed. ``details``: ``url``."""

    code = "remote_address_forbidden"


class OperatorSetting(InvalidRequest):
    """``POST /acore/models/load`` asked for an option only ``serve``'s operator sets (cache sharing,
    cache scope, disk paths, cache budgets), or a value past what a client may ask for.
    ``details``: ``field`` (``options.NAME``), ``option``, and ``limit`` for a bounded one."""

    code = "operator_setting"
    http_status = 403
    type = "permission_error"


class InvalidOtlpUrl(InvalidRequest):
    """``--otlp URL`` is not an ``http://`` or ``https://`` URL with a host."""

    code = "invalid_otlp_url"


class PolicyError(MLXRuntimeError):
    code = "policy_invalid"
    http_status = 400
    type = "configuration_error"


class ModelNotFound(MLXRuntimeError):
    code = "model_not_found"
    http_status = 404
    type = "not_found_error"


class RunNotFound(MLXRuntimeError):
    code = "run_not_found"
    http_status = 404
    type = "not_found_error"


class ConflictError(MLXRuntimeError):
    code = "conflict"
    http_status = 409
    type = "conflict_error"


class RequestCancelled(ConflictError):
    code = "cancelled"
    type = "cancelled"


class OwnerBusy(ConflictError):
    code = "owner_busy"


class RuntimeClosed(ConflictError):
    code = "runtime_closed"


class ResidencyConflict(ConflictError):
    code = "residency_conflict"


class PromptCacheLocked(ConflictError):
    code = "prompt_cache_locked"

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message, details={"path": path})
        self.path = path


class RunLocked(ConflictError):
    """Another live process drives the run: it holds the run's lock (a file lock beside a SQLite
    ledger, an advisory lock on PostgreSQL). ``details``: ``run_id``, ``lock`` (where it is) and
    ``holder`` (what the holder wrote about itself: pid, host, command; empty when unreadable)."""

    code = "run_locked"


class RunNotResumable(ConflictError):
    """The run is not in a state that takes this continuation: it finished, it does not wait for
    an answer or event, or another driver continued it first. ``details``: ``run_id``, ``status``."""

    code = "run_not_resumable"


class CapacityError(MLXRuntimeError):
    code = "capacity"
    http_status = 503
    type = "capacity_error"


class QueueFull(CapacityError):
    code = "queue_full"


class TooManyStreams(CapacityError):
    """As many live event streams are open as the server allows; ``details``: ``limit``
    (the option's name) and ``max`` (its value). Close one, or retry later."""

    code = "too_many_streams"

    def __init__(self, message: str, *, limit: str, maximum: int) -> None:
        super().__init__(message, details={"limit": limit, "max": maximum})


class TooManyConnections(CapacityError):
    """``serve`` holds ``--max-connections`` connections, each with a request in flight; the new
    one is answered with this and closed. ``details``: ``limit`` (the option's name) and ``max``."""

    code = "too_many_connections"

    def __init__(self, message: str, *, limit: str, maximum: int) -> None:
        super().__init__(message, details={"limit": limit, "max": maximum})


class StreamBackpressure(CapacityError):
    code = "stream_backpressure"
    http_status = 429


class InsufficientMemory(CapacityError):
    """``serve`` cannot load a model: its estimate (weights + KV reserve) does not fit the memory
    budget even after evicting every idle, unpinned model. ``details``: ``model``,
    ``needed_bytes``, ``budget_bytes``, ``resident_bytes`` and ``kept`` (the resident models
    that could not be evicted, each with why: ``pinned`` or ``in_flight``)."""

    code = "insufficient_memory"
    http_status = 507


class QueueTimeout(MLXRuntimeError):
    code = "queue_timeout"
    http_status = 504
    type = "timeout_error"


class RunLimitExceeded(MLXRuntimeError):
    """A run went past one of the limits it runs under (``host.DriveLimits``); the run fails at
    the node named in the message. ``details``: ``limit`` (the flag's name) and ``max``."""

    code = "run_limit"
    http_status = 422
    type = "limit_error"

    def __init__(self, message: str, *, limit: str, maximum: float) -> None:
        super().__init__(message, details={"limit": limit, "max": maximum})
        self.limit = limit
        self.maximum = maximum


class StepLimitExceeded(RunLimitExceeded):
    code = "step_limit"


class DepthLimitExceeded(RunLimitExceeded):
    code = "depth_limit"


class WallTimeLimitExceeded(RunLimitExceeded):
    code = "wall_time_limit"


class CodeTimeLimitExceeded(RunLimitExceeded):
    code = "code_time_limit"


class CodeMemoryLimitExceeded(RunLimitExceeded):
    code = "code_memory_limit"


class CodeResultLimitExceeded(RunLimitExceeded):
    """A code node call returned a result whose JSON is larger than its limit
    (``--max-code-result-mib``); ``details`` also has ``bytes``, the size seen (at least that)."""

    code = "code_result_limit"

    def __init__(self, message: str, *, limit: str, maximum: float, size: int) -> None:
        super().__init__(message, limit=limit, maximum=maximum)
        self.details["bytes"] = size
        self.size = size


class SpeculationUnavailable(MLXRuntimeError):
    """Strict speculation (``require_acceleration=True``) could not be honoured.

    ``reason`` is a stable slug (``no_mtp_drafter_for_model``, ``mtp_logit_processors_unsupported``, ...).
    """

    code = "speculation_unavailable"
    http_status = 422
    type = "invalid_request_error"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(f"{message} (speculation.require_acceleration=True)", details={"reason": reason})
        self.reason = reason


class StructuredOutputInvalid(MLXRuntimeError):
    """A structured-output call ended without a schema-valid answer: the output cap cut the JSON,
    or (prompted mode) every retry gave invalid JSON. ``details``: ``mode``, ``attempts``, ``error``."""

    code = "structured_output_invalid"
    http_status = 422
    type = "invalid_request_error"


class AuthenticationError(MLXRuntimeError):
    code = "unauthorized"
    http_status = 401
    type = "authentication_error"


class TraceExportFailed(MLXRuntimeError):
    """The OTLP receiver was unreachable, timed out or answered with an error status.
    ``details``: ``url`` and, when it answered, ``status``."""

    code = "trace_export_failed"
    http_status = 502


class MissingExtra(MLXRuntimeError):
    """An optional dependency is not installed; the message names the extra that brings it
    (``pip install 'abstractruntime-mlx[otlp]'``). ``details``: ``extra``, ``module``."""

    code = "missing_extra"


class LedgerError(MLXRuntimeError):
    code = "ledger_error"
    http_status = 500
    type = "ledger_error"


class LedgerNotFound(LedgerError):
    """An inspection command named a ledger database that does not exist (nothing is created)."""

    code = "ledger_not_found"
    http_status = 404


class RunLockUnsafe(LedgerError):
    """The run lock file is not a private regular file (a symlink, a hard link to another file, a
    directory, a FIFO, another user's file); it is left untouched. ``details``: ``run_id``,
    ``lock`` (the path) and ``reason``."""

    code = "run_lock_unsafe"


class EngineError(MLXRuntimeError):
    code = "backend_error"
    http_status = 500
    type = "native_runtime_error"


class EngineCrashed(EngineError):
    code = "engine_crashed"


class UpstreamError(EngineError):
    code = "upstream_error"
    http_status = 502


class PromptCacheFlushFailed(EngineError):
    """Raised by ``unload_model`` after the worker stopped: flushing the prompt cache's SSD tier
    raised, or snapshot writes since load did not reach the disk. The model is unloaded all the
    same. ``details``: ``path`` (the namespace directory) and ``write_failures``."""

    code = "prompt_cache_flush_failed"


def _all_error_classes() -> list[type[MLXRuntimeError]]:
    seen: list[type[MLXRuntimeError]] = []
    stack: list[type[MLXRuntimeError]] = [MLXRuntimeError]
    while stack:
        cls = stack.pop()
        seen.append(cls)
        stack.extend(cls.__subclasses__())
    return seen


def error_class_for_code(code: str | None) -> type[MLXRuntimeError]:
    """The class whose stable ``code`` is ``code`` (the remote client rebuilds errors with it)."""
    for cls in _all_error_classes():
        if cls.code == code:
            return cls
    return MLXRuntimeError


def _json_safe(value: object) -> JSONValue:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return repr(value)
