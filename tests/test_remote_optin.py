"""Remote LLM targets are opt-in: a flow's own base_url gets nothing (no prompt, no probe) unless the
user allows remotes; --route and --var URLs are the user's; link-local / metadata addresses never."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from abstractruntime_mlx.cli.main import main
from abstractruntime_mlx.errors import RemoteAddressForbidden, RemoteNotAllowed
from abstractruntime_mlx.runtime_plugin import RemotePolicy, parse_route, run_flow
from abstractruntime_mlx.runtime_plugin.adapter.routing import forbidden_reason

PROMPT = "the secret prompt 7f3a"


class Listener:
    """A real HTTP server on the loopback interface that records every request it gets and
    answers 400 (a refusal no client retries)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str]] = []
        seen = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def _record(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                seen.append((self.command, self.path, self.rfile.read(length).decode("utf-8", "replace")))
                body = json.dumps(
                    {
                        "error": {
                            "message": "refused by the test listener",
                            "type": "invalid_request_error",
                            "code": "invalid_request",
                        }
                    }
                ).encode()
                self.send_response(400)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _record  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def prompts(self) -> list[str]:
        return [body for method, _, body in self.requests if method == "POST" and PROMPT in body]


@pytest.fixture()
def listener() -> Iterator[Listener]:
    server = Listener()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def remote_flow(tmp_path: Path, effect_config: dict[str, object]) -> str:
    flow = {
        "id": "remote",
        "entryNode": "start",
        "nodes": [
            {"id": "start", "type": "on_flow_start", "data": {}},
            {
                "id": "ask",
                "type": "llm_call",
                "data": {"effectConfig": {"model": "m", **effect_config}, "pinDefaults": {"prompt": PROMPT}},
            },
        ],
        "edges": [{"source": "start", "sourceHandle": "exec-out", "target": "ask", "targetHandle": "exec-in"}],
    }
    path = tmp_path / "remote.json"
    path.write_text(json.dumps(flow), encoding="utf-8")
    return str(path)


@pytest.mark.slow
def test_a_flow_base_url_gets_nothing_unless_remotes_are_allowed(cli_env, capsys, tmp_path, listener, dense_model):
    flow = remote_flow(tmp_path, {"provider": "mlx", "base_url": listener.url})

    code, out, err = cli(capsys, "run", flow, "--model", dense_model)
    assert code == 1 and out == ""
    assert "[remote_not_allowed]" in err and "node 'ask'" in err and listener.url in err
    code, out, _ = cli(capsys, "check", flow, "--model", dense_model, "--json")
    assert code == 1 and [(p["code"], p["node_id"]) for p in json.loads(out)["problems"]] == [
        ("remote_not_allowed", "ask")
    ]
    code, _, _ = cli(capsys, "check", flow, "--model", dense_model, "--allow-remote")
    assert code == 0
    assert listener.requests == []  # no prompt, and no GET /health either

    code, _, _ = cli(capsys, "check", flow, "--model", dense_model, "--allow-remote", "--probe")
    assert code == 0 and [(m, p) for m, p, _ in listener.requests] == [("GET", "/health")]

    code, _, _ = cli(capsys, "run", flow, "--model", dense_model, "--allow-remote")
    assert code == 1  # the listener refuses the call: what matters is that it got the prompt
    assert listener.prompts()


@pytest.mark.slow
def test_the_config_file_allows_remotes_by_host(cli_env, capsys, tmp_path, listener, dense_model):
    flow = remote_flow(tmp_path, {"provider": "mlx", "base_url": listener.url})
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"allow_remote": ["example.com"]}), encoding="utf-8")
    code, _, err = cli(capsys, "run", flow, "--model", dense_model, "--config", str(config))
    assert code == 1 and "[remote_not_allowed]" in err and listener.requests == []

    config.write_text(json.dumps({"allow_remote": "yes"}), encoding="utf-8")
    code, _, err = cli(capsys, "run", flow, "--model", dense_model, "--config", str(config))
    assert code == 1 and "'allow_remote' must be true, false or a list" in err

    config.write_text(json.dumps({"allow_remote": ["127.0.0.1"]}), encoding="utf-8")
    code, _, _ = cli(capsys, "run", flow, "--model", dense_model, "--config", str(config))
    assert listener.prompts()


