"""A model served by MLX's distributed engine, reached as just another URL.

``mlx.launch -n 2 --backend ring`` runs ``mlx_lm.server`` on the tiny dense model (``qwen3``,
which mlx-lm shards tensor-parallel: two ranks on 127.0.0.1, CPU, joined over TCP); rank 0
answers HTTP. The model folder is named as ``tests/flows/routed.json``'s node names its model
(``qwen/qwen3-next-80b``, a folder in the ranks' working directory), so the flow runs unchanged
with ``run --route lmstudio=URL``, as it would against a model too big for one machine.

Verdicts: token counts, finish reasons, where the text lands (content or reasoning), error
codes, and the prompt the server rendered (its ``prompt_tokens``, against the tiny chat
template rendered here with thinking on and off); never prose or durations.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.errors import ModelNotFound
from abstractruntime_mlx.remote_client import RemoteClient
from abstractruntime_mlx.testing.pool import MLXLMServerProcess, free_port

FLOW = Path(__file__).parent / "flows" / "routed.json"
ASK = next(n for n in json.loads(FLOW.read_text(encoding="utf-8"))["nodes"] if n["id"] == "ask")["data"]
SERVED_AS: str = ASK["effectConfig"]["model"]  # "qwen/qwen3-next-80b"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not mx.distributed.is_available("ring"),
        reason="this MLX build has no ring backend (mx.distributed.is_available('ring') is False)",
    ),
]


@pytest.fixture(scope="module")
def ring(dense_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MLXLMServerProcess]:
    workdir = tmp_path_factory.mktemp("ring")
    folder = workdir / SERVED_AS
    folder.parent.mkdir(parents=True)
    folder.symlink_to(dense_model, target_is_directory=True)
    server = MLXLMServerProcess.start(SERVED_AS, port=free_port(), ranks=2, cwd=workdir, log_path=workdir / "ring.log")
    try:
        yield server
    finally:
        server.stop()
    assert not server.running(), "a rank outlived stop()"


@pytest.fixture(scope="module")
def rendered(dense_model: str) -> Any:
    """``rendered(prompt, thinking)``: how many tokens the tiny chat template makes of one user
    turn, rendered as mlx_lm.server renders it (its tokenizer loader, the generation prompt,
    ``enable_thinking`` from the request's ``chat_template_kwargs``)."""
    tokenizer = load_tokenizer(Path(dense_model))

    def count(prompt: str, thinking: bool) -> int:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False, enable_thinking=thinking
        )
        return len(tokenizer.encode(text, add_special_tokens=False))

    assert count("Hi", True) != count("Hi", False)  # the template tells them apart, so the counts below do
    return count


def remote_of(metadata: Mapping[str, object] | None) -> Mapping[str, object]:
    """The ``remote`` block the client adds to a result's metadata."""
    remote = (metadata or {}).get("remote")
    assert isinstance(remote, Mapping), metadata
    return remote


def client(ring: MLXLMServerProcess, **options: Any) -> RemoteClient:
    return RemoteClient(
        ring.url, model=SERVED_AS, **options
    )  # a model named: mlx_lm's GET /v1/models needs a Hub cache


def test_a_plain_call_answers_through_the_remote_client(ring: MLXLMServerProcess, rendered: Any) -> None:
    with client(ring) as c:
        result = c.generate("Hi", messages=[], max_output_tokens=6, temperature=0, thinking=False)
    assert result.finish_reason == "length"
    assert result.usage["completion_tokens"] == 6
    assert result.usage["prompt_tokens"] == rendered("Hi", False)
    assert result.model == SERVED_AS
    assert remote_of(result.metadata)["base_url"] == ring.url and remote_of(result.metadata)["streamed"] is False


def test_a_stream_delivers_its_tokens_then_usage(ring: MLXLMServerProcess, rendered: Any) -> None:
    with client(ring) as c:
        chunks = list(c.stream("Tell me more", messages=[], max_output_tokens=8, temperature=0, thinking=False))
    *body, last = chunks
    assert body and all(chunk.finish_reason is None for chunk in body)
    assert sum(1 for chunk in chunks if chunk.content) <= 8  # at most one delta per token
    assert last.finish_reason == "length"
    assert last.usage is not None and last.usage["completion_tokens"] == 8
    assert last.usage["prompt_tokens"] == rendered("Tell me more", False)
    assert remote_of(last.metadata)["streamed"] is True and "ttft_s" in remote_of(last.metadata)


