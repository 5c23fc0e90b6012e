"""Native image rules of /v1/chat/completions, one test per rule (scripted fake provider)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from starlette.testclient import TestClient

from abstractruntime_mlx.server import create_app
from abstractruntime_mlx.server.media import MAX_IMAGE_BYTES, MiB
from test_server_harness import FakeProvider, data_url, image_part, jpeg_bytes, png_bytes

PNG = png_bytes()
# A PNG whose base64 form carries "=" padding (its length is not a multiple of 3).
PADDED = PNG + b"\x00" * (1 if (len(PNG) + 1) % 3 else 2)


@pytest.fixture()
def fake() -> FakeProvider:
    return FakeProvider()


@pytest.fixture()
def client(fake: FakeProvider) -> Any:
    with TestClient(create_app(fake)) as c:
        yield c


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": "What is in the image?"}, *parts]}


def post(client: Any, messages: list[dict[str, Any]]) -> Any:
    return client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})


def rejected(response: Any, fragment: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "native_media_invalid"
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"], error["message"]


def test_valid_images_reach_the_provider_as_bytes(client: Any, fake: FakeProvider) -> None:
    jpeg = jpeg_bytes()
    gif = b"GIF89a" + b"\x00" * 16
    webp = b"RIFF\x10\x00\x00\x00WEBPVP8 " + b"\x00" * 8
    parts = [
        image_part(data_url(PNG), detail="low"),
        image_part(data_url(jpeg, "image/jpeg")),
        image_part(data_url(gif, "image/gif")),
        image_part(data_url(webp, "image/webp")),
    ]
    reply = post(client, [{"role": "system", "content": "Look."}, user(*parts)])
    assert reply.status_code == 200, reply.text
    call = fake.calls[0]
    assert call["media"] == [PNG, jpeg, gif, webp]
    assert call["messages"][-1] == {"role": "user", "content": "What is in the image?"}


def test_text_parts_are_joined_with_newlines(client: Any, fake: FakeProvider) -> None:
    message = {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}
    assert post(client, [message]).status_code == 200
    assert fake.calls[0]["messages"] == [{"role": "user", "content": "one\ntwo"}]
    assert "media" not in fake.calls[0]


@pytest.mark.parametrize(
    "url",
    ["https://example.com/cat.png", "http://127.0.0.1/cat.png", "file:///tmp/cat.png", "/tmp/cat.png"],
)
def test_remote_and_file_urls_are_rejected(client: Any, url: str) -> None:
    rejected(post(client, [user(image_part(url))]), "inline base64 image data URLs only")


def test_unsupported_part_types_are_rejected(client: Any) -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    rejected(post(client, [user(audio)]), "unsupported content part type 'input_audio'")


def test_images_in_history_are_rejected(client: Any) -> None:
    messages = [
        user(image_part(data_url(PNG))),
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": "And now?"},
    ]
    rejected(post(client, messages), "only in the final user message")


def test_images_outside_user_messages_are_rejected(client: Any) -> None:
    messages = [{"role": "assistant", "content": [image_part(data_url(PNG))]}, {"role": "user", "content": "hi"}]
    rejected(post(client, messages), "only in the final user message")


def test_more_than_16_images_are_rejected(client: Any) -> None:
    rejected(post(client, [user(*[image_part(data_url(PNG))] * 17)]), "at most 16 images")


def test_16_images_are_accepted(client: Any, fake: FakeProvider) -> None:
    assert post(client, [user(*[image_part(data_url(PNG))] * 16)]).status_code == 200
    assert len(fake.calls[0]["media"]) == 16


def test_an_image_over_10_mib_is_rejected(client: Any) -> None:
    big = PNG + b"\x00" * (MAX_IMAGE_BYTES + 1 - len(PNG))
    rejected(post(client, [user(image_part(data_url(big)))]), "10 MiB per-image limit")


def test_images_over_32_mib_together_are_rejected(client: Any) -> None:
    nine = PNG + b"\x00" * (9 * MiB - len(PNG))
    rejected(post(client, [user(*[image_part(data_url(nine))] * 4)]), "32 MiB total")


@pytest.mark.parametrize(
    "payload",
    [
        base64.b64encode(PADDED).decode().rstrip("="),  # unpadded
        base64.b64encode(PNG).decode()[:-4] + "!!!=",  # not the alphabet
        base64.b64encode(PNG).decode()[:40] + "\n" + base64.b64encode(PNG).decode()[40:],  # whitespace
        base64.urlsafe_b64encode(b"\xff" * 30).decode(),  # URL-safe alphabet
    ],
)
def test_non_strict_base64_is_rejected(client: Any, payload: str) -> None:
    rejected(post(client, [user(image_part(f"data:image/png;base64,{payload}"))]), "base64")


def test_magic_bytes_must_match_the_declared_type(client: Any) -> None:
    rejected(post(client, [user(image_part(data_url(jpeg_bytes(), "image/png")))]), "declares image/png")
    rejected(post(client, [user(image_part(data_url(b"hello world!", "image/png")))]), "not a known image format")


def test_unsupported_image_types_are_rejected(client: Any) -> None:
    rejected(post(client, [user(image_part(data_url(b"BM" + b"\x00" * 10, "image/bmp")))]), "unsupported image type")
    rejected(post(client, [user(image_part("data:image/png," + "abcd"))]), "';base64'")


def test_detail_must_be_auto_low_or_high(client: Any) -> None:
    rejected(post(client, [user(image_part(data_url(PNG), detail="ultra"))]), "detail")
