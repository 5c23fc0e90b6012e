"""Code nodes run in a process of their own, under a time, a memory and a result-size limit.

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
(the body's result must be JSON already; nothing the child writes is unpickled here), bounded in
bytes:

- a result limit (``CodeLimits.result_mib``, ``--max-code-result-mib``): the child measures the
  result's JSON and sends only its size when it is larger; this process reads the child's
  output with a bounded reader (``read_bounded``) that stops, and kills the child, as soon as
  more than the limit came. Either way the call raises ``CodeResultLimitExceeded``, and this
  process never holds more than the limit (plus a copy or two while it parses or stores it).
- a result larger than ``INLINE_RESULT_BYTES`` is kept as a JSON artifact in the run's artifact
  store (the ``ArtifactStore`` given to ``limits``, ``<ledger file>.artifacts/`` for a driven
  run), not in the run's rows: the node's output is a reference
  ``{"$artifact": ID, "content_type": "application/json", "size_bytes": N, "kind": "code_result"}``
  (AbstractRuntime's artifact reference), and a later code node that takes it as input gets the
  value back (``_with_results``).

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
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final

from ...default_limits import DEFAULT_CODE_MEMORY_MIB, DEFAULT_CODE_RESULT_MIB, DEFAULT_CODE_TIME_S
from ...errors import CodeMemoryLimitExceeded, CodeResultLimitExceeded, CodeTimeLimitExceeded, RunLimitExceeded

if TYPE_CHECKING:
    from abstractruntime.storage.artifacts import ArtifactStore

__all__ = [
    "DEFAULT_CODE_MEMORY_MIB",
    "DEFAULT_CODE_RESULT_MIB",
    "DEFAULT_CODE_TIME_S",
    "INLINE_RESULT_BYTES",
    "CodeLimits",
    "CodeRuns",
    "install",
    "is_result_ref",
    "limits",
    "read_bounded",
]

_CHILD: Final = Path(__file__).with_name("code_child.py")
_MIB: Final = 1024 * 1024
INLINE_RESULT_BYTES: Final = 256 * 1024
"""A code result whose JSON is larger than this is kept as an artifact, not in the run's rows."""
_HEADER_MAX_BYTES: Final = 64 * 1024  # the child's answer line before the result (a short JSON object)
_READ_BYTES: Final = 1024 * 1024
_REF_DEPTH: Final = 4
_JSON: Final = "application/json"
_RESULT_KIND: Final = "code_result"
_REF_KEYS: Final = frozenset({"$artifact", "content_type", "size_bytes", "kind"})


@dataclass(frozen=True, slots=True)
class CodeLimits:
    time_s: float = DEFAULT_CODE_TIME_S
    memory_mib: int = DEFAULT_CODE_MEMORY_MIB
    result_mib: int = DEFAULT_CODE_RESULT_MIB


@dataclass(slots=True)
class CodeRuns:
    """The code limits of one driven run, where its large results go (``artifacts``, tagged
    with ``run_id``, the run being ticked), and the limit error of the last call past one."""

    limits: CodeLimits
    artifacts: ArtifactStore | None = None
    run_id: str | None = None
    tripped: RunLimitExceeded | None = None

    def take_tripped(self) -> RunLimitExceeded | None:
        tripped, self.tripped = self.tripped, None
        return tripped


_CURRENT: ContextVar[CodeRuns | None] = ContextVar("abstractruntime_mlx_code_runs", default=None)
_INSTALL_LOCK = threading.Lock()


