"""Which ``/acore/models/load`` options a client may set, and which only ``serve``'s operator may.

A client (anyone who can reach the server) may tune how its model runs: batching, queue and
batch sizes within bounds, the lanes, speculation, an MTP head inside the model roots. What
decides isolation between tenants, what touches the filesystem and what sizes the caches is
the operator's: the value ``serve`` was started with (or the provider's default) stays.

- ``OPERATOR_OPTIONS`` (cache sharing and scope, the SSD tier's path and budget, the RAM
  budget): a client's value that differs from the operator's is refused with
  ``OperatorSetting`` (403, ``operator_setting``); the same value is accepted (nothing changes).
- ``CLIENT_LIMITS``: the most a client may ask for of a size or a wait; more is the same 403
  (the operator may start ``serve`` with more, and then that is the client's bound).

Values are checked for their type and range by the provider (``create_llm``) as for any caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from ..errors import OperatorSetting

OPERATOR_OPTIONS: Final = frozenset(
    {"mlx_cache_sharing", "mlx_cache_scope", "mlx_cache_disk_path", "mlx_cache_disk_max_gb", "mlx_cache_memory_max_gb"}
)
"""Options only the operator sets: tenant isolation, paths on the server's disk, cache budgets."""

CLIENT_LIMITS: Final[Mapping[str, float]] = {
    "mlx_max_batch_size": 64,
    "mlx_max_queue_size": 1024,
    "mlx_output_queue_size": 4096,
    "mlx_prefill_step_size": 8192,
    "mlx_queue_timeout_s": 600.0,
}
"""The largest value a client may ask for (unless the operator's own value is larger)."""


def client_load_options(options: Mapping[str, object], *, operator: Mapping[str, object]) -> dict[str, object]:
    """``options`` a client sent, checked against the operator's (``operator``: what ``serve`` gave
    this model); operator-only options equal to the operator's value are dropped (they change
    nothing). Raises ``OperatorSetting`` naming the first option refused."""
    from ..provider.mlx_provider import EXECUTION_DEFAULTS

    allowed: dict[str, object] = {}
    for name, value in options.items():
        ruling = operator.get(name, EXECUTION_DEFAULTS.get(name))
        if name in OPERATOR_OPTIONS:
            if not option_equal(value, ruling):
                raise OperatorSetting(
                    f"options.{name} is the server operator's setting (given when serve starts, else the default); "
                    "a client may not change it over HTTP",
                    details={"field": f"options.{name}", "option": name},
                )
            continue
        limit = CLIENT_LIMITS.get(name)
        if limit is not None and _number(value) is not None:
            bound = max(limit, _number(ruling) or 0.0)
            if (_number(value) or 0.0) > bound:
                raise OperatorSetting(
                    f"options.{name} may be at most {bound:g} when a client asks; larger values are the operator's "
                    "to give when serve starts",
                    details={"field": f"options.{name}", "option": name, "limit": bound},
                )
        allowed[name] = value
    return allowed


def option_equal(a: object, b: object) -> bool:
    """Two option values that mean the same (``4 == 4.0``; ``True`` is not ``1``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return bool(a == b)


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
