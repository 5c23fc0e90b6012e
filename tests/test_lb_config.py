"""The affinity key a call carries to a pool of servers, and the HAProxy configuration
``lb-config`` writes for that pool (checked by HAProxy itself when it is installed)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from abstractruntime_mlx.errors import InvalidControls, InvalidRequest
from abstractruntime_mlx.lb_config import LBSettings, PoolServer, haproxy_config, parse_address, probe_capacity
from abstractruntime_mlx.remote_client import RemoteClient
from abstractruntime_mlx.remote_client._base import affinity_header_value, build_chat_call
from abstractruntime_mlx.request import AFFINITY_HEADER, GenerationRequest
from abstractruntime_mlx.runtime_plugin.adapter.payload import request_from_payload
from abstractruntime_mlx.runtime_plugin.prefetch.prompt_cache import CallIdentity
from abstractruntime_mlx.testing.pool import free_port, haproxy_binary

COMPLETION = {
    "id": "c",
    "object": "chat.completion",
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1},
}


# -- the affinity key -----------------------------------------------------------------------


def test_an_affinity_key_is_checked_at_the_edge_and_is_not_part_of_the_answer():
    plain = GenerationRequest.from_kwargs("hi")
    keyed = GenerationRequest.from_kwargs("hi", affinity_key="  session-1 ")
    assert keyed.affinity_key == "session-1" and plain.affinity_key is None
    assert keyed.to_dict() == plain.to_dict() and keyed == plain  # the same call: fingerprints agree
    assert "affinity_key" not in build_chat_call(keyed, model="m").body  # a header, not a body field
    for bad in ("", "   ", 7, "k" * 513):
        with pytest.raises(InvalidControls) as info:
            GenerationRequest.from_kwargs("hi", affinity_key=bad)
        assert info.value.code == "invalid_controls" and info.value.details["field"] == "affinity_key"


def test_the_header_carries_the_key_or_a_digest_of_a_key_that_is_not_header_text():
    assert affinity_header_value("session-0f3a") == "session-0f3a"
    for odd in ("séance", "a b", "x" * 129, "tab\there"):
        value = affinity_header_value(odd)
        assert value.startswith("sha256:") and len(value) == 39 and value.isascii()
        assert value == affinity_header_value(odd)  # equal keys, equal values: the same server


def test_the_remote_client_sends_the_key_on_every_call_and_nothing_without_one():
    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get(AFFINITY_HEADER))
        return httpx.Response(200, json=COMPLETION)

    with RemoteClient("http://pool.invalid", model="m", transport=httpx.MockTransport(answer)) as client:
        client.generate("a", affinity_key="run-1")
        client.generate("b", affinity_key="é" * 3)
        client.generate("c")
    assert seen == ["run-1", affinity_header_value("é" * 3), None]


def test_a_node_call_carries_its_runs_session_else_its_run_id():
    payload = {"prompt": "hi", "provider": "mlx"}
    with_session = CallIdentity(run_id="r1", workflow_id="w", node_id="n", session_id="s1")
    without = CallIdentity(run_id="r1", workflow_id="w", node_id="n", session_id=None)
    assert request_from_payload(payload, {}, call=with_session).affinity_key == "s1"
    assert request_from_payload(payload, {}, call=without).affinity_key == "r1"
    assert request_from_payload(payload, {}).affinity_key is None


# -- the configuration ------------------------------------------------------------------------


def two_servers(**kwargs: object) -> LBSettings:
    return LBSettings(
        servers=(PoolServer("10.0.0.2", 8080, slots=4, queue=32), PoolServer("::1", 8081, slots=8, queue=0)), **kwargs
    )  # type: ignore[arg-type]


def test_the_configuration_hashes_the_affinity_header_with_bounded_load_and_per_server_capacity():
    text = haproxy_config(two_servers(stats_socket="/run/pool.sock"))
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    for expected in (
        f"balance hdr({AFFINITY_HEADER})",
        "hash-type consistent",
        "hash-balance-factor 150",
        "option httpchk GET /health",
        "option redispatch 1",
        "retries 3",
        "retry-on conn-failure empty-response junk-response 503",
        "timeout server 600s",
        "timeout queue 120s",
        "stats socket /run/pool.sock mode 600 level admin",
        "server s1 10.0.0.2:8080 maxconn 36",
        "server s2 [::1]:8081 maxconn 8",
        "bind 127.0.0.1:8090",
    ):
        assert expected in lines, expected
    assert "hash-balance-factor" not in haproxy_config(two_servers(balance_factor=0))
    assert "stats socket" not in haproxy_config(two_servers())


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        (lambda: LBSettings(servers=()), "server"),
        (lambda: LBSettings(servers=(PoolServer("a", 1, 4, 0), PoolServer("a", 1, 4, 0))), "server"),
        (lambda: LBSettings(servers=(PoolServer("a", 1, 0, 0),)), "slots"),
        (lambda: LBSettings(servers=(PoolServer("a", 1, 4, -1),)), "slots"),
        (lambda: two_servers(balance_factor=99), "balance_factor"),
        (lambda: two_servers(retries=-1), "retries"),
        (lambda: two_servers(queue_timeout_s=0), "queue_timeout_s"),
        (lambda: two_servers(bind="nowhere"), "bind"),
        (lambda: two_servers(stats_socket="a\nb"), "stats_socket"),
    ],
)
def test_bad_settings_are_invalid_requests_naming_the_field(settings, field):
    with pytest.raises(InvalidRequest) as info:
        settings()
    assert (
        info.value.code == "invalid_request" and info.value.http_status == 400 and info.value.details["field"] == field
    )


@pytest.mark.parametrize(
    "text", ["host", "host:", ":80", "host:0", "host:65536", "host:http", "a b:80", "[::1]80", "#x:80"]
)
def test_a_bad_address_is_refused(text):
    with pytest.raises(InvalidRequest, match="server"):
        parse_address(text)


def test_addresses_parse():
    assert parse_address("10.0.0.2:8080") == ("10.0.0.2", 8080)
    assert parse_address("[fe80::1]:81") == ("fe80::1", 81)
    assert parse_address("mac-2.local:8080") == ("mac-2.local", 8080)


@pytest.mark.parametrize(
    "text",
    [
        "h:1\n",  # a newline would end the line HAProxy reads
        " 10.0.0.2:8080",
        "127.0.0.1:\u0661\u0668\u0669\u0669\u0665",  # Arabic-Indic digits: int() reads 18995
        "127.0.0.1:\uff18\uff10",  # fullwidth digits
        "h\u00e9:80",  # not ASCII (an IDN goes as its punycode)
        "h#x:80",
        "h'x:80",
        "[::1 #]:80",
        "[zz::1]:80",
        "*:80",  # a wildcard only where HAProxy listens
    ],
)
def test_an_address_haproxy_would_misread_is_refused(text):
    with pytest.raises(InvalidRequest) as info:
        parse_address(text)
    assert info.value.code == "invalid_request" and info.value.details["field"] == "server"


def test_the_bind_address_takes_a_wildcard_and_is_written_as_parsed():
    assert parse_address("*:8090", field="bind", wildcard=True) == ("*", 8090)
    assert "    bind *:8090" in haproxy_config(two_servers(bind="*:8090")).splitlines()
    assert "    bind [::1]:8090" in haproxy_config(two_servers(bind="[::1]:8090")).splitlines()
    with pytest.raises(InvalidRequest) as info:
        two_servers(bind="127.0.0.1:\u0661\u0668\u0669\u0669\u0665")
    assert info.value.details["field"] == "bind"


@pytest.mark.parametrize(
    "path",
    [
        "S.sock mode 666 #",
        "/tmp/a b.sock",
        "/tmp/a#b",
        "/tmp/a\nb",
        "/tmp/a\tb",
        "/tmp/'a'",
        '/tmp/"a"',
        "/tmp/a\\b",
        "/tmp/\u0663.sock",
        "/tmp/a\u2028b",
        "",
    ],
)
def test_a_stats_socket_path_haproxy_would_misread_is_refused(path):
    with pytest.raises(InvalidRequest) as info:
        two_servers(stats_socket=path)
    assert info.value.details["field"] == "stats_socket"


def test_a_stats_socket_path_with_plain_non_ascii_letters_is_kept():
    text = haproxy_config(two_servers(stats_socket="/Users/zoé/pool.sock"))
    assert "    stats socket /Users/zoé/pool.sock mode 600 level admin" in text.splitlines()


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        (lambda: LBSettings(servers=(PoolServer("a\nb", 1, 4, 0),)), "server"),
        (lambda: LBSettings(servers=(PoolServer("a b", 1, 4, 0),)), "server"),
        (lambda: LBSettings(servers=(PoolServer("a", 0, 4, 0),)), "server"),
        (lambda: LBSettings(servers=(PoolServer("a", 70000, 4, 0),)), "server"),
        (lambda: LBSettings(servers=(PoolServer("a", 1, True, 0),)), "slots"),  # type: ignore[arg-type]
        (lambda: LBSettings(servers=(PoolServer("a", 1, 4, 0, source="flags\n#"),)), "source"),
        (lambda: two_servers(queue_timeout_s=float("inf")), "queue_timeout_s"),
        (lambda: two_servers(check_interval_s=float("nan")), "check_interval_s"),
        (lambda: two_servers(server_timeout_s=3e9), "server_timeout_s"),
        (lambda: two_servers(retries=True), "retries"),
    ],
)
def test_every_value_written_is_checked_in_python_too(settings, field):
    with pytest.raises(InvalidRequest) as info:
        settings()
    assert info.value.details["field"] == field


def test_a_comment_line_is_one_printable_line():
    with pytest.raises(InvalidRequest) as info:
        haproxy_config(two_servers(), comment=["ok", "two\nlines"])
    assert info.value.details["field"] == "comment"


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--stats-socket", "S.sock mode 666 #", "error: [invalid_request] the stats socket path 'S.sock mode 666 #'"),
        ("--server", "h:1\n", "error: [invalid_request] server 'h:1\\n'"),
        ("--bind", "127.0.0.1:\u0661\u0668\u0669\u0669\u0665", "error: [invalid_request] bind '127.0.0.1:"),
        ("--queue-timeout", "\u0663", "argument --queue-timeout: invalid number"),
        ("--queue-timeout", "inf", "argument --queue-timeout: invalid number"),
    ],
)
def test_the_command_refuses_a_value_it_would_write_wrongly_and_writes_nothing(tmp_path, flag, value, message):
    out = tmp_path / "pool.cfg"
    done = cli("--server", "127.0.0.1:9", "--slots", "1", "--queue", "1", "--no-probe", "--out", str(out), flag, value)
    assert done.returncode in (1, 2) and done.stdout == "" and message in done.stderr
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_the_written_by_comment_names_the_servers_as_parsed(tmp_path):
    done = cli("--server", "127.0.0.1:9", "--server", "[::1]:10", "--slots", "1", "--queue", "1", "--no-probe")
    assert done.returncode == 0, done.stderr
    assert (
        "# Written by: abstractruntime-mlx lb-config --server 127.0.0.1:9 --server [::1]:10" in done.stdout.splitlines()
    )


def test_a_server_that_does_not_answer_has_no_known_capacity():
    assert probe_capacity("127.0.0.1", free_port(), timeout_s=0.5) is None


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "abstractruntime_mlx.cli.main", "lb-config", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_the_command_needs_capacity_for_a_server_it_cannot_ask(tmp_path):
    port = free_port()
    done = cli("--server", f"127.0.0.1:{port}")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("error: [invalid_request] server 127.0.0.1:") and "--slots N --queue M" in done.stderr
    done = cli("--server", "bad")
    assert done.returncode == 1 and done.stderr.startswith("error: [invalid_request] server 'bad'")

    out = tmp_path / "pool.cfg"
    done = cli("--server", f"127.0.0.1:{port}", "--slots", "2", "--queue", "6", "--no-probe", "--out", str(out))
    assert done.returncode == 0 and done.stdout == "", done.stderr
    assert "maxconn 8 (2 slots + 6 queue, from flags)" in done.stderr
    assert f"server s1 127.0.0.1:{port} maxconn 8" in out.read_text()
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.skipif(haproxy_binary() is None, reason="haproxy is not installed")
def test_haproxy_accepts_the_configuration(tmp_path):
    path = tmp_path / "pool.cfg"
    path.write_text(haproxy_config(two_servers(stats_socket=str(tmp_path / "s.sock"), bind=f"127.0.0.1:{free_port()}")))
    binary = haproxy_binary()
    assert binary is not None
    done = subprocess.run([binary, "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Configuration file is valid" in done.stdout + done.stderr
