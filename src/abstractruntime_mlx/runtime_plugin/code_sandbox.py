"""Code nodes run in a process of their own, under a time and a memory limit.

AbstractRuntime runs a ``code`` node's body (and a ``function`` node's ``code``) in the host
process, with RestrictedPython: what the body may import or touch is limited, how long it runs
and how much memory it takes is not (``while True: pass`` stops the run forever). ``install()``
replaces the compiler's ``create_code_handler`` (``visualflow_compiler.visual.executor``, the one
name it calls for both node types; ``tests/test_backend_contract.py`` pins it) with one that
compiles and checks the body in this process as before, then runs each call in a child process
(``code_child.py``) under the host's same sandbox, with

- a wall-clock limit (``CodeLimits.time_s``, including the process start, about 0.1 s): past
  it the process group is killed and the call raises ``CodeTimeLimitExceeded``; the child also
  has an ``RLIMIT_CPU`` one second longer, so it ends even if this process dies first;
- a memory limit (``CodeLimits.memory_mib``): the child's ``RLIMIT_AS``; an allocation past it
  raises ``MemoryError`` in the body and the call raises ``CodeMemoryLimitExceeded``. The kernel
  enforces ``RLIMIT_AS`` on Linux; macOS accepts the limit but does not enforce it.

The input crosses to the child pickled (this process wrote it), the result comes back as JSON
(the body's result must be JSON already; nothing the child writes is unpickled here).

``drive`` sets the limits of the run it drives (``limits(...)``, a context variable: ticks run on
the driving thread) and learns from the returned ``CodeRuns`` which limit a call went past, so
it can fail the run rather than let the host end it as completed with an error output.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ..errors import CodeMemoryLimitExceeded, CodeTimeLimitExceeded, RunLimitExceeded
from ..default_limits import DEFAULT_CODE_MEMORY_MIB, DEFAULT_CODE_TIME_S

__all__ = ["DEFAULT_CODE_MEMORY_MIB", "DEFAULT_CODE_TIME_S", "CodeLimits", "CodeRuns", "install", "limits"]

_CHILD: Final = Path(__file__).with_name("code_child.py")


@dataclass(frozen=True, slots=True)
class CodeLimits:
    time_s: float = DEFAULT_CODE_TIME_S
    memory_mib: int = DEFAULT_CODE_MEMORY_MIB


@dataclass(slots=True)
class CodeRuns:
    """The code limits of one driven run, and the limit error of the last call past one."""

    limits: CodeLimits
    tripped: RunLimitExceeded | None = None

    def take_tripped(self) -> RunLimitExceeded | None:
        tripped, self.tripped = self.tripped, None
        return tripped


_CURRENT: ContextVar[CodeRuns | None] = ContextVar("abstractruntime_mlx_code_runs", default=None)
_INSTALL_LOCK = threading.Lock()


@contextlib.contextmanager
def limits(code_limits: CodeLimits) -> Iterator[CodeRuns]:
    """Code nodes run on this thread inside the block get ``code_limits``."""
    runs = CodeRuns(code_limits)
    token = _CURRENT.set(runs)
    try:
        yield runs
    finally:
        _CURRENT.reset(token)


def install() -> None:
    """Make the host's compiler run code node bodies through ``run_code`` (once per process)."""
    from abstractruntime.visualflow_compiler.visual import code_executor, executor

    with _INSTALL_LOCK:
        if getattr(executor.create_code_handler, "_runs_in_child", False):
            return
        in_process = executor.create_code_handler

        def create_code_handler(code: str, function_name: str = "transform", *, permissions: object = "sandbox") -> Callable[[object], object]:
            # Built here first, as before: a body the sandbox refuses is refused when the node is built.
            in_process(code, function_name, permissions=permissions)

            def handler(input_data: object) -> object:
                return run_code(code, function_name, permissions=permissions, input_data=input_data)

            return handler

        setattr(create_code_handler, "_runs_in_child", True)
        setattr(create_code_handler, "_executor_path", code_executor.__file__)
        executor.create_code_handler = create_code_handler


def run_code(code: str, function_name: str, *, permissions: object, input_data: object) -> object:
    """Run one call of a code node body in a child process under the current limits."""
    from abstractruntime.visualflow_compiler.visual import code_executor

    runs = _CURRENT.get()
    current = runs.limits if runs is not None else CodeLimits()
    request = pickle.dumps(
        {
            "sys_path": list(sys.path),
            "executor": code_executor.__file__,
            "restricted": code_executor.RESTRICTED_PYTHON_AVAILABLE,
            "code": code,
            "function_name": function_name,
            "permissions": permissions,
            "cpu_s": math.ceil(current.time_s) + 1,
            "memory_bytes": current.memory_mib * 1024 * 1024,
            "input": input_data,
        }
    )
    child = subprocess.Popen(
        [sys.executable, "-I", str(_CHILD)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: a timeout kills whatever it started too
    )
    try:
        out, _ = child.communicate(request, timeout=current.time_s)
    except subprocess.TimeoutExpired:
        _kill_group(child)
        child.communicate()
        raise _trip(runs, CodeTimeLimitExceeded(_time_message(current), limit="--max-code-s", maximum=current.time_s)) from None
    finally:
        if child.poll() is None:
            _kill_group(child)
            child.wait()
    if child.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        raise _trip(runs, CodeTimeLimitExceeded(_time_message(current), limit="--max-code-s", maximum=current.time_s))
    try:
        answer = json.loads(out.decode("utf-8")) if out else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        answer = None
    if not isinstance(answer, dict):
        raise code_executor.CodeExecutionError(f"the code node's process ended (status {child.returncode}) without an answer")
    if answer.get("ok") is True:
        return answer.get("result")
    if answer.get("kind") == "memory":
        raise _trip(
            runs,
            CodeMemoryLimitExceeded(
                f"the code needed more than its memory limit of {current.memory_mib} MiB (--max-code-mib)",
                limit="--max-code-mib",
                maximum=current.memory_mib,
            ),
        )
    raise code_executor.CodeExecutionError(str(answer.get("message") or "the code failed"))


def _time_message(current: CodeLimits) -> str:
    return f"the code ran past its time limit of {current.time_s:g} s (--max-code-s)"


def _trip(runs: CodeRuns | None, exc: RunLimitExceeded) -> RunLimitExceeded:
    if runs is not None:
        runs.tripped = exc
    return exc


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
