"""Connection limits of ``serve`` (``server/connections.py``), against a real uvicorn server on
127.0.0.1 with real sockets: idle connections past the cap are closed and ``/health`` still
answers; slowloris headers and idle keep-alive connections are closed by the server; a
connection past a cap of busy ones gets 503 ``too_many_connections``; the cap stays below the
descriptor limit. Bounds are generous multiples of the settings: the tests assert that the
server closed a socket (``recv`` returns ``b""``), never how fast."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest
from packaging.version import Version

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.errors import InvalidRequest, TooManyConnections, error_class_for_code
from abstractruntime_mlx.server import create_app
from abstractruntime_mlx.server.connections import (
    DEFAULT_MAX_CONNECTIONS,
    DESCRIPTOR_HEADROOM,
    ConnectionLimits,
    connection_cap,
    guarded_protocol,
)
from test_server_harness import serve_in_thread

SRC = Path(__file__).resolve().parents[1] / "src"
CLOSE_WITHIN_S = 20.0  # many times every timeout below
PROTOCOLS = ["h11", "httptools"]


@contextmanager
def guarded_server(limits: ConnectionLimits, http: str) -> Iterator[tuple[str, int]]:
    """An empty server (no model: ``/health`` answers) behind ``limits``; yields (url, port)."""
    with serve_in_thread(
        create_app(), http=guarded_protocol(limits, http=http), timeout_keep_alive=limits.idle_timeout_s
    ) as url:
        yield url, int(url.rsplit(":", 1)[1])


def closed_by_server(sock: socket.socket, timeout_s: float = CLOSE_WITHIN_S) -> bool:
    """Whether the server closes ``sock`` within ``timeout_s`` (what it sent first is skipped)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            return False
        try:
            if sock.recv(65536) == b"":
                return True
        except ConnectionError:
            return True
    return False


def health_status(url: str) -> int:
    with httpx.Client(timeout=10.0) as client:
        return client.get(f"{url}/health").status_code


@pytest.mark.slow
@pytest.mark.parametrize("http", PROTOCOLS)
def test_idle_connections_past_the_cap_are_closed_and_health_answers(http: str) -> None:
    limits = ConnectionLimits(max_connections=20, header_timeout_s=1.0, idle_timeout_s=1)
    with guarded_server(limits, http) as (url, port):
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        try:
            assert health_status(url) == 200  # through 200 connections that send nothing, 10 x the cap
            assert all(closed_by_server(sock) for sock in idle)
            assert health_status(url) == 200
        finally:
            for sock in idle:
                sock.close()


@pytest.mark.slow
@pytest.mark.parametrize("http", PROTOCOLS)
def test_a_header_sent_a_byte_at_a_time_is_cut_off_at_the_header_deadline(http: str) -> None:
    limits = ConnectionLimits(
        max_connections=100, header_timeout_s=1.0, idle_timeout_s=60
    )  # under the cap: no eviction
    with guarded_server(limits, http) as (url, port):
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(30)]
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        open_ = set(slow)
        deadline = time.monotonic() + CLOSE_WITHIN_S
        while open_ and time.monotonic() < deadline:
            for sock in list(open_):  # one more header byte each, every 0.1 s: the trickle never stops
                try:
                    sock.sendall(b"X")
                except OSError:
                    open_.discard(sock)
            readable, _, _ = select.select(list(open_), [], [], 0.1)
            for sock in readable:
                try:
                    if sock.recv(65536) == b"":
                        open_.discard(sock)
                except ConnectionError:
                    open_.discard(sock)
        try:
            assert not open_, f"{len(open_)} of 30 slowloris connections still open"
            assert health_status(url) == 200
        finally:
            for sock in slow:
                sock.close()


