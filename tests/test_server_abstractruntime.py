"""AbstractRuntime 0.13's own ``RemoteAbstractCoreLLMClient`` calling this package's server:
speculation and thinking reach the provider, execution metadata comes back, and the
``/acore/prompt_cache/key_meta`` attribution relay is stored."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from abstractruntime_mlx import create_llm
from abstractruntime_mlx.request import GenerationRequest
from abstractruntime_mlx.server import create_app
from abstractruntime_mlx.testing import tiny_model
from test_server_harness import request_fields, serve_in_thread


class Recording:
    """The real provider, recording the keyword arguments of each ``agenerate`` call.

    ``stop_at_space`` adds ``stop=[" "]`` to calls that set no stop and no cap: AbstractRuntime's
    remote client forwards no ``max_output_tokens``, and a flow fails an LLM call that ends by
    length, which a random model's answer to a prompt carrying the current time may do.
    """

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.calls: list[dict[str, Any]] = []
        self.stop_at_space = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def agenerate_request(self, request: GenerationRequest, *, stream: bool = False) -> Any:
        self.calls.append(request_fields(request))
        if self.stop_at_space and not request.stop and request.max_output_tokens is None:
            request = dataclasses.replace(request, stop=(" ",))
        return await self._llm.agenerate_request(request, stream=stream)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tiny_model(tmp_path_factory.mktemp("ar-models") / "dense", kind="dense")
    llm = create_llm("mlx", model=str(path), mlx_batching=True)
    recording = Recording(llm)
    app = create_app(recording)
    with serve_in_thread(app) as url:
        yield recording, app, url
    llm.unload_model(llm.model)


def test_remote_client_forwards_controls_and_keeps_metadata(served: Any) -> None:
    from abstractruntime.integrations.abstractcore.llm_client import RemoteAbstractCoreLLMClient

    recording, _, url = served
    client = RemoteAbstractCoreLLMClient(server_base_url=f"{url}/v1", model=f"mlx/{recording.model}")
    off = client.generate(
        prompt="Say hi",
        system_prompt="You are a test.",
        params={"speculation": False, "thinking": False, "temperature": 0, "max_tokens": 6, "seed": 1},
    )
    call = recording.calls[-1]
    assert call["speculation"] is False and call["thinking"] is False
    assert call["max_output_tokens"] == 6 and call["seed"] == 1 and call["temperature"] == 0
    assert off["usage"]["completion_tokens"] <= 6
    assert off["metadata"]["execution"]["mode"] == "continuous"
    assert off["metadata"]["speculation"]["reason"] == "disabled_for_this_call"

    mtp = client.generate(
        prompt="Say hi",
        params={"speculation": {"mode": "native_mtp", "num_draft_tokens": 2}, "thinking": "high", "max_tokens": 4},
    )
    call = recording.calls[-1]
    assert call["speculation"] == {"mode": "native_mtp", "num_draft_tokens": 2} and call["thinking"] == "high"
    # the dense tiny model has no MTP head: optional MTP reports a named, unaccelerated outcome
    spec = mtp["metadata"]["speculation"]
    assert spec["requested"] is True and spec["num_draft_tokens"] == 2
    assert spec["used"] is False and spec["reason"] == "no_mtp_drafter_for_model"


def test_llm_call_of_a_flow_runs_remotely_with_key_meta(served: Any) -> None:
    from abstractruntime.integrations.abstractcore.factory import create_remote_runtime
    from abstractruntime.visualflow_compiler import compile_visualflow

    recording, app, url = served
    flow = {
        "id": "remote_flow",
        "entryNode": "start",
        "nodes": [
            {"id": "start", "type": "on_flow_start", "data": {}},
            {
                "id": "llm",
                "type": "llm_call",
                "data": {
                    "effectConfig": {
                        "provider": "mlx",
                        "model": recording.model,
                        "speculation": False,
                        "thinking": False,
                        "temperature": 0,
                    },
                    "pinDefaults": {"prompt": "Say hi"},
                },
            },
            {"id": "end", "type": "on_flow_end", "data": {}},
        ],
        "edges": [
            {"source": "start", "target": "llm", "sourceHandle": "exec-out", "targetHandle": "exec-in"},
            {"source": "llm", "target": "end", "sourceHandle": "exec-out", "targetHandle": "exec-in"},
        ],
    }
    recording.stop_at_space = True
    runtime = create_remote_runtime(server_base_url=url, model=f"mlx/{recording.model}")
    spec = compile_visualflow(flow)
    run_id = runtime.start(workflow=spec, vars={}, session_id="sess-1")
    state = runtime.tick(workflow=spec, run_id=run_id, max_steps=100)
    assert state.status.name == "COMPLETED", state.error
    effect = state.vars["_temp"]["effects"]["llm"]
    call = recording.calls[-1]
    assert call["speculation"] is False and call["thinking"] is False
    assert effect["metadata"]["execution"]["mode"] == "continuous"
    assert effect["metadata"]["speculation"]["used"] is False
    assert effect["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    key = call["prompt_cache_key"]
    assert effect["metadata"]["prompt_cache"]["key"] == key
    # the client's attribution relay after the call
    meta = app.state.key_meta[key]
    assert meta["session_id"] == "sess-1" and meta["run_id"] == run_id and meta["node_id"] == "llm"
