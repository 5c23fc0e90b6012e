"""Image types the wire accepts, told apart by their magic bytes (no decoding, no MLX).

Shared by the server, which checks inline images, and the remote client, which encodes them.
"""

from __future__ import annotations

from typing import Final

MIME_BY_TYPE: Final = {"png": "image/png", "jpeg": "image/jpeg", "gif": "image/gif", "webp": "image/webp"}


def sniff_image_type(data: bytes) -> str | None:
    """``png``/``jpeg``/``gif``/``webp`` from the magic bytes, else ``None``."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None