def read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """One HTTP/1.1 response with a content-length: (status, JSON body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "closed before a response"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), json.loads(body)


@pytest.mark.slow
@pytest.mark.parametrize("http", PROTOCOLS)
def test_keep_alive_serves_the_next_request_then_closes_an_idle_connection(http: str) -> None:
    limits = ConnectionLimits(max_connections=10, header_timeout_s=2.0, idle_timeout_s=1)
    with guarded_server(limits, http) as (_url, port), socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(CLOSE_WITHIN_S)
        for _ in range(3):  # each request well within the deadlines: answered on the same connection
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, body = read_response(sock)
            assert status == 200 and body["status"] == "healthy"
        assert closed_by_server(sock)  # then idle: closed


@pytest.mark.slow
@pytest.mark.parametrize("http", PROTOCOLS)
def test_past_a_cap_of_busy_connections_a_new_one_gets_503_too_many_connections(http: str) -> None:
    limits = ConnectionLimits(max_connections=4, header_timeout_s=1.0, idle_timeout_s=1)
    with guarded_server(limits, http) as (url, port):
        busy = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        for sock in busy:  # a complete header, a body that never comes: a request in flight
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nContent-Length: 100\r\n\r\n{"
            )
        try:
            # past the header deadline (1 s) and still open: the server read the headers, the requests are in flight
            time.sleep(1.5)
            assert all(not closed_by_server(sock, timeout_s=0.2) for sock in busy)
            with socket.create_connection(("127.0.0.1", port)) as extra:
                extra.settimeout(CLOSE_WITHIN_S)
                status, body = read_response(extra)
                assert status == 503
                assert body["error"]["code"] == "too_many_connections"
                assert body["error"]["details"] == {"limit": "max_connections", "max": 4}
                assert error_class_for_code(body["error"]["code"]) is TooManyConnections
                assert closed_by_server(extra)
            assert all(not closed_by_server(sock, timeout_s=0.2) for sock in busy)  # refused, not evicted
        finally:
            for sock in busy:
                sock.close()
        deadline = time.monotonic() + CLOSE_WITHIN_S
        while time.monotonic() < deadline and health_status_or_none(url) != 200:
            time.sleep(0.1)
        assert health_status(url) == 200  # room again once they left


def health_status_or_none(url: str) -> int | None:
    try:
        return health_status(url)
    except httpx.HTTPError:
        return None


def test_the_cap_stays_below_the_descriptor_limit() -> None:
    assert connection_cap(None, None) == DEFAULT_MAX_CONNECTIONS
    assert connection_cap(None, 100_000) == DEFAULT_MAX_CONNECTIONS
    assert connection_cap(None, 1024) == 1024 - DESCRIPTOR_HEADROOM  # the default lowered to fit
    assert connection_cap(None, 256) == 192  # a small limit keeps a quarter free
    assert connection_cap(500, 2048) == 500
    with pytest.raises(InvalidRequest) as info:
        connection_cap(2000, 2048)
    assert info.value.details == {"field": "max_connections", "max": 2048 - DESCRIPTOR_HEADROOM}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_connections": 0}, "max_connections"),
        ({"max_connections": True}, "max_connections"),
        ({"header_timeout_s": 0}, "header_timeout_s"),
        ({"header_timeout_s": float("nan")}, "header_timeout_s"),
        ({"header_timeout_s": 1e9}, "header_timeout_s"),
        ({"idle_timeout_s": -1}, "idle_timeout_s"),
        ({"idle_timeout_s": 1.5}, "idle_timeout_s"),
    ],
)
def test_bad_limits_are_invalid_requests_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        ConnectionLimits(**kwargs)
    assert info.value.details["field"] == field


@pytest.mark.slow
def test_the_soft_descriptor_limit_is_raised_to_the_hard_one() -> None:
    """In a child whose soft limit starts at 64 (the parent's own limits stay as they are)."""
    code = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "from abstractruntime_mlx.server.connections import raise_open_file_limit\n"
        "print(raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(SRC)}
    )
    assert done.returncode == 0, done.stderr
    reported, soft, hard = (int(word) for word in done.stdout.split())
    assert reported == soft and soft > 64 and (soft == hard or hard < 0)  # hard < 0: unlimited (RLIM_INFINITY)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--header-timeout", "\u0663"], "argument --header-timeout: invalid number"),
        (["--header-timeout", "inf"], "argument --header-timeout: invalid number"),
        (["--idle-timeout", "\u0663"], "argument --idle-timeout: invalid integer"),
        (["--max-connections", "\u0663"], "argument --max-connections: invalid integer"),
    ],
)
def test_serve_refuses_bad_connection_flags(capsys: Any, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", *argv, "--port", "1"])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_serve_refuses_a_cap_over_the_descriptor_limit_before_it_starts(capsys: Any) -> None:
    assert main(["serve", "--max-connections", "100000000", "--port", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: [invalid_request] --max-connections 100000000: this process may open")


def test_the_uvicorn_hooks_are_those_of_the_supported_range() -> None:
    """The overrides hook uvicorn's protocols (connection_made / data_received /
    on_response_complete / connection_lost) and read ``cycle.response_complete``."""
    import inspect

    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert Version("0.29") <= Version(version("uvicorn")) < Version("0.56")
    for protocol in (H11Protocol, HttpToolsProtocol):
        source = inspect.getsource(protocol)
        for hook in (
            "def connection_made",
            "def data_received",
            "def on_response_complete",
            "def connection_lost",
            "self.cycle = RequestResponseCycle(",
            "on_response=self.on_response_complete",
        ):
            assert hook in source, (protocol.__name__, hook)
        cycle_source = inspect.getsource(sys.modules[protocol.__module__].RequestResponseCycle)
        assert "self.response_complete = True" in cycle_source
