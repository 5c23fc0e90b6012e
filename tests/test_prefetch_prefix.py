"""Prefetch of the next node's prefix: when an LLM node finishes, the ``llm_call`` nodes it enables
get their predictable prefix warmed in the local model's prefix cache (``Engine.warm_prefix``),
counted in their report as ``prefetched_tokens``; a live request never waits behind a warm; bad
warm calls raise ``InvalidPrefixWarm``. Real MLX, the tiny dense model."""

from __future__ import annotations

import threading
import time

import pytest

from abstractruntime_mlx.engine.core.request import RequestStatus
from abstractruntime_mlx.errors import InvalidPrefixWarm
from abstractruntime_mlx.nodes import ProviderRegistry
from abstractruntime_mlx.runtime_plugin import build_pack, run_flow
from abstractruntime_mlx.runtime_plugin.prefetch.prediction import Unpredictable, plan_prefix

SYSTEM_A = "You plan the work. " + "Keep every step short and exact. " * 24
SYSTEM_B = "You review the plan. " + "Check each step against the task and say what is wrong. " * 16
# A code node between the two calls: the time a real flow spends outside the model (a tool, a
# check), during which the engine is idle and the second call's prefix is warmed.
PAUSE = "s = 0\nfor i in range(2000000):\n    s += i\nreturn s"


def llm(node_id: str, system: str) -> dict[str, object]:
    return {
        "id": node_id,
        "type": "llm_call",
        "data": {
            "effectConfig": {
                "provider": "mlx",
                "model": "vendor/some-model",
                "temperature": 0.0,
                "max_output_tokens": 6,
            },
            "pinDefaults": {"system": system, "include_context": False},
        },
    }


def chain_flow() -> dict[str, object]:
    """start(query) -> plan (prompt: the query) -> pause (code) -> review (prompt: plan's answer) -> end."""
    return {
        "id": "prefix_chain",
        "entryNode": "start",
        "nodes": [
            {"id": "start", "type": "on_flow_start", "data": {"outputs": [{"id": "exec-out"}, {"id": "query"}]}},
            llm("plan", SYSTEM_A),
            {
                "id": "pause",
                "type": "code",
                "data": {
                    "codeBody": PAUSE,
                    "inputs": [{"id": "exec-in", "type": "execution"}],
                    "outputs": [{"id": "exec-out", "type": "execution"}, {"id": "output", "type": "any"}],
                },
            },
            llm("review", SYSTEM_B),
            {"id": "end", "type": "on_flow_end", "data": {}},
        ],
        "edges": [
            {"source": "start", "sourceHandle": "exec-out", "target": "plan", "targetHandle": "exec-in"},
            {"source": "plan", "sourceHandle": "exec-out", "target": "pause", "targetHandle": "exec-in"},
            {"source": "pause", "sourceHandle": "exec-out", "target": "review", "targetHandle": "exec-in"},
            {"source": "review", "sourceHandle": "exec-out", "target": "end", "targetHandle": "exec-in"},
            {"source": "start", "sourceHandle": "query", "target": "plan", "targetHandle": "prompt"},
            {"source": "plan", "sourceHandle": "response", "target": "review", "targetHandle": "prompt"},
        ],
    }


def test_a_prompt_from_an_earlier_answer_leaves_the_system_prompt_to_warm():
    flow = chain_flow()
    prefix = plan_prefix(flow, "review")
    assert prefix["prefix_only"] is True and prefix["prompt"] == "" and prefix["system_prompt"] == SYSTEM_B
    whole = plan_prefix(flow, "plan")  # its prompt is a start pin: the whole payload is known
    assert "prefix_only" not in whole
    flow["nodes"][3]["data"]["pinDefaults"]["system"] = ""
    with pytest.raises(Unpredictable, match="no system prompt"):
        plan_prefix(flow, "review")


def run_chain(dense_model, tmp_path, *, prefix_warm: bool):
    registry = ProviderRegistry()  # a fresh resident model: its prefix cache starts empty
    try:
        with build_pack(
            tmp_path / f"warm-{prefix_warm}.sqlite",
            model=dense_model,
            force_model=True,
            registry=registry,
            prefix_warm=prefix_warm,
        ) as pack:
            (result,) = run_flow(chain_flow(), vars={"query": "Plan the release."}, pack=pack, session_id="s-1")
            assert result.status == "completed", result.error
            shown = show(pack.ledger, result.run_id)
        return {n.node_id: n.result for n in result.nodes if n.node_id in ("plan", "review")}, shown
    finally:
        registry.close()


def show(ledger, run_id):
    """What ``runs show`` prints and what the inspector's call views hold."""
    from abstractruntime_mlx.cli.runs_cmd import render_run
    from abstractruntime_mlx.inspection import run_view

    view = run_view(ledger, run_id)
    assert view is not None
    return render_run(ledger, run_id), {call.node_id: call for call in view.calls}


