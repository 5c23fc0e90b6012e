"""Our RemoteClient against AbstractCore 2.30's own single-model server
(``abstractcore.endpoint.app.create_app(provider_instance=llm)``) serving the tiny model with
AbstractCore's MLX provider (``create_llm("mlx", model=path, mlx_batching=True)``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from abstractruntime_mlx.errors import InvalidMedia, SpeculationUnavailable
from abstractruntime_mlx.remote_client import AsyncRemoteClient, RemoteClient
from abstractruntime_mlx.testing import tiny_model
from test_server_harness import serve_in_thread

pytest.importorskip("abstractcore.endpoint.app")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def core_url(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from abstractcore import create_llm as core_create_llm
    from abstractcore.endpoint.app import create_app as core_create_app

    path = tiny_model(tmp_path_factory.mktemp("core-models") / "dense", kind="dense")
    llm = core_create_llm("mlx", model=str(path), mlx_batching=True)
    assert llm.supports_concurrent_generation() is True
    with serve_in_thread(core_create_app(provider_instance=llm)) as url:
        yield url
    llm.unload_model(llm.model)


def test_generate_against_abstractcore(core_url: str) -> None:
    with RemoteClient(core_url) as client:  # model=None: asks GET /v1/models
        result = client.generate("Say hi", temperature=0, max_output_tokens=5, speculation=False, thinking=False)
        again = client.generate("Say hi", temperature=0, max_output_tokens=5, speculation=False, thinking=False)
    assert result.content == again.content and result.content
    assert result.finish_reason == "length"
    assert result.usage["completion_tokens"] == 5 and result.usage["cached_input_tokens"] == 0
    assert result.metadata["execution"]["mode"] == "continuous"
    assert "performance" in result.metadata
    assert result.metadata["remote"]["retries"] == 0


def test_stream_against_abstractcore(core_url: str) -> None:
    with RemoteClient(core_url) as client:
        chunks = list(client.generate("Say hi", temperature=0, max_output_tokens=5, stream=True))
        whole = client.generate("Say hi", temperature=0, max_output_tokens=5)
    finals = [c for c in chunks if c.finish_reason is not None]
    assert len(finals) == 1 and finals[0] is chunks[-1]
    assert "".join(c.content for c in chunks).strip() == whole.content.strip()  # AbstractCore strips non-stream text
    assert chunks[-1].usage["completion_tokens"] == 5
    assert chunks[-1].metadata["execution"]["peak_batch_size"] >= 1


def test_concurrent_async_streams_against_abstractcore(core_url: str) -> None:
    async def one(client: AsyncRemoteClient, i: int) -> dict[str, Any]:
        stream = await client.generate(f"Question {i}", temperature=0, max_output_tokens=24, stream=True)
        final = None
        async for chunk in stream:
            final = chunk
        assert final is not None and final.metadata is not None
        return dict(final.metadata["execution"])

    async def main() -> list[dict[str, Any]]:
        async with AsyncRemoteClient(core_url) as client:
            return list(await asyncio.gather(*[one(client, i) for i in range(3)]))

    executions = asyncio.run(main())
    assert all(e["mode"] == "continuous" for e in executions)
    assert max(e["peak_batch_size"] for e in executions) > 1


def test_abstractcore_errors_become_typed_errors(core_url: str) -> None:
    with RemoteClient(core_url) as client:
        remote_image = [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}
        ]
        with pytest.raises(InvalidMedia):
            client.generate("", messages=remote_image, max_output_tokens=2)
        with pytest.raises(SpeculationUnavailable):
            client.generate("hi", max_output_tokens=2, speculation={"mode": "native_mtp", "require_acceleration": True})
        stats = client.get_prompt_cache_stats()
    assert stats["execution"]["submitted"] >= 1
