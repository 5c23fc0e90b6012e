"""``unload_model()`` right after a stream is closed waits for the engine to let the
cancelled request go (bounded) instead of refusing with ``OwnerBusy``; a stream still open
is refused at once. A worker that does not stop in time keeps the model owned for a retry;
a prompt-cache flush that fails as the worker stops is raised, with the model unloaded."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from abstractruntime_mlx import create_llm
from abstractruntime_mlx.engine.cache.prefix_cache import PrefixCache
from abstractruntime_mlx.errors import OwnerBusy, PromptCacheFlushFailed
from abstractruntime_mlx.provider import residency
from abstractruntime_mlx.provider.residency import UNLOAD_SETTLE_S

MESSAGES = [{"role": "system", "content": "You answer briefly. " * 20}, {"role": "user", "content": "What is a cache?"}]


@pytest.mark.parametrize("batching", [True, False])
def test_unload_straight_after_closing_a_stream(dense_model: str, batching: bool) -> None:
    for _ in range(3):
        llm = create_llm("mlx", model=dense_model, mlx_batching=batching)
        stream = llm.generate("hello", stream=True, max_output_tokens=500)
        for index, _chunk in enumerate(stream):
            if index == 1:
                break
        stream.close()
        assert llm.unload_model(llm.model) is True


def test_an_open_stream_is_still_refused_without_waiting(dense_model: str) -> None:
    llm = create_llm("mlx", model=dense_model)
    stream = llm.generate("hello", stream=True, max_output_tokens=500)
    next(iter(stream))
    started = time.monotonic()
    with pytest.raises(OwnerBusy):
        llm.unload_model(llm.model)
    assert time.monotonic() - started < UNLOAD_SETTLE_S
    stream.close()
    assert llm.unload_model(llm.model) is True


def test_snapshot_writes_that_never_reached_the_disk_are_reported_at_unload(make_llm, dense_model, tmp_path):
    disk = tmp_path / "cache"
    llm = make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=str(disk))
    namespace = Path(llm.get_prompt_cache_stats()["disk"]["path"])
    # The namespace directory gives way to a file: every snapshot write fails (root included).
    namespace.rename(tmp_path / "moved")
    namespace.write_text("not a directory")
    llm.generate("", messages=MESSAGES, prompt_cache_key="k", max_output_tokens=4, thinking=False)
    with pytest.raises(PromptCacheFlushFailed) as info:
        llm.unload_model(llm.model)
    assert info.value.code == "prompt_cache_flush_failed" and info.value.http_status == 500
    assert info.value.details["write_failures"] >= 1 and info.value.details["path"] == str(namespace)
    # reported, yet unloaded: nothing left to unload, and the namespace lock is free again
    assert llm.health() == {"state": "unloaded"} and llm.unload_model(llm.model) is False
    namespace.unlink()
    again = make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=str(disk))
    assert again.generate("hi", max_output_tokens=2).content is not None
    assert again.unload_model(again.model) is True


def test_a_flush_that_raises_is_reported_and_the_model_still_unloads(make_llm, dense_model, tmp_path, monkeypatch):
    def broken_flush(self: PrefixCache) -> None:  # a fault no real disk here produces on demand
        raise OSError("I/O error while flushing")

    disk = tmp_path / "cache"
    llm = make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=str(disk))
    llm.generate("", messages=MESSAGES, prompt_cache_key="k", max_output_tokens=4, thinking=False)
    monkeypatch.setattr(PrefixCache, "flush", broken_flush)
    with pytest.raises(PromptCacheFlushFailed) as info:
        llm.unload_model(llm.model)
    assert "I/O error while flushing" in str(info.value) and isinstance(info.value.__cause__, OSError)
    assert llm.health() == {"state": "unloaded"}
    monkeypatch.undo()
    again = make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=str(disk))  # the SSD lock was released
    assert again.unload_model(again.model) is True


def test_a_worker_that_does_not_stop_in_time_stays_owned_for_a_retry(make_llm, dense_model, monkeypatch):
    release_flush = threading.Event()
    flushing = threading.Event()
    close = PrefixCache.close

    def slow_close(self: PrefixCache) -> None:  # a flush held until the test lets it finish
        flushing.set()
        release_flush.wait()
        close(self)

    monkeypatch.setattr(PrefixCache, "close", slow_close)
    monkeypatch.setattr(residency, "UNLOAD_STOP_S", 0.05)
    llm = make_llm(dense_model, mlx_batching=True)
    llm.generate("hello", max_output_tokens=2)
    try:
        with pytest.raises(OwnerBusy) as info:
            llm.unload_model(llm.model)
        assert info.value.details == {"reason": "worker_stop_timeout", "timeout_s": 0.05}
        assert flushing.wait(60)  # the worker is inside the held flush
        # still owned by this provider: closed to new work, not released
        assert llm.health() == {"state": "closed"}
    finally:
        release_flush.set()
    monkeypatch.setattr(residency, "UNLOAD_STOP_S", 60.0)
    assert llm.unload_model(llm.model) is True
    assert llm.health() == {"state": "unloaded"}
