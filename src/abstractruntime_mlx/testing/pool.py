"""Start and stop the processes of a scale-out set-up on this machine (tests and benchmarks).

    with ServerProcess.start(model, port=free_port()) as a, ServerProcess.start(model, port=free_port()) as b:
        config = tmp / "pool.cfg"   # written by `abstractruntime-mlx lb-config`
        with HAProxyProcess.start(config, socket=tmp / "haproxy.sock", port=lb_port) as lb:
            lb.server_stats()       # {"s1": {"status": "UP", "stot": 3, ...}, ...}

Every process is started by the caller's test and stopped by it (``stop()``, or leaving the
``with``): nothing keeps running. Waits are bounded and re-check that the process lives.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["HAProxyProcess", "ServerProcess", "free_port", "haproxy_binary", "wait_until"]

START_TIMEOUT_S: Final = 90.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def haproxy_binary() -> str | None:
    """The ``haproxy`` executable (PATH, then /usr/sbin where Debian puts it), or None."""
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin:/opt/homebrew/sbin")


def wait_until(ready: Callable[[], bool], *, what: str, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = START_TIMEOUT_S) -> None:
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


def _get_json(url: str, timeout_s: float = 2.0) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - loopback URLs built here
            body = json.loads(response.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None
    return body if isinstance(body, dict) else None


def _stop(proc: subprocess.Popen[bytes], *, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


@dataclass
class ServerProcess:
    """One ``abstractruntime-mlx serve --model MODEL`` on 127.0.0.1:``port``."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path | None = None

    @classmethod
    def start(cls, model: str, *, port: int, extra: tuple[str, ...] = (), log_path: Path | None = None) -> ServerProcess:
        command = [sys.executable, "-m", "abstractruntime_mlx.cli.main", "serve", "--model", model, "--port", str(port), *extra]
        log = open(log_path, "wb") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
        env = {**os.environ, "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        server = cls(proc, port, log_path)
        try:
            wait_until(server.healthy, what=f"serve on port {port}", proc=proc)
        except BaseException:
            server.stop()
            raise
        return server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@dataclass
class HAProxyProcess:
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
        try:
            wait_until(lambda: lb.count_up() >= servers_up, what="haproxy", proc=proc)
        except BaseException:
            lb.stop()
            raise
        return lb

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

    def __enter__(self) -> HAProxyProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
