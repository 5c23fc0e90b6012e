"""``keep_alive`` reads ASCII digits only, as every edge does: ``"٣"`` is not 3 seconds, in
Python, in a body sent to a real server, and for ``serve --keep-alive``."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.errors import InvalidRequest
from abstractruntime_mlx.server import ModelSpec, create_app
from abstractruntime_mlx.server.keep_alive import parse_keep_alive
from test_server_harness import serve_in_thread

NOT_ASCII = ["\u0663", "\u0663s", "-\u0663", "1\u0660s", "\uff13m", "\u0969h", "3.\u0665s", "\u0663ms"]


@pytest.mark.parametrize("value", NOT_ASCII)
def test_digits_other_than_ascii_are_refused(value: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_keep_alive(value)
    assert info.value.code == "invalid_request" and info.value.details == {"field": "keep_alive"}


def test_ascii_forms_still_read() -> None:
    assert parse_keep_alive("3") == 3.0 and parse_keep_alive("3s") == 3.0 and parse_keep_alive(" 1h30m ") == 5400.0
    assert parse_keep_alive("2.5m") == 150.0 and parse_keep_alive("-3") is None


def test_a_real_server_answers_400_and_loads_nothing(dense_model: str) -> None:
    with serve_in_thread(create_app(models=[ModelSpec("alpha", dense_model)])) as url:
        for value in ("\u0663", "\u0663s"):
            chat = httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "keep_alive": value},
                timeout=60,
            )
            assert chat.status_code == 400 and chat.json()["error"]["details"]["field"] == "keep_alive"
            load = httpx.post(f"{url}/acore/models/load", json={"model": "alpha", "keep_alive": value}, timeout=60)
            assert load.status_code == 400 and load.json()["error"]["details"]["field"] == "keep_alive"
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [m["state"] for m in models if m["id"] == "alpha"] == ["unloaded"]


def test_serve_refuses_a_keep_alive_flag_in_other_digits(capsys: Any, tmp_path: Any) -> None:
    # the missing --model-root stops serve before it listens, should the flag ever be taken
    assert main(["serve", "--keep-alive", "\u0663", "--port", "1", "--model-root", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: [invalid_request] --keep-alive must be seconds")
