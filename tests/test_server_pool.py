"""serve with several resident models: names and aliases, the memory check, LRU eviction,
keep-alive, pins and work in flight.

Real servers (uvicorn on 127.0.0.1, in a thread or as a ``serve`` process) over tiny random
models; each model's memory estimate is computed with the pool's own estimator, and the budget
is set from it, so "two fit, three do not" holds on any machine.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.errors import InvalidRequest
from abstractruntime_mlx.server import ModelSpec, PoolSettings, create_app
from abstractruntime_mlx.server.keep_alive import parse_keep_alive
from abstractruntime_mlx.server.memory import estimate_footprint, parse_byte_size
from abstractruntime_mlx.testing import tiny_model
from test_server_harness import serve_in_thread, wait_until

USER = [{"role": "user", "content": "Say something."}]
LONG = {"messages": USER, "max_tokens": 4000, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pool-models")
    return {
        name: str(tiny_model(root / name, kind="dense", seed=seed))
        for seed, name in enumerate(("alpha", "beta", "gamma"))
    }


@pytest.fixture(scope="module")
def one_model_bytes(tiny_models: dict[str, str]) -> int:
    """The estimate of one tiny model as the pool computes it (no batching: one KV row)."""
    sizes = {estimate_footprint(Path(p), max_batch_size=1).total_bytes for p in tiny_models.values()}
    assert len(sizes) == 1 and sizes.pop() > 0
    return estimate_footprint(Path(tiny_models["alpha"]), max_batch_size=1).total_bytes


def specs(tiny_models: dict[str, str], *, pinned: tuple[str, ...] = ()) -> list[ModelSpec]:
    return [ModelSpec(name, path, pinned=name in pinned) for name, path in tiny_models.items()]


@pytest.fixture()
def two_fit(tiny_models: dict[str, str], one_model_bytes: int) -> PoolSettings:
    return PoolSettings(memory_budget_bytes=int(one_model_bytes * 2.5))


def models_by_id(url: str) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}


def chat(client: httpx.Client, model: str | None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"messages": USER, "max_tokens": 2, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return client.post("/v1/chat/completions", json=body)


# --------------------------------------------------------------------------- several models


@pytest.mark.slow
def test_two_tiny_models_served_by_one_process(tiny_models: dict[str, str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "abstractruntime_mlx.cli.main", "serve", "--port", str(port)]
    argv += ["--model", f"alpha={tiny_models['alpha']}", "--model", f"beta={tiny_models['beta']}"]
    argv += ["--alias", "google_gemma-3-1b-it=beta"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            try:
                return bool(httpx.get(f"{url}/health", timeout=1).json()["loaded"])
            except httpx.HTTPError:
                return False

        if (
            not wait_until(lambda: healthy() or proc.poll() is not None, timeout_s=60, interval_s=0.1)
            or proc.poll() is not None
        ):
            proc.terminate()
            pytest.fail(f"serve did not come up: {proc.communicate(timeout=30)[1].decode(errors='replace')[-2000:]}")
        listed = models_by_id(url)
        assert list(listed) == ["alpha", "beta"]  # the default model first
        assert listed["alpha"]["state"] == "loaded" and listed["beta"]["state"] == "unloaded"
        assert listed["beta"]["aliases"] == ["google_gemma-3-1b-it"]
        with httpx.Client(base_url=url, timeout=60) as client:
            by_alias = chat(client, "google_gemma-3-1b-it")  # loads beta on first request
            assert by_alias.status_code == 200, by_alias.text
            assert by_alias.json()["model"] == "beta"  # the model's one name, not the alias or its path
            assert chat(client, "alpha").json()["model"] == "alpha"
            assert chat(client, None).json()["model"] == "alpha"  # no model: the first --model
            unknown = chat(client, "nobody/nothing")
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
            health = client.get("/health").json()
            assert health["model"] == "alpha" and {m["id"]: m["state"] for m in health["models"]} == {
                "alpha": "loaded",
                "beta": "loaded",
            }
            assert health["memory"]["budget_bytes"] > 0 and health["memory"]["resident_bytes"] > 0
            caps = client.get("/v1/models/execution-capabilities", params={"model_name": "google_gemma-3-1b-it"}).json()
            assert caps["model"] == tiny_models["beta"] and caps["residency"]["state"] == "loaded"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode in (0, -15)


# --------------------------------------------------------------------------- memory


def test_eviction_under_a_small_budget_while_a_third_loads(tiny_models: dict[str, str], two_fit: PoolSettings) -> None:
    app = create_app(models=specs(tiny_models), residency=two_fit)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        for name in ("alpha", "beta", "alpha"):  # beta is now the least recently used
            assert chat(client, name).status_code == 200
        assert chat(client, "gamma").status_code == 200  # does not fit beside both: beta goes
        states = {name: m["state"] for name, m in models_by_id(url).items()}
        assert states == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
        counters = app.state.pool.counters()
        assert counters["beta"].evictions == 1 and counters["alpha"].evictions == 0
        assert [m.name for m in app.state.pool.resident()] == ["alpha", "gamma"]


def test_a_model_with_work_in_flight_is_not_evicted(tiny_models: dict[str, str], two_fit: PoolSettings) -> None:
    app = create_app(models=specs(tiny_models), residency=two_fit)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        assert chat(client, "alpha").status_code == 200
        assert chat(client, "beta").status_code == 200
        with client.stream("POST", "/v1/chat/completions", json={**LONG, "model": "alpha"}) as running:
            lines = running.iter_lines()
            next(lines)  # alpha, the least recently used, is streaming
            assert models_by_id(url)["alpha"]["in_flight"] == 1
            assert chat(client, "gamma").status_code == 200
            states = {name: m["state"] for name, m in models_by_id(url).items()}
            assert states == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}


def test_pinned_and_busy_models_make_a_load_refused_with_insufficient_memory(
    tiny_models: dict[str, str], two_fit: PoolSettings
) -> None:
    no_wait = replace(two_fit, load_wait_s=0.0)  # refused at once, not once beta's stream ends
    app = create_app(models=specs(tiny_models, pinned=("alpha",)), residency=no_wait)
    app.state.pool.preload(["alpha"])
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        assert chat(client, "beta").status_code == 200
        with client.stream("POST", "/v1/chat/completions", json={**LONG, "model": "beta"}) as running:
            lines = running.iter_lines()
            next(lines)
            refused = chat(client, "gamma")
            assert refused.status_code == 507, refused.text
            error = refused.json()["error"]
            assert error["code"] == "insufficient_memory"
            assert sorted((k["model"], k["reason"]) for k in error["details"]["kept"]) == [
                ("alpha", "pinned"),
                ("beta", "in_flight"),
            ]
            assert error["details"]["reason"] == "models_in_use"
            assert error["details"]["budget_bytes"] == two_fit.memory_budget_bytes
        states = {name: m["state"] for name, m in models_by_id(url).items()}
        assert states == {"alpha": "loaded", "beta": "loaded", "gamma": "unloaded"}  # nothing was evicted for it
        assert app.state.pool.counters()["gamma"].refusals == 1


def test_a_model_larger_than_the_budget_is_refused_at_start(tiny_models: dict[str, str], one_model_bytes: int) -> None:
    app = create_app(models=specs(tiny_models), residency=PoolSettings(memory_budget_bytes=one_model_bytes // 2))
    with pytest.raises(Exception) as refused:
        app.state.pool.preload(["alpha"])
    assert getattr(refused.value, "code", None) == "insufficient_memory"
    assert app.state.pool.resident() == ()


# --------------------------------------------------------------------------- keep-alive


@pytest.mark.slow
def test_keep_alive_zero_unloads_when_idle_and_a_longer_one_keeps(tiny_models: dict[str, str]) -> None:
    app = create_app(models=specs(tiny_models))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        assert chat(client, "alpha", keep_alive="1h").status_code == 200
        assert chat(client, "beta", keep_alive=0).status_code == 200
        assert wait_until(lambda: models_by_id(url)["beta"]["state"] == "unloaded", timeout_s=20)
        alpha = models_by_id(url)["alpha"]
        assert alpha["state"] == "loaded" and alpha["keep_alive"] == "3600s" and 0 < alpha["expires_in_s"] <= 3600
        counters = app.state.pool.counters()
        assert counters["beta"].expirations == 1 and counters["alpha"].expirations == 0
        # the server default applies to what a request does not say; "-1" means no idle unload
        assert chat(client, "beta", keep_alive="-1").status_code == 200
        assert models_by_id(url)["beta"]["keep_alive"] == "forever"


@pytest.mark.slow
def test_serve_keep_alive_default_unloads_idle_models_but_never_a_pinned_one(tiny_models: dict[str, str]) -> None:
    app = create_app(models=specs(tiny_models, pinned=("alpha",)), residency=PoolSettings(keep_alive_s=0.0))
    app.state.pool.preload(["alpha"])
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        assert chat(client, "beta").status_code == 200
        assert chat(client, "alpha").status_code == 200
        assert wait_until(lambda: models_by_id(url)["beta"]["state"] == "unloaded", timeout_s=20)
        assert models_by_id(url)["alpha"]["state"] == "loaded" and models_by_id(url)["alpha"]["pinned"] is True


# --------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("value", ["soon", "5 minutes", True, [1], {"s": 1}, "1e999", float("nan")])
def test_bad_keep_alive_is_a_400_naming_the_field(tiny_models: dict[str, str], value: Any) -> None:
    from starlette.testclient import TestClient

    with TestClient(create_app(models=specs(tiny_models))) as client:
        raw = json.dumps({"model": "alpha", "messages": USER, "keep_alive": value}, allow_nan=True)
        reply = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["code"] == "invalid_request"
        if not isinstance(value, float):
            assert reply.json()["error"]["details"]["field"] == "keep_alive"
        assert models_by_id_client(client)["alpha"]["state"] == "unloaded"  # refused before any load
        load = client.post("/acore/models/load", json={"model": "alpha", "keep_alive": "soon"})
        assert load.status_code == 400 and load.json()["error"]["details"]["field"] == "keep_alive"


def models_by_id_client(client: Any) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in client.get("/v1/models").json()["data"]}


def test_keep_alive_and_size_forms() -> None:
    assert parse_keep_alive(0) == 0.0 and parse_keep_alive("30s") == 30.0 and parse_keep_alive("5m") == 300.0
    assert parse_keep_alive("1h30m") == 5400.0 and parse_keep_alive("250ms") == 0.25 and parse_keep_alive("90") == 90.0
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None
    with pytest.raises(InvalidRequest):
        parse_keep_alive("10y")
    with pytest.raises(InvalidRequest):
        parse_keep_alive(10**12)
    assert parse_byte_size("8GiB") == 8 * 1024**3 and parse_byte_size("512MiB") == 512 * 1024**2
    assert parse_byte_size("2G") == 2 * 1000**3 and parse_byte_size("1000") == 1000
    for bad in ("lots", "", "-1GiB", "0", "1XB"):
        with pytest.raises(ValueError):
            parse_byte_size(bad)


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--model", "a=/x", "--alias", "b=nobody"], "--alias"),
        (["--model", "a=/x", "--alias", "a=a"], "--alias"),
        (["--model", "a=/x", "--pin", "b"], "--pin"),
        (["--model", "=/x"], "--model"),
        (["--model", "a=/x", "--model", "a=/y"], "--model"),
        (["--model", "a=/x", "--memory-budget", "lots"], "--memory-budget"),
        (["--model", "a=/x", "--keep-alive", "soon"], "--keep-alive"),
        (["--model", "a=/x", "--kv-reserve-tokens", "0"], "--kv-reserve-tokens"),
    ],
)
def test_serve_refuses_bad_pool_arguments(argv: list[str], field: str) -> None:
    import argparse

    from abstractruntime_mlx.cli import serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers())
    with pytest.raises(InvalidRequest) as refused:
        serve_cmd.settings_from_args(parser.parse_args(["serve", *argv]), environ={})
    assert refused.value.details["field"] == field


def test_serve_settings_build_the_pool() -> None:
    import argparse

    from abstractruntime_mlx.cli import serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers())
    argv = ["serve", "--model", "a=/x", "--model", "/models/b", "--alias", "gpt=a", "--pin", "/models/b"]
    argv += ["--memory-budget", "1GiB", "--keep-alive", "5m"]
    settings = serve_cmd.settings_from_args(parser.parse_args(argv), environ={})
    assert [(s.name, s.source, s.pinned) for s in settings.model_specs()] == [
        ("a", "/x", False),
        ("/models/b", "/models/b", True),
    ]
    assert settings.aliases == (("gpt", "a"),) and settings.preload() == ["a", "/models/b"]
    pool = settings.pool_settings()
    assert pool.memory_budget_bytes == 1024**3 and pool.keep_alive_s == 300.0


# --------------------------------------------------------------------------- flows routed to serve


def routed_flow(tmp_path: Path, model: str) -> str:
    flow = {
        "id": "routed",
        "entryNode": "start",
        "nodes": [
            {"id": "start", "type": "on_flow_start", "data": {}},
            {
                "id": "ask",
                "type": "llm_call",
                "data": {
                    "effectConfig": {"provider": "lmstudio", "model": model},
                    "pinDefaults": {"prompt": "Say hi."},
                },
            },
        ],
        "edges": [{"source": "start", "sourceHandle": "exec-out", "target": "ask", "targetHandle": "exec-in"}],
    }
    path = tmp_path / f"routed-{model.replace('/', '_')}.json"
    path.write_text(json.dumps(flow), encoding="utf-8")
    return str(path)


@pytest.fixture()
def served_url(tiny_models: dict[str, str]) -> Iterator[str]:
    app = create_app(models=specs(tiny_models), aliases={"google_gemma-3-1b-it": "beta"})
    with serve_in_thread(app) as url:
        yield url


@pytest.mark.slow
def test_a_flow_routed_to_serve_runs_on_the_model_its_node_names(
    cli_env: Path, capsys: Any, tmp_path: Path, served_url: str
) -> None:
    flow = routed_flow(tmp_path, "google_gemma-3-1b-it")
    route = f"lmstudio={served_url}"
    assert main(["check", flow, "--route", route, "--probe"]) == 0
    code = main(["run", flow, "--route", route, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert models_by_id(served_url)["beta"]["state"] == "loaded"  # loaded by the node's request, by alias


def test_check_refuses_a_flow_whose_model_the_server_cannot_serve(
    cli_env: Path, capsys: Any, tmp_path: Path, served_url: str
) -> None:
    flow = routed_flow(tmp_path, "qwen/not-here")
    code = main(["check", flow, "--route", f"lmstudio={served_url}", "--probe", "--json"])
    out, _ = capsys.readouterr()
    assert code == 1
    problems = [(p["code"], p["node_id"], p["field"]) for p in json.loads(out)["problems"]]
    assert problems == [("model_not_served", "ask", "nodes[1].data.effectConfig.model")]
    assert main(["check", flow, "--route", f"lmstudio={served_url}"]) == 0  # nothing is asked without --probe
    capsys.readouterr()
    # run routed to the server asks it first: refused before any node runs
    assert main(["run", flow, "--route", f"lmstudio={served_url}", "--json"]) == 1
    _, err = capsys.readouterr()
    assert "model_not_served" in err and "ask" in err
