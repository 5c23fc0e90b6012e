"""What the inspector shows of each call's input, model and cost, on real runs of two test flows:

- ``tests/flows/context_call.json``: an LLM call built from the run's context messages
  (``include_context``): a user turn, an assistant tool call, the tool's result, an answer, then
  the node's prompt; the host stamps the prompt turn with ``<runtime_metadata>``, the node sends
  it without.
- ``tests/flows/two_agents.json``: two agent nodes one after the other (each a child run).

Both run once per module through the real host on a tiny model built for this module (so its
first call loads it: the load is a span of its own), on a SQLite ledger; then the JSON API, the
pages in headless Chromium, ``runs show`` (text and ``--json``) and ``run``'s own output are read.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from abstractruntime_mlx.ledger import Ledger, sqlite_url
from abstractruntime_mlx.server.inspector import create_inspector_app
from abstractruntime_mlx.testing import tiny_model

FLOWS = Path(__file__).parent / "flows"
CONTEXT = {
    "messages": [
        {"role": "user", "content": "What files are here?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "list_files", "arguments": '{"pattern": "*"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "list_files", "content": "a.txt\nb.txt"},
        {"role": "assistant", "content": "Two files: a.txt and b.txt."},
    ]
}
# The agent's cap travels as _runtime.max_output_tokens (AbstractAgent reads it), keeping turns short.
VARS = {"context": CONTEXT, "_runtime": {"max_output_tokens": 8}}


@dataclasses.dataclass(frozen=True)
class Runs:
    url: str
    model: str
    context_run: str
    agents_run: str


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    from abstractruntime_mlx.nodes import default_registry
    from abstractruntime_mlx.runtime_plugin import load_flow, run_flow

    root = tmp_path_factory.mktemp("conversation")
    model = str(tiny_model(root / "dense-long", kind="dense-long"))  # not resident yet: the first call loads it
    url = sqlite_url(root / "ledger.sqlite")
    (context_run,) = run_flow(
        load_flow(FLOWS / "context_call.json"), ledger_url=url, model=model, force_model=True, vars=VARS
    )
    (agents_run,) = run_flow(
        load_flow(FLOWS / "two_agents.json"), ledger_url=url, model=model, force_model=True, vars=VARS
    )
    assert context_run.status == "completed" and agents_run.status == "completed", (context_run, agents_run)
    yield Runs(url, model, context_run.run_id, agents_run.run_id)
    default_registry().close()


@pytest.fixture()
def client(runs: Runs) -> Iterator[TestClient]:
    with TestClient(create_inspector_app(runs.url)) as c:
        yield c


# ------------------------------------------------------------------------------ JSON API


def test_a_call_built_from_messages_shows_the_conversation_model_and_route(client: TestClient, runs: Runs) -> None:
    view = client.get(f"/api/runs/{runs.context_run}").json()
    (call,) = view["calls"]
    messages = call["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert messages[0]["content"] == "You are terse."
    assert messages[2]["tool_calls"][0]["function"]["name"] == "list_files"
    assert (messages[3]["tool_call_id"], messages[3]["content"]) == ("call_1", "a.txt\nb.txt")
    # The host stamped the prompt turn; the node sent it bare, and that is what is shown.
    assert messages[-1]["content"] == "And the weather?"
    assert (call["prompt"], call["system_prompt"]) == ("And the weather?", "You are terse.")
    assert call["prompt_tokens"] > 0 and call["new_from"] == 0
    assert call["model"] == runs.model
    assert call["route"]["served"] == {"provider": "mlx", "model": runs.model}
    assert call["route"]["asked"] == {"provider": "lmstudio", "model": "qwen/qwen3-next-80b"}
    assert view["output"]["answer"] == call["response"]


def test_a_model_load_is_its_own_span_before_the_first_call(client: TestClient, runs: Runs) -> None:
    (call,) = client.get(f"/api/runs/{runs.context_run}").json()["calls"]
    load = call["load"]
    assert (load["model"], load["state"]) == (runs.model, "loaded")
    assert load["size_bytes"] > 0 and load["seconds"] > 0
    phases = [s["phase"] for s in call["segments"]]
    assert phases[0] == "load" and phases[-1] == "generate"
    assert call["segments"][0]["end_s"] <= call["segments"][1]["start_s"] + 1e-6
    # The next flow's calls found the model resident: no load.
    agents = client.get(f"/api/runs/{runs.agents_run}").json()
    assert all(c["load"] == {} for span in agents["spans"] for c in span["calls"])


def test_a_root_run_totals_its_agents_and_names_them(client: TestClient, runs: Runs) -> None:
    view = client.get(f"/api/runs/{runs.agents_run}").json()
    assert view["calls"] == [] and view["run"]["prompt_tokens"] == 0  # the root makes no call itself
    spans = view["spans"]
    assert [(s["kind"], s["node_id"], s["node_label"]) for s in spans] == [
        ("agent", "writer", "writer"),
        ("agent", "critic", "critic"),
    ]
    calls = [c for s in spans for c in s["calls"]]
    totals = view["totals"]
    assert totals["runs"] == 3 and totals["calls"] == len(calls) >= 2
    assert totals["prompt_tokens"] == sum(c["prompt_tokens"] for c in calls) > 0
    assert totals["generated_tokens"] == sum(c["generated_tokens"] for c in calls) > 0
    assert totals["cached_tokens"] == sum(c["cached_tokens"] or 0 for c in calls)
    assert totals["elapsed_s"] >= max(s["end_s"] for s in spans) - 1e-6
    assert all(c["model"] == runs.model and c["messages"][0]["role"] == "system" for c in calls)
    # A later turn of an agent repeats the transcript: new_from says where this turn's part starts.
    writer = spans[0]["calls"]
    if len(writer) > 1:
        assert writer[1]["new_from"] > 0
        assert writer[1]["messages"][: writer[1]["new_from"]] == writer[0]["messages"][: writer[1]["new_from"]]
    # The list shows the same totals on the root row.
    (row,) = [r for r in client.get("/api/runs").json()["runs"] if r["run_id"] == runs.agents_run]
    assert {k: row["totals"][k] for k in ("prompt_tokens", "generated_tokens", "cached_tokens", "runs")} == {
        k: totals[k] for k in ("prompt_tokens", "generated_tokens", "cached_tokens", "runs")
    }


def test_a_busy_tree_counts_up_and_a_finished_one_stops(runs: Runs) -> None:
    from abstractruntime_mlx.cli.live import run_elapsed
    from abstractruntime_mlx.inspection import run_view

    with Ledger(runs.url) as ledger:
        tree = run_view(ledger, runs.agents_run)
        root = run_view(ledger, runs.agents_run, tree=False)
        assert tree is not None and root is not None
        children = [view for s in tree.spans if (view := run_view(ledger, s.run.run_id, tree=False)) is not None]
    later = root.summary.created_at + dt.timedelta(seconds=500)
    # Finished: the tree's time ends at its last checkpoint, whatever the clock says.
    assert run_elapsed(root, [root, *children], later) == pytest.approx(tree.totals.elapsed_s, abs=1e-3)
    assert tree.totals.elapsed_s < 500
    # The root waits on its agent while the agent runs: the root's time goes on.
    waiting = dataclasses.replace(
        root, summary=dataclasses.replace(root.summary, status="waiting", wait_reason="subworkflow")
    )
    busy_child = dataclasses.replace(children[0], summary=dataclasses.replace(children[0].summary, status="running"))
    assert run_elapsed(waiting, [waiting, busy_child], later) == pytest.approx(500.0)


def test_the_input_sent_records_only_the_turns_the_node_changed() -> None:
    from abstractruntime_mlx.runtime_plugin.adapter.payload import input_as_sent, request_from_payload

    stamp = '<runtime_metadata>{"display":"[2026-01-01 10:00:00]"}</runtime_metadata>\n'
    payload = {
        "prompt": stamp + "go",
        "messages": [{"role": "user", "content": stamp + "hi"}, {"role": "assistant", "content": "yo"}],
    }
    assert input_as_sent(payload, request_from_payload(payload, {})) == {"prompt": "go", "messages": {"0": "hi"}}
    plain = {"prompt": "go", "messages": [{"role": "user", "content": "hi"}]}
    assert input_as_sent(plain, request_from_payload(plain, {})) == {}


# ------------------------------------------------------------------------------ CLI


def test_runs_show_json_and_text_show_input_model_and_output(runs: Runs, capsys: pytest.CaptureFixture[str]) -> None:
    from abstractruntime_mlx.cli.main import main

    assert main(["runs", "show", runs.context_run, "--ledger", runs.url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    (call,) = shown["calls"]
    assert [m["role"] for m in call["messages"]] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert call["model"] == runs.model and shown["output"]["answer"] == call["response"]
    assert main(["runs", "show", runs.agents_run, "--ledger", runs.url, "--json"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert tree["totals"]["prompt_tokens"] > 0 and tree["totals"]["runs"] == 3

    assert main(["runs", "show", runs.context_run, "--ledger", runs.url]) == 0
    text = capsys.readouterr().out
    assert "output answer:" in text and "output success: true" in text
    assert f"served by {runs.model}" in text
    assert "[tool] name=list_files tool_call_id=call_1" in text and "a.txt" in text
    assert "model load: loaded in" in text
    assert main(["runs", "show", runs.agents_run, "--ledger", runs.url]) == 0
    assert "with its 2 child runs:" in capsys.readouterr().out


def test_run_prints_the_flows_output_at_the_end(runs: Runs, cli_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from abstractruntime_mlx.cli.main import main

    code = main(
        [
            "run",
            str(FLOWS / "context_call.json"),
            "--model",
            runs.model,
            "--ledger",
            str(cli_env),
            "--var",
            f"context={json.dumps(CONTEXT)}",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    answers = [i for i, line in enumerate(lines) if line.startswith("  output answer:")]
    assert answers and any(line.startswith("  output success: true") for line in lines[answers[0] :])


# ------------------------------------------------------------------------------ browser


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
def test_pages_show_the_prompt_the_model_and_root_totals_in_chromium(runs: Runs, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = _chromium()
    if executable is None:
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    from tests.test_inspector import Server

    with Server(runs.url) as server, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1200})
            page.goto(server.base_url + "/")
            root = page.locator(f"#runs tr.root[data-run-id='{runs.agents_run}']")
            assert int(root.locator("td.tokens-in").inner_text().replace(",", "")) > 0
            assert int(root.locator("td.tokens-out").inner_text().replace(",", "")) > 0

            # The two-agent root: its agents' turns are on its timeline, under their agent node.
            page.goto(f"{server.base_url}/runs/{runs.agents_run}")
            page.wait_for_selector("#timeline svg")
            assert page.locator("#timeline .span-label").evaluate_all("els => els.map(e => e.textContent)")[:2] == [
                "▸ agent writer",
                "▸ agent critic",
            ]
            tokens_in = page.locator("#tokens").inner_text().split(" in", 1)[0]  # "6,200 in / 2,704 from cache / ..."
            assert int(tokens_in.replace(",", "")) > 0
            turn = page.locator("#timeline .bar[data-turn='1']").first
            turn.click()
            assert page.locator("#served-model").inner_text() == runs.model
            roles = page.locator("#messages .message-item").evaluate_all("els => els.map(e => e.dataset.role)")
            assert roles and roles[0] == "system"
            page.screenshot(path=str(tmp_path / "agents.png"), full_page=True)

            # The call built from messages: every turn with its role, tool call and result, the prompt.
            page.goto(f"{server.base_url}/runs/{runs.context_run}")
            page.wait_for_selector("#messages")
            roles = page.locator("#messages .message-item").evaluate_all("els => els.map(e => e.dataset.role)")
            assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
            assert "And the weather?" in page.locator("#messages .message-item[data-index='5']").inner_text()
            assert "list_files" in page.locator("#messages .message-item[data-index='2']").inner_text()
            assert page.locator("#served-model").inner_text() == runs.model
            assert page.locator("#timeline .seg-load").count() == 1
            assert page.locator("#output .output-field[data-field='answer']").count() == 1
            panel = page.locator("#panel").inner_text()
            assert panel.count("cached tokens") == 1 and "cached prompt tokens" not in panel
        finally:
            browser.close()
