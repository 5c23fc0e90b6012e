"""A bounded local attack on a real ``serve`` (no model, 127.0.0.1): how many connections it
holds and whether ``/health`` answers (``server/connections.py``).

    python bench/connection_flood.py                          # this checkout, descriptor limit 2048
    python bench/connection_flood.py --src /other/checkout/src   # another checkout, for comparison

First ``--idle`` connections that send nothing: how many the server still holds half a second
later and 12.5 s later (past the default header deadline), and ``/health`` meanwhile. Then
``--slow`` connections that send a request header a byte per second (slowloris): how many are
still open after 20 s. The server runs with its soft and hard ``RLIMIT_NOFILE`` set to
``--descriptors``; this process needs more than ``--idle`` descriptors itself.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SRC = Path(__file__).resolve().parents[1] / "src"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def held(socks: list[socket.socket]) -> int:
    """Sockets the server has not closed (nothing to read yet, or bytes but no EOF)."""
    count = 0
    for sock in socks:
        sock.setblocking(False)
        try:
            count += sock.recv(65536) != b""
        except BlockingIOError:
            count += 1
        except OSError:
            pass
        sock.setblocking(True)
    return count


def health(url: str) -> str:
    try:
        return str(httpx.get(f"{url}/health", timeout=5).status_code)
    except httpx.HTTPError as exc:
        return type(exc).__name__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", default=str(SRC), help="the checkout's src/ to run serve from")
    parser.add_argument("--descriptors", type=int, default=2048)
    parser.add_argument("--idle", type=int, default=2100)
    parser.add_argument("--slow", type=int, default=300)
    parser.add_argument("serve_args", nargs="*", help="more serve flags (after --)")
    args = parser.parse_args()
    port = free_port()
    limit = args.descriptors

    def limit_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    env = {**os.environ, "PYTHONPATH": args.src}
    command = [sys.executable, "-m", "abstractruntime_mlx.cli.main", "serve", "--port", str(port), *args.serve_args]
    server = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL, preexec_fn=limit_descriptors)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while health(url) != "200":
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("serve did not start")
            time.sleep(0.1)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(args.idle)]
        time.sleep(0.5)
        print(f"idle: {len(idle)} opened, {held(idle)} held by the server, /health {health(url)}")
        time.sleep(12)
        print(f"idle, 12.5 s later: {held(idle)} held, /health {health(url)}")
        for sock in idle:
            sock.close()
        slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(args.slow)]
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        while time.monotonic() - started < 20:
            for sock in slow:
                try:
                    sock.sendall(b"X")
                except OSError:
                    pass
            time.sleep(1)
        print(f"slowloris, 20 s later: {held(slow)} of {len(slow)} open, /health {health(url)}")
        for sock in slow:
            sock.close()
    finally:
        server.terminate()
        server.wait(timeout=20)


if __name__ == "__main__":
    main()
