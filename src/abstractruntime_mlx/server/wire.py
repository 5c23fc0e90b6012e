"""OpenAI-compatible JSON bodies built from ``GenerationResult`` / ``GenerationChunk``.

Pure functions, no I/O. Additive fields (AbstractCore's):

- ``usage.prompt_tokens_details.cached_tokens`` mirrors ``usage.cached_input_tokens``; the
  provider's own usage keys (``input_tokens``, ``output_tokens``, ``cached_input_tokens``)
  are kept alongside OpenAI's three.
- ``abstractcore``: ``{execution, speculation, performance, prompt_cache, controls, structured}``
  (the keys the provider reported; absent ones stay absent).
- ``choices[0].stop_reason`` on a finished choice, as vLLM sends it: the stop string that
  matched, the end-of-sequence token id that ended the answer, or ``null``.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Final

from ..errors import MLXRuntimeError
from ..json_values import JSONObject, JSONValue
from ..results import WIRE_METADATA_KEYS, GenerationChunk, GenerationResult, TokenLogprob, stop_reason

log = logging.getLogger(__name__)

_SURROGATE: Final = re.compile("[\ud800-\udfff]")  # in a str every surrogate is a lone one
_USAGE_EXTRAS: Final = ("input_tokens", "output_tokens", "cached_input_tokens")


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage_to_wire(usage: Mapping[str, int] | None) -> JSONObject | None:
    if not usage:
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    out: JSONObject = {
        "prompt_tokens": int(prompt or 0),
        "completion_tokens": int(completion or 0),
        "total_tokens": int(usage.get("total_tokens", (prompt or 0) + (completion or 0))),
    }
    for key in _USAGE_EXTRAS:
        if usage.get(key) is not None:
            out[key] = usage[key]
    if usage.get("cached_input_tokens") is not None:
        out["prompt_tokens_details"] = {"cached_tokens": int(usage["cached_input_tokens"])}
    return out


def abstractcore_block(metadata: Mapping[str, JSONValue] | None) -> JSONObject | None:
    if not metadata:
        return None
    block = {k: metadata[k] for k in WIRE_METADATA_KEYS if metadata.get(k) is not None}
    return block or None


def completion_body(result: GenerationResult, *, completion_id: str, model: str, created: int) -> JSONObject:
    """A ``chat.completion``: one choice per answer (``result.choices``, else the result)."""
    body: JSONObject = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [_chat_choice(one, index) for index, one in enumerate(result.choices or [result])],
    }
    return with_usage_and_block(body, usage=usage_to_wire(result.usage), metadata=result.metadata)


def _chat_choice(result: GenerationResult, index: int) -> JSONObject:
    # An answer that is only tool calls has no content (``null``), as OpenAI's.
    content = None if result.tool_calls and not result.content else result.content
    message: JSONObject = {"role": "assistant", "content": content}
    if result.reasoning:
        # ``reasoning_content`` as vLLM and LM Studio name it; ``reasoning`` as before.
        message["reasoning_content"] = result.reasoning
        message["reasoning"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = format_tool_calls(result.tool_calls)
    choice: JSONObject = {
        "index": index,
        "message": message,
        "logprobs": None if result.logprobs is None else chat_logprobs(result.logprobs),
    }
    return finished_choice(choice, result.finish_reason or "stop", result.metadata)


def chat_logprobs(entries: Sequence[TokenLogprob]) -> JSONObject:
    """OpenAI chat's ``choices[].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    return {"content": logprob_entries(entries)}


def logprob_entries(entries: Sequence[TokenLogprob]) -> list[JSONValue]:
    """``[{token, logprob, bytes, top_logprobs}]``: chat's ``logprobs.content`` and the Responses
    API's ``output_text`` ``logprobs``."""
    return [
        {**_logprob_entry(e.token, e.logprob), "top_logprobs": [_logprob_entry(t.token, t.logprob) for t in e.top]}
        for e in entries
    ]


def completion_logprobs(entries: Sequence[TokenLogprob], *, offset: int) -> tuple[JSONObject, int]:
    """The legacy completions' ``choices[].logprobs`` (``tokens``, ``token_logprobs``,
    ``top_logprobs`` as ``{token: logprob}``, ``text_offset``: each token's character offset in
    the choice's text, counted from ``offset``) and the offset after the last token."""
    offsets: list[JSONValue] = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    body: JSONObject = {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }
    return body, offset


def _logprob_entry(token: str, logprob: float) -> JSONObject:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}


def chunk_body(
    *,
    completion_id: str,
    model: str,
    created: int,
    delta: JSONObject,
    finish_reason: str | None = None,
    usage: Mapping[str, int] | None = None,
    metadata: Mapping[str, JSONValue] | None = None,
    logprobs: Sequence[TokenLogprob] | None = None,
    index: int = 0,
) -> JSONObject:
    choice: JSONObject = {"index": index, "delta": delta}
    if logprobs:
        choice["logprobs"] = chat_logprobs(logprobs)
    body: JSONObject = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [finished_choice(choice, finish_reason, metadata)],
    }
    return with_usage_and_block(body, usage=usage_to_wire(usage), metadata=metadata)


def finished_choice(
    choice: JSONObject, finish_reason: str | None, metadata: Mapping[str, JSONValue] | None
) -> JSONObject:
    """``choice`` with its ``finish_reason``; a finished one also gets vLLM's ``stop_reason``."""
    choice["finish_reason"] = finish_reason
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason(metadata)
    return choice


def with_usage_and_block(
    body: JSONObject, *, usage: JSONObject | None, metadata: Mapping[str, JSONValue] | None
) -> JSONObject:
    """``body`` with ``usage`` (already in its route's form) and the ``abstractcore`` block of
    ``metadata`` added, each only when there is one (absent keys stay absent)."""
    if usage is not None:
        body["usage"] = usage
    block = abstractcore_block(metadata)
    if block is not None:
        body["abstractcore"] = block
    return body


def format_tool_calls(calls: Sequence[Mapping[str, JSONValue]]) -> list[JSONObject]:
    """OpenAI's ``{"id", "type": "function", "function": {"name", "arguments": str}}``."""
    out: list[JSONObject] = []
    for call in calls:
        fn = spec if isinstance(spec := call.get("function"), dict) else call
        arguments = fn.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        out.append(
            {
                "id": call.get("id") or f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {"name": fn.get("name"), "arguments": arguments},
            }
        )
    return out


def error_payload(exc: BaseException) -> tuple[int, JSONObject]:
    """``(http_status, {"error": {...}})`` for any exception; unexpected ones are logged.

    Messages may quote what the client sent, so every string is made encodable first (a
    lone surrogate becomes U+FFFD): the error itself must always reach the client.
    """
    if isinstance(exc, MLXRuntimeError):
        return exc.http_status, {"error": _encodable(exc.to_dict())}
    log.error("unexpected server error", exc_info=exc)
    return 500, {
        "error": _encodable(
            {
                "message": f"internal server error: {type(exc).__name__}: {exc}",
                "type": "server_error",
                "code": "internal_error",
            }
        )
    }


def _encodable(value: JSONValue) -> JSONValue:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        # A key that is not a string (possible only from an untyped caller) is left to json.dumps.
        return {(_SURROGATE.sub("\ufffd", k) if isinstance(k, str) else k): _encodable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encodable(v) for v in value]
    return value


def now_s() -> int:
    return int(time.time())


def chunk_is_terminal(chunk: GenerationChunk) -> bool:
    return chunk.finish_reason is not None
