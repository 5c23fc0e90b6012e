"""The inspector's live streams share one poller, and their number is capped.

A real server on 127.0.0.1 streams a real SQLite ledger; the ledger counts its own run-list
reads (``list_runs``), so sharing is asserted on reads, never on timing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from abstractruntime_mlx.ledger import Ledger, sqlite_url
from abstractruntime_mlx.server.inspector import DEFAULT_MAX_STREAMS
from test_inspector import Server, _events, _run_state
from test_server_harness import wait_until

# Long enough that nothing is re-read by the clock during a test: reads happen only for a
# topic no stream followed before.
NEVER_S = 3600.0


class CountingLedger(Ledger):
    """A real ledger that counts how often the run list is read (its top-level runs; the child
    runs of the listed runs are read with them, one more read per level)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.list_reads = 0
        self._count_lock = threading.Lock()

    def list_runs(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("roots_only"):
            with self._count_lock:
                self.list_reads += 1
        return super().list_runs(*args, **kwargs)


@pytest.fixture()
def ledger(tmp_path: Path) -> Iterator[CountingLedger]:
    store = CountingLedger(sqlite_url(tmp_path / "live.sqlite"))
    store.save_run(_run_state("old", status="completed"))
    yield store
    store.close()


def _open(
    stack: contextlib.ExitStack, http: httpx.Client, path: str, **params: str
) -> Iterator[tuple[str, dict[str, Any]]]:
    response = stack.enter_context(http.stream("GET", path, params=params))
    assert response.status_code == 200, response.read()
    return _events(response.iter_lines())


def test_streams_of_one_list_share_one_read(ledger: CountingLedger) -> None:
    with Server(ledger, poll_interval_s=NEVER_S) as server, httpx.Client(base_url=server.base_url, timeout=20) as http:
        with contextlib.ExitStack() as stack:
            streams = []  # kept open: a dropped iterator closes its connection
            firsts = []
            for _ in range(5):
                streams.append(_open(stack, http, "/api/runs/stream", workflow="live_flow"))
                firsts.append(next(streams[-1]))
            assert firsts == [firsts[0]] * 5 and firsts[0][0] == "runs"
            assert [r["run_id"] for r in firsts[0][1]["runs"]] == ["old"]
            assert ledger.list_reads == 1  # five streams, one read
            other = _open(stack, http, "/api/runs/stream", status="completed")
            assert next(other)[0] == "runs"
            assert ledger.list_reads == 2  # another filter is another topic: one more read
            assert server.app.state.live.streams == 6


def test_a_change_reaches_every_stream(ledger: CountingLedger) -> None:
    with Server(ledger, poll_interval_s=0.05) as server, httpx.Client(base_url=server.base_url, timeout=20) as http:
        with contextlib.ExitStack() as stack:
            streams = [_open(stack, http, "/api/runs/stream", workflow="live_flow") for _ in range(3)]
            for events in streams:
                assert [r["run_id"] for r in next(events)[1]["runs"]] == ["old"]
            ledger.save_run(_run_state("new"))
            for events in streams:
                name, listing = next(events)
                assert name == "runs" and [r["run_id"] for r in listing["runs"]] == ["new", "old"]
            ledger.save_run(_run_state("new-sub", parent_run_id="new"))  # a child run: nested, not a row
            for events in streams:
                name, listing = next(events)
                assert [r["run_id"] for r in listing["runs"]] == ["new", "old"]
                assert [c["run_id"] for c in listing["runs"][0]["children"]] == ["new-sub"]


def test_the_stream_cap_refuses_one_more_with_a_typed_503(ledger: CountingLedger) -> None:
    ledger.save_run(_run_state("live-1"))
    with (
        Server(ledger, poll_interval_s=NEVER_S, max_streams=2) as server,
        httpx.Client(base_url=server.base_url, timeout=20) as http,
    ):
        live = server.app.state.live
        with contextlib.ExitStack() as stack:
            # Each iterator is kept: dropping it would close its connection.
            listing = _open(stack, http, "/api/runs/stream")
            assert next(listing)[0] == "runs"
            with contextlib.ExitStack() as second:
                run = _open(second, http, "/api/runs/live-1/stream")
                assert next(run)[0] == "run"  # run streams count too
                for path in ("/api/runs/stream", "/api/runs/live-1/stream"):
                    refused = http.get(path)
                    assert refused.status_code == 503
                    error = refused.json()["error"]
                    assert error["code"] == "too_many_streams"
                    assert error["details"] == {"limit": "max_streams", "max": 2}
                    assert "max_streams=2" in error["message"]
                assert http.get("/api/runs").status_code == 200  # the other routes still answer
            # The closed stream's place is given back once the server sees it go.
            assert wait_until(lambda: live.streams == 1, timeout_s=10), f"{live.streams} streams still counted"
            again = _open(stack, http, "/api/runs/live-1/stream")
            assert next(again)[0] == "run"


def test_runs_web_takes_the_cap(tmp_path: Path) -> None:
    from abstractruntime_mlx.cli.main import build_parser
    from abstractruntime_mlx.cli.runs_web_cmd import settings_from_args

    parser = build_parser()
    ledger = str(tmp_path / "l.sqlite")
    assert (
        settings_from_args(parser.parse_args(["runs", "web", "--ledger", ledger]), environ={}).max_streams
        == DEFAULT_MAX_STREAMS
    )
    assert (
        settings_from_args(
            parser.parse_args(["runs", "web", "--ledger", ledger, "--max-streams", "3"]), environ={}
        ).max_streams
        == 3
    )
    with pytest.raises(SystemExit, match="--max-streams must be >= 1"):
        settings_from_args(parser.parse_args(["runs", "web", "--ledger", ledger, "--max-streams", "0"]), environ={})


def test_the_default_cap_is_documented() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "inspector.md").read_text(encoding="utf-8")
    assert f"`--max-streams N` | `{DEFAULT_MAX_STREAMS}`" in text
