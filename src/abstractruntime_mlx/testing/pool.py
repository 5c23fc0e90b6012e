"""Start and stop the processes of a scale-out set-up on this machine (tests and benchmarks).

    with ServerProcess.start(model, port=free_port()) as a, ServerProcess.start(model, port=free_port()) as b:
        config = tmp / "pool.cfg"   # written by `abstractruntime-mlx lb-config`
        with HAProxyProcess.start(config, socket=tmp / "haproxy.sock", port=lb_port) as lb:
            lb.server_stats()       # {"s1": {"status": "UP", "stot": 3, ...}, ...}

    with MLXLMServerProcess.start(model, port=free_port(), ranks=2) as ring:  # mlx.launch + mlx_lm.server
        ring.url                # rank 0 answers HTTP; every rank holds a shard of the model

Every process is started by the caller's test and stopped by it (``stop()``, or leaving the
``with``): nothing keeps running. Waits are bounded and re-check that the process lives.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Self, TypeVar

__all__ = [
    "HAProxyProcess",
    "MLXLMServerProcess",
    "ServerProcess",
    "free_port",
    "free_port_run",
    "haproxy_binary",
    "mlx_launch_command",
    "wait_until",
]

START_TIMEOUT_S: Final = 90.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive TCP ports free on 127.0.0.1 now (``mlx.launch``'s ring
    backend listens on ``--starting-port`` plus one per rank)."""
    for _ in range(100):
        first = free_port()
        if first + count <= 65536 and all(_port_free(first + i) for i in range(1, count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def haproxy_binary() -> str | None:
    """The ``haproxy`` executable (PATH, then /usr/sbin where Debian puts it), or None."""
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin:/opt/homebrew/sbin")


def wait_until(
    ready: Callable[[], bool],
    *,
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> None:
    """Poll ``ready()`` until it is true; ``RuntimeError`` naming ``what`` when ``proc`` exits or
    the time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with status {proc.returncode}")
        if ready():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what}: not ready after {timeout_s:.0f} s")


class _StopsOnExit:
    """A started process that leaving its ``with`` block stops."""

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


_S = TypeVar("_S", bound=_StopsOnExit)


def _ready_or_stopped(started: _S, ready: Callable[[], bool], *, what: str, proc: subprocess.Popen[bytes]) -> _S:
    """``started`` once ``ready()``; when it never is, ``started`` is stopped and the error raised."""
    try:
        wait_until(ready, what=what, proc=proc)
    except BaseException:
        started.stop()
        raise
    return started


def _get_json(url: str, timeout_s: float = 2.0) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - loopback URLs built here
            body = json.loads(response.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None
    return body if isinstance(body, dict) else None


def mlx_launch_command() -> list[str]:
    """How to run ``mlx.launch`` (MLX's launcher, installed with the ``mlx`` wheel) with this
    interpreter: the script next to ``sys.executable`` when there is one, else the module."""
    script = Path(sys.executable).parent / "mlx.launch"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


def _status(url: str, timeout_s: float = 1.0) -> int | None:
    """The HTTP status of ``GET url``, None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - loopback URLs built here
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, urllib.error.URLError):
        return None


def _stop(proc: subprocess.Popen[bytes], *, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


@dataclass
class _LocalServer(_StopsOnExit):
    """A server process answering HTTP on 127.0.0.1:``port``."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class ServerProcess(_LocalServer):
    """One ``abstractruntime-mlx serve --model MODEL`` on 127.0.0.1:``port``."""

    @classmethod
    def start(
        cls, model: str, *, port: int, extra: tuple[str, ...] = (), log_path: Path | None = None
    ) -> ServerProcess:
        command = [
            sys.executable,
            "-m",
            "abstractruntime_mlx.cli.main",
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            *extra,
        ]
        log = open(log_path, "wb") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
        env = {**os.environ, "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        server = cls(proc, port, log_path)
        return _ready_or_stopped(server, server.healthy, what=f"serve on port {port}", proc=proc)

    def healthy(self) -> bool:
        body = _get_json(self.url + "/health", timeout_s=1.0)
        return body is not None and body.get("loaded") is True

    def execution(self) -> dict[str, object]:
        """The engine's execution counters (``/acore/prompt_cache/stats``), ``{}`` when it does not answer."""
        body = _get_json(self.url + "/acore/prompt_cache/stats", timeout_s=1.0) or {}
        stats = body.get("stats")
        execution = stats.get("execution") if isinstance(stats, dict) else None
        return execution if isinstance(execution, dict) else {}

    def kill(self) -> None:
        """SIGKILL, as a machine losing power would end it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        _stop(self.proc)


@dataclass
class HAProxyProcess(_StopsOnExit):
    """``haproxy -db -f CONFIG`` in the foreground, with its stats socket at ``socket_path``."""

    proc: subprocess.Popen[bytes]
    port: int
    socket_path: Path

    @classmethod
    def start(cls, config: Path, *, socket_path: Path, port: int, servers_up: int) -> HAProxyProcess:
        binary = haproxy_binary()
        if binary is None:
            raise RuntimeError("haproxy is not installed")
        proc = subprocess.Popen([binary, "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        lb = cls(proc, port, socket_path)
        return _ready_or_stopped(lb, lambda: lb.count_up() >= servers_up, what="haproxy", proc=proc)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, line: str) -> str:
        """One stats socket command's answer (``show stat``, ``show servers state``...)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5.0)
            s.connect(str(self.socket_path))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def server_stats(self) -> dict[str, dict[str, str]]:
        """``show stat`` of the pool's servers by name (``s1``...): ``status``, ``stot``
        (sessions so far), ``scur`` (now), ``wretr`` (retries), ``wredis`` (redispatches)..."""
        try:
            text = self.command("show stat")
        except OSError:
            return {}
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {row["svname"]: row for row in rows if row.get("svname") not in (None, "FRONTEND", "BACKEND")}

    def count_up(self) -> int:
        return sum(1 for row in self.server_stats().values() if row.get("status", "").startswith("UP"))

    def stop(self) -> None:
        _stop(self.proc)


@dataclass
class MLXLMServerProcess(_LocalServer):
    """mlx-lm's own server on 127.0.0.1:``port``. With ``ranks`` > 1 it is
    ``mlx.launch -n RANKS --backend ring -- mlx_lm.server --model MODEL --port PORT``: RANKS
    processes joined by MLX's ring backend (TCP on loopback), each holding a tensor-parallel
    shard of MODEL (``--pipeline`` in ``extra`` for pipeline stages); rank 0 answers HTTP.
    With ``ranks=1``, one plain ``mlx_lm.server``; with ``launcher=False``, the same ranks
    started without ``mlx.launch`` (benchmarks: its per-rank I/O threads poll without waiting
    and take a core each).

    The process runs in a session of its own and the ranks inherit its process group, so
    ``stop()`` ends all of them with one ``killpg``. ``cwd`` is the working directory: a
    relative ``model`` (``org/name``, as a flow names it) is a folder there, not a Hub download.
    """

    @classmethod
    def start(
        cls,
        model: str,
        *,
        port: int,
        ranks: int = 2,
        cwd: Path | None = None,
        extra: tuple[str, ...] = (),
        log_path: Path | None = None,
        launcher: bool = True,
    ) -> MLXLMServerProcess:
        server_args = ["-m", "mlx_lm", "server", "--model", model, "--host", "127.0.0.1", "--port", str(port), *extra]
        env = {**os.environ, "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "HF_HUB_OFFLINE": "1"}
        ring_port = free_port_run(ranks)
        if ranks > 1 and launcher:
            command = [*mlx_launch_command(), "-n", str(ranks), "--backend", "ring", "--starting-port", str(ring_port)]
            if cwd is not None:
                command += ["--cwd", str(cwd)]
            command += ["--python", sys.executable, "--", *server_args]
        elif ranks > 1:
            # What mlx.launch gives each local rank (MLX_RANK, MLX_HOSTFILE), started here: a
            # shell that starts every rank and waits, so they share its process group.
            hostfile = Path(tempfile.mkdtemp(prefix="ring-")) / "hosts.json"
            hostfile.write_text(
                json.dumps([[f"127.0.0.1:{ring_port + rank}"] for rank in range(ranks)]), encoding="utf-8"
            )
            one = shlex.join([sys.executable, *server_args])
            script = " ".join(
                f"MLX_RANK={rank} MLX_HOSTFILE={shlex.quote(str(hostfile))} {one} &" for rank in range(ranks)
            )
            command = ["/bin/sh", "-c", script + " wait"]
        else:
            command = [sys.executable, *server_args]
        # stdin: a pipe nobody writes to. mlx.launch forwards its stdin to every rank; on
        # /dev/null, always readable, its main loop would never wait.
        with open(log_path if log_path is not None else os.devnull, "wb") as log:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        server = cls(proc, port, log_path)
        what = f"mlx.launch -n {ranks} mlx_lm.server" if ranks > 1 else "mlx_lm.server"
        return _ready_or_stopped(server, server.answers_chat, what=f"{what} on port {port}", proc=proc)

    def answers_chat(self) -> bool:
        """``/health`` is up before the ranks have loaded their shards; a one-token chat call
        answers only once they have. ``RuntimeError`` when ``/health`` says 503: the generation
        thread died (a model it cannot load or shard), and the process stays up without it."""
        status = _status(self.url + "/health")
        if status == 503:
            raise RuntimeError(
                f"mlx_lm.server on port {self.port}: its generation thread died (/health 503); see its log"
            )
        if status != 200:
            return False
        body = json.dumps({"messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}).encode()
        request = urllib.request.Request(
            self.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60.0) as response:  # noqa: S310 - loopback URL built here
                return int(response.status) == 200
        except (OSError, urllib.error.URLError):
            return False

    def running(self) -> bool:
        """Whether any process of the group (the launcher, a rank) is still alive."""
        self.proc.poll()  # a reaped leader is no longer counted
        return _group_alive(self.proc.pid)

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """SIGTERM to the launcher's process group (launcher and ranks), SIGKILL to what is
        left after ``timeout_s``."""
        group = self.proc.pid  # start_new_session: the launcher leads its own group
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal_group(group, signal.SIGKILL)
        self.proc.wait(timeout_s)
        if self.proc.stdin is not None:
            self.proc.stdin.close()


def _signal_group(group: int, sig: signal.Signals) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