@pytest.mark.slow
def test_routes_and_run_vars_the_user_gives_are_allowed(cli_env, capsys, tmp_path, listener, dense_model):
    flow = remote_flow(tmp_path, {"provider": "lmstudio"})
    cli(capsys, "run", flow, "--model", dense_model, "--route", f"lmstudio={listener.url}")
    assert len(listener.prompts()) == 1
    cli(capsys, "run", flow, "--model", dense_model, "--var", f"_runtime.base_url={listener.url}")
    assert len(listener.prompts()) == 2


@pytest.mark.slow
def test_the_handler_refuses_a_server_nobody_allowed(tmp_path, listener, policy_file):
    """run_flow checks nothing first: the LLM_CALL handler itself refuses before sending."""
    flow = json.loads(Path(remote_flow(tmp_path, {"provider": "mlx", "base_url": listener.url})).read_text())
    (result,) = run_flow(flow, ledger_url=str(tmp_path / "l.sqlite"))
    assert [f.node_id for f in result.failures] == ["ask"]
    assert "[remote_not_allowed] node 'ask' would send its prompts to " + listener.url in result.failures[0].error
    assert listener.requests == []
    (result,) = run_flow(flow, ledger_url=str(tmp_path / "l.sqlite"), allow_remote=["127.0.0.1"])
    assert listener.prompts()


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data",
        "http://169.254.170.2:80",
        "http://2852039166/",
        "http://0xa9.0xfe.0xa9.0xfe/",
        "http://[fe80::1]:8080",
        "http://[::ffff:169.254.169.254]/",
        "http://METADATA.google.internal./computeMetadata",
        "http://[fd00:ec2::254]/",
    ],
)
def test_link_local_and_metadata_addresses_are_refused_whatever_is_allowed(url):
    assert forbidden_reason(url) is not None
    with pytest.raises(RemoteAddressForbidden):
        RemotePolicy(allow_all=True).check(url, where="node 'ask'")
    with pytest.raises(RemoteAddressForbidden):
        parse_route(f"openai={url}")


def test_ordinary_servers_are_allowed_by_host_or_host_and_port():
    for url in ("http://127.0.0.1:8080", "https://example.com/v1", "http://10.0.0.5:1234"):
        assert forbidden_reason(url) is None
    policy = RemotePolicy.build(["example.com", "127.0.0.1:8080"])
    policy.check("https://example.com:8443/v1", where="x")
    policy.check("http://127.0.0.1:8080/v1", where="x")
    with pytest.raises(RemoteNotAllowed):
        policy.check("http://127.0.0.1:9000", where="x")


def test_the_cli_refuses_metadata_targets_before_anything_runs(cli_env, capsys, tmp_path, dense_model):
    flow = remote_flow(tmp_path, {"provider": "mlx"})
    code, _, err = cli(capsys, "run", flow, "--model", dense_model, "--route", "openai=http://169.254.169.254")
    assert code == 1 and "[remote_address_forbidden]" in err
    code, _, err = cli(capsys, "run", flow, "--var", "_runtime.base_url=http://169.254.169.254")
    assert code == 1 and "[remote_address_forbidden]" in err
    metadata = remote_flow(tmp_path, {"provider": "mlx", "base_url": "http://metadata.google.internal"})
    code, out, _ = cli(capsys, "check", metadata, "--model", dense_model, "--allow-remote", "--json")
    assert code == 1 and [p["code"] for p in json.loads(out)["problems"]] == ["remote_address_forbidden"]
    assert not cli_env.exists()
