"""``abstractruntime-mlx chat``: a conversation driven through stdin, on the tiny dense model.

In this process (``main`` with stdin swapped) for the turns, the commands and ``--remote``; a
real process for Ctrl-C during a reply and for the interactive prompt on a pseudo-terminal."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from abstractruntime_mlx import create_llm
from abstractruntime_mlx.cli.chat_cmd import default_history_path
from abstractruntime_mlx.cli.completion_cmd import command_words
from abstractruntime_mlx.cli.main import build_parser, main
from abstractruntime_mlx.cli.terminal import printable
from abstractruntime_mlx.server import create_app
from test_server_harness import serve_in_thread

SYSTEM = "You are a terse assistant who answers in one line. " * 6  # a prefix of several 16-token blocks
FIGURES = re.compile(
    r"^prompt (\d+) tokens \((\d+) cached\) \| (\d+) generated \| TTFT \d+ ms \| decode [\d.]+ tok/s$", re.M
)


def chat(capsys: Any, monkeypatch: pytest.MonkeyPatch, lines: str, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    capsys.readouterr()
    code = main(["chat", *args])
    out, err = capsys.readouterr()
    return code, out, err


def figures(err: str) -> list[tuple[int, int, int]]:
    return [(int(p), int(c), int(g)) for p, c, g in FIGURES.findall(err)]


def test_second_turn_reuses_the_first_turns_prefix(
    cli_env: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, dense_model: str
) -> None:
    code, _out, err = chat(
        capsys,
        monkeypatch,
        "Explain TTL caches.\nAnd LRU caches?\n",
        dense_model,
        "--system",
        SYSTEM,
        "--max-tokens",
        "8",
    )
    assert code == 0, err
    (p1, c1, g1), (p2, c2, g2) = figures(err)
    assert c1 == 0 and g1 == g2 == 8
    assert p2 > p1
    # turn 2 resends turn 1's prompt; all of it but the assistant opener and the guard comes from the cache
    assert p1 - 24 <= c2 < p1


def test_a_reply_is_the_models_greedy_stream(
    cli_env: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, dense_model: str, make_llm: Any
) -> None:
    code, out, err = chat(
        capsys, monkeypatch, "Explain TTL caches.\n", dense_model, "--max-tokens", "12", "--thinking", "off"
    )
    assert code == 0, err
    llm = make_llm(dense_model, mlx_batching=True)
    stream = llm.generate(
        "",
        messages=[{"role": "user", "content": "Explain TTL caches."}],
        stream=True,
        thinking=False,
        max_output_tokens=12,
    )
    expected = "".join(chunk.content for chunk in stream)
    assert out == printable(expected, keep="\n\t") + "\n"


def test_commands_change_the_session_and_bad_ones_are_typed_errors(
    cli_env: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, dense_model: str
) -> None:
    lines = (
        "\n".join(
            [
                "/system Answer briefly.",
                "/system",
                "/thinking high",
                "/thinking banana",
                "/frobnicate",
                "first question",
                "/stats",
                "/clear",
                "/stats",
                "/help",
                "/exit",
                "never answered",
            ]
        )
        + "\n"
    )
    code, _out, err = chat(capsys, monkeypatch, lines, dense_model, "--max-tokens", "4")
    assert code == 1  # two lines failed; each is one error line and the chat went on
    assert "system: 'Answer briefly.'" in err
    assert "thinking: high" in err
    assert "error: [invalid_controls] /thinking takes on, off, auto or a level" in err
    assert "error: [invalid_request] unknown command '/frobnicate' (/help lists them)" in err
    assert len(figures(err)) == 1  # the line after /exit is not answered
    keys = re.findall(r"^prompt cache key: (chat-[0-9a-f]{16})$", err, re.M)
    assert len(keys) == 2 and keys[0] != keys[1]  # /clear starts a new key
    assert re.findall(r"^turns: (\d+), messages in the conversation: (\d+)$", err, re.M) == [("1", "2"), ("1", "0")]
    assert "/thinking MODE" in err


def test_a_bad_thinking_flag_fails_before_loading(
    cli_env: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, dense_model: str
) -> None:
    code, out, err = chat(capsys, monkeypatch, "hi\n", dense_model, "--thinking", "loud")
    assert code == 1 and out == ""
    assert err.startswith("error: [invalid_controls]") and "loading" not in err


def test_remote_chat_against_serve_reuses_the_prefix(
    cli_env: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, dense_model: str
) -> None:
    llm = create_llm("mlx", model=dense_model, mlx_batching=True)
    try:
        with serve_in_thread(create_app(llm)) as url:
            code, out, err = chat(
                capsys,
                monkeypatch,
                "Explain TTL caches.\nAnd LRU caches?\n/stats\n",
                "--remote",
                url,
                "--system",
                SYSTEM,
                "--max-tokens",
                "8",
            )
    finally:
        llm.unload_model(llm.model)
    assert code == 0, err
    (p1, c1, _), (_p2, c2, _) = figures(err)
    assert c1 == 0 and p1 - 24 <= c2 < p1
    assert f"model: {dense_model}" in err  # the server's first model, asked over HTTP
    assert out.count("\n") >= 2


def test_chat_is_a_command_with_completion() -> None:
    words = command_words(build_parser())
    assert "chat" in words[""]
    assert {"--remote", "--system", "--thinking", "--history", "--max-tokens"} <= set(words["chat"])


def test_history_lives_in_the_state_dir() -> None:
    assert default_history_path({"XDG_STATE_HOME": "/s"}) == Path("/s/abstractruntime-mlx/chat_history")
    assert default_history_path({}) == Path("~/.local/state/abstractruntime-mlx/chat_history").expanduser()


def _process(args: list[str], env_dir: Path, **kwargs: Any) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(env_dir / "cache"),
        "XDG_STATE_HOME": str(env_dir / "state"),
        "TERM": "dumb",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "abstractruntime_mlx.cli.main", "chat", *args],
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job may inherit SIGINT ignored
        **kwargs,
    )


@pytest.mark.slow
def test_ctrl_c_stops_the_reply_not_the_chat(tmp_path: Path, dense_model: str, policy_file: Path) -> None:
    process = _process(
        [dense_model, "--max-tokens", "3000"],
        tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        process.stdin.write(b"tell me a very long story\n")
        process.stdin.flush()
        assert select.select([process.stdout], [], [], 120)[0], "no reply began"
        os.read(process.stdout.fileno(), 64)  # the reply is streaming
        process.send_signal(signal.SIGINT)
        out_rest, err = process.communicate(b"/stats\n", timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = err.decode()
    assert process.returncode == 0, text
    assert "reply stopped (Ctrl-C); it is left out of the conversation" in text
    assert "turns: 0, messages in the conversation: 0" in text  # the chat went on to /stats
    assert figures(text) == []


@pytest.mark.slow
def test_interactive_prompt_on_a_terminal_keeps_a_history(tmp_path: Path, dense_model: str, policy_file: Path) -> None:
    main_fd, child_fd = pty.openpty()
    process = _process([dense_model, "--max-tokens", "4"], tmp_path, stdin=child_fd, stdout=child_fd, stderr=child_fd)
    os.close(child_fd)
    seen = b""

    def read_until(marker: bytes, timeout_s: float = 120) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout_s
        while marker not in seen:
            assert time.monotonic() < deadline, seen.decode(errors="replace")
            if select.select([main_fd], [], [], 1)[0]:
                seen += os.read(main_fd, 4096)

    try:
        read_until(b">>> ")
        os.write(main_fd, b"hello there\r")
        read_until(b"generated")
        read_until(b">>> ")
        os.write(main_fd, b"/exit\r")
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(main_fd)
    assert b"chatting with" in seen and b"prompt " in seen
    history = tmp_path / "state" / "abstractruntime-mlx" / "chat_history"
    assert history.read_text().splitlines()[-2:] == ["hello there", "/exit"]
    assert history.stat().st_mode & 0o777 == 0o600


@pytest.mark.slow
def test_the_docs_example_runs_as_written(tmp_path: Path, policy_file: Path) -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "cli-chat.md").read_text()
    (block,) = re.findall(r"```bash\n(.*?)```", doc, re.S)
    cli = f'abstractruntime-mlx() {{ "{sys.executable}" -m abstractruntime_mlx.cli.main "$@"; }}\n'
    script = cli + "set -e -o pipefail\n" + block.replace("/tmp/arm-", str(tmp_path / "arm-"))
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr
    (_, c1, _), (_, c2, _) = figures(done.stderr)
    assert c1 == 0 and c2 > 0
    assert "turns: 2, messages in the conversation: 4" in done.stderr