@pytest.mark.slow
def test_the_next_node_prefix_is_warmed_and_its_answer_is_the_same(dense_model, tmp_path, policy_file):
    warmed, (text, calls) = run_chain(dense_model, tmp_path, prefix_warm=True)
    plain, (plain_text, plain_calls) = run_chain(dense_model, tmp_path, prefix_warm=False)
    (warm,) = warmed["plan"]["metadata"]["prefix_warm"]
    assert warm["node_id"] == "review" and warm["prefix_only"] is True and warm["queued"] is True
    cache = warmed["review"]["metadata"]["prompt_cache"]
    assert cache["prefetched_tokens"] > 0 and cache["prefetched_tokens"] <= cache["cached_tokens"]
    assert "prefix_warm" not in plain["plan"]["metadata"]
    assert "prefetched_tokens" not in plain["review"]["metadata"]["prompt_cache"]
    assert plain["review"]["metadata"]["prompt_cache"]["cached_tokens"] == 0
    for node in ("plan", "review"):
        assert warmed[node]["content"] == plain[node]["content"]
    # shown in the inspector's call view and in ``runs show``
    assert calls["review"].prefetched_tokens == cache["prefetched_tokens"]
    assert calls["plan"].prefix_warm[0]["node_id"] == "review"
    assert f"prefetched={cache['prefetched_tokens']}" in text
    assert "prefix warm: review's system prompt" in text
    assert plain_calls["review"].prefetched_tokens is None and "prefix warm" not in plain_text


