"""The conversation rule shared by the local provider and the remote client (pure, no MLX).

The system prompt comes first (replacing a system turn in the history), then the history,
then ``prompt`` as a user turn (an empty prompt too, when there is nothing else). Images
always attach to the final user message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from .errors import InvalidMedia, InvalidRequest
from .json_values import JSONValue

Message = TypeVar("Message", bound=Mapping[str, object])


def assemble_conversation(
    *, prompt: str | None, messages: Sequence[Mapping[str, JSONValue]] | None, system_prompt: str | None
) -> list[dict[str, JSONValue]]:
    out: list[dict[str, JSONValue]] = []
    if system_prompt:
        out.append({"role": "system", "content": system_prompt})
    for message in messages or []:
        if not isinstance(message, Mapping) or "role" not in message:
            raise InvalidRequest("each message must be an object with a 'role'")
        if message["role"] == "system" and system_prompt:
            continue
        out.append(dict(message))
    if prompt or (prompt is not None and not out):
        # An empty prompt on its own is an empty user turn, as AbstractCore sends it: flows wire
        # a start input left empty straight into a prompt.
        out.append({"role": "user", "content": prompt})
    if not out:
        raise InvalidRequest("nothing to generate from: give a prompt or messages")
    return out


def final_user_message(conversation: Sequence[Message]) -> Message:
    """The message images attach to (the caller's own message object, to change in place)."""
    for message in reversed(conversation):
        if message["role"] == "user":
            return message
    raise InvalidMedia("images need a user message to attach to")