@contextlib.contextmanager
def limits(code_limits: CodeLimits, *, artifacts: ArtifactStore | None = None) -> Iterator[CodeRuns]:
    """Code nodes run on this thread inside the block get ``code_limits``; their results larger
    than ``INLINE_RESULT_BYTES`` go to ``artifacts`` (without one, they stay inline)."""
    runs = CodeRuns(code_limits, artifacts)
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

        def create_code_handler(
            code: str, function_name: str = "transform", *, permissions: object = "sandbox"
        ) -> Callable[[object], object]:
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
    store = runs.artifacts if runs is not None else None
    request = pickle.dumps(
        {
            "sys_path": list(sys.path),
            "executor": code_executor.__file__,
            "restricted": code_executor.RESTRICTED_PYTHON_AVAILABLE,
            "code": code,
            "function_name": function_name,
            "permissions": permissions,
            "cpu_s": math.ceil(current.time_s) + 1,
            "memory_bytes": current.memory_mib * _MIB,
            "result_bytes": current.result_mib * _MIB,
            "input": _with_results(input_data, store),
        }
    )
    deadline = time.monotonic() + current.time_s
    child = subprocess.Popen(
        [sys.executable, "-I", str(_CHILD)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: a timeout kills whatever it started too
    )
    assert child.stdin is not None and child.stdout is not None
    # Fed from a thread: a child that stops reading must not hold this one past the deadline.
    feeder = threading.Thread(target=_feed, args=(child.stdin, request), name="code-node-input", daemon=True)
    feeder.start()
    try:
        output = read_bounded(
            child.stdout.fileno(), deadline=deadline, max_bytes=current.result_mib * _MIB + _HEADER_MAX_BYTES
        )
        if output.outcome == "eof":
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        output = ChildOutput(bytearray(), "timeout")
    finally:
        if child.poll() is None:
            _kill_group(child)
            child.wait()
        feeder.join()
        child.stdout.close()
    if output.outcome == "over":
        raise _trip(runs, _result_too_large(current, output.size))
    if output.outcome == "timeout" or child.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        raise _trip(runs, CodeTimeLimitExceeded(_time_message(current), limit="--max-code-s", maximum=current.time_s))
    header, body = _split_answer(output.data)
    if header is None:
        raise code_executor.CodeExecutionError(
            f"the code node's process ended (status {child.returncode}) without an answer"
        )
    if header.get("ok") is True:
        return _result(body, runs)
    if header.get("kind") == "memory":
        raise _trip(
            runs,
            CodeMemoryLimitExceeded(
                f"the code needed more than its memory limit of {current.memory_mib} MiB (--max-code-mib)",
                limit="--max-code-mib",
                maximum=current.memory_mib,
            ),
        )
    if header.get("kind") == "result_size":
        size = header.get("bytes")
        raise _trip(runs, _result_too_large(current, size if isinstance(size, int) else current.result_mib * _MIB + 1))
    raise code_executor.CodeExecutionError(str(header.get("message") or "the code failed"))


@dataclass(slots=True)
class ChildOutput:
    """What ``read_bounded`` read: ``outcome`` ``"eof"`` (all of it), ``"over"`` (more than the
    limit came; reading stopped) or ``"timeout"`` (the deadline passed first)."""

    data: bytearray
    outcome: str

    @property
    def size(self) -> int:
        return len(self.data)


def read_bounded(fd: int, *, deadline: float, max_bytes: int) -> ChildOutput:
    """Read ``fd`` until its writer closes it, at most ``max_bytes`` plus one read's worth: past
    ``max_bytes`` it stops at once (``"over"``), at ``deadline`` (a ``time.monotonic()`` value)
    too (``"timeout"``). The caller ends the writer."""
    data = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return ChildOutput(data, "timeout")
            if not selector.select(left):
                continue
            chunk = os.read(fd, _READ_BYTES)
            if not chunk:
                return ChildOutput(data, "eof")
            data += chunk
            if len(data) > max_bytes:
                return ChildOutput(data, "over")


def _feed(stream: IO[bytes], request: bytes) -> None:
    try:
        stream.write(request)
    except (BrokenPipeError, ValueError):
        pass  # the child ended (or was ended) before it read all of it; its answer says why
    finally:
        with contextlib.suppress(BrokenPipeError):
            stream.close()


def _split_answer(data: bytearray) -> tuple[dict[str, object] | None, memoryview]:
    """The child's answer: a JSON header line, then (for a result) the result's JSON."""
    end = data.find(b"\n", 0, _HEADER_MAX_BYTES)
    if end < 0:
        return None, memoryview(b"")
    try:
        header = json.loads(bytes(data[:end]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, memoryview(b"")
    if not isinstance(header, dict):
        return None, memoryview(b"")
    body = memoryview(data)[end + 1 :]
    if header.get("ok") is True and header.get("bytes") != len(body):
        return None, memoryview(b"")
    return header, body


def _result(body: memoryview, runs: CodeRuns | None) -> object:
    """The call's result: the value itself, or a reference to the artifact it is kept in."""
    store = runs.artifacts if runs is not None else None
    if store is None or len(body) <= INLINE_RESULT_BYTES:
        return json.loads(bytes(body))
    size = len(body)
    meta = store.store(
        bytes(body),
        content_type=_JSON,
        run_id=runs.run_id if runs is not None else None,
        tags={"kind": _RESULT_KIND},
    )
    return {"$artifact": meta.artifact_id, "content_type": _JSON, "size_bytes": size, "kind": _RESULT_KIND}


def is_result_ref(value: object) -> bool:
    """Whether ``value`` is the reference ``run_code`` returns for a result kept as an artifact."""
    # Exactly these keys: the host also spreads a node's output object into the next node's
    # input, next to its pins, and that input is not a reference.
    return (
        isinstance(value, dict)
        and value.keys() == _REF_KEYS
        and isinstance(value["$artifact"], str)
        and value["kind"] == _RESULT_KIND
        and value["content_type"] == _JSON
    )


def _with_results(input_data: object, store: ArtifactStore | None) -> object:
    """A code node's input (its pins' values) with the code results it holds by reference
    loaded back: a pin's value, or one inside a list or an object a few levels down. The input
    itself is never taken for a reference: the host spreads the previous node's output object
    into it, a reference included."""
    if store is None or not isinstance(input_data, dict):
        return input_data
    return {key: _loaded(value, store, 1) for key, value in input_data.items()}


def _loaded(value: object, store: ArtifactStore, depth: int) -> object:
    if depth > _REF_DEPTH:
        return value
    if is_result_ref(value):
        assert isinstance(value, dict)
        artifact = store.load(value["$artifact"])
        if artifact is None:
            from abstractruntime.visualflow_compiler.visual import code_executor

            raise code_executor.CodeExecutionError(
                f"the code result kept as artifact {value['$artifact']} is no longer in the artifact store"
            )
        return json.loads(artifact.content)
    if isinstance(value, dict):
        loaded = {key: _loaded(item, store, depth + 1) for key, item in value.items()}
        return loaded if any(loaded[key] is not value[key] for key in value) else value
    if isinstance(value, list):
        items = [_loaded(item, store, depth + 1) for item in value]
        return items if any(new is not old for new, old in zip(items, value)) else value
    return value


def _result_too_large(current: CodeLimits, size: int) -> CodeResultLimitExceeded:
    return CodeResultLimitExceeded(
        f"the code's result is {size / _MIB:.1f} MiB of JSON or more, past its limit of {current.result_mib} MiB (--max-code-result-mib)",
        limit="--max-code-result-mib",
        maximum=current.result_mib,
        size=size,
    )


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
