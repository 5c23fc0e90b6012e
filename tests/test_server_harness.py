"""Helpers shared by the HTTP tests (no tests here): a uvicorn server on a free loopback port
in a background thread, the real ``serve`` command in a subprocess, a scripted fake provider,
and small image builders."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from abstractruntime_mlx.errors import MLXRuntimeError
from abstractruntime_mlx.request import GenerationRequest
from abstractruntime_mlx.results import GenerationChunk, GenerationResult


@contextmanager
def serve_in_thread(app: Any, **options: Any) -> Iterator[str]:
    """Run ``app`` with uvicorn on 127.0.0.1 (a free port); yield its base URL. ``options``: more
    ``uvicorn.Config`` arguments."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="on", **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_serve(
    args: list[str], tmp_path: Path, *, stdout: int = subprocess.DEVNULL
) -> tuple[subprocess.Popen[str], str]:
    """``abstractruntime-mlx serve ARGS`` in a subprocess on a free loopback port (stderr piped),
    returned with its URL once ``/health`` answers; the caller stops it."""
    port = free_port()
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "abstractruntime_mlx.cli.main", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=stdout, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() >= deadline:
            proc.kill()
            _, err = proc.communicate(timeout=60)
            raise AssertionError(f"serve never answered /health: {err}")
        time.sleep(0.2)


def engine_stats(llm: Any) -> dict[str, Any]:
    """The engine counters (submitted/completed/cancelled/active/queued) of a real provider."""
    return dict(llm.get_prompt_cache_stats().get("execution") or {})


def wait_until(predicate: Any, timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


# --------------------------------------------------------------------------- images


def png_bytes(color: tuple[int, int, int] = (255, 0, 0), size: tuple[int, int] = (8, 8)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg_bytes() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 0, 255)).save(buffer, format="JPEG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


# --------------------------------------------------------------------------- fake provider


def request_fields(request: GenerationRequest) -> dict[str, Any]:
    """A typed request as the flat keyword form callers wrote (only what is set)."""
    out: dict[str, Any] = {"messages": [dict(m) for m in request.messages], **request.sampling.to_dict()}
    out.update(request.call.to_dict())
    if request.media:
        out["media"] = list(request.media)
    if request.tools:
        out["tools"] = [dict(t) for t in request.tools]
    if request.max_output_tokens is not None:
        out["max_output_tokens"] = request.max_output_tokens
    if request.stop:
        out["stop"] = list(request.stop)
    if request.prompt_cache_key is not None:
        out["prompt_cache_key"] = request.prompt_cache_key
    if request.cancel is not None:
        out["cancel_event"] = request.cancel
    if request.progress is not None:
        out["on_progress"] = request.progress
    return out


class FakeProvider:
    """A scripted provider: records every call's keyword arguments.

    ``texts`` are streamed as chunks; ``fail_after`` raises ``error`` after that many chunks
    (0 = before the first); ``delay_s`` sleeps between chunks; progress events are sent when
    ``on_progress`` is given.
    """

    def __init__(
        self,
        *,
        model: str = "fake-model",
        texts: tuple[str, ...] = ("Hello", " world"),
        error: MLXRuntimeError | None = None,
        fail_after: int | None = None,
        delay_s: float = 0.0,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.execution_options = {"mlx_batching": True, "mlx_max_batch_size": 4}
        self.texts = texts
        self.error = error
        self.fail_after = fail_after
        self.delay_s = delay_s
        self.metadata = metadata or {
            "execution": {"mode": "continuous", "peak_batch_size": 1, "queue_s": 0.001, "ttft_s": 0.002},
            "speculation": {"requested": False, "mode": "off", "used": False, "reason": "disabled_for_this_call"},
        }
        self.calls: list[dict[str, Any]] = []
        self.cancel_events: list[threading.Event] = []
        self.unloaded = False

    def supports_concurrent_generation(self) -> bool:
        return True

    def supports_text_progress_events(self) -> bool:
        return True

    def speculation_default(self) -> Any:
        return None

    def unload_model(self, name: str | None = None) -> bool:
        self.unloaded = True
        return True

    def get_prompt_cache_stats(self) -> dict[str, Any]:
        return {"enabled": True, "backend": "fake", "execution": {"submitted": len(self.calls)}}

    def prompt_cache_clear(self, key: str | None = None) -> dict[str, Any]:
        return {"cleared": True, "scope": "all_keys", "ram_entries_removed": 0, "disk_files_removed": 0, "key": key}

    def _usage(self) -> dict[str, Any]:
        n = len(self.texts)
        return {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n, "cached_input_tokens": 2}

    async def agenerate_request(self, request: GenerationRequest, *, stream: bool = False) -> Any:
        self.calls.append({"stream": stream, **request_fields(request)})
        if request.cancel is not None:
            self.cancel_events.append(request.cancel)
        chunks = self._chunks(request.progress)
        if stream:
            return chunks
        text = ""
        final: GenerationChunk | None = None
        async for chunk in chunks:
            text += chunk.content
            final = chunk
        assert final is not None
        return GenerationResult(
            content=text,
            finish_reason=final.finish_reason,
            usage=final.usage or {},
            metadata=final.metadata or {},
            model=self.model,
        )

    async def _chunks(self, on_progress: Any) -> Any:
        if on_progress is not None:
            on_progress({"kind": "llm", "phase": "prefill", "prompt_tokens": 5})
        for index, text in enumerate(self.texts):
            if self.fail_after is not None and index == self.fail_after:
                assert self.error is not None
                raise self.error
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if index == 0 and on_progress is not None:
                on_progress({"kind": "llm", "phase": "generate", "first_token": True, "generated_tokens": 1})
            yield GenerationChunk(content=text, model=self.model)
        if self.fail_after is not None and self.fail_after >= len(self.texts):
            assert self.error is not None
            raise self.error
        if on_progress is not None:
            on_progress({"kind": "llm", "phase": "complete", "final": True, "finish_reason": "stop"})
        yield GenerationChunk(
            content="", finish_reason="stop", usage=self._usage(), metadata=dict(self.metadata), model=self.model
        )
