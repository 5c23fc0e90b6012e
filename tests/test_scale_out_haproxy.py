"""A pool of two ``serve`` processes behind HAProxy, as ``lb-config`` writes its configuration.

Real processes on 127.0.0.1: two ``abstractruntime-mlx serve --model tiny``, one ``haproxy``
(Debian's package; ``.ci/run`` installs it) with the generated configuration, and flow runs
in this process as their coordinator. Verdicts are read from HAProxy's stats socket (which
server took which calls) and from the ledger (which steps ran, on which attempt), never from
durations."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from abstractruntime_mlx.ledger import Ledger, sqlite_url
from abstractruntime_mlx.nodes import default_registry
from abstractruntime_mlx.remote_client import RemoteClient
from abstractruntime_mlx.runtime_plugin import FlowRunResult, run_flow
from abstractruntime_mlx.testing.pool import HAProxyProcess, ServerProcess, free_port, haproxy_binary, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        haproxy_binary() is None,
        reason="haproxy is not installed (Debian: apt-get install haproxy; macOS: brew install haproxy)",
    ),
]

BRANCHES = 4


def fanout_flow(max_tokens: int) -> dict[str, object]:
    """One parallel node with ``BRANCHES`` LLM branches (siblings: prefetched together), collected at the end."""
    branches = [f"b{i}" for i in range(BRANCHES)]
    nodes: list[dict[str, object]] = [
        {"id": "start", "type": "on_flow_start", "data": {}},
        {
            "id": "fan",
            "type": "parallel",
            "data": {
                "outputs": [
                    *({"id": f"then:{i}", "type": "execution"} for i in range(BRANCHES)),
                    {"id": "completed", "type": "execution"},
                ]
            },
        },
        *(
            {
                "id": b,
                "type": "llm_call",
                "data": {
                    "effectConfig": {
                        "provider": "mlx",
                        "temperature": 0,
                        "max_output_tokens": max_tokens,
                        "speculation": False,
                    },
                    "pinDefaults": {"prompt": f"Branch {b}: tell a story."},
                },
            }
            for b in branches
        ),
        {
            "id": "end",
            "type": "on_flow_end",
            "data": {
                "inputs": [{"id": "exec-in", "type": "execution"}, *({"id": b, "type": "string"} for b in branches)]
            },
        },
    ]
    edges: list[dict[str, object]] = [
        {"source": "start", "sourceHandle": "exec-out", "target": "fan", "targetHandle": "exec-in"},
        {"source": "fan", "sourceHandle": "completed", "target": "end", "targetHandle": "exec-in"},
    ]
    for i, b in enumerate(branches):
        edges.append({"source": "fan", "sourceHandle": f"then:{i}", "target": b, "targetHandle": "exec-in"})
        edges.append({"source": b, "sourceHandle": "response", "target": "end", "targetHandle": b})
    return {"id": "pool_fanout", "entryNode": "start", "nodes": nodes, "edges": edges}


@pytest.fixture(scope="module")
def pool(dense_model, tmp_path_factory):
    """Two servers, the configuration ``lb-config`` wrote for them (reading their capacity), HAProxy."""
    tmp = tmp_path_factory.mktemp("pool")
    servers = [ServerProcess.start(dense_model, port=free_port(), log_path=tmp / f"serve{i}.log") for i in (1, 2)]
    try:
        lb_port = free_port()
        config, socket_path = tmp / "pool.cfg", tmp / "haproxy.sock"
        argv = [
            "lb-config",
            *(a for s in servers for a in ("--server", f"127.0.0.1:{s.port}")),
            "--bind",
            f"127.0.0.1:{lb_port}",
            "--stats-socket",
            str(socket_path),
            "--out",
            str(config),
        ]
        done = subprocess.run(
            [sys.executable, "-m", "abstractruntime_mlx.cli.main", *argv], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stderr.count("maxconn 36 (4 slots + 32 queue, from server)") == 2, (
            done.stderr
        )  # read from the servers
        with HAProxyProcess.start(config, socket_path=socket_path, port=lb_port, servers_up=2) as lb:
            yield servers, lb
    finally:
        for server in servers:
            server.stop()
        default_registry().close()


def sessions_by_server(lb: HAProxyProcess) -> dict[str, int]:
    return {name: int(row["stot"]) for name, row in lb.server_stats().items()}


def test_each_affinity_key_stays_on_one_server(pool, dense_model):
    _servers, lb = pool
    used: set[str] = set()
    with RemoteClient(lb.url, model=dense_model) as client:  # a model named: no GET /v1/models (which carries no key)
        for key in (f"session-{i}" for i in range(8)):
            before = sessions_by_server(lb)
            for _ in range(3):
                result = client.generate("Hi", messages=[], max_output_tokens=4, temperature=0, affinity_key=key)
                assert result.finish_reason in ("stop", "length")
            after = sessions_by_server(lb)
            grew = {name: after[name] - before[name] for name in after if after[name] != before[name]}
            assert len(grew) == 1 and sum(grew.values()) == 3, (key, grew)  # all three on one server
            used.update(grew)
    assert used == {"s1", "s2"}  # eight keys spread over both


def llm_steps(ledger_url: str, run_id: str) -> list:
    with Ledger(ledger_url) as ledger:
        return [s for s in ledger.run_steps(run_id) if s.effect_type == "llm_call"]


def run_batch(lb: HAProxyProcess, model: str, ledger_url: str, *, runs: int, max_tokens: int) -> list[FlowRunResult]:
    return run_flow(
        fanout_flow(max_tokens),
        runs=runs,
        ledger_url=ledger_url,
        model=model,
        vars={"_runtime": {"base_url": lb.url}},
        allow_remote=["127.0.0.1"],
    )


def test_fan_out_runs_complete_through_the_balancer_with_their_phase_events(pool, dense_model, tmp_path, policy_file):
    _servers, lb = pool
    ledger_url = sqlite_url(tmp_path / "ledger.db")
    results = run_batch(lb, dense_model, ledger_url, runs=8, max_tokens=16)
    assert [r.status for r in results] == ["completed"] * 8
    with Ledger(ledger_url) as ledger:
        for r in results:
            assert sorted(n.node_id for n in r.nodes) == [f"b{i}" for i in range(BRANCHES)]
            for n in r.nodes:
                client = n.result["metadata"]["client"]
                assert client == {"kind": "remote", "concurrency": "remote", "base_url": lb.url}
            phases = {row.phase for row in ledger.node_timeline(r.run_id)}
            assert {"prefill", "complete"} <= phases, phases  # SSE phase events came back through HAProxy


def test_a_server_killed_mid_batch_costs_retries_not_runs(pool, dense_model, tmp_path, policy_file):
    servers, lb = pool
    ledger_url = sqlite_url(tmp_path / "ledger.db")
    outcome: dict[str, object] = {}

    def batch() -> None:
        try:
            # Long answers: a call is still streaming when the kill lands, however loaded the
            # machine is (a call HAProxy can still redispatch is retried there, unseen by the run).
            outcome["results"] = run_batch(lb, dense_model, ledger_url, runs=8, max_tokens=1500)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            outcome["error"] = exc

    coordinator = threading.Thread(target=batch, name="coordinator")
    coordinator.start()
    # The victim: a server whose engine has stepped a few times with calls in it, so their SSE
    # answers have begun (HAProxy redispatches a call that has not answered yet: the run would
    # never see that one fail).
    victim = None
    first_steps: dict[int, int] = {}
    deadline = time.monotonic() + 120
    while victim is None and coordinator.is_alive() and time.monotonic() < deadline:
        for i, server in enumerate(servers):
            execution = server.execution()
            steps = int((execution.get("step_profile") or {}).get("num_steps", 0) or 0)
            if int(execution.get("active", 0) or 0) < 1:
                first_steps.pop(i, None)
                continue
            if steps - first_steps.setdefault(i, steps) >= 3:
                victim = server
                break
    assert victim is not None, "no server ever had an active call"
    victim.kill()
    coordinator.join(300)
    assert not coordinator.is_alive()
    assert "error" not in outcome, outcome.get("error")
    results = outcome["results"]
    assert isinstance(results, list)
    assert [r.status for r in results] == ["completed"] * 8, [(r.status, r.error, r.failures) for r in results]
    for r in results:  # a failed attempt is listed: only calls the kill cut off mid-answer
        assert all(f.error.startswith("[upstream_error]") for f in r.failures), r.failures

    # A cut call is called again, and the ledger says so: a node's own call as the step's next
    # attempt, a sibling prefetch (siblings are prefetched together) in the node's recorded
    # result (``sibling_batch``: ``prefetch_failed``, then called again within the attempt).
    retried: list[str] = []
    for r in results:
        steps = llm_steps(ledger_url, r.run_id)
        completed = {s.node_id for s in steps if s.status == "completed"}
        assert completed == {f"b{i}" for i in range(BRANCHES)}
        retried += [f"{r.run_id}/{s.node_id}#{s.attempt}" for s in steps if s.status == "completed" and s.attempt >= 2]
        for n in r.nodes:
            sibling = n.result["metadata"].get("sibling_batch") or {}
            if sibling.get("reason") == "prefetch_failed":
                assert sibling.get("error") == "upstream_error", sibling
                retried.append(f"{r.run_id}/{n.node_id} (prefetch)")
    assert retried, "no call was cut off by the kill: a retried call shows as a step attempt or a failed prefetch"
    name = f"s{servers.index(victim) + 1}"  # lb-config names the servers in the order given
    wait_until(
        lambda: lb.server_stats()[name]["status"].startswith("DOWN"), what=f"HAProxy marking {name} down", timeout_s=60
    )