def messages(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def test_a_warm_fills_the_cache_and_the_next_call_counts_it(make_llm, dense_model):
    llm = make_llm(dense_model, mlx_batching=True)
    call = {"messages": messages(SYSTEM_A, "Plan it."), "temperature": 0.0, "thinking": False, "prompt_cache_key": "w1"}
    plain = llm.generate("", max_output_tokens=6, **call)
    llm.prompt_cache_clear()
    report = llm.prompt_cache_warm(**call)
    assert report["queued"] is True and report["resident_tokens"] == 0
    wait_for_warms(llm, 1)
    warmed = llm.generate("", max_output_tokens=6, **call)
    cache = warmed.metadata["prompt_cache"]
    assert cache["prefetched_tokens"] == cache["cached_tokens"] > 0
    assert warmed.token_ids == plain.token_ids
    again = llm.prompt_cache_warm(**call)
    assert (again["queued"], again["reason"]) == (False, "already_resident")
    # each warmed block is counted once: the next call restores it as any cached block
    assert llm.generate("", max_output_tokens=6, **call).metadata["prompt_cache"]["prefetched_tokens"] == 0


def wait_for_warms(llm, finished: int) -> None:
    deadline = time.monotonic() + 60
    while llm.get_prompt_cache_stats()["warms"]["finished"] < finished:
        assert time.monotonic() < deadline, "the warm did not finish"
        time.sleep(0.02)


def test_a_live_request_goes_before_a_warm(make_llm, dense_model):
    """A warm queued while a request runs is held until the engine is idle, then runs one prefill
    chunk a request; a live request arriving meanwhile is admitted next to it and waits one chunk
    at most. The chunks go on until the whole prefix is in RAM, and the call that comes gets it."""
    llm = make_llm(dense_model, mlx_batching=True)
    engine = llm._engine
    step = engine.config.prefill_step_size
    busy = threading.Thread(
        target=llm.generate, args=("",), kwargs={"messages": messages("Busy.", "Count."), "max_output_tokens": 40}
    )
    busy.start()
    call = {"messages": messages(SYSTEM_B * 4, "Review."), "prompt_cache_key": "w-late", "thinking": False}
    deadline = time.monotonic() + 30
    while engine.snapshot()["active"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    report = llm.prompt_cache_warm(**call)
    assert report["queued"] is True and report["prompt_tokens"] > 3 * step
    (first,) = [r for r in engine._live.values() if r.warm]
    assert len(first.prompt_ids) == step  # one chunk of the prefix, not all of it
    assert busy.is_alive() and first.status == RequestStatus.WAITING  # held while the engine is busy
    while first.status == RequestStatus.WAITING:  # admitted: from here on it is not cancelled
        assert time.monotonic() < deadline and not first.cancelled
        time.sleep(0.001)
    live = llm.generate("", messages=messages("Live.", "Answer now."), max_output_tokens=4, temperature=0.0)
    busy.join()
    assert live.token_ids
    deadline = time.monotonic() + 60
    while any(r.warm for r in list(engine._live.values())):
        assert time.monotonic() < deadline, "the warm chunks did not finish"
        time.sleep(0.02)
    assert not first.cancelled and len(first.prompt_ids) - (first.cached_tokens or 0) <= step
    warms = llm.get_prompt_cache_stats()["warms"]
    assert warms["finished"] >= report["prompt_tokens"] // step  # chained, chunk after chunk
    cache = llm.generate("", max_output_tokens=4, temperature=0.0, **call).metadata["prompt_cache"]
    assert cache["prefetched_tokens"] == cache["cached_tokens"] > 3 * step


@pytest.mark.parametrize(
    ("call", "field"),
    [
        ({"messages": messages("s", "u")}, "prompt_cache_key"),
        ({"messages": [], "prompt_cache_key": "k"}, "messages"),
        ({"messages": [{"role": "user", "content": ""}], "prompt_cache_key": "k"}, "messages"),
    ],
)
def test_bad_warm_calls_raise_typed_errors(make_llm, dense_model, call, field):
    llm = make_llm(dense_model, mlx_batching=True)
    with pytest.raises(InvalidPrefixWarm) as info:
        llm.prompt_cache_warm(**call)
    assert info.value.code == "invalid_prefix_warm" and info.value.details["field"] == field


def test_bad_engine_warm_calls_raise_typed_errors(make_llm, dense_model):
    from abstractruntime_mlx.engine.core.request import EngineRequest

    engine = make_llm(dense_model, mlx_batching=True)._engine
    for request, field in (
        (EngineRequest("a", [1, 2, 3], 4), "prompt_cache_key"),
        (EngineRequest("b", [], 4, prompt_cache_key="k"), "prompt_ids"),
        (EngineRequest("c", [1, -2], 4, prompt_cache_key="k"), "prompt_ids"),
    ):
        with pytest.raises(InvalidPrefixWarm) as info:
            engine.warm_prefix(request)
        assert info.value.details["field"] == field


def test_a_live_request_arriving_with_a_warm_runs_first_and_cancels_its_own_keys(make_llm, dense_model, monkeypatch):
    """A warm and two live requests reach the worker in one turn (held by a control): the live
    ones run first; the warm of a live request's own key is cancelled, the other one runs after."""
    llm = make_llm(dense_model, mlx_batching=True)
    engine = llm._engine
    gate, held = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        gate.wait(30)

    blocker = threading.Thread(target=engine.control, args=(hold,))
    blocker.start()
    assert held.wait(30)
    other = {"messages": messages(SYSTEM_A, "Plan."), "prompt_cache_key": "w-other", "thinking": False}
    own = {"messages": messages(SYSTEM_B, "Review."), "prompt_cache_key": "w-own", "thinking": False}
    assert llm.prompt_cache_warm(**other)["queued"] and llm.prompt_cache_warm(**own)["queued"]
    warms = {r.prompt_cache_key: r for r in engine._live.values() if r.warm}
    submitted = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda request, **kw: submitted.append(request) or submit(request, **kw))
    results: list[object] = []
    live = threading.Thread(
        target=lambda: results.append(llm.generate("", max_output_tokens=4, temperature=0.0, **own))
    )
    live.start()
    deadline = time.monotonic() + 30
    while not any(not c.request.warm for c in list(engine._inbox) if hasattr(c, "request")):
        assert time.monotonic() < deadline  # until the live request is in the inbox, behind the warms
        time.sleep(0.001)
    gate.set()
    blocker.join()
    live.join()
    assert warms["w-own"].done.wait(30) and warms["w-other"].done.wait(30)
    assert warms["w-own"].cancelled and warms["w-own"].started_at is None
    assert not warms["w-other"].cancelled and warms["w-other"].started_at is not None
    (result,), (live_request,) = results, submitted
    assert result.token_ids and live_request.finished_at is not None
    # the other key's warm waited for an idle engine: it began after the live request had finished
    assert warms["w-other"].started_at > live_request.finished_at


@pytest.mark.slow
def test_a_prefix_on_the_ssd_tier_is_warmed_back_in_one_step(make_llm, dense_model, tmp_path):
    """After a restart the SSD tier holds the prefix: the warm's first chunk runs to its end, so one
    step reads it back, and its store keeps it in RAM (upstream's SSD restore makes no RAM blocks);
    the call then finds it in RAM."""
    disk = str(tmp_path / "cache")
    call = {"messages": messages(SYSTEM_A, "Plan it."), "temperature": 0.0, "thinking": False, "prompt_cache_key": "s1"}
    first = make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=disk)
    plain = first.generate("", max_output_tokens=6, **call)
    first.unload_model()  # flushes the SSD tier
    restarted = make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=disk)
    report = restarted.prompt_cache_warm(**call)
    assert report["queued"] is True and report["resident_tokens"] == 0
    assert report["ssd_tokens"] > restarted.get_prompt_cache_stats()["execution"].get("prefill_step_size", 256)
    wait_for_warms(restarted, 1)
    again = restarted.prompt_cache_warm(**call)
    assert (again["queued"], again["reason"]) == (False, "already_resident")  # in RAM after one warm
    warmed = restarted.generate("", max_output_tokens=6, **call)
    warms = restarted.get_prompt_cache_stats()["warms"]
    assert warms["finished"] == 1 and warms["blocks"] * 16 >= report["ssd_tokens"]  # one step, no chunk after it
    assert warmed.metadata["prompt_cache"]["prefetched_tokens"] >= report["ssd_tokens"]
    assert warmed.metadata["prompt_cache"]["apc"]["disk_hits"] == 0  # RAM had it: no disk read in the call
    assert warmed.token_ids == plain.token_ids
