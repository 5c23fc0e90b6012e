"""Prompt-cache keys of flow nodes, derived exactly as the host derives them; sessions that
continue across ``run`` invocations; the agent's turns reuse their transcript, with the same
greedy answers as without reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from abstractruntime.integrations.abstractcore.effect_handlers import _derive_prompt_cache_key

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.errors import InvalidRequest
from abstractruntime_mlx.nodes import default_registry
from abstractruntime_mlx.runtime_plugin import run_flow
from abstractruntime_mlx.runtime_plugin.adapter.payload import request_from_payload
from abstractruntime_mlx.runtime_plugin.prefetch.prompt_cache import CallIdentity
from abstractruntime_mlx.testing import tiny_model

FLOWS = Path(__file__).resolve().parent / "flows"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "multiturn.json"
CALL = CallIdentity(run_id="run-1", workflow_id="assistant@0.0.3:c53b1579", node_id="reason", session_id="sess-1")


def key_of(payload, run_vars=None, call=CALL, node_config=None):
    return request_from_payload(payload, run_vars or {}, node_config=node_config, call=call).prompt_cache_key


def host_key(
    *,
    session_id="sess-1",
    provider="mlx",
    model="m1",
    workflow_id="assistant@0.0.3:c53b1579",
    node_id="reason",
    namespace="session",
):
    return _derive_prompt_cache_key(
        namespace=namespace,
        session_id=session_id,
        provider=provider,
        model=model,
        workflow_id=workflow_id,
        node_id=node_id,
    )


PAYLOAD = {"prompt": "hi", "provider": "mlx", "model": "m1", "params": {}}


def test_derived_key_is_the_hosts(monkeypatch):
    monkeypatch.delenv("ABSTRACTRUNTIME_PROMPT_CACHE", raising=False)
    key = key_of(PAYLOAD)
    assert key == host_key() and key.startswith("session:")
    # the bundle version is not part of it: a republished workflow keeps its sessions warm
    assert key_of(PAYLOAD, call=CallIdentity("run-2", "assistant@0.0.4:c53b1579", "reason", "sess-1")) == key
    # every input that is part of it changes it
    others = {
        key_of(PAYLOAD, call=CallIdentity("run-1", CALL.workflow_id, "reason", "sess-2")),
        key_of(PAYLOAD, call=CallIdentity("run-1", CALL.workflow_id, "answer", "sess-1")),
        key_of({**PAYLOAD, "model": "m2"}),
        key_of(PAYLOAD, call=CallIdentity("run-1", "other@0.0.3:c53b1579", "reason", "sess-1")),
    }
    assert key not in others and len(others) == 4
    # a run with no session gets none, as on the host
    assert key_of(PAYLOAD, call=CallIdentity("run-1", CALL.workflow_id, "reason", None)) is None


def test_opt_outs_and_overrides(monkeypatch):
    monkeypatch.delenv("ABSTRACTRUNTIME_PROMPT_CACHE", raising=False)
    assert key_of(PAYLOAD, {"_runtime": {"prompt_cache": False}}) is None
    assert key_of(PAYLOAD, {"_runtime": {"prompt_cache": {"enabled": False}}}) is None
    assert key_of(PAYLOAD, {"_runtime": {"prompt_cache": {"namespace": "team"}}}) == host_key(namespace="team")
    assert key_of(PAYLOAD, {"_runtime": {"prompt_cache": {"key": "fixed"}}}) == "fixed"
    # an explicit key wins; present and null or empty turns reuse off for that call
    assert key_of({**PAYLOAD, "params": {"prompt_cache_key": "mine"}}) == "mine"
    assert key_of({**PAYLOAD, "params": {"prompt_cache_key": None}}) is None
    assert key_of({**PAYLOAD, "params": {"prompt_cache_key": ""}}) is None
    # a binding names the key; a binding object without one derives none
    assert key_of({**PAYLOAD, "params": {"prompt_cache_binding": "bound"}}) == "bound"
    assert key_of({**PAYLOAD, "params": {"prompt_cache_binding": {"key": "bound"}}}) == "bound"
    assert key_of({**PAYLOAD, "params": {"prompt_cache_binding": {"binding_id": "b"}}}) is None
    with pytest.raises(InvalidRequest) as info:
        key_of({**PAYLOAD, "params": {"prompt_cache_key": "a", "prompt_cache_binding": {"key": "b"}}})
    assert info.value.code == "invalid_request" and info.value.details["field"] == "prompt_cache_key"
    # this pack's own levels: the node's effectConfig key, then the run's
    assert (
        key_of(PAYLOAD, {"_runtime": {"prompt_cache_key": "run-key"}}, node_config={"prompt_cache_key": "node-key"})
        == "node-key"
    )
    assert key_of(PAYLOAD, {"_runtime": {"prompt_cache_key": "run-key"}}) == "run-key"
    # process-wide off, as on the host
    monkeypatch.setenv("ABSTRACTRUNTIME_PROMPT_CACHE", "0")
    assert key_of(PAYLOAD) is None
    assert key_of({**PAYLOAD, "params": {"prompt_cache_key": "mine"}}) == "mine"


@pytest.fixture()
def ledger_path(tmp_path, monkeypatch, policy_file):
    monkeypatch.delenv("ABSTRACTRUNTIME_PROMPT_CACHE", raising=False)
    path = tmp_path / "runs.sqlite"
    monkeypatch.setenv("ABSTRACTRUNTIME_MLX_LEDGER", str(path))
    yield path
    default_registry().close()


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    return out


def plain_flow(tmp_path):
    """The example multi-turn flow without its explicit keys: only derived keys remain."""
    flow = json.loads(EXAMPLE.read_text())
    for node in flow["nodes"]:
        node["data"].get("effectConfig", {}).pop("prompt_cache_key", None)
    path = tmp_path / "derived.json"
    path.write_text(json.dumps(flow))
    return path


def node_results(out):
    (run,) = json.loads(out[out.index("[") :])
    return {n["node_id"]: n["result"] for n in run["nodes"]}


@pytest.mark.slow
def test_a_session_continues_in_a_later_run(ledger_path, capsys, tmp_path, dense_model):
    path = plain_flow(tmp_path)
    first = node_results(run_cli(capsys, "run", path, "--model", dense_model, "--session", "chat-7", "--json"))
    key = first["turn1"]["metadata"]["prompt_cache"]["key"]
    assert key.startswith("session:") and first["turn2"]["metadata"]["prompt_cache"]["outcome"] == "hit"
    # the same session in a later invocation: the same keys, and turn 1 is warm now
    again = node_results(run_cli(capsys, "run", path, "--model", dense_model, "--session", "chat-7", "--json"))
    assert again["turn1"]["metadata"]["prompt_cache"]["key"] == key
    assert again["turn1"]["usage"]["cached_input_tokens"] > 0
    # a fresh session derives other keys (and still shares the identical prefix)
    fresh = node_results(run_cli(capsys, "run", path, "--model", dense_model, "--json"))
    assert fresh["turn1"]["metadata"]["prompt_cache"]["key"] != key
    # the closing summary counts what was reused
    out = run_cli(capsys, "run", path, "--model", dense_model, "--session", "chat-7")
    reused = [line for line in out.splitlines() if "prompt tokens" in line and "reused" in line]
    assert reused and not reused[0].split("prompt tokens ")[1].startswith("0/")


@pytest.mark.slow
def test_a_session_is_warm_after_a_restart_with_a_cache_dir(ledger_path, capsys, tmp_path, dense_model):
    path = plain_flow(tmp_path)
    cache_dir = tmp_path / "ssd"
    run_cli(capsys, "run", path, "--model", dense_model, "--session", "s", "--cache-dir", cache_dir, "--json")
    default_registry().close()  # the model is unloaded: its RAM tier is gone, the SSD tier flushed
    again = node_results(
        run_cli(capsys, "run", path, "--model", dense_model, "--session", "s", "--cache-dir", cache_dir, "--json")
    )
    cache = again["turn1"]["metadata"]["prompt_cache"]
    assert cache["apc"]["disk_hits"] > 0 and again["turn1"]["usage"]["cached_input_tokens"] > 0


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory):
    return str(tiny_model(tmp_path_factory.mktemp("agent-model") / "dense-long", kind="dense-long"))


@pytest.mark.slow
@pytest.mark.parametrize("batching", [True, False], ids=["continuous", "serial"])
def test_agent_turns_reuse_their_transcript_with_identical_answers(ledger_path, tmp_path, agent_model, batching):
    """The host's ReAct agent re-sends its whole transcript every turn: from the second turn on
    the derived key restores it, and every turn's greedy answer is the one without reuse."""
    flow = json.loads((FLOWS / "agent.json").read_text())
    # On the tiny model this task's greedy answers run out of tokens: the agent goes on past one turn.
    flow["nodes"][1]["data"]["pinDefaults"].update(task="Write one word.", max_iterations=3)
    flow["nodes"][1]["data"]["agentConfig"]["temperature"] = 0  # greedy: answers comparable
    options = {"mlx_batching": batching}
    runs = {
        reuse: run_flow(
            flow,
            ledger_url=f"sqlite:///{ledger_path}",
            model=agent_model,
            force_model=True,
            provider_options=options,
            vars={} if reuse else {"_runtime": {"prompt_cache": False}},
        )[0]
        for reuse in (False, True)
    }
    plain, reused = runs[False], runs[True]
    assert plain.status == reused.status == "completed"
    turns = [n for n in reused.nodes if n.node_id == "reason"]
    assert len(turns) >= 2
    assert [n.result["content"] for n in reused.nodes] == [n.result["content"] for n in plain.nodes]
    assert all("prompt_cache" not in n.result["metadata"] for n in plain.nodes)
    keys = {n.result["metadata"]["prompt_cache"]["key"] for n in turns}
    assert len(keys) == 1 and keys.pop().startswith("session:")
    for earlier, later in zip(turns, turns[1:]):
        cache = later.result["metadata"]["prompt_cache"]
        assert cache["outcome"] == "hit", cache
        # at least the earlier turn's prompt but its last block and guard is restored
        assert cache["cached_tokens"] >= earlier.result["usage"]["prompt_tokens"] - 24 - 16


