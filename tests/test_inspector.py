"""The web inspector (``runs web``): JSON routes, pages, auth, live event streams, a real browser.

The ledger is written by real flow runs (examples/fanout.json on the tiny hybrid MTP model);
live cases add rows through the ledger's own API while a real server on 127.0.0.1 streams them.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from abstractruntime_mlx.ledger import Ledger, NodeKey, ProgressEvent, sqlite_url
from abstractruntime_mlx.nodes import default_registry
from abstractruntime_mlx.server.inspector import STATIC_DIR, create_inspector_app

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fanout.json"
ARTIFACTS = Path(os.environ.get("INSPECTOR_ARTIFACTS", ROOT / "build" / "test-artifacts" / "inspector"))
FANOUT_NODES = {"plain", "mtp2", "inherit", "think"}


@pytest.fixture(scope="module")
def flow_ledger(tmp_path_factory: pytest.TempPathFactory, hybrid_model: str) -> Iterator[str]:
    """A SQLite ledger holding two real runs of the fan-out example."""
    from abstractruntime_mlx.runtime_plugin import run_flow

    url = sqlite_url(tmp_path_factory.mktemp("inspector") / "ledger.sqlite")
    # Strict MTP as the provider default (nodes inherit require_acceleration): optional MTP
    # beside the plain branch would run target-only (deferred under load).
    strict = {"speculation": {"require_acceleration": True}}
    results = run_flow(EXAMPLE, runs=2, ledger_url=url, model=hybrid_model, force_model=True, provider_options=strict)
    assert [r.status for r in results] == ["completed", "completed"]
    yield url
    default_registry().close()


@pytest.fixture()
def client(flow_ledger: str) -> Iterator[TestClient]:
    app = create_inspector_app(flow_ledger)
    with TestClient(app, base_url="http://inspector", follow_redirects=False) as c:
        yield c


# ----------------------------------------------------------------------------- JSON


def test_run_list_shows_runs_with_tokens_and_filters(client: TestClient) -> None:
    body = client.get("/api/runs").json()
    assert len(body["runs"]) == 2
    assert body["workflows"] == ["mlx_fanout"]
    for run in body["runs"]:
        assert run["status"] == "completed" and run["workflow_id"] == "mlx_fanout"
        assert run["node_count"] == 5 and run["progress_count"] >= 8
        assert run["generated_tokens"] == 4 * 32  # four LLM nodes, max_output_tokens 32 each
        assert run["prompt_tokens"] > 0 and run["duration_s"] > 0
    assert len(client.get("/api/runs", params={"status": "completed"}).json()["runs"]) == 2
    assert client.get("/api/runs", params={"status": "failed"}).json()["runs"] == []
    assert client.get("/api/runs", params={"workflow": "other"}).json()["runs"] == []
    assert len(client.get("/api/runs", params={"workflow": "mlx_fanout", "limit": "1"}).json()["runs"]) == 1


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"status": "done"}, "status"),
        ({"limit": "0"}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"limit": "9999999"}, "limit"),
        ({"limit": "²"}, "limit"),  # "²".isdigit() is true, int("²") raises
        ({"limit": "٣"}, "limit"),  # int("٣") would be 3
        ({"limit": "9" * 5000}, "limit"),
        ({"workflow": "w" * 300}, "workflow"),
    ],
)
def test_bad_filters_are_400_naming_the_field(client: TestClient, params: dict[str, str], field: str) -> None:
    for path in ("/api/runs", "/api/runs/stream"):
        response = client.get(path, params=params)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "invalid_request" and field in error["message"]
    page = client.get("/", params=params)
    assert page.status_code == 400 and field in page.text


def test_run_view_has_one_bar_per_call_with_phase_segments_and_control_sources(client: TestClient) -> None:
    run_id = client.get("/api/runs").json()["runs"][0]["run_id"]
    view = client.get(f"/api/runs/{run_id}").json()
    assert view["run"]["run_id"] == run_id and view["live"] is False
    calls = {c["node_id"]: c for c in view["calls"]}
    assert set(calls) == FANOUT_NODES
    for call in calls.values():
        phases = [s["phase"] for s in call["segments"]]
        assert "prefill" in phases and phases[-1] == "generate"
        for seg in call["segments"]:
            assert 0 <= seg["start_s"] <= seg["end_s"] <= view["horizon_s"]
        assert call["status"] == "completed" and call["finish_reason"] == "length"
        assert call["generated_tokens"] == 32 and call["response"]
        assert call["lane"] in {"continuous", "cohort", "exclusive", "serialized"}
        assert call["samples"][0]["phase"] == "prefill" and call["samples"][-1]["phase"] == "complete"
        assert call["prompt"].endswith("?")
    controls = {name: {c["name"]: (c["value"], c["source"]) for c in call["controls"]} for name, call in calls.items()}
    assert controls["plain"] == {"speculation": ("off", "call"), "thinking": ("off", "call")}
    assert controls["mtp2"]["speculation"] == ("native_mtp(depth=2)", "call")
    assert controls["think"]["thinking"] == ("high", "call")
    assert controls["inherit"]["speculation"][1] != "call"  # decided above the node
    assert calls["mtp2"]["speculation"]["used"] is True and 0 < calls["mtp2"]["acceptance"] <= 1
    assert calls["plain"]["acceptance"] is None
    assert calls["plain"]["execution"]["peak_batch_size"] >= 1
    seqs = [s["seq"] for s in view["steps"]]  # ledger order; phase events share the sequence
    assert seqs[0] == 1 and seqs == sorted(set(seqs))


def test_unknown_run_is_a_typed_404(client: TestClient) -> None:
    response = client.get("/api/runs/no-such-run")
    assert response.status_code == 404 and response.json()["error"]["code"] == "run_not_found"
    assert client.get("/api/runs/no-such-run/stream").status_code == 404
    page = client.get("/runs/no-such-run")
    assert page.status_code == 404 and "no run &#x27;no-such-run&#x27;" in page.text
    assert client.get("/api/nothing").json()["error"]["code"] == "not_found"
    assert client.post("/api/runs").status_code == 405  # read-only: no writing route exists


def test_pages_embed_their_data_and_ship_their_own_assets(client: TestClient) -> None:
    listing = client.get("/")
    assert listing.status_code == 200 and listing.headers["content-type"].startswith("text/html")
    data = json.loads(
        re.search(r'<script id="initial" type="application/json">(.*?)</script>', listing.text, re.S).group(1)
    )  # type: ignore[union-attr]
    assert len(data["runs"]) == 2
    run_id = data["runs"][0]["run_id"]
    page = client.get(f"/runs/{run_id}")
    assert page.status_code == 200 and run_id in page.text
    for asset in ("inspector.js", "inspector.css"):
        response = client.get(f"/static/{asset}")
        assert response.status_code == 200 and len(response.text) > 1000
    for path in STATIC_DIR.iterdir():  # no CDN, no font service: nothing is fetched at view time
        assert not re.search(r"(src|href)=[\"']?(https?:)?//", path.read_text(encoding="utf-8")), path.name
        assert "@import" not in path.read_text(encoding="utf-8")


def test_embedded_data_cannot_close_its_script_tag(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "ledger.sqlite")
    with Ledger(url) as ledger:
        ledger.save_run(_run_state("r-1", workflow_id="</script><script>alert(1)</script>"))
    app = create_inspector_app(url)
    with TestClient(app, base_url="http://inspector", follow_redirects=False) as c:
        page = c.get("/").text
    assert "</script><script>alert(1)" not in page and "\\u003c/script>" in page


HOSTILE_ID = "child-</script><img src=x onerror=alert(1)>&\"'"
HOSTILE_HREF = "/runs/child-%3C%2Fscript%3E%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E%26%22'"  # encodeURIComponent


def _tree_ledger(url: str) -> None:
    """A parent run with two child runs (one of them with a child of its own, and a hostile id)
    beside a run without children."""
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    at = lambda s: (t0 + dt.timedelta(seconds=s)).isoformat()  # noqa: E731
    with Ledger(url) as ledger:
        ledger.save_run(_run_state("lone", status="completed", workflow_id="w_lone", created_at=at(0)))
        ledger.save_run(_run_state("root", status="completed", workflow_id="w_parent", created_at=at(1)))
        ledger.save_run(
            _run_state("sub-1", status="completed", workflow_id="w_child", created_at=at(2), parent_run_id="root")
        )
        ledger.save_run(
            _run_state(HOSTILE_ID, status="failed", workflow_id="w_child", created_at=at(3), parent_run_id="root")
        )
        ledger.save_run(
            _run_state("agent-1", status="completed", workflow_id="w_agent", created_at=at(4), parent_run_id=HOSTILE_ID)
        )


def test_run_list_nests_child_runs_under_their_root(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "tree.sqlite")
    _tree_ledger(url)
    with TestClient(create_inspector_app(url), base_url="http://inspector") as c:
        runs = {r["run_id"]: r for r in c.get("/api/runs").json()["runs"]}
        assert set(runs) == {"lone", "root"}  # child runs are not rows of their own
        assert runs["lone"]["children"] == []
        sub, hostile = runs["root"]["children"]  # oldest first
        assert (sub["run_id"], sub["parent_run_id"], sub["children"]) == ("sub-1", "root", [])
        assert (hostile["run_id"], hostile["status"]) == (HOSTILE_ID, "failed")
        assert [(g["run_id"], g["parent_run_id"], g["children"]) for g in hostile["children"]] == [
            ("agent-1", HOSTILE_ID, [])
        ]
        # Filters pick top-level runs; their child runs come along whatever their status.
        failed = c.get("/api/runs", params={"status": "failed"}).json()["runs"]
        assert failed == []
        (only,) = c.get("/api/runs", params={"workflow": "w_parent", "limit": "1"}).json()["runs"]
        assert [k["run_id"] for k in only["children"]] == ["sub-1", HOSTILE_ID]
        assert c.get("/api/runs", params={"workflow": "w_child"}).json()["runs"] == []

        page = c.get("/").text  # the list page embeds the same tree, with no markup of a run id
        assert "<img src=x" not in page and "</script><img" not in page
        data = json.loads(
            re.search(r'<script id="initial" type="application/json">(.*?)</script>', page, re.S).group(1)
        )  # type: ignore[union-attr]
        assert [k["run_id"] for k in {r["run_id"]: r for r in data["runs"]}["root"]["children"]] == [
            "sub-1",
            HOSTILE_ID,
        ]

        child_page = c.get("/runs/sub-1")  # a child run's view names its parent (the page links it)
        assert child_page.status_code == 200
        assert c.get("/api/runs/sub-1").json()["run"]["parent_run_id"] == "root"


def test_list_script_renders_child_rows_as_escaped_links(tmp_path: Path) -> None:
    """inspector.js under node with a minimal DOM: each root row has its child count, the child
    rows (hidden until the count is clicked) link to their run pages, and every id is text and
    an encoded URL, never markup; a child run's page links to its parent."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on PATH")
    url = sqlite_url(tmp_path / "tree.sqlite")
    _tree_ledger(url)
    with TestClient(create_inspector_app(url), base_url="http://inspector") as c:
        listing = c.get("/api/runs").json()
        child_view = c.get("/api/runs/agent-1").json()
    harness = tmp_path / "render.js"
    harness.write_text(
        LIST_HARNESS.replace("__SCRIPT__", json.dumps(str(STATIC_DIR / "inspector.js"))), encoding="utf-8"
    )
    done = subprocess.run(
        [node, str(harness)],
        input=json.dumps({"list": listing, "run": child_view}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    rows = out["closed"]
    assert [(r["class"], r["id"], r["hidden"]) for r in rows] == [
        ("root", "root", False),
        ("child", "sub-1", True),
        ("child", HOSTILE_ID, True),
        ("child", "agent-1", True),
        ("root", "lone", False),
    ]
    assert rows[0]["toggle"] == "▸ 3 child runs" and rows[4]["toggle"] is None
    assert [r["hidden"] for r in out["opened"]] == [False] * 5 and out["opened"][0]["toggle"] == "▾ 3 child runs"
    assert out["relisted"][1]["hidden"] is False  # a live update keeps the tree open
    hostile = rows[2]
    assert hostile["links"] == [{"href": HOSTILE_HREF, "text": HOSTILE_ID}]
    assert hostile["root"] == "root" and rows[3]["root"] == "root"
    assert out["markup"] == []  # no element was ever built from a run id
    assert out["parent"] == {"href": HOSTILE_HREF, "text": HOSTILE_ID}


LIST_HARNESS = r"""
// A minimal DOM: elements with attributes, text nodes and click listeners; enough for the list
// and the run summary. Element tags are recorded so a run id used as markup would show.
const fs = require("fs");
const created = [];
class Text { constructor(t) { this.text = String(t); } get textContent() { return this.text; } }
class Element {
  constructor(tag) {
    this.tag = tag; this.attrs = {}; this.children = []; this.listeners = {};
    this.className = ""; this.hidden = false; this.dataset = {}; created.push(tag);
  }
  setAttribute(k, v) {
    if (k === "hidden") this.hidden = true; else this.attrs[k] = v;
    if (k.startsWith("data-")) this.dataset[k.slice(5)] = v;
  }
  getAttribute(k) { return this.attrs[k]; }
  append(...nodes) { this.children.push(...nodes); }
  replaceChildren(...nodes) { this.children = nodes; }
  addEventListener(name, fn) { this.listeners[name] = fn; }
  get textContent() { return this.children.map((c) => c.textContent).join(""); }
  set textContent(t) { this.children = [new Text(t)]; }
  get options() { return this.children; }
  all(tag) {
    return this.children.flatMap((c) => c instanceof Element ? [...(c.tag === tag ? [c] : []), ...c.all(tag)] : []);
  }
}
globalThis.Node = Object;  // every node is an object
const input = JSON.parse(fs.readFileSync(0, "utf8"));
const byId = {};
const pageIds = ["ledger", "status", "workflow", "empty", "live", "filters", "crumb", "summary", "run-error",
  "timeline", "charts", "panel"];
for (const id of pageIds) byId[id] = new Element("div");
const tbody = new Element("tbody");
const stepsBody = new Element("tbody");
byId.initial = { textContent: JSON.stringify(input.list) };
byId.status.options[0] = new Element("option");
byId.workflow.options[0] = new Element("option");
globalThis.document = {
  body: { dataset: { page: "none" } },
  getElementById: (id) => byId[id],
  querySelector: (q) => (q === "#runs tbody" ? tbody : stepsBody),
  createElement: (tag) => new Element(tag),
  createTextNode: (t) => new Text(t),
  createElementNS: (_ns, tag) => new Element(tag),
};
globalThis.window = { addEventListener() {} };
(0, eval)(
  fs.readFileSync(__SCRIPT__, "utf8") + ";globalThis.renderList = renderList; globalThis.renderRun = renderRun;"
);
const rows = () => tbody.children.map((tr) => {
  const toggle = tr.all("button")[0];
  return { class: tr.className, id: tr.attrs["data-run-id"], root: tr.attrs["data-root"] ?? null, hidden: tr.hidden,
    toggle: toggle ? toggle.textContent : null,
    links: tr.all("a").map((a) => ({ href: a.attrs.href, text: a.textContent })) };
});
renderList(input.list);
const closed = rows();
tbody.children[0].all("button")[0].listeners.click();
const opened = rows();
renderList(input.list);
const relisted = rows();
const tags = new Set(["div", "tbody", "option", "tr", "td", "a", "button", "span", "b", "h1", "p", "svg", "g", "line",
  "text", "rect", "title", "table", "th", "h2", "h3", "pre", "polyline", "circle"]);
try { renderRun(input.run); } catch (e) { /* the timeline needs layout; the summary is drawn first */ }
const parentLink = byId.summary.all("a")[0];
process.stdout.write(JSON.stringify({ closed, opened, relisted, markup: created.filter((t) => !tags.has(t)),
  parent: parentLink ? { href: parentLink.attrs.href, text: parentLink.textContent } : null }));
"""


def test_api_key_guards_every_route(flow_ledger: str) -> None:
    app = create_inspector_app(flow_ledger, api_key="s3cret")
    with TestClient(app, base_url="http://inspector", follow_redirects=False) as c:
        for path in ("/api/runs", "/api/runs/stream", "/static/inspector.js"):
            response = c.get(path)
            assert response.status_code == 401
        assert c.get("/api/runs").json()["error"]["code"] == "unauthorized"
        page = c.get("/")
        assert page.status_code == 401 and "?key=" in page.text
        assert c.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/api/runs", params={"key": "s3cret"}).status_code == 200
        first = c.get("/", params={"key": "s3cret", "status": "completed"})
        assert first.status_code == 303 and first.headers["location"] == "/?status=completed"
        assert "httponly" in first.headers["set-cookie"].lower()
        assert c.get("/").status_code == 200  # the cookie now carries the key
        assert c.get("/static/inspector.css").status_code == 200
        c.cookies.clear()
        assert c.get("/", params={"key": "wrong"}).status_code == 401


# ----------------------------------------------------------------------------- live


def _run_state(run_id: str, *, status: str = "running", workflow_id: str = "live_flow", **extra: Any) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC).isoformat()
    return {
        "run_id": run_id,
        "workflow_id": workflow_id,
        "status": status,
        "created_at": extra.pop("created_at", now),
        "updated_at": now,
        "vars": {},
        **extra,
    }


def _progress(key: NodeKey, event: dict[str, Any]) -> ProgressEvent:
    return ProgressEvent(
        key=key, event={"kind": "llm", **event}, idempotency_key=f"p:{uuid.uuid4().hex}", created_at=time.time()
    )


class Server:
    """The inspector under uvicorn on 127.0.0.1 in a thread (a real socket, real SSE framing)."""

    def __init__(self, url: str, **options: Any) -> None:
        import uvicorn

        self.app = create_inspector_app(url, **options)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "inspector did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def _events(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    name = "message"
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            yield name, json.loads(line[6:])
            name = "message"


def test_run_stream_follows_a_run_in_progress_until_it_ends(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "live.sqlite")
    ledger = Ledger(url)
    ledger.save_run(_run_state("live-1"))
    key = NodeKey("live-1", "n1", workflow_id="live_flow", step_id="s1", attempt=1)
    ledger.append_progress(
        [_progress(key, {"phase": "prefill", "prompt_tokens": 512, "elapsed_s": 0.0, "event_index": 0})]
    )
    with Server(url, poll_interval_s=0.05) as server, httpx.Client(base_url=server.base_url, timeout=20) as http:
        with http.stream("GET", "/api/runs/live-1/stream") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = _events(response.iter_lines())
            name, view = next(events)
            assert name == "run" and view["live"] is True
            (call,) = view["calls"]
            assert call["phase"] == "prefill" and call["prefill_processed_tokens"] is None

            ledger.append_progress(
                [
                    _progress(
                        key,
                        {
                            "phase": "prefill",
                            "prompt_tokens": 512,
                            "prefill_processed_tokens": 256,
                            "elapsed_s": 0.1,
                            "event_index": 1,
                        },
                    )
                ]
            )
            name, view = next(events)
            assert name == "run" and view["calls"][0]["prefill_processed_tokens"] == 256

            ledger.append_progress(
                [
                    _progress(
                        key,
                        {
                            "phase": "generate",
                            "prompt_tokens": 512,
                            "generated_tokens": 1,
                            "ttft_s": 0.2,
                            "elapsed_s": 0.2,
                            "event_index": 2,
                        },
                    )
                ]
            )
            name, view = next(events)
            assert [s["phase"] for s in view["calls"][0]["segments"]] == ["prefill", "generate"]

            ledger.save_run(_run_state("live-1", status="completed"))
            name, view = next(events)
            assert name == "run" and view["live"] is False and view["run"]["status"] == "completed"
            assert next(events) == ("end", {"status": "completed"})
            assert next(events, None) is None  # the server closed the stream
    ledger.close()


def test_runs_stream_shows_a_new_run(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "live.sqlite")
    ledger = Ledger(url)
    ledger.save_run(_run_state("old", status="completed"))
    with Server(url, poll_interval_s=0.05) as server, httpx.Client(base_url=server.base_url, timeout=20) as http:
        with http.stream("GET", "/api/runs/stream", params={"workflow": "live_flow"}) as response:
            events = _events(response.iter_lines())
            name, listing = next(events)
            assert name == "runs" and [r["run_id"] for r in listing["runs"]] == ["old"]
            ledger.save_run(_run_state("new"))
            name, listing = next(events)
            assert [r["run_id"] for r in listing["runs"]] == ["new", "old"]
            assert listing["runs"][0]["status"] == "running"
            ledger.save_run(_run_state("new-sub", parent_run_id="new"))  # a child run nests under its root
            name, listing = next(events)
            assert [r["run_id"] for r in listing["runs"]] == ["new", "old"]
            assert [(c["run_id"], c["status"]) for c in listing["runs"][0]["children"]] == [("new-sub", "running")]
            ledger.save_run(_run_state("new-sub", status="completed", parent_run_id="new"))
            name, listing = next(events)
            assert [(c["run_id"], c["status"]) for c in listing["runs"][0]["children"]] == [("new-sub", "completed")]
    ledger.close()


# ----------------------------------------------------------------------------- browser


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.mark.slow
def test_in_a_real_browser(flow_ledger: str, hybrid_model: str, tmp_path: Path) -> None:
    """Headless Chromium (the distribution's package) driven by playwright: the run list, a run's
    timeline and node panel, then a run started after the page opened appearing without a reload,
    and a run in progress updating live. Screenshots of both pages land in ARTIFACTS."""
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = _chromium()
    if executable is None:
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    from abstractruntime_mlx.runtime_plugin import run_flow

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with Server(flow_ledger, poll_interval_s=0.1) as server, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(server.base_url + "/")
            rows = page.locator("#runs tbody tr")
            assert rows.count() == 2
            assert page.locator("#workflow option[value='mlx_fanout']").count() == 1
            page.screenshot(path=str(ARTIFACTS / "run-list.png"), full_page=True)

            # A run started now appears in the open list, and reaches completed, without a reload.
            done = threading.Event()
            worker = threading.Thread(
                target=lambda: (
                    run_flow(EXAMPLE, ledger_url=flow_ledger, model=hybrid_model, force_model=True),
                    done.set(),
                ),
                daemon=True,
            )
            worker.start()
            page.wait_for_function("document.querySelectorAll('#runs tbody tr').length === 3", timeout=60_000)
            worker.join(timeout=120)
            assert done.is_set()
            page.wait_for_function(
                "[...document.querySelectorAll('#runs tbody tr')].every(r => r.dataset.status === 'completed')",
                timeout=30_000,
            )

            page.locator("#runs tbody tr a").first.click()
            page.wait_for_selector("#timeline svg")
            bars = page.locator("#timeline .bar")
            assert sorted(bars.nth(i).get_attribute("data-node") or "" for i in range(bars.count())) == sorted(
                FANOUT_NODES
            )
            for i in range(bars.count()):
                phases = bars.nth(i).locator("rect.seg").evaluate_all("els => els.map(e => e.dataset.phase)")
                assert "prefill" in phases and "generate" in phases
            assert page.locator("#charts .chart").count() == 4
            page.locator("#timeline .bar[data-node='think']").click()
            sources = page.locator("#panel table.controls tr[data-control='thinking'] td").all_inner_texts()
            assert sources == ["thinking", "high", "call"]
            assert page.locator("#panel pre.response").inner_text().strip()
            page.screenshot(path=str(ARTIFACTS / "run-page.png"), full_page=True)

            # A run in progress: the open page follows the ledger as rows land.
            with Ledger(flow_ledger) as ledger:
                ledger.save_run(_run_state("live-browser", workflow_id="mlx_fanout"))
                key = NodeKey("live-browser", "plain", workflow_id="mlx_fanout", step_id="s-live", attempt=1)
                ledger.append_progress(
                    [_progress(key, {"phase": "prefill", "prompt_tokens": 4000, "elapsed_s": 0.0, "event_index": 0})]
                )
                page.goto(server.base_url + "/runs/live-browser")
                page.wait_for_selector("#live:not([hidden])")
                assert page.locator("#timeline rect.seg[data-phase='generate']").count() == 0
                ledger.append_progress(
                    [
                        _progress(
                            key,
                            {
                                "phase": "generate",
                                "prompt_tokens": 4000,
                                "generated_tokens": 1,
                                "ttft_s": 0.3,
                                "elapsed_s": 0.3,
                                "event_index": 1,
                            },
                        )
                    ]
                )
                page.wait_for_selector("#timeline rect.seg[data-phase='generate']", timeout=20_000)
                ledger.save_run(_run_state("live-browser", status="completed", workflow_id="mlx_fanout"))
                page.wait_for_selector("#summary .status-completed", timeout=20_000)
                page.wait_for_selector("#live[hidden]", state="attached", timeout=20_000)
        finally:
            browser.close()


# ----------------------------------------------------------------------------- both databases


def test_inspector_queries_on_sqlite_and_postgresql(ledger_url: str) -> None:
    """The inspector's queries (filters, token sums per call, cursors, progress after a seq)
    answer the same on both dialects, through the app."""
    prefix = uuid.uuid4().hex[:8]  # a shared PostgreSQL database may hold other tests' runs
    workflow = f"wf-{prefix}"
    run_a, run_b = f"{prefix}-a", f"{prefix}-b"
    with Ledger(ledger_url) as ledger:
        ledger.save_run(_run_state(run_a, status="completed", workflow_id=workflow))
        ledger.save_run(_run_state(run_b, workflow_id=workflow))
        for step, generated in (("s1", 10), ("s2", 7)):  # two calls of one node: 10 + 7 generated tokens
            key = NodeKey(run_a, "ask", workflow_id=workflow, step_id=step, attempt=1)
            ledger.append_progress(
                [
                    _progress(key, {"phase": "prefill", "prompt_tokens": 100, "elapsed_s": 0.0, "event_index": 0}),
                    _progress(
                        key,
                        {
                            "phase": "generate",
                            "prompt_tokens": 100,
                            "generated_tokens": 1,
                            "ttft_s": 0.1,
                            "elapsed_s": 0.1,
                            "event_index": 1,
                        },
                    ),
                    _progress(
                        key,
                        {
                            "phase": "complete",
                            "final": True,
                            "prompt_tokens": 100,
                            "generated_tokens": generated,
                            "elapsed_s": 0.3,
                            "event_index": 2,
                        },
                    ),
                ]
            )
        cursor = ledger.run_cursor(run_a)
        assert cursor is not None and cursor.last_progress_seq == 6 and cursor.last_step_seq == 0
        assert [r.seq for r in ledger.node_timeline(run_a, after_seq=4)] == [5, 6]
        assert ledger.run_cursor("absent") is None
        assert workflow in ledger.list_workflows()
        with TestClient(create_inspector_app(ledger)) as c:
            runs = {r["run_id"]: r for r in c.get("/api/runs", params={"workflow": workflow}).json()["runs"]}
            assert set(runs) == {run_a, run_b}
            assert (runs[run_a]["prompt_tokens"], runs[run_a]["generated_tokens"]) == (200, 17)
            assert (runs[run_b]["prompt_tokens"], runs[run_b]["generated_tokens"]) == (0, 0)
            running = c.get("/api/runs", params={"workflow": workflow, "status": "running"}).json()["runs"]
            assert [r["run_id"] for r in running] == [run_b]
            view = c.get(f"/api/runs/{run_a}").json()
            assert [call["generated_tokens"] for call in view["calls"]] == [10, 7]
            assert all([s["phase"] for s in call["segments"]] == ["prefill", "generate"] for call in view["calls"])


@pytest.mark.slow
def test_runs_web_command_serves_the_ledger(flow_ledger: str, tmp_path: Path) -> None:
    """The real command in a subprocess: it prints its URL (with the port it got) and serves."""
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "abstractruntime_mlx.cli.main",
        "runs",
        "web",
        "--ledger",
        flow_ledger,
        "--port",
        "0",
        "--api-key",
        "k",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+/)\?key=k", line)
        assert match, line
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.get(match.group(1) + "api/runs", headers={"Authorization": "Bearer k"}, timeout=5)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert response.status_code == 200 and len(response.json()["runs"]) >= 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    missing = subprocess.run(
        [*cmd[:5], "--ledger", str(tmp_path / "absent.sqlite")], capture_output=True, text=True, env=env, timeout=60
    )
    assert missing.returncode != 0 and "no ledger at" in missing.stderr and not (tmp_path / "absent.sqlite").exists()
    bad_port = subprocess.run(
        [*cmd[:5], "--ledger", flow_ledger, "--port", "70000"], capture_output=True, text=True, env=env, timeout=60
    )
    assert bad_port.returncode != 0 and "--port" in bad_port.stderr
