"""The local MLX provider: ``generate`` / ``agenerate`` (and streams) on one resident model."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

from ..artifacts import DOWNLOAD_COMMAND, companion_candidates, detect_mtp, looks_like_path, resolve_model_path
from ..controls import ControlLevel, ResolvedControls, Sampling, resolve_controls
from ..engine.api import (
    HEAD_UPSTREAMS,
    REMOVED,
    Engine,
    EngineConfig,
    EngineRequest,
    FinishReason,
    ImagePrompt,
    LoadedModel,
    Outcome,
    PrefillObservation,
    PrefixCache,
    RequestStream,
    SampledLogprob,
    SpeculationPlan,
    TokenDelta,
    Upstream,
    attribute,
    image_hash,
    prepare_conversation,
    render_prompt,
    speculation_report,
    unreached_cache_report,
    validate_cache_options,
    validate_hints,
    validate_pin,
)
from ..errors import (
    ContextTooLong,
    InvalidControls,
    InvalidMedia,
    InvalidPrefixWarm,
    InvalidRequest,
    MLXRuntimeError,
    OptionRemoved,
    RuntimeClosed,
    SpeculationUnavailable,
    UpstreamError,
)
from ..model_output import THINK_END, THINK_START, parse_output, tool_format_of
from ..policy import read_policy_controls
from ..request import GenerationRequest
from ..results import GenerationChunk, GenerationResult, TokenLogprob, TopLogprob
from ..structured import parse_answer, run_schema_work
from . import residency
from .choices import choice_seed, combined_usage, merge_streams
from .progress import ProgressTracker, progress_interval_from_env

log = logging.getLogger(__name__)

DEFAULT_MAX_OUTPUT_TOKENS = 1024

# The engine's options: provider option -> ``EngineConfig`` field. Their defaults are the
# engine's (``engine/core/config.py``, the one home of both).
ENGINE_OPTIONS: dict[str, str] = {
    "mlx_max_batch_size": "max_batch_size",
    "mlx_max_queue_size": "max_queue_size",
    "mlx_batch_wait_ms": "batch_wait_ms",
    "mlx_queue_timeout_s": "queue_timeout_s",
    "mlx_output_queue_size": "output_queue_size",
    "mlx_prefill_step_size": "prefill_step_size",
    "mlx_sampled_exclusive": "sampled_exclusive",
    # A lone request decodes on the single-request lane until a second one joins (docs/provider.md).
    "mlx_single_lane": "single_lane",
    "mlx_burst_gap_ms": "burst_gap_ms",
    # Plain text rows batch in the text lane (docs/provider.md, "Which batch loop").
    "mlx_text_lane": "text_lane",
    # Whether the text lane's finished rows idle until half the batch has finished (docs/provider.md, "Which batch loop").
    "mlx_idle_finished_rows": "idle_finished_rows",
    # The text lane's prefill shapes: bucketed and warmed at load (docs/provider.md, "Prefill shapes").
    "mlx_prefill_buckets": "prefill_buckets",
    # The text lane's decode attention in one kernel on CUDA (docs/provider.md, "Decode attention").
    "mlx_fused_decode_attention": "fused_decode_attention",
    # Short prompt chunks' attention in plain ops on CUDA, not cuDNN (docs/provider.md, "Prefill attention").
    "mlx_prefill_attention_ops": "prefill_attention_ops",
    # One matmul for q/k/v and one for gate/up in the text lane's model (docs/provider.md, "Fused projections").
    "mlx_fused_projections": "fused_projections",
}
_ENGINE_DEFAULTS = EngineConfig()

# Options that were removed: refused with ``OptionRemoved``, saying what replaced them.
REMOVED_OPTIONS: dict[str, str] = {
    "mlx_own_text_loop": REMOVED["own_text_loop"],
    "mlx_admission_wave_steps": REMOVED["admission_wave_steps"],
}

# Constructor options and their defaults.
EXECUTION_DEFAULTS: dict[str, Any] = {
    "mlx_batching": False,
    **{option: getattr(_ENGINE_DEFAULTS, field) for option, field in ENGINE_OPTIONS.items()},
    # Prefix reuse (see docs/prompt-cache.md): RAM budget override, opt-in SSD tier, identity scope.
    "mlx_cache_memory_max_gb": None,
    "mlx_cache_disk_path": None,
    "mlx_cache_disk_max_gb": None,
    "mlx_cache_scope": "local",
    "mlx_cache_sharing": "scope",
}

_lease_ids = itertools.count(1)


@dataclass(slots=True)
class _Prepared:
    request: EngineRequest
    tracker: ProgressTracker | None
    speculation: SpeculationPlan
    controls: ResolvedControls
    prompt_cache_key: str | None
    started: float
    # What the prompt was rendered from, for prefix-break attribution (references, not copies).
    text: str = ""
    conversation: list[dict[str, Any]] = field(default_factory=list)
    tools: tuple[Mapping[str, Any], ...] = ()


class MLXProvider:
    """``create_llm("mlx", model=...)``. Thread-safe: many threads may call ``generate`` at once."""

    provider = "mlx"

    def __init__(
        self,
        model: str,
        *,
        speculation: Any = None,
        thinking: Any = None,
        mtp_head: str | None = None,
        progress_min_interval_s: float | None = None,
        **options: Any,
    ) -> None:
        for name in sorted(set(options) & REMOVED_OPTIONS.keys()):
            raise OptionRemoved(name, REMOVED_OPTIONS[name])
        unknown = set(options) - set(EXECUTION_DEFAULTS)
        if unknown:
            raise InvalidRequest(f"unknown create_llm option(s): {', '.join(sorted(unknown))}")
        self.model = model
        self.execution_options = _validate_options({**EXECUTION_DEFAULTS, **options})
        self._defaults = ControlLevel.parse(speculation=speculation, thinking=thinking)
        self.progress_min_interval_s = (
            progress_interval_from_env() if progress_min_interval_s is None else float(progress_min_interval_s)
        )
        self.path = resolve_model_path(model)
        head = resolve_model_path(mtp_head) if mtp_head else None
        self._mtp = detect_mtp(self.path, name=model, head=head)
        batching = self.execution_options["mlx_batching"]
        # The head is loaded with the target when the inherited default would use it, and
        # attached on first use otherwise (a call or node that asks for MTP gets it).
        head_source = _drafter_source(self.path, head, self._mtp) if self._mtp.get("head_present") else None
        default = self.resolve_controls().speculation
        load_head = default.enabled and head_source is not None
        # Non-batched: mlx-vlm's in-process lane when the default runs MTP (the head is loaded
        # with the target), else mlx-lm's; the lane is a load-time choice (docs/provider.md).
        upstream = Upstream.NATIVE if batching else (Upstream.MLX_VLM if load_head else Upstream.MLX_LM)
        head_lane = upstream in HEAD_UPSTREAMS
        config = EngineConfig(
            **{field: self.execution_options[option] for option, field in ENGINE_OPTIONS.items()},
            # The serialized lanes chunk by 2,048 (mlx-lm's default) unless the caller chose a step.
            **(
                {"serial_prefill_step_size": options["mlx_prefill_step_size"]}
                if "mlx_prefill_step_size" in options
                else {}
            ),
        )
        self._lease = next(_lease_ids)
        self._resident: residency.Resident | None = residency.acquire(
            self.path,
            head=head_source if head_lane else None,
            upstream=upstream,
            head_source=head_source if head_lane else None,
            load_head=load_head,
            options=dict(self.execution_options),
            config=config,
            lease=self._lease,
            cache_options=validate_cache_options(self.execution_options),
        )
        self._finalizer = weakref.finalize(self, residency.retire, self._resident, self._lease)
        if load_head and self._resident.engine.loaded is not None and self._resident.engine.loaded.drafter is None:
            # Resident already, loaded by a provider whose default was off: attach now, as a
            # load that asked for MTP would have.
            try:
                self._resident.engine.attach_head()
            except MLXRuntimeError:
                pass  # reported by name on the first MTP request (``mtp_head_attach_failed``)

    # --- capabilities -----------------------------------------------------------------
    def supports_concurrent_generation(self) -> bool:
        return bool(self.execution_options["mlx_batching"]) and self._resident is not None

    def supports_text_progress_events(self) -> bool:
        return True

    def speculation_default(self) -> Any:
        """The constructor-level speculation setting (wire form); ``None`` inherits the policy."""
        speculation = self._defaults.speculation
        return None if speculation is None else speculation.to_wire()

    def control_defaults(self) -> ControlLevel:
        """The provider level of the precedence chain (the constructor's ``speculation``/``thinking``)."""
        return self._defaults

    def resolve_controls(self, request: GenerationRequest | None = None) -> ResolvedControls:
        """The effective speculation and thinking of ``request`` (of a bare call when ``None``)
        and the level that decided each: call, run, this provider, the Core policy (read now),
        verified default. What ``generate`` runs and ``get_execution_capabilities`` reports."""
        return resolve_controls(
            call=None if request is None else request.call,
            run=None if request is None else request.run,
            provider=self._defaults,
            policy=read_policy_controls(),
            verified_default=bool(self._mtp.get("verified")),
        )

    def reasoning_opens_in_prompt(self, request: GenerationRequest) -> bool:
        """Whether the chat template's generation prompt for ``request`` leaves a think block
        open (the answer starts inside it), as rendered for a one-message probe with the
        request's resolved thinking; a streamed answer sends such text as reasoning."""
        thinking = (request.resolved or self.resolve_controls(request)).thinking
        text = render_prompt(
            self._engine.serving_model().tokenizer, [{"role": "user", "content": "x"}], thinking=thinking
        )
        return text.rfind(THINK_START) > text.rfind(THINK_END)

    def speculation_ready(self) -> bool:
        if self._resident is None:
            return False
        engine = self._resident.engine
        loaded = engine.loaded
        return loaded is not None and engine.failure is None and loaded.drafter is not None

    def speculation_attachable(self) -> bool:
        """A head is on this machine and this lane attaches it on the first MTP request
        (no reload), though it is not attached yet."""
        if self._resident is None:
            return False
        loaded = self._resident.engine.loaded
        return (
            loaded is not None
            and loaded.drafter is None
            and loaded.upstream == Upstream.NATIVE
            and loaded.head_source is not None
            and loaded.drafter_error is None
        )

    def health(self) -> dict[str, Any]:
        """``{"state": "ready"|"loading"|"failed"|"closed"|"unloaded"}``, with ``error`` when failed.

        A failed model serves no request until it is unloaded and loaded again.
        """
        if self._resident is None:
            return {"state": "unloaded"}
        engine = self._resident.engine
        out: dict[str, Any] = {"state": engine.state}
        failure = engine.failure
        if failure is not None:
            out["error"] = {"type": type(failure).__name__, "message": str(failure)}
        return out

    @property
    def _engine(self) -> Engine:
        if self._resident is None:
            raise RuntimeClosed(f"{self.model} was unloaded from this provider; create it again")
        return self._resident.engine

    # --- lifecycle ----------------------------------------------------------------------
    def unload_model(self, model_name: str | None = None) -> bool:
        """Release this provider's hold on the model; the last holder frees it.

        Refused (``OwnerBusy``) while requests on this model are queued or running, or while
        the worker has not stopped within ``residency.UNLOAD_STOP_S``: the hold is kept and a
        later call retries. ``PromptCacheFlushFailed`` when the SSD tier's flush failed as the
        worker stopped: the model is unloaded all the same.
        """
        if model_name not in (None, self.model, str(self.path)):
            raise InvalidRequest(f"this provider serves {self.model!r}, not {model_name!r}")
        resident = self._resident
        if resident is None:
            return False
        try:
            residency.release(resident, self._lease)
        finally:
            if not residency.holds(resident, self._lease):
                self._finalizer.detach()
                self._resident = None
        return True

    def get_prompt_cache_stats(self) -> dict[str, Any]:
        """Prefix-cache state since load: budget, RAM and SSD entries and bytes, hit counters."""
        engine = self._engine
        stats = engine.prompt_cache_stats()
        if stats is None:
            stats = {"enabled": False, "reason": "prefix_cache_not_loaded"}
        return {**stats, "execution": engine.snapshot()}

    def prompt_cache_clear(self, key: str | None = None) -> dict[str, Any]:
        """Drop every owned RAM and SSD prefix entry of this model (between engine steps).

        Keys share one namespace, so a ``key`` still clears all of them; the result says so.
        """
        if key is not None and not isinstance(key, str):
            raise InvalidControls("key must be a string", field="key", value=key)
        result = self._engine.prompt_cache_clear()
        if result is None:
            return {"cleared": False, "scope": "none", "reason": "prefix_cache_not_loaded"}
        out: dict[str, Any] = {"cleared": True, **result}
        if key is not None:
            out["key"] = key
            out["warning"] = "a key-specific clear clears the whole prompt-cache namespace: every key of this model"
        return out

    def prompt_cache_hints(self, hints: Mapping[str, int | None], *, replace: bool = False) -> dict[str, Any]:
        """Steps-to-execution per ``prompt_cache_key``: how many steps away each key's next call
        is (0: next), or None when no live run reaches it again. Idle blocks are then evicted
        unreachable first, unhinted next, the farthest next call after, recency between equals
        (see docs/prompt-cache.md). Merged into the hints given before unless ``replace``."""
        valid = validate_hints(hints)
        return self._cache_command(lambda cache: cache.set_hints(valid, replace=replace))

    def prompt_cache_pin(self, key: str, ttl_s: float) -> dict[str, Any]:
        """Keep ``key``'s idle blocks resident for ``ttl_s`` seconds (again: renew). A store never
        evicts them; a live request that needs the memory takes the newest pin first."""
        name, ttl = validate_pin(key, ttl_s)
        return self._cache_command(lambda cache: cache.pin(name, ttl))

    def prompt_cache_release(self, key: str) -> dict[str, Any]:
        """End ``key``'s pin (``released``: whether one was alive)."""
        name, _ = validate_pin(key, 1.0)
        return self._cache_command(lambda cache: cache.release(name))

    def prompt_cache_warm(self, prompt: str = "", **kwargs: Any) -> dict[str, Any]:
        """Put the prefix of a call that is coming in RAM before it comes: the same arguments as
        ``generate`` (its ``messages``/``system_prompt``/``tools``, controls and ``prompt_cache_key``),
        rendered as that call renders them. A warm runs only while the engine is idle, one prefill
        chunk at a time, and a live request arriving cancels one still waiting (docs/prompt-cache.md). Returns at
        once: ``queued``, or not with the ``reason``. ``InvalidPrefixWarm`` without a key or any text."""
        return self.prompt_cache_warm_request(GenerationRequest.from_kwargs(prompt, **kwargs))

    def prompt_cache_warm_request(self, request: GenerationRequest) -> dict[str, Any]:
        """``prompt_cache_warm`` for a validated request (what a node would send)."""
        if request.prompt_cache_key is None:
            raise InvalidPrefixWarm("a warmed prefix needs a prompt_cache_key", field="prompt_cache_key", value=None)
        if request.media or request.n > 1 or request.continuation is not None:
            raise InvalidPrefixWarm(
                "a warmed prefix is text messages of one answer (no media, n=1, no continuation)", field="messages"
            )
        if not any(isinstance(m.get("content"), str) and m["content"] for m in request.messages):
            raise InvalidPrefixWarm("a warmed prefix needs some text in its messages", field="messages")
        prepared = self._prepare(dataclasses.replace(request, progress=None))
        return {"applied": True, **self._engine.warm_prefix(prepared.request).to_dict()}

    def _cache_command(self, command: Callable[[PrefixCache], dict[str, Any]]) -> dict[str, Any]:
        result = self._engine.prompt_cache_command(command)
        if result is None:
            return {"applied": False, "reason": "prefix_cache_not_loaded"}
        return {"applied": True, **result}

    # --- generation ----------------------------------------------------------------------
    def generate(self, prompt: str = "", *, stream: bool = False, **kwargs: Any) -> GenerationResult | ChunkStream:
        return self.generate_request(GenerationRequest.from_kwargs(prompt, **kwargs), stream=stream)

    async def agenerate(
        self, prompt: str = "", *, stream: bool = False, **kwargs: Any
    ) -> GenerationResult | AsyncChunkStream:
        return await self.agenerate_request(GenerationRequest.from_kwargs(prompt, **kwargs), stream=stream)

    @overload
    def generate_request(self, request: GenerationRequest, *, stream: Literal[False] = False) -> GenerationResult: ...

    @overload
    def generate_request(self, request: GenerationRequest, *, stream: Literal[True]) -> ChunkStream: ...

    @overload
    def generate_request(self, request: GenerationRequest, *, stream: bool) -> GenerationResult | ChunkStream: ...

    def generate_request(self, request: GenerationRequest, *, stream: bool = False) -> GenerationResult | ChunkStream:
        """Run one validated request (the typed twin of ``generate``); several answers (``n``)
        are served by ``agenerate_request`` only."""
        if request.n > 1:
            raise InvalidControls(
                "n > 1 is served by agenerate_request (its answers are read at once)", field="n", value=request.n
            )
        prepared = self._prepare(request)
        submitted = self._submit(prepared)
        chunks = self._stream(prepared, submitted)
        if stream:
            return ChunkStream(chunks, submitted)
        return _result_from_chunks(list(chunks), request)

    async def agenerate_request(
        self, request: GenerationRequest, *, stream: bool = False
    ) -> GenerationResult | AsyncChunkStream:
        """Run one validated request. With ``n`` > 1 its answers run as rows submitted at once
        (their prompt prefilled once where the lane shares it, see ``choices``): the result is
        the first answer with every answer in ``choices``; a stream tags each piece with its
        answer's ``index``."""
        # Rendering and tokenizing run on a thread (a huge prompt must not stall the event
        # loop); errors (context too long, full queue) raise from this await. A structured
        # request compiles its grammar there too: on the few schema threads, so that many
        # schemas at once wait for each other, not for the threads other requests need.
        if request.response_format is not None or request.tool_choice.forced:
            prepared = await run_schema_work(self._prepare_choices, request)
        else:
            prepared = await asyncio.to_thread(self._prepare_choices, request)
        submitted = self._submit_together(prepared)
        streams = [self._astream(p, s) for p, s in zip(prepared, submitted)]
        if stream:
            return AsyncChunkStream(streams[0] if len(streams) == 1 else merge_streams(streams), *submitted)
        try:
            parts = await asyncio.gather(*(_collect(s) for s in streams))
        except BaseException:
            for one in submitted:
                one.close()
            raise
        results = [_result_from_chunks(p, request) for p in parts]
        if len(results) == 1:
            return results[0]
        usage = combined_usage([r.usage for r in results])
        return dataclasses.replace(results[0], usage=usage or {}, choices=results)

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """The prompt tokens ``request`` would be given: its messages and tools rendered with the
        chat template (the thinking control resolved as a call resolves it) and tokenized;
        nothing is generated or queued. It is the ``usage["prompt_tokens"]`` of that call. A
        request with images is refused (``InvalidMedia``): their tokens are known only after the
        vision processor ran on the worker."""
        if request.media:
            raise InvalidMedia("counting tokens takes text only: image tokens are counted when the call runs")
        controls = request.resolved if request.resolved is not None else self.resolve_controls(request)
        loaded = self._engine.serving_model()
        conversation = prepare_conversation(request.messages, num_images=0)
        return len(loaded.encode(_render(loaded, request, controls, conversation)))

    # --- internals --------------------------------------------------------------------------
    def _prepare_choices(self, call: GenerationRequest) -> list[_Prepared]:
        """One prepared request per answer asked for (the first one alone reports progress)."""
        if call.n == 1:
            return [self._prepare(call)]
        return [
            self._prepare(
                dataclasses.replace(
                    call, n=1, sampling=choice_seed(call.sampling, i), progress=call.progress if i == 0 else None
                )
            )
            for i in range(call.n)
        ]

    def _submit_together(self, prepared: list[_Prepared]) -> list[RequestStream]:
        """Submit every answer's request in one go (the worker takes them in one step); when
        one is refused (a full queue) those already submitted are cancelled."""
        submitted: list[RequestStream] = []
        try:
            with self._engine.together():
                for one in prepared:
                    submitted.append(self._submit(one))
        except BaseException:
            for stream in submitted:
                stream.close()
            raise
        return submitted

    def _prepare(self, call: GenerationRequest) -> _Prepared:
        controls = call.resolved if call.resolved is not None else self.resolve_controls(call)
        engine = self._engine
        loaded = engine.serving_model()
        images = _load_images(call.media, loaded)
        if call.continuation is not None:
            conversation: list[dict[str, Any]] = []
            text = _continuation_text(loaded.tokenizer, call.continuation)
        else:
            conversation = prepare_conversation(call.messages, num_images=len(images))
            text = _render(loaded, call, controls, conversation)
        prompt_ids = _encode_within_context(loaded, text, call.max_output_tokens)
        constrained = call.response_format is not None or call.tool_choice.forced
        draft_tokens, speculation = self._speculation_plan(controls, call.sampling, loaded, structured=constrained)
        max_tokens = _output_cap(loaded, len(prompt_ids), call.max_output_tokens)
        grammar = None
        # Compiled here, on the caller's thread: the worker's other rows never wait for it.
        if call.response_format is not None:
            grammar = loaded.grammar_compiler().processor(
                call.response_format, max_tokens=max_tokens, prompt_text=text, thinking=controls.thinking
            )
        elif call.tool_choice.forced:
            grammar = loaded.grammar_compiler().tool_processor(
                call.tools,
                call.tool_choice,
                tool_format_of(getattr(loaded.tokenizer, "chat_template", None)),
                max_tokens=max_tokens,
                prompt_text=text,
                thinking=controls.thinking,
            )

        request = EngineRequest(
            request_id=uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=call.sampling,
            stop=call.stop,
            draft_tokens=draft_tokens,
            speculation=speculation,
            speculation_required=bool(draft_tokens and controls.speculation.require_acceleration),
            cache_group=None,
            prompt_cache_key=call.prompt_cache_key,
            media_hash=image_hash(images),
            output_queue_size=self.execution_options["mlx_output_queue_size"],
            observe_prefill=call.progress is not None,
            cancel_event=call.cancel or threading.Event(),
            image_prompt=ImagePrompt(text, tuple(images)) if images else None,
            grammar=grammar,
            logprobs=call.logprobs,
        )
        tracker = ProgressTracker(call.progress, min_interval_s=self.progress_min_interval_s) if call.progress else None
        return _Prepared(
            request,
            tracker,
            speculation,
            controls,
            call.prompt_cache_key,
            time.perf_counter(),
            text,
            conversation,
            tuple(_offered_tools(call)),
        )

    def _speculation_plan(
        self, controls: ResolvedControls, sampling: Sampling, loaded: LoadedModel, *, structured: bool = False
    ) -> tuple[int, SpeculationPlan]:
        """The draft depth the engine runs (0: none) and the plan saying why (``metadata["speculation"]``)."""
        effective, source = controls.speculation, controls.speculation_source
        if not effective.enabled:
            return 0, SpeculationPlan(
                requested=False, mode=effective.mode, source=source, used=False, reason=controls.speculation_off_reason
            )
        depth = effective.num_draft_tokens
        assert depth is not None  # the resolver always fills the depth of native MTP
        asked = SpeculationPlan(
            requested=True,
            mode=effective.mode,
            source=source,
            used=False,
            num_draft_tokens=depth,
            require_acceleration=bool(effective.require_acceleration),
        )
        reason, message = None, None
        attach_s: float | None = None
        if loaded.upstream not in HEAD_UPSTREAMS:
            reason, message = self._mlx_lm_lane_reason(loaded)
        elif loaded.drafter is None and loaded.head_source is None:
            reason, message = "no_mtp_drafter_for_model", self._no_head_message()
        elif not sampling.logits_neutral():
            reason, message = "mtp_logit_processors_unsupported", "native MTP cannot honor penalties or logit bias"
        elif structured:
            # Upstream's speculative rounds apply no logits processors: drafts would escape the grammar.
            reason, message = "structured_output", "native MTP cannot check drafts against a structured-output grammar"
        elif loaded.drafter is None:
            try:
                attach_s = self._engine.attach_head()
            except UpstreamError as exc:
                reason, message = (
                    "mtp_head_attach_failed",
                    f"the MTP head at {loaded.head_source} could not be attached: {exc.message}",
                )
        if reason is not None:
            if effective.require_acceleration:
                raise SpeculationUnavailable(message or reason, reason=reason)
            return 0, dataclasses.replace(asked, reason=reason, message=message)
        used = dataclasses.replace(asked, used=True, drafter=loaded.drafter_source)
        if attach_s is not None:
            # This request attached the head (once per resident model): what it cost.
            used = dataclasses.replace(used, head_attach_s=round(attach_s, 6), head_bytes=loaded.drafter_bytes)
        return depth, used

    def _mlx_lm_lane_reason(self, loaded: LoadedModel) -> tuple[str, str]:
        """Why MTP cannot run on the mlx-lm lane (a non-batched provider whose default was off)."""
        if loaded.head_source is None and not self._mtp.get("head_present"):
            return "no_mtp_drafter_for_model", self._no_head_message()
        return (
            "speculation_is_load_time",
            "this non-batched provider was loaded on mlx-lm without its MTP head (its default speculation is off); "
            "create it with speculation= on (mlx-vlm's in-process lane) or with mlx_batching=True",
        )

    def _no_head_message(self) -> str:
        """Why no MTP head is available here, naming the command that downloads one."""
        names = (
            companion_candidates(self.model)
            if not looks_like_path(self.model) and not Path(self.model).expanduser().is_dir()
            else []
        )
        if names:
            return (
                f"{self.model} has no MTP head on this machine (no embedded mtp.* weights, no companion head "
                f"{' or '.join(names)} in the model cache); download one with "
                f"`{DOWNLOAD_COMMAND.format(name=names[-1])}`, or pass mtp_head="
            )
        # Named by directory, not full path: a served answer carries this message to clients that
        # must not learn the server's file layout.
        siblings = companion_candidates(self.path.name)
        return (
            f"{self.path.name} has no MTP head on this machine (no embedded mtp.* weights, no companion head "
            f"{' or '.join(siblings)} beside it); download one with "
            f"`{DOWNLOAD_COMMAND.format(name='<org>/<model>-MTP')}` and pass it as mtp_head="
        )

    def _submit(self, prepared: _Prepared) -> RequestStream:
        """Submit now, so a full queue or a closed engine raises at call time, not at first read."""
        tracker = prepared.tracker
        if tracker is None:
            return self._engine.stream(prepared.request)

        def on_prefill_progress(obs: PrefillObservation) -> None:
            self._note_admission(prepared, tracker)
            tracker.prefill(obs.processed, obs.total, obs.cached)

        engine = self._engine
        # The serialized lane restores a key's snapshot from a store it can read now: the
        # cached/fed split is known before the start event (the batched lanes learn it on the worker).
        cached = engine.restorable_prefix_tokens(prepared.request)
        stream = engine.stream(prepared.request, on_prefill_progress=on_prefill_progress)
        tracker.start(prepared.request.num_prompt_tokens, cached=cached)
        return stream

    def _stream(self, prepared: _Prepared, stream: RequestStream) -> Iterator[GenerationChunk]:
        request = prepared.request
        items = iter(stream)
        try:
            for item in items:
                chunk = self._on_item(prepared, item)
                if chunk is not None:
                    yield chunk
        except MLXRuntimeError as exc:
            if (
                stream.outcome is None
                or stream.outcome.finish_reason != FinishReason.CANCELLED
                or exc.code != "cancelled"
            ):
                raise
        finally:
            items.close()  # type: ignore[attr-defined]
        yield self._final_chunk(prepared, stream.outcome or request.outcome, self._prefix_break(prepared))

    async def _astream(self, prepared: _Prepared, stream: RequestStream) -> AsyncIterator[GenerationChunk]:
        request = prepared.request
        items = stream.aiter()
        try:
            async for item in items:
                chunk = self._on_item(prepared, item)
                if chunk is not None:
                    yield chunk
        except MLXRuntimeError as exc:
            if exc.code != "cancelled":
                raise
        finally:
            await items.aclose()
        # Only a break renders anything (a few template renders): off the event loop.
        located = await asyncio.to_thread(self._prefix_break, prepared) if request.prefix_break is not None else None
        yield self._final_chunk(prepared, stream.outcome or request.outcome, located)

    @staticmethod
    def _note_admission(prepared: _Prepared, tracker: ProgressTracker) -> None:
        if tracker.execution_mode is None and prepared.request.mode is not None:
            tracker.execution_mode = prepared.request.mode  # set at admission, before any output
            tracker.speculation = _speculation_event(prepared)

    def _on_item(self, prepared: _Prepared, item: TokenDelta) -> GenerationChunk | None:
        tracker = prepared.tracker
        if tracker is not None:
            self._note_admission(prepared, tracker)
            if item.token_ids:
                # The worker set ``cached_tokens`` when the prompt was done, before this token was queued.
                tracker.tokens(len(item.token_ids), cached=prepared.request.cached_tokens)
        if not item.text and not item.logprobs:
            return None
        logprobs = _token_logprobs(self._engine.serving_model().tokenizer, item.logprobs) if item.logprobs else None
        return GenerationChunk(content=item.text, token_ids=list(item.token_ids), model=self.model, logprobs=logprobs)

    def _prefix_break(self, prepared: _Prepared) -> dict[str, Any] | None:
        """``prompt_cache.prefix_break`` when the worker found the prompt broke its key's previous
        prompt: the message (or tools block) it broke in, located here, on the caller's thread."""
        request = prepared.request
        brk = request.prefix_break
        if brk is None:
            return None
        loaded = self._engine.serving_model()
        try:
            return attribute(
                brk,
                prompt_ids=request.prompt_ids,
                text=prepared.text,
                conversation=prepared.conversation,
                tokenizer=loaded.tokenizer,
                tools=prepared.tools,
                thinking=prepared.controls.thinking,
            )
        except Exception as exc:  # noqa: BLE001 - a report must never fail the request it describes
            log.exception("prefix-break attribution failed")
            return {
                "token": brk.token,
                "reused_tokens": brk.reused_tokens,
                "expected_tokens": brk.expected_tokens,
                "segment": "unknown",
                "reason": f"attribution failed: {type(exc).__name__}: {exc}",
            }

    def _final_chunk(
        self, prepared: _Prepared, outcome: Outcome | None, prefix_break: dict[str, Any] | None = None
    ) -> GenerationChunk:
        assert outcome is not None
        request = prepared.request
        usage = {
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            "input_tokens": outcome.prompt_tokens,
            "output_tokens": outcome.completion_tokens,
        }
        if outcome.cached_tokens is not None:
            usage["cached_input_tokens"] = outcome.cached_tokens
        assert outcome.speculation is not None  # every request this provider submits carries its plan
        metadata: dict[str, Any] = {
            "execution": outcome.execution.to_wire(),
            "speculation": outcome.speculation.to_wire(),
        }
        if outcome.stop_reason is not None:
            metadata["stop_reason"] = outcome.stop_reason  # the matched stop string, or the end-of-sequence id
        performance = _performance(request)
        if performance:
            metadata["performance"] = performance
        if prepared.prompt_cache_key is not None:
            cache_report = outcome.prompt_cache or unreached_cache_report(prepared.prompt_cache_key)
            metadata["prompt_cache"] = cache_report.to_wire(prefix_break)
        if prepared.controls.thinking is not None:
            metadata["thinking"] = prepared.controls.thinking
        if request.grammar is not None:
            metadata["structured"] = request.grammar.metadata()
        metadata["controls"] = prepared.controls.to_metadata()
        if prepared.tracker is not None:
            prepared.tracker.execution_mode = request.mode
            if request.mode is not None:
                prepared.tracker.speculation = _speculation_event(prepared)
            prepared.tracker.complete(
                outcome.finish_reason.value,
                prompt_tokens=outcome.prompt_tokens,
                cached_tokens=outcome.cached_tokens,
                generated_tokens=outcome.completion_tokens,
            )
            metadata["progress"] = prepared.tracker.metadata()
        return GenerationChunk(
            content="",
            finish_reason=outcome.finish_reason.value,
            usage=usage,
            metadata=metadata,
            token_ids=list(request.token_ids),
            model=self.model,
        )


class ChunkStream:
    """The chunks of one request. ``close()`` cancels it, also before the first read."""

    def __init__(self, chunks: Iterator[GenerationChunk], submitted: RequestStream) -> None:
        self._chunks = chunks
        self._submitted = submitted

    def __iter__(self) -> ChunkStream:
        return self

    def __next__(self) -> GenerationChunk:
        return next(self._chunks)

    def close(self) -> None:
        self._submitted.close()
        self._chunks.close()  # type: ignore[attr-defined]

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncChunkStream:
    """Async twin of ``ChunkStream``: ``await stream.aclose()`` cancels the request (each of
    them, for a call with several answers)."""

    def __init__(self, chunks: AsyncIterator[GenerationChunk], *submitted: RequestStream) -> None:
        self._chunks = chunks
        self._submitted = submitted

    def __aiter__(self) -> AsyncChunkStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        for submitted in self._submitted:
            submitted.close()
        await self._chunks.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> AsyncChunkStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _speculation_event(prepared: _Prepared) -> dict[str, Any]:
    """What phase events say about speculation once the request is admitted: whether MTP runs
    and, when it does not, the named reason (``deferred_under_load`` decided at admission)."""
    report = speculation_report(prepared.speculation, None, prepared.request.speculation_deferred)
    if report.used:
        return {"speculation_used": True}
    return {"speculation_used": False, "speculation_reason": report.reason}


def _validate_options(options: dict[str, Any]) -> dict[str, Any]:
    def positive_int(name: str, lo: int = 1) -> None:
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise InvalidControls(f"{name} must be an integer >= {lo}", field=name, value=value)

    switches = [o for o, f in ENGINE_OPTIONS.items() if isinstance(getattr(_ENGINE_DEFAULTS, f), bool)]
    for name in ("mlx_batching", *switches):
        if not isinstance(options[name], bool):
            raise InvalidControls(f"{name} must be a boolean", field=name, value=options[name])
    positive_int("mlx_max_batch_size")
    positive_int("mlx_max_queue_size")
    positive_int("mlx_output_queue_size", lo=2)
    positive_int("mlx_prefill_step_size", lo=16)
    idle = options["mlx_idle_finished_rows"]
    if idle is not None and not isinstance(idle, bool):
        raise InvalidControls(
            "mlx_idle_finished_rows must be a boolean or None", field="mlx_idle_finished_rows", value=idle
        )
    validate_cache_options(options)
    for name in ("mlx_batch_wait_ms", "mlx_burst_gap_ms"):
        wait = options[name]
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 1000:
            raise InvalidControls(f"{name} must be a number in [0, 1000]", field=name, value=wait)
    timeout = options["mlx_queue_timeout_s"]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise InvalidControls(
            "mlx_queue_timeout_s must be a positive number", field="mlx_queue_timeout_s", value=timeout
        )
    return dict(options)


def _drafter_source(path: Path, head: Path | None, mtp: dict[str, Any]) -> Path | None:
    """The MTP head to load, from the one detection made for this model."""
    if head is not None:
        return head
    if mtp.get("embedded"):
        return path
    companion = mtp.get("companion_path")
    return Path(companion) if companion else None


def _offered_tools(call: GenerationRequest) -> list[Mapping[str, Any]]:
    """The tools the prompt offers: none under ``tool_choice: none``."""
    return list(call.tools) if call.tool_choice.mode != "none" else []


def _render(
    loaded: LoadedModel, call: GenerationRequest, controls: ResolvedControls, conversation: list[dict[str, Any]]
) -> str:
    """The prompt text of ``call``: its conversation and offered tools through the model's chat template."""
    return render_prompt(loaded.tokenizer, conversation, tools=_offered_tools(call), thinking=controls.thinking)


def _encode_within_context(loaded: Any, text: str, cap: int | None) -> list[int]:
    """Tokenize ``text``, refusing at once (before encoding) a text that cannot fit the context
    with the output cap ``_output_cap`` would give its fewest possible tokens."""
    context = loaded.context_length
    if context is not None:
        at_least = loaded.min_prompt_tokens(text)
        least_cap = _output_cap(loaded, at_least, cap)
        if at_least + least_cap > context:
            raise ContextTooLong(
                f"the prompt needs at least {at_least} tokens ({len(text)} characters) and the output cap is "
                f"{least_cap}; this model's context is {context} tokens",
                details={"prompt_tokens_at_least": at_least, "max_output_tokens": least_cap, "context_length": context},
            )
    ids: list[int] = loaded.encode(text)
    return ids


def _output_cap(loaded: Any, prompt_tokens: int, cap: int | None) -> int:
    """The engine's ``max_tokens``, decided here alone: the caller's cap, or the default shrunk
    to what the context leaves (at least 1, so a prompt that fills the context is refused as
    ``context_too_long``). The engine checks prompt plus cap against the context again once an
    image prompt's final length is known (``LoadedModel.check_request``)."""
    if cap is not None:
        return cap
    context = loaded.context_length
    if context is None:
        return DEFAULT_MAX_OUTPUT_TOKENS
    return max(1, min(DEFAULT_MAX_OUTPUT_TOKENS, int(context) - prompt_tokens))


def _load_images(media: tuple[Any, ...], loaded: LoadedModel) -> list[Any]:
    if not media:
        return []
    if not loaded.supports_images:
        raise InvalidMedia(
            "this model takes no images: it has no vision tower"
            if loaded.upstream == Upstream.NATIVE
            else "images need the mlx_batching=True lane (mlx-vlm)"
        )
    from PIL import Image, UnidentifiedImageError

    images = []
    for i, item in enumerate(media):
        try:
            if isinstance(item, Image.Image):
                image = item
            elif isinstance(item, (bytes, bytearray)):
                image = Image.open(io.BytesIO(item))
            elif isinstance(item, (str, Path)):
                if not Path(item).is_file():
                    raise InvalidMedia(f"media[{i}]: no file at {item}")
                image = Image.open(item)
            else:
                raise InvalidMedia(
                    f"media[{i}]: expected a file path, image bytes or a PIL image, got {type(item).__name__}"
                )
            images.append(image.convert("RGB"))
        except (UnidentifiedImageError, OSError) as exc:
            raise InvalidMedia(f"media[{i}] is not a readable image: {exc}") from exc
    return images


def _performance(request: EngineRequest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if request.first_token_at is not None and request.started_at is not None:
        prefill_s = request.first_token_at - request.started_at
        fed = request.num_prompt_tokens - (request.cached_tokens or 0)
        if prefill_s > 0:
            out["prompt_tokens_per_second"] = round(fed / prefill_s, 3)
    if request.finished_at is not None and request.first_token_at is not None and request.num_output_tokens > 1:
        decode_s = request.finished_at - request.first_token_at
        if decode_s > 0:
            out["generation_tokens_per_second"] = round((request.num_output_tokens - 1) / decode_s, 3)
    return out


def _continuation_text(tokenizer: Any, prompt: str) -> str:
    """A plain prompt as the model reads it: the tokenizer's begin-of-sequence text first (when
    it has one and the prompt does not start with it), then the prompt as is."""
    bos = getattr(tokenizer, "bos_token", None)
    text = prompt if not isinstance(bos, str) or not bos or prompt.startswith(bos) else bos + prompt
    if not text:
        raise InvalidRequest(
            "the prompt is empty and this model has no begin-of-sequence token", details={"field": "prompt"}
        )
    return text


def _token_logprobs(tokenizer: Any, sampled: list[SampledLogprob]) -> list[TokenLogprob]:
    """The engine's logprobs with each token's text: the chosen token's share of the answer's
    text (they concatenate to it exactly), each alternative decoded alone."""

    def text(token_id: int) -> str:
        return str(tokenizer.decode([token_id]))

    return [
        TokenLogprob(
            text(s.token_id) if s.text is None else s.text,
            s.token_id,
            s.logprob,
            tuple(TopLogprob(text(i), i, lp) for i, lp in s.top),
        )
        for s in sampled
    ]


async def _collect(chunks: AsyncIterator[GenerationChunk]) -> list[GenerationChunk]:
    return [chunk async for chunk in chunks]


def _result_from_chunks(chunks: list[GenerationChunk], call: GenerationRequest) -> GenerationResult:
    final = chunks[-1]
    asked = [c.logprobs for c in chunks if c.logprobs is not None]
    text = "".join(c.content for c in chunks)
    response_format = call.response_format
    reads_calls = bool(call.tools) and call.tool_choice.mode != "none" and response_format is None
    output = parse_output(text, tools=reads_calls)
    parsed = None
    if response_format is not None and final.finish_reason != "cancelled":
        parsed = parse_answer(output.content, response_format, mode="constrained", finish_reason=final.finish_reason)
    tool_calls = [c.to_openai() for c in output.tool_calls] or None
    finish = final.finish_reason
    if tool_calls and finish == "stop":
        finish = "tool_calls"
    return GenerationResult(
        content=output.content,
        finish_reason=finish,
        usage=final.usage or {},
        metadata=final.metadata or {},
        model=final.model,
        reasoning=output.reasoning,
        tool_calls=tool_calls,
        token_ids=final.token_ids,
        parsed=parsed,
        logprobs=[entry for entries in asked for entry in entries] if asked else None,
    )
