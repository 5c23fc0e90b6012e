"""One code node's body, run in a process of its own under the limits ``code_sandbox`` gives.

``code_sandbox`` starts this file by path (``python -I code_child.py``), so it imports nothing of
this package (nor AbstractRuntime's package ``__init__``): the process starts in about a tenth
of a second. The host's own sandbox (``code_executor.create_code_handler``, loaded from the file
the parent names) runs the body here, as it would in the parent.

stdin: a pickled request from the parent: ``sys_path``, ``executor`` (the path of the host's
``code_executor.py``), ``restricted`` (whether the parent has RestrictedPython), ``code``,
``function_name``, ``permissions``, ``cpu_s``, ``memory_bytes``, ``result_bytes``, ``input``.
stdout: one line of JSON, then for a result its JSON (UTF-8):
``{"ok": true, "bytes": N}\n<N bytes>``, or ``{"ok": false, "kind": "error" | "memory" |
"result_size", "message": ..., "bytes": ...}\n``: a result whose JSON is larger than
``result_bytes`` is not sent, only its size (``bytes``, at least). The body's own prints go to
stderr, never into the answer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import resource
import sys


def _caused_by_memory(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(16):  # the sandbox wraps the body's exception in its own
        if seen is None:
            return False
        if isinstance(seen, MemoryError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _answer(request: dict[str, object]) -> dict[str, object]:
    """``{"ok": True, "result": ...}`` or a failure: what ``_send`` writes."""
    sys.path[:] = [str(p) for p in request["sys_path"]]  # type: ignore[attr-defined]
    spec = importlib.util.spec_from_file_location("_abstractruntime_code_executor", str(request["executor"]))
    if spec is None or spec.loader is None:
        return {"ok": False, "kind": "error", "message": f"cannot load the host's sandbox from {request['executor']}"}
    executor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(executor)
    if bool(executor.RESTRICTED_PYTHON_AVAILABLE) != bool(request["restricted"]):
        # The body would run under a weaker sandbox here than in the host process.
        return {
            "ok": False,
            "kind": "error",
            "message": "the code node process does not see the host's RestrictedPython",
        }
    cpu_s = int(request["cpu_s"])  # type: ignore[call-overload]
    memory = int(request["memory_bytes"])  # type: ignore[call-overload]
    # Set last: the limits bound the body, not this process's start.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    try:
        handler = executor.create_code_handler(
            request["code"], request["function_name"], permissions=request["permissions"]
        )
        return {"ok": True, "result": handler(request["input"])}
    except BaseException as exc:  # noqa: BLE001 - every failure of the body is the answer
        if _caused_by_memory(exc):
            return {"ok": False, "kind": "memory", "message": "the code ran out of memory"}
        return {"ok": False, "kind": "error", "message": str(exc)}


def _encoded(answer: dict[str, object], max_bytes: int) -> tuple[dict[str, object], bytes]:
    """The answer's header and, for a result, the result's JSON in UTF-8 (within ``max_bytes``)."""
    if answer.get("ok") is not True:
        return answer, b""
    try:
        text = json.dumps(answer["result"], ensure_ascii=False)
        if len(text) > max_bytes:  # UTF-8 takes at least a byte a character: over already
            return {"ok": False, "kind": "result_size", "bytes": len(text)}, b""
        body = text.encode("utf-8")
    except MemoryError:
        return {"ok": False, "kind": "memory", "message": "the code's result does not fit in its memory limit"}, b""
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError (a lone surrogate) is a ValueError
        return {"ok": False, "kind": "error", "message": f"the code's result cannot be sent as JSON: {exc}"}, b""
    if len(body) > max_bytes:
        return {"ok": False, "kind": "result_size", "bytes": len(body)}, b""
    return {"ok": True, "bytes": len(body)}, body


def main() -> int:
    request = pickle.load(sys.stdin.buffer)
    answer_to = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    answer = _answer(request)
    header, body = _encoded(answer, int(request["result_bytes"]))
    del answer
    answer_to.write(json.dumps(header).encode("ascii") + b"\n")
    answer_to.write(body)
    answer_to.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
