"""What a waiting run waits for, in words and as data, and the envelope of an event sent to it.

describe_wait(state.waiting)   # "answer to 'Continue?' (choices: yes, no)"
wait_info(state.waiting)       # {"reason": "user", "prompt": ..., "choices": [...], ...}
"""

from __future__ import annotations

import datetime as dt

from abstractruntime.core.models import RunState, WaitReason, WaitState

__all__ = ["describe_wait", "event_envelope", "event_name", "wait_info"]


def event_name(wait_key: str | None) -> str | None:
    """The event name of a ``wait_event`` key (``evt:{scope}:{scope_id}:{name}``)."""
    key = str(wait_key or "")
    if not key.startswith("evt:"):
        return None
    parts = key.split(":", 3)
    return parts[3] if len(parts) == 4 else None


def wait_info(wait: WaitState | None) -> dict[str, object] | None:
    """The parts of a wait a person needs to answer it (JSON)."""
    if wait is None:
        return None
    reason = str(getattr(wait.reason, "value", wait.reason))
    info: dict[str, object] = {"reason": reason, "wait_key": wait.wait_key}
    if wait.reason == WaitReason.USER:
        info.update(prompt=wait.prompt, choices=list(wait.choices or []), allow_free_text=wait.allow_free_text)
    elif wait.reason == WaitReason.UNTIL:
        info["until"] = wait.until
    elif wait.reason == WaitReason.EVENT:
        # A wait_event key names its event; any other key (a host channel) is the name to send.
        info["event"] = event_name(wait.wait_key) or wait.wait_key
    elif wait.reason == WaitReason.SUBWORKFLOW and isinstance(wait.details, dict):
        info["sub_run_id"] = wait.details.get("sub_run_id")
    return info


def describe_wait(wait: WaitState | None) -> str:
    """One line: what the run waits for and how to continue it."""
    if wait is None:
        return "nothing"
    if wait.reason == WaitReason.USER:
        text = f"an answer to {wait.prompt or '(no prompt)'!r}"
        if wait.choices:
            text += f" (choices: {', '.join(str(c) for c in wait.choices)}{'' if wait.allow_free_text else ', nothing else'})"
        return text + " -> runs resume RUN_ID --answer TEXT"
    if wait.reason == WaitReason.UNTIL:
        return f"a timer until {wait.until} -> runs resume RUN_ID (waits for it)"
    if wait.reason == WaitReason.EVENT:
        return f"event {event_name(wait.wait_key) or wait.wait_key!r} -> runs resume RUN_ID --event NAME[=JSON]"
    if wait.reason == WaitReason.SUBWORKFLOW:
        child = wait.details.get("sub_run_id") if isinstance(wait.details, dict) else None
        return f"subflow run {child}"
    return f"{getattr(wait.reason, 'value', wait.reason)} ({wait.wait_key})"


def event_envelope(name: str, payload: object, run: RunState) -> dict[str, object]:
    """The envelope the host's scheduler delivers with an external event (``Scheduler.emit_event``)."""
    key = str(run.waiting.wait_key if run.waiting is not None else "")
    parts = key.split(":", 3)
    scope = parts[1] if len(parts) == 4 else "session"
    return {
        "event_id": None,
        "name": name,
        "scope": scope,
        "session_id": run.session_id,
        "payload": dict(payload) if isinstance(payload, dict) else {"value": payload},
        "emitted_at": dt.datetime.now(dt.UTC).isoformat(),
        "emitter": {"source": "external"},
    }
