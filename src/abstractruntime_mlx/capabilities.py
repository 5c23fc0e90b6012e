"""Execution capabilities of one model route, without loading weights.

The shape matches AbstractCore's ``get_execution_capabilities`` (version 1)::

    {"version": 1, "provider": "mlx", "model": NAME,
     "speculation": {"supported", "ready", "reason", "message", "companion", "head_present",
                     "supported_depths", "default", "effective_default", "effective_source",
                     "requires_reload", "head_path"?, "head_fingerprint"?},
     "thinking": {"effective_default", "effective_source"},
     "concurrency": {"supported", "source", "reason"}}

Evidence comes from config files and safetensors headers only (see ``artifacts``). ``ready``
is ``null`` (unknown) unless a loaded ``instance`` answers ``speculation_ready()``; unknown
is not proof that a head is ready. A loaded instance whose head is on this machine but not
attached yet (``speculation_attachable()``) reports ``mtp_head_attaches_on_first_use`` and
``requires_reload: false``. ``head_path`` / ``head_fingerprint`` (bounded, see
``artifacts.model_fingerprint``) identify the local head and are absent when there is none. A
model that is not on this machine is reported (``supported: false, reason: "model_not_found"``,
with the download command in ``message``) rather than raised, so a discovery UI can render it; a
corrupt policy file still raises ``PolicyError``.

``effective_default`` / ``effective_source`` come from ``controls.resolve_controls`` over the
provider level (a loaded ``instance``'s own ``resolve_controls()``) and the Core policy: the
same resolution, value and source that ``generate`` runs for a call that says nothing.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from . import artifacts
from .controls import ResolvedControls, control_level, resolve_controls
from .errors import InvalidRequest, ModelNotFound
from .policy import read_policy

CAPABILITIES_VERSION: Final = 1
SUPPORTED_PROVIDERS: Final = frozenset({"mlx"})
SUPPORTED_DEPTHS: Final[tuple[int, ...]] = (1, 2, 3, 4, 5)


def get_execution_capabilities(
    model_name: str,
    provider: str = "mlx",
    instance: object = None,
    *,
    head: str | None = None,
    policy_path: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> dict[str, object]:
    """Describe MTP support/readiness and concurrency for ``model_name`` on ``provider``.

    ``instance`` (optional) is a loaded provider; it may offer ``speculation_ready() -> bool``,
    ``supports_concurrent_generation() -> bool`` and ``control_defaults() -> ControlLevel``
    (its constructor-level speculation and thinking). ``head`` names a companion MTP head
    explicitly. ``policy_path`` overrides the Core config file; ``cache_dir`` the Hugging Face
    cache.
    """
    speculation, controls = describe_speculation(
        model_name, provider, instance, head=head, policy_path=policy_path, cache_dir=cache_dir
    )
    return {
        "version": CAPABILITIES_VERSION,
        "provider": provider,
        "model": model_name,
        "speculation": speculation,
        "thinking": {"effective_default": controls.thinking, "effective_source": controls.thinking_source},
        "concurrency": describe_concurrency(instance),
    }


def describe_concurrency(instance: object) -> dict[str, object]:
    if instance is None:
        return {"supported": None, "source": "unknown", "reason": None}
    probe = getattr(instance, "supports_concurrent_generation", None)
    if not callable(probe):
        return {"supported": None, "source": "loaded_instance", "reason": "capability_probe_missing"}
    answer = probe()
    if not isinstance(answer, bool):
        return {"supported": None, "source": "loaded_instance", "reason": "invalid_capability_probe"}
    return {"supported": answer, "source": "loaded_instance", "reason": None}


def describe_speculation(
    model_name: str,
    provider: str,
    instance: object = None,
    *,
    head: str | None = None,
    policy_path: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> tuple[dict[str, object], ResolvedControls]:
    """The ``speculation`` block of ``get_execution_capabilities`` and the resolution behind it."""
    policy = read_policy(policy_path)
    default_wire = None if policy.speculation is None else policy.speculation.to_wire()
    hook = getattr(instance, "control_defaults", None)
    provider_level = control_level(hook(), level="provider") if callable(hook) else None
    evidence, reason, message = _artifact_evidence(model_name, provider, head=head, cache_dir=cache_dir)
    if reason is not None:
        controls = resolve_controls(provider=provider_level, policy=policy.controls, verified_default=False)
        return {
            "supported": False,
            "ready": False,
            "reason": reason,
            "message": message,
            "companion": evidence.get("companion") if evidence else None,
            "head_present": evidence.get("head_present") if evidence else None,
            "supported_depths": [],
            "default": default_wire,
            "effective_default": False,
            "effective_source": "unsupported",
            "requires_reload": None,
        }, controls
    assert evidence is not None
    ready = _instance_ready(instance)
    head_present = True if ready else evidence["head_present"]
    attachable = ready is False and head_present is True and _instance_attachable(instance)
    if ready:
        reason = None
    elif head_present is False:
        reason = "mtp_head_not_cached"
    elif instance is None:
        reason = "model_not_loaded"
    elif attachable:
        reason = "mtp_head_attaches_on_first_use"
    elif ready is False:
        reason = "speculation_is_load_time"
    else:
        reason = "readiness_unknown"
    if reason == "mtp_head_not_cached" and evidence["companion"]:
        companion = evidence["companion"]
        message = (
            f"MTP acceleration off: companion head {companion} is not on this machine; "
            f"download it with `{artifacts.DOWNLOAD_COMMAND.format(name=companion)}`"
        )
    controls = resolve_controls(provider=provider_level, policy=policy.controls, verified_default=True)
    return {
        "supported": True,
        "ready": ready,
        "reason": reason,
        "message": message,
        "companion": evidence["companion"],
        "head_present": head_present,
        "supported_depths": list(SUPPORTED_DEPTHS),
        "default": default_wire,
        "effective_default": controls.speculation.to_wire(),
        "effective_source": controls.speculation_source,
        "requires_reload": (not ready and not attachable) if isinstance(ready, bool) else None,
        **_head_identity(evidence),
    }, controls


def _head_identity(evidence: Mapping[str, object]) -> dict[str, str]:
    """``head_path`` and ``head_fingerprint`` of the local head (a companion directory, or the
    checkpoint itself for embedded ``mtp.*`` weights); absent when no head is on this machine."""
    path = evidence.get("companion_path") or (evidence.get("path") if evidence.get("embedded") else None)
    if not isinstance(path, (str, Path)) or not path:
        return {}
    try:
        return {"head_path": str(path), "head_fingerprint": artifacts.model_fingerprint(path)}
    except InvalidRequest:
        return {}


def _instance_attachable(instance: object) -> bool:
    probe = getattr(instance, "speculation_attachable", None)
    return bool(probe()) if callable(probe) else False


def _instance_ready(instance: object) -> bool | None:
    if instance is None:
        return None
    probe = getattr(instance, "speculation_ready", None)
    if not callable(probe):
        return None
    answer = probe()
    return answer if isinstance(answer, bool) else None


def _artifact_evidence(
    model_name: str, provider: str, *, head: str | None, cache_dir: str | Path | None
) -> tuple[dict[str, object] | None, str | None, str | None]:
    """``(evidence, reason, message)``; ``reason`` is set when MTP cannot run for this route."""
    if provider not in SUPPORTED_PROVIDERS:
        return None, "native_mtp_backend_unavailable", None
    try:
        path = artifacts.resolve_model_path(model_name, cache_dir=cache_dir)
        evidence = {**artifacts.detect_mtp(path, name=model_name, head=head, cache_dir=cache_dir), "path": str(path)}
    except ModelNotFound as exc:
        return None, "model_not_found", exc.message
    except InvalidRequest as exc:
        return None, "checkpoint_unreadable", exc.message
    if evidence["num_weight_files"] == 0:
        return evidence, "checkpoint_unreadable", f"no *.safetensors files in {path}"
    if evidence["is_head"]:
        return evidence, "model_is_mtp_head", f"{model_name} is an MTP head; load its target model instead"
    if not evidence["verified"]:
        if evidence["config_mtp_layers"]:
            return (
                evidence,
                "embedded_mtp_weights_missing",
                f"the config of {model_name} declares MTP layers but its weights carry no mtp.* tensors",
            )
        return evidence, "mtp_artifact_unverified", None
    if importlib.util.find_spec("mlx_vlm") is None:
        return evidence, "mlx_vlm_missing", "native MTP needs mlx-vlm; install it with `pip install mlx-vlm`"
    return evidence, None, None