@pytest.mark.slow
def test_a_node_sent_to_serve_carries_its_derived_key_and_reuses_there(
    ledger_path, capsys, tmp_path, dense_model, make_llm
):
    from abstractruntime_mlx.server import create_app
    from test_server_harness import serve_in_thread

    llm = make_llm(dense_model, mlx_batching=True)
    path = plain_flow(tmp_path)
    with serve_in_thread(create_app(llm)) as url:
        out = run_cli(capsys, "run", path, "--var", f"_runtime.base_url={url}", "--session", "remote-session", "--json")
    (run,) = json.loads(out[out.index("[") :])
    nodes = {n["node_id"]: n["result"] for n in run["nodes"]}
    served = nodes["turn1"]["metadata"]["route"]["served"]
    assert served["base_url"] == url
    key = host_key(
        session_id="remote-session",
        provider=served["provider"],
        model=served["model"],
        workflow_id=run["workflow_id"],
        node_id="turn1",
    )
    assert nodes["turn1"]["metadata"]["prompt_cache"]["key"] == key
    # the server reused under the key as the local provider does
    assert nodes["turn2"]["metadata"]["prompt_cache"]["outcome"] == "hit"
    assert nodes["turn2"]["usage"]["cached_input_tokens"] > 0
    assert llm.get_prompt_cache_stats()["requests"]["requests"] == 3
