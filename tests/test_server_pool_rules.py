"""serve's pool rules at the edges: one name per model everywhere, true 507 reasons, eviction under
bursts that never closes a model with work, and load options only the operator may set.

Real servers (uvicorn on 127.0.0.1 in a thread, or Starlette's TestClient) over tiny random models;
budgets are computed from the pool's own estimator, so "two fit, a third needs both" holds anywhere.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from abstractruntime_mlx.errors import InvalidRequest, OperatorSetting, error_class_for_code
from abstractruntime_mlx.server import ModelSpec, PoolSettings, create_app
from abstractruntime_mlx.server.load_policy import CLIENT_LIMITS, client_load_options
from abstractruntime_mlx.server.memory import estimate_footprint
from abstractruntime_mlx.testing import tiny_model
from test_server_harness import serve_in_thread, wait_until

USER = [{"role": "user", "content": "Say something."}]
WIDE = {"mlx_batching": True, "mlx_max_batch_size": 2}
"""gamma's options: two batch rows, so its KV reserve is twice a small model's."""


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rule-roots")


@pytest.fixture(scope="module")
def paths(roots: Path) -> dict[str, str]:
    return {
        name: str(tiny_model(roots / "R" / name, kind="dense", seed=seed))
        for seed, name in enumerate(("alpha", "beta", "gamma"))
    }


@pytest.fixture(scope="module")
def small_bytes(paths: dict[str, str]) -> int:
    return estimate_footprint(Path(paths["alpha"]), max_batch_size=1).total_bytes


def chat(client: Any, model: str | None, **extra: Any) -> Any:
    body: dict[str, Any] = {"messages": USER, "max_tokens": 2, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return client.post("/v1/chat/completions", json=body)


def metric_models(text: str) -> set[str]:
    """Every value the ``model`` label takes in a Prometheus exposition."""
    found: set[str] = set()
    for line in text.splitlines():
        if line.startswith("#") or 'model="' not in line:
            continue
        found.add(line.split('model="', 1)[1].split('"', 1)[0])
    return found


# --------------------------------------------------------------------------- one name per model


@pytest.mark.slow
def test_a_model_has_one_name_in_answers_metrics_and_the_ledger(paths: dict[str, str], tmp_path: Path) -> None:
    from abstractruntime_mlx.ledger import Ledger, sqlite_url
    from abstractruntime_mlx.server.serve_ledger import ServeLedger, session_run_id

    ledger = Ledger(sqlite_url(tmp_path / "ledger.sqlite"))
    recorder = ServeLedger(ledger)
    app = create_app(models=[ModelSpec("a", paths["alpha"])], aliases={"x": "a"}, serve_ledger=recorder)
    try:
        with (
            serve_in_thread(app) as url,
            httpx.Client(base_url=url, timeout=60, headers={"X-Session-Affinity": "s1"}) as client,
        ):
            for spelling in ("a", "x", "mlx/a", paths["alpha"], None):
                answer = chat(client, spelling)
                assert answer.status_code == 200, answer.text
                assert answer.json()["model"] == "a"
            streamed = chat(client, "x", stream=True)
            assert '"model":"a"' in streamed.text and paths["alpha"] not in streamed.text
            loaded = client.post("/acore/models/load", json={"model": "x"}).json()
            assert loaded["model"] == "a" and loaded["loaded_new"] is False
            assert metric_models(client.get("/metrics").text) == {"a"}
            recorder.drain(timeout_s=30)
        steps = ledger.run_steps(session_run_id("s1"))
        assert len(steps) == 12  # six calls, started + completed
        assert {s.record["effect"]["payload"]["model"] for s in steps if s.status == "started"} == {"a"}
        assert {s.record["result"]["model"] for s in steps if s.status == "completed"} == {"a"}
    finally:
        ledger.close()


@pytest.mark.slow
def test_spellings_of_a_model_loaded_by_name_share_one_name_and_label(roots: Path, paths: dict[str, str]) -> None:
    app = create_app(model_roots=[roots])
    spellings = ["R/alpha", "R//alpha", "R///alpha", f"{roots}/R/alpha", f"{roots}//R/./alpha"]
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        for spelling in spellings:
            answer = chat(client, spelling, keep_alive=0)  # unloaded once idle: each spelling loads afresh
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "R/alpha"
            assert wait_until(lambda: app.state.pool.resident() == (), timeout_s=20)
        assert metric_models(client.get("/metrics").text) == {"R/alpha"}
        assert {name: c.loads for name, c in app.state.pool.counters().items()} == {"R/alpha": len(spellings)}
        loaded = client.post("/acore/models/load", json={"model": "R////alpha"}).json()
        assert loaded["model"] == "R/alpha"
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["R/alpha"]


def test_a_model_loaded_by_name_whose_name_is_taken_goes_by_its_path(roots: Path, paths: dict[str, str]) -> None:
    with TestClient(create_app(models=[ModelSpec("R/beta", paths["alpha"])], model_roots=[roots])) as client:
        answer = chat(client, f"{roots}/R/beta")  # not the --model named "R/beta": another checkpoint
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == paths["beta"]
        assert sorted(m["id"] for m in client.get("/v1/models").json()["data"]) == sorted(["R/beta", paths["beta"]])


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "a=/x", "--model", "b=/y", "--alias", "x=a", "--alias", "x=b"],
        ["--model", "a=/x", "--alias", "x=a", "--alias", "x=a"],
    ],
)
def test_serve_refuses_an_alias_given_twice(argv: list[str]) -> None:
    from abstractruntime_mlx.cli import serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers())
    with pytest.raises(InvalidRequest) as refused:
        serve_cmd.settings_from_args(parser.parse_args(["serve", *argv]), environ={})
    assert refused.value.details == {"field": "--alias", "alias": "x"}


def test_create_app_refuses_aliases_that_name_one_name_twice(paths: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="given twice"):
        create_app(models=[ModelSpec("a", paths["alpha"])], aliases={"x": "a", "mlx/x": "a"})


# --------------------------------------------------------------------------- 507 reasons


def test_a_model_larger_than_the_budget_is_refused_as_such_and_idle_models_stay(
    paths: dict[str, str], small_bytes: int
) -> None:
    specs = [
        ModelSpec("alpha", paths["alpha"]),
        ModelSpec("huge", paths["gamma"], options={"mlx_batching": True, "mlx_max_batch_size": 4}),
    ]
    budget = int(small_bytes * 2.5)
    assert estimate_footprint(Path(paths["gamma"]), max_batch_size=4).total_bytes > budget
    app = create_app(models=specs, residency=PoolSettings(memory_budget_bytes=budget))
    with TestClient(app) as client:
        assert chat(client, "alpha").status_code == 200
        refused = chat(client, "huge")
        assert refused.status_code == 507, refused.text
        details = refused.json()["error"]["details"]
        assert details["reason"] == "larger_than_budget" and details["budget_bytes"] == budget
        assert [(k["model"], k["reason"]) for k in details["kept"]] == [("alpha", "idle")]
        assert [m.name for m in app.state.pool.resident()] == ["alpha"]  # nothing was evicted for it
        assert app.state.pool.counters()["alpha"].evictions == 0


# --------------------------------------------------------------------------- eviction under bursts


@pytest.mark.slow
def test_bursts_across_three_models_that_need_two_evictions_never_fail(paths: dict[str, str], small_bytes: int) -> None:
    """Two small models fit; gamma needs both evicted, and either small one needs gamma evicted.
    Requests arrive while each eviction runs: none may find its resident model closed."""
    specs = [
        ModelSpec("alpha", paths["alpha"]),
        ModelSpec("beta", paths["beta"]),
        ModelSpec("gamma", paths["gamma"], options=WIDE),
    ]
    budget = int(small_bytes * 2.5)
    wide = estimate_footprint(Path(paths["gamma"]), max_batch_size=2).total_bytes
    assert 2 * small_bytes <= budget < wide + small_bytes and wide <= budget
    app = create_app(models=specs, residency=PoolSettings(memory_budget_bytes=budget))
    pick = random.Random(7)
    rounds = [[pick.choice(("alpha", "beta", "gamma")) for _ in range(9)] for _ in range(8)]
    statuses: Counter[tuple[int, str]] = Counter()
    with (
        serve_in_thread(app) as url,
        httpx.Client(base_url=url, timeout=120) as client,
        ThreadPoolExecutor(9) as workers,
    ):
        for burst in rounds:
            for model, reply in zip(burst, workers.map(lambda m: chat(client, m), burst)):
                code = reply.json().get("error", {}).get("code", "") if reply.status_code != 200 else ""
                statuses[(reply.status_code, code)] += 1
                assert reply.status_code != 200 or reply.json()["model"] == model
    assert statuses == Counter({(200, ""): 72}), statuses
    counters = app.state.pool.counters()
    assert sum(c.evictions for c in counters.values()) >= 4  # the bursts did make the pool evict
    assert sum(c.refusals for c in counters.values()) == 0


def slow_unloading_factory(delay_s: float) -> Any:
    """Real providers whose unload takes ``delay_s`` longer: the window in which requests arrive
    while an eviction runs (a tiny model unloads too fast to aim a request into it)."""
    from abstractruntime_mlx import create_llm

    def factory(model: str, **options: object) -> Any:
        llm = create_llm("mlx", model=model, **options)
        unload = llm.unload_model

        def slow_unload(model_name: str | None = None) -> object:
            time.sleep(delay_s)
            return unload(model_name)

        llm.unload_model = slow_unload  # type: ignore[method-assign]
        return llm

    return factory


@pytest.mark.slow
def test_a_request_that_leases_the_next_victim_mid_eviction_keeps_its_model(
    paths: dict[str, str], small_bytes: int
) -> None:
    specs = [
        ModelSpec("alpha", paths["alpha"]),
        ModelSpec("beta", paths["beta"]),
        ModelSpec("gamma", paths["gamma"], options=WIDE),
    ]
    app = create_app(
        models=specs,
        residency=PoolSettings(memory_budget_bytes=int(small_bytes * 2.5)),
        model_factory=slow_unloading_factory(0.3),
    )
    pool = app.state.pool
    with (
        serve_in_thread(app) as url,
        httpx.Client(base_url=url, timeout=120) as client,
        ThreadPoolExecutor(1) as loader,
    ):
        for name in ("alpha", "beta"):  # alpha is the least recently used: the first victim
            assert chat(client, name).status_code == 200
        gamma = loader.submit(chat, client, "gamma")  # needs alpha and beta evicted
        assert wait_until(lambda: {m.name: m.state.value for m in pool.models()}["alpha"] == "unloading", timeout_s=20)
        # EOS (id 2) held off: beta streams its whole cap, long past the first eviction.
        body = {
            "model": "beta",
            "messages": USER,
            "max_tokens": 300,
            "temperature": 0,
            "stream": True,
            "logit_bias": {"2": -100},
        }
        with client.stream("POST", "/v1/chat/completions", json=body) as running:
            events = [line for line in running.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
        finishes = [
            c["finish_reason"] for e in events[:-1] for c in json.loads(e[6:])["choices"] if c.get("finish_reason")
        ]
        assert len(finishes) == 1  # the stream ended with its answer, not closed under it
        assert gamma.result().status_code == 200, gamma.result().text  # loaded once beta went idle
        counters = pool.counters()
        assert (counters["alpha"].evictions, counters["beta"].evictions, counters["gamma"].refusals) == (1, 1, 0)


# --------------------------------------------------------------------------- operator settings


@pytest.fixture()
def operator_app(roots: Path, paths: dict[str, str]) -> Any:
    """A server started with cache sharing by key (for its --model and for models loaded by name)."""
    operator = {"mlx_cache_sharing": "key"}
    return create_app(
        models=[ModelSpec("alpha", paths["alpha"], options=operator)],
        model_roots=[roots],
        residency=PoolSettings(default_options=operator),
    )


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("mlx_cache_sharing", "scope"),
        ("mlx_cache_scope", "tenant-b"),
        ("mlx_cache_disk_max_gb", 100000),
        ("mlx_cache_memory_max_gb", 0.5),
        ("mlx_max_batch_size", 100000),
        ("mlx_max_queue_size", 10**9),
        ("mlx_queue_timeout_s", 86400.0),
    ],
)
@pytest.mark.parametrize("model", ["alpha", "R/beta"])
def test_a_client_cannot_load_with_an_operator_setting(
    operator_app: Any, option: str, value: object, model: str
) -> None:
    with TestClient(operator_app) as client:
        refused = client.post("/acore/models/load", json={"model": model, "options": {option: value}})
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == "operator_setting" and error["type"] == "permission_error"
        assert error["details"]["field"] == f"options.{option}"
        assert ("limit" in error["details"]) is (option in CLIENT_LIMITS)
        assert operator_app.state.pool.resident() == ()  # refused before anything loaded


def test_a_client_cannot_put_the_disk_tier_anywhere(operator_app: Any, tmp_path: Path) -> None:
    fresh = tmp_path / "elsewhere" / "cache"
    with TestClient(operator_app) as client:
        refused = client.post(
            "/acore/models/load",
            json={"model": "R/beta", "options": {"mlx_cache_disk_path": str(fresh), "mlx_cache_disk_max_gb": 1}},
        )
        assert (
            refused.status_code == 403 and refused.json()["error"]["details"]["field"] == "options.mlx_cache_disk_path"
        )
    assert not (tmp_path / "elsewhere").exists()


def test_the_operators_settings_stay_under_a_clients_options(operator_app: Any) -> None:
    with TestClient(operator_app) as client:
        same = client.post("/acore/models/load", json={"model": "alpha", "options": {"mlx_cache_sharing": "key"}})
        assert same.status_code == 200, same.text  # the operator's own value changes nothing
        assert same.json()["options"]["mlx_cache_sharing"] == "key"
        tuned = client.post("/acore/models/load", json={"model": "R/beta", "options": {"mlx_max_queue_size": 8}})
        assert tuned.status_code == 200, tuned.text
        options = tuned.json()["options"]
        assert options["mlx_max_queue_size"] == 8 and options["mlx_cache_sharing"] == "key"


def test_client_load_options_bounds() -> None:
    operator = {"mlx_max_batch_size": 128}
    assert client_load_options({"mlx_max_batch_size": 128}, operator=operator) == {"mlx_max_batch_size": 128}
    assert client_load_options({"mlx_max_batch_size": 64, "mlx_batching": True}, operator={}) == {
        "mlx_max_batch_size": 64,
        "mlx_batching": True,
    }
    assert client_load_options({"mlx_cache_scope": "local"}, operator={}) == {}  # the default, unchanged
    with pytest.raises(OperatorSetting) as refused:
        client_load_options({"mlx_max_batch_size": 65}, operator={})
    assert refused.value.details == {
        "field": "options.mlx_max_batch_size",
        "option": "mlx_max_batch_size",
        "limit": 64.0,
    }
    assert error_class_for_code("operator_setting") is OperatorSetting
    assert json.loads(json.dumps(refused.value.to_dict()))["code"] == "operator_setting"
