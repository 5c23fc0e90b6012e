"""``unload_model()`` right after a stream is closed waits for the engine to let the
cancelled request go (bounded) instead of refusing with ``OwnerBusy``; a stream still open
is refused at once."""

from __future__ import annotations

import time

import pytest

from abstractruntime_mlx import create_llm
from abstractruntime_mlx.errors import OwnerBusy
from abstractruntime_mlx.provider.residency import UNLOAD_SETTLE_S


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
