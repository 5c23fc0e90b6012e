"""Native image rules for chat messages (OpenAI ``image_url`` content parts).

Accepted: inline ``data:image/{png,jpeg,webp,gif};base64,...`` URLs whose payload is strict,
canonical, padded base64 and whose decoded bytes start with the magic bytes of the declared
type; only in the final user message; at most ``MAX_IMAGES`` images, ``MAX_IMAGE_BYTES`` each
and ``MAX_TOTAL_IMAGE_BYTES`` together (decoded sizes). Everything else (remote or file URLs,
other part types, images in history) raises ``InvalidMedia`` (400, ``native_media_invalid``)
with a message naming the rule. Text parts of a message are joined with ``"\\n"``.

``extract_images(messages)`` returns the messages with plain-string contents and the decoded
image bytes, in order, for the provider's ``media=``.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from ..errors import InvalidMedia
from ..image_types import sniff_image_type
from ..json_values import JSONObject, JSONValue

MiB: Final = 1024 * 1024
MAX_IMAGE_BYTES: Final = 10 * MiB
MAX_TOTAL_IMAGE_BYTES: Final = 32 * MiB
MAX_IMAGES: Final = 16
DETAIL_VALUES: Final = frozenset({"auto", "low", "high"})

_DATA_URL = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<payload>.*)$", re.S)
_MIME_TYPES: Final = {
    "image/png": "png",
    "image/jpeg": "jpeg",
    "image/jpg": "jpeg",
    "image/webp": "webp",
    "image/gif": "gif",
}


@dataclass(frozen=True, slots=True)
class NativeImages:
    messages: list[JSONObject]
    images: list[bytes]
    details: list[str | None]

    @property
    def total_bytes(self) -> int:
        return sum(len(i) for i in self.images)


def extract_images(messages: list[JSONObject]) -> NativeImages:
    """Validate every content part and pull the images out of the final user message."""
    final_user = _final_user_index(messages)
    out: list[JSONObject] = []
    images: list[bytes] = []
    details: list[str | None] = []
    total = 0
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        texts: list[str] = []
        for part_index, part in enumerate(content):
            where = f"messages[{index}].content[{part_index}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise InvalidMedia(f"{where}: a text part needs a string 'text'")
                texts.append(text)
            elif kind == "image_url":
                if index != final_user:
                    raise InvalidMedia(
                        f"{where}: images are accepted only in the final user message, not in conversation "
                        "history; send the history as text and attach images to the current turn"
                    )
                if len(images) >= MAX_IMAGES:
                    raise InvalidMedia(f"native chat supports at most {MAX_IMAGES} images per request")
                data, detail = _decode_image_part(part, where)
                total += len(data)
                if total > MAX_TOTAL_IMAGE_BYTES:
                    raise InvalidMedia(
                        f"native chat images exceed the {MAX_TOTAL_IMAGE_BYTES // MiB} MiB total decoded limit"
                    )
                images.append(data)
                details.append(detail)
            else:
                shown = kind if kind is not None else type(part).__name__
                raise InvalidMedia(
                    f"{where}: unsupported content part type {shown!r}; "
                    "native chat accepts 'text' and 'image_url' parts"
                )
        out.append({**message, "content": "\n".join(texts)})
    return NativeImages(messages=out, images=images, details=details)


def _final_user_index(messages: Sequence[Mapping[str, JSONValue]]) -> int | None:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "user":
            return index
    return None


def _decode_image_part(part: Mapping[str, JSONValue], where: str) -> tuple[bytes, str | None]:
    spec = part.get("image_url")
    detail: JSONValue = None
    if isinstance(spec, str):
        url = spec
    elif isinstance(spec, dict) and isinstance(given := spec.get("url"), str):
        url = given
        detail = spec.get("detail")
    else:
        raise InvalidMedia(f"{where}: an image_url part needs image_url.url (a data URL)")
    if detail is not None and (not isinstance(detail, str) or detail not in DETAIL_VALUES):
        raise InvalidMedia(f"{where}: image_url.detail must be one of {sorted(DETAIL_VALUES)}, got {detail!r}")
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "a bare path"
        raise InvalidMedia(
            f"{where}: native vision accepts inline base64 image data URLs only; HTTP and file URLs are "
            f"unsupported (got {scheme})"
        )
    match = _DATA_URL.match(url)
    if match is None:
        raise InvalidMedia(f"{where}: malformed data URL")
    mime = match["mime"].strip().lower()
    kind = _MIME_TYPES.get(mime)
    if kind is None:
        raise InvalidMedia(f"{where}: unsupported image type {mime or '(none)'!r}; accepted: PNG, JPEG, WebP, GIF")
    if match["params"].lower() != ";base64":
        raise InvalidMedia(f"{where}: the data URL must be ';base64' encoded")
    payload = match["payload"]
    # Reject oversize payloads before decoding them.
    if len(payload) // 4 * 3 - 2 > MAX_IMAGE_BYTES:
        raise InvalidMedia(f"{where}: the image exceeds the {MAX_IMAGE_BYTES // MiB} MiB per-image limit")
    data = _strict_b64decode(payload, where)
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidMedia(f"{where}: the image exceeds the {MAX_IMAGE_BYTES // MiB} MiB per-image limit")
    actual = sniff_image_type(data)
    if actual != kind:
        raise InvalidMedia(
            f"{where}: the decoded bytes are {'not a known image format' if actual is None else actual.upper()}, "
            f"but the data URL declares {mime}"
        )
    return data, detail


def _strict_b64decode(payload: str, where: str) -> bytes:
    if not payload or len(payload) % 4:
        raise InvalidMedia(f"{where}: the base64 payload must be canonical, padded base64")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidMedia(f"{where}: the base64 payload is invalid: {exc}") from exc
    if base64.b64encode(data).decode("ascii") != payload:
        raise InvalidMedia(f"{where}: the base64 payload must be canonical, padded base64")
    return data
