"""Rendering every prompt through the model's own chat template (one path for every lane)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ...conversation import final_user_message
from ...errors import InvalidRequest


def prepare_conversation(messages: Iterable[Mapping[str, Any]], *, num_images: int = 0) -> list[dict[str, Any]]:
    """Copies of an assembled conversation as chat templates expect them (tool-call arguments
    as objects, ``content`` never null), with ``num_images`` image slots on the final user turn."""
    out = [_normalise_message(m) for m in messages]
    if num_images:
        _attach_images(out, num_images)
    return out


def render_prompt(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool | str | None = None,
    add_generation_prompt: bool = True,
) -> str:
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "tokenize": False}
    if tools:
        kwargs["tools"] = tools
    if thinking is not None:
        kwargs["enable_thinking"] = thinking is not False
        if isinstance(thinking, str):
            kwargs["reasoning_effort"] = thinking
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequest("this model has no chat template; it cannot render chat messages")
    try:
        rendered: str = tokenizer.apply_chat_template(conversation, **kwargs)
        return rendered
    except Exception as exc:  # noqa: BLE001 - jinja raises many kinds
        raise InvalidRequest(f"the model's chat template rejected the conversation: {exc}") from exc


def _normalise_message(message: Mapping[str, Any]) -> dict[str, Any]:
    msg = dict(message)
    calls = msg.get("tool_calls")
    if calls:
        normalised = []
        for call in calls:
            fn = dict(call.get("function", call))
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args)
                except json.JSONDecodeError:
                    pass
            normalised.append({"type": "function", "function": fn, **({"id": call["id"]} if "id" in call else {})})
        msg["tool_calls"] = normalised
    if msg.get("content") is None:
        msg["content"] = ""
    return msg


def _attach_images(conversation: list[dict[str, Any]], num_images: int) -> None:
    message = final_user_message(conversation)
    content = message["content"]
    parts = list(content) if isinstance(content, list) else [{"type": "text", "text": content}]
    message["content"] = [{"type": "image"} for _ in range(num_images)] + [p for p in parts if p.get("type") != "image"]