def test_concurrent_calls_each_get_their_own_answer(ring: MLXLMServerProcess, rendered: Any) -> None:
    prompts = [f"Question {'number ' * i}{i}" for i in range(4)]  # each prompt its own length

    def call(i: int) -> tuple[int, int]:
        with client(ring) as c:
            result = c.generate(prompts[i], messages=[], max_output_tokens=5 + i, temperature=0, thinking=False)
        assert result.finish_reason == "length"
        return result.usage["prompt_tokens"], result.usage["completion_tokens"]

    with ThreadPoolExecutor(max_workers=4) as pool:
        counts = list(pool.map(call, range(4)))
    assert counts == [(rendered(prompts[i], False), 5 + i) for i in range(4)]  # no answer crossed to another caller


@pytest.mark.parametrize(("thinking", "template_on"), [(True, True), (False, False), ("high", True), (None, True)])
def test_thinking_reaches_the_chat_template(
    ring: MLXLMServerProcess, rendered: Any, thinking: bool | str | None, template_on: bool
) -> None:
    """The client sends ``chat_template_kwargs.enable_thinking`` (and a level as ``reasoning_effort``,
    which the tiny template ignores); unsaid, the template's default (on) applies. With thinking on
    the generation prompt leaves ``<think>`` open and mlx_lm.server returns the text as ``reasoning``."""
    with client(ring) as c:
        result = c.generate("Hi", messages=[], max_output_tokens=6, temperature=0, thinking=thinking)
    assert result.usage["prompt_tokens"] == rendered("Hi", template_on)
    if template_on:
        assert result.reasoning and result.content == ""
    else:
        assert result.reasoning is None and result.content


def run_routed(capsys: pytest.CaptureFixture[str], ring: MLXLMServerProcess, *extra: str) -> dict[str, Any]:
    code = main(["run", str(FLOW), "--route", f"lmstudio={ring.url}", "--json", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    (run,) = json.loads(out)
    assert run["status"] == "completed", run
    (node,) = run["nodes"]
    result: dict[str, Any] = node["result"]
    return result


def test_a_flow_node_routed_to_it_runs_as_on_serve(
    ring: MLXLMServerProcess, rendered: Any, cli_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt, max_tokens = ASK["pinDefaults"]["prompt"], ASK["effectConfig"]["max_output_tokens"]
    result = run_routed(capsys, ring)
    route = result["metadata"]["route"]
    assert route["served"] == {"provider": "lmstudio", "model": SERVED_AS, "base_url": ring.url}
    assert route["rule"] == f"--route lmstudio={ring.url}"
    assert result["metadata"]["client"]["kind"] == "remote"
    assert result["finish_reason"] == "length" and result["usage"]["completion_tokens"] == max_tokens
    assert result["usage"]["prompt_tokens"] == rendered(prompt, True)  # thinking unsaid: the template's default

    off = run_routed(capsys, ring, "--var", "_runtime.thinking=false")  # a run-level control reaches the template
    assert off["metadata"]["controls"]["thinking"] is False
    assert off["usage"]["prompt_tokens"] == rendered(prompt, False)


def test_a_model_the_ranks_do_not_hold_is_model_not_found(ring: MLXLMServerProcess, rendered: Any) -> None:
    """mlx_lm.server tries to load any model a request names (offline here: no Hub download) and
    answers 404; the ranks drop their shards for it and reload theirs on the next call."""
    with RemoteClient(ring.url, model="other/model", max_retries=0) as c, pytest.raises(ModelNotFound) as caught:
        c.generate("Hi", messages=[], max_output_tokens=4)
    assert caught.value.code == "model_not_found"
    with client(ring) as c:
        result = c.generate("Hi", messages=[], max_output_tokens=4, temperature=0, thinking=False)
    assert result.usage == {**result.usage, "prompt_tokens": rendered("Hi", False), "completion_tokens": 4}
