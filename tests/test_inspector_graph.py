"""The run page of a real run tree in Debian's headless Chromium: the flow's graph with each
node's state, a subflow, an agent, a loop (calls numbered #1..#3) and a waiting node, the child
runs linked both ways, then the page following the run live as its question is answered.

The run is ``tests/flows/tour.json`` (a subflow, a loop of three LLM calls, an agent, an
``ask_user``, a second LLM node with the same label as the first) on the tiny ``dense-long``
model. Screenshots land in ``build/test-artifacts/inspector``, or in ``docs/img`` (the ones
``docs/inspector.md`` shows) with ``INSPECTOR_DOC_IMAGES=1``."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from abstractruntime_mlx.ledger import sqlite_url
from abstractruntime_mlx.testing import tiny_model
from test_inspector import ARTIFACTS, ROOT, Server

FLOW = Path(__file__).resolve().parent / "flows" / "tour.json"
IMAGES = ROOT / "docs" / "img" if os.environ.get("INSPECTOR_DOC_IMAGES") == "1" else ARTIFACTS


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_model(tmp_path_factory.mktemp("agent-model") / "dense-long", kind="dense-long"))


@pytest.fixture(scope="module")
def tour(tmp_path_factory: pytest.TempPathFactory, agent_model: str) -> Iterator[tuple[str, str]]:
    """(ledger URL, root run id) of one run of the tour flow, waiting at its question."""
    from abstractruntime_mlx.nodes import default_registry
    from abstractruntime_mlx.runtime_plugin import run_flow

    url = sqlite_url(tmp_path_factory.mktemp("tour") / "ledger.sqlite")
    (result,) = run_flow(FLOW, ledger_url=url, model=agent_model, force_model=True)
    assert result.status == "waiting" and len(result.children) == 2, result
    yield url, result.run_id
    default_registry().close()


def _states(page: object) -> dict[str, tuple[str, int]]:
    found = page.locator("#graph .gnode").evaluate_all(  # type: ignore[attr-defined]
        "els => els.map(e => [e.dataset.node, e.dataset.state, Number(e.dataset.visits)])"
    )
    return {node: (state, visits) for node, state, visits in found}


@pytest.mark.slow
def test_run_tree_graph_live_in_chromium(tour: tuple[str, str], agent_model: str) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    from abstractruntime_mlx.runtime_plugin import resume_run

    url, root = tour
    IMAGES.mkdir(parents=True, exist_ok=True)
    with Server(url, poll_interval_s=0.1) as server, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{server.base_url}/runs/{root}")
            page.wait_for_selector("#graph svg")

            # The graph: every node of the flow, in the editor's layout, with its state in this run.
            assert _states(page) == {
                "start": ("completed", 1),
                "sub": ("completed", 1),
                "each": ("completed", 1),
                "llm-a": ("completed", 3),
                "agent": ("completed", 1),
                "ask": ("waiting", 1),
                "llm-b": ("idle", 0),
                "end": ("idle", 0),
            }
            labels = page.locator("#graph .gnode .glabel").evaluate_all("els => els.map(e => e.textContent)")
            assert "LLM Call (llm-a)" in labels and "LLM Call (llm-b)" in labels  # one label, told apart
            assert page.locator("#graph path.edge").count() == 10

            # Child runs (the subflow and the agent), linked from the page and drawn as spans.
            children = page.locator("#children tbody tr")
            assert children.count() == 2
            child_ids = children.evaluate_all("els => els.map(e => e.dataset.runId)")
            assert page.locator("#timeline g.span").count() == 2
            assert page.locator("#timeline g.bar.child-call").count() >= 2  # the subflow's call, the agent's turns

            # A loop node's calls are numbered; clicking the node opens them, with its inputs and outputs.
            page.locator("#graph .gnode[data-node='llm-a']").click()
            assert page.locator("#panel .node-calls a").all_inner_texts() == [
                f"LLM Call (llm-a) #{i}" for i in (1, 2, 3)
            ]
            assert '"prompt"' in page.locator("#panel pre.node-inputs").inner_text()
            assert '"content"' in page.locator("#panel pre.node-outputs").inner_text()
            page.locator("#panel .node-calls a").nth(1).click()
            assert page.locator("#panel h2").inner_text().startswith("LLM Call (llm-a) #2")
            page.locator("#graph .gnode[data-node='sub']").click()
            assert page.locator("#panel .node-children a").all_inner_texts() == [child_ids[0]]
            page.screenshot(path=str(IMAGES / "inspector-graph.png"), full_page=True)

            # A child run's page: its own graph (the subflow's), and a link back to its parent.
            page.locator("#panel .node-children a").first.click()
            page.wait_for_selector("#graph svg")
            assert page.locator("#summary a").first.inner_text() == root
            assert set(_states(page)) == {"start", "sum", "end"}
            assert page.locator("#graph .gnode[data-node='sum']").get_attribute("data-state") == "completed"

            # Live: the open root page follows the run as its question is answered and it ends.
            page.goto(f"{server.base_url}/runs/{root}")
            page.wait_for_selector("#graph .gnode[data-node='ask'][data-state='waiting']")
            worker = threading.Thread(
                target=lambda: resume_run(root, ledger_url=url, model=agent_model, answer="caches"), daemon=True
            )
            worker.start()
            page.wait_for_selector("#graph .gnode[data-node='llm-b'][data-state='completed']", timeout=120_000)
            page.wait_for_selector("#summary .status-completed", timeout=60_000)
            worker.join(timeout=60)
            assert _states(page)["ask"] == ("completed", 1) and _states(page)["end"][0] == "completed"
            page.screenshot(path=str(IMAGES / "inspector-graph-done.png"), full_page=True)
            assert errors == []
        finally:
            browser.close()
