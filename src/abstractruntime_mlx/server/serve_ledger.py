"""``serve --ledger URL``: every served call recorded in the ledger, as ``run`` records its calls.

One run per client session: calls that carry the same ``X-Session-Affinity`` header are the
steps of one run (``run_id = serve-<sha256(session)[:16]>``, ``session_id`` = the header);
a call without the header is a run of its own (``serve-<uuid>``). Every run's
``workflow_id`` is ``serve``. Each call is an ``llm_call`` step whose ``node_id`` is the route
(``chat``, ``responses``, ``completions``): its STARTED record (the messages, model and route)
is written before the call starts, its phase events go through the ledger's
``ProgressWriter`` as ``abstract.progress`` rows, and its COMPLETED (or FAILED) record holds
the answer, usage and metadata in the shape ``run`` records (``content``, ``usage``,
``metadata.execution`` ..., ``metadata.route``: the model as the request named it and the
pool's name of the model that served it). The STARTED payload's ``http`` holds the HTTP method,
the path (``/v1/chat/completions``, ``/v1/messages``, ``/api/chat`` ...) and whether it
streamed. So ``runs list``, ``runs show`` and ``runs web`` show server traffic like flow runs. A
session's run reads ``running`` while one of its calls runs, then the status of its last call.

Every record is written by one thread of this recorder, in the order the calls began and
ended (a call's end comes before the start of a call that began after it ended), never on
the event loop; ``close()`` waits for them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

from ..errors import MLXRuntimeError
from ..json_values import JSONObject, JSONValue
from ..ledger import Ledger, NodeKey
from ..request import GenerationRequest
from ..results import GenerationChunk, GenerationResult

log = logging.getLogger(__name__)

SERVE_WORKFLOW: Final = "serve"
PROVIDER: Final = "mlx"


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


@dataclass(frozen=True, slots=True)
class ServedHttp:
    """The HTTP request of a served call: its method, its path, the model as it named it."""

    method: str
    route: str
    asked_model: str | None = None


def session_run_id(session: str) -> str:
    """The run of every call in ``session`` (a digest: the header may hold any text)."""
    return f"serve-{hashlib.sha256(session.encode('utf-8')).hexdigest()[:16]}"


class ServeLedger:
    """Records served calls in ``ledger`` (which stays the caller's to close, after ``close()``)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.writer = ledger.progress_writer()
        self._records = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="serve-ledger"
        )  # one writer: records in order
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}  # run id -> calls running in it

    async def begin(
        self,
        *,
        route: str,
        model: str,
        call: GenerationRequest,
        stream: bool,
        session: str | None,
        http: ServedHttp | None = None,
    ) -> LedgerCall:
        """Write the call's run (if new) and its STARTED step; returns the call's observer."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._records, self._begin, route, model, call, stream, session, http)

    def _begin(
        self,
        route: str,
        model: str,
        call: GenerationRequest,
        stream: bool,
        session: str | None,
        http: ServedHttp | None,
    ) -> LedgerCall:
        now = _now()
        session = session.strip() if session and session.strip() else None
        run_id = session_run_id(session) if session else f"serve-{uuid.uuid4().hex}"
        run: JSONObject = {
            "run_id": run_id,
            "workflow_id": SERVE_WORKFLOW,
            "status": "running",
            "current_node": route,
            "vars": {},
            "created_at": now,
            "updated_at": now,
            "session_id": session,
        }
        stored, created = self.ledger.create_run_if_absent(run)
        if not created:
            self.ledger.save_run({**stored, "status": "running", "current_node": route, "updated_at": now})
        step_id = uuid.uuid4().hex
        effect: JSONObject = {
            "type": "llm_call",
            "payload": _payload(call, route=route, model=model, stream=stream, http=http),
        }
        self.ledger.append_step(
            {
                "run_id": run_id,
                "step_id": step_id,
                "node_id": route,
                "status": "started",
                "effect": effect,
                "attempt": 1,
                "idempotency_key": f"serve:{step_id}",
                "started_at": now,
                "session_id": session,
            }
        )
        with self._lock:
            self._in_flight[run_id] = self._in_flight.get(run_id, 0) + 1
        key = NodeKey(run_id, route, workflow_id=SERVE_WORKFLOW, step_id=step_id, attempt=1)
        asked = http.asked_model if http is not None and http.asked_model else model
        return LedgerCall(self, key=key, effect=effect, model=model, asked_model=asked, started_at=now, session=session)

    def finish(self, call: LedgerCall, record: JSONObject, status: str) -> None:
        """Write the call's end on the recorder's thread (after what was asked before, off the event loop)."""
        self._records.submit(self._finish, call, record, status)

    def _finish(self, call: LedgerCall, record: JSONObject, status: str) -> None:
        try:
            self.writer.flush(call.key)  # its phase events come before its terminal record
            self.ledger.append_step(record)
            with self._lock:
                left = self._in_flight.get(call.key.run_id, 1) - 1
                if left > 0:
                    self._in_flight[call.key.run_id] = left
                else:
                    self._in_flight.pop(call.key.run_id, None)
            stored = self.ledger.load_run(call.key.run_id) or {}
            self.ledger.save_run({**stored, "status": "running" if left > 0 else status, "updated_at": _now()})
        except (MLXRuntimeError, RuntimeError):
            log.error("serve ledger: could not record the end of call %s", call.key.step_id, exc_info=True)

    def drain(self, *, timeout_s: float = 30.0) -> None:
        """Wait (at most ``timeout_s``) until the end records of calls that ended so far are written."""
        self._records.submit(lambda: None).result(timeout=timeout_s)

    def close(self) -> None:
        """Wait for the pending end records, then stop the progress writer. Idempotent."""
        self._records.shutdown(wait=True)
        self.writer.stop()


class LedgerCall:
    """One served call's records (an ``observe.CallObserver``)."""

    wants_progress: Final = True

    def __init__(
        self,
        recorder: ServeLedger,
        *,
        key: NodeKey,
        effect: JSONObject,
        model: str,
        started_at: str,
        session: str | None,
        asked_model: str | None = None,
    ) -> None:
        self._recorder = recorder
        self.key = key
        self._effect = effect
        self._model = model
        self._asked_model = asked_model or model
        self._started_at = started_at
        self._session = session
        self._text: list[str] = []
        self._final: GenerationChunk | GenerationResult | None = None

    def progress(self, event: JSONObject) -> None:
        self._recorder.writer.put(event, self.key)

    def chunk(self, chunk: GenerationChunk) -> None:
        if chunk.finish_reason is not None:
            self._final = chunk
        if chunk.content and chunk.index == 0:  # several answers (``n``): the first is recorded
            self._text.append(chunk.content)

    def result(self, result: GenerationResult) -> None:
        self._final = result

    def ended(self, error: BaseException | None) -> None:
        final = self._final
        record: JSONObject = {
            "run_id": self.key.run_id,
            "step_id": str(self.key.step_id),
            "node_id": self.key.node_id,
            "effect": self._effect,
            "attempt": 1,
            "idempotency_key": f"serve:{self.key.step_id}",
            "started_at": self._started_at,
            "ended_at": _now(),
            "session_id": self._session,
        }
        if error is not None or final is None:
            cancelled = getattr(error, "code", None) == "cancelled"
            status = "cancelled" if cancelled else "failed"
            code = getattr(error, "code", "internal_error")
            record.update(
                status=status, error=f"[{code}] {error}" if error is not None else "the call ended without an answer"
            )
        else:
            status = "completed"
            record.update(status=status, result=self._result_record(final))
        self._recorder.finish(self, record, status)

    def _result_record(self, final: GenerationChunk | GenerationResult) -> JSONObject:
        """The answer in the shape ``run`` records an LLM call's result (``NodeResult.to_runtime_result``)."""
        metadata: dict[str, JSONValue] = dict(final.metadata or {})
        metadata["client"] = {"kind": "served", "session": self._session}
        metadata.setdefault(
            "route",
            {
                "asked": {"provider": PROVIDER, "model": self._asked_model},
                "served": {"provider": PROVIDER, "model": self._model},
            },
        )
        content = final.content if isinstance(final, GenerationResult) else "".join(self._text)
        out: JSONObject = {
            "content": content,
            "finish_reason": final.finish_reason,
            "usage": dict(final.usage or {}),
            "model": self._model,
            "provider": PROVIDER,
            "metadata": metadata,
        }
        if isinstance(final, GenerationResult):
            if final.reasoning is not None:
                out["reasoning"] = final.reasoning
            if final.tool_calls:
                out["tool_calls"] = [dict(call) for call in final.tool_calls]
        return out


def _payload(call: GenerationRequest, *, route: str, model: str, stream: bool, http: ServedHttp | None) -> JSONObject:
    """The STARTED record's payload: the conversation as sent (images counted, not copied)."""
    messages: list[JSONValue] = [dict(message) for message in call.messages]
    prompt = next((m.get("content") for m in reversed(call.messages) if m.get("role") == "user"), None)
    system = next((m.get("content") for m in call.messages if m.get("role") in ("system", "developer")), None)
    payload: JSONObject = {
        "provider": PROVIDER,
        "model": model,
        "route": route,
        "stream": stream,
        "messages": messages,
        "params": {"max_output_tokens": call.max_output_tokens},
    }
    if isinstance(prompt, str):
        payload["prompt"] = prompt
    if isinstance(system, str):
        payload["system_prompt"] = system
    if call.media:
        payload["num_images"] = len(call.media)
    if call.prompt_cache_key is not None:
        payload["prompt_cache_key"] = call.prompt_cache_key
    if http is not None:
        payload["http"] = {"method": http.method, "route": http.route, "stream": stream}
    return payload
