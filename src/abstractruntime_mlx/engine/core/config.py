"""The engine's knobs and their defaults: the one home for both (no MLX).

``provider.mlx_provider.EXECUTION_DEFAULTS`` derives its engine options from ``EngineConfig``.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass

from ...errors import OptionRemoved
from ..backends.rows import PREFILL_STEP_SIZE  # prompt tokens per prefill chunk on the batched lanes

# Prompt tokens per prefill chunk on the serialized lanes (``mlx_batching=False``): mlx-lm's
# and mlx-vlm's own default, the seed's 2,048. One request runs at a time there, so a chunk
# never holds back another request's decode, and fewer chunks prefill faster.
SERIAL_PREFILL_STEP_SIZE = 2048


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # The seed's four batch slots, 32 waiting requests, a 10 ms collection window, a
    # 120-second queue timeout and 256 buffered output records.
    max_batch_size: int = 4
    max_queue_size: int = 32
    batch_wait_ms: float = 10  # an int, as the provider's options have always shown it
    queue_timeout_s: float = 120.0
    output_queue_size: int = 256
    prefill_step_size: int = PREFILL_STEP_SIZE
    # The serialized lanes' chunk; an explicit ``mlx_prefill_step_size`` sets both.
    serial_prefill_step_size: int = SERIAL_PREFILL_STEP_SIZE
    # Sampled requests run alone, one at a time (the seed's behaviour), instead of sharing
    # the continuous batch; their tokens are the same either way.
    sampled_exclusive: bool = False
    # A continuous group of one decodes on the single-request lane (``single``) until a
    # second request joins; off: every continuous row decodes in upstream's batch step.
    single_lane: bool = True
    # A continuous group starts once no compatible request has arrived for this long (at most
    # ``batch_wait_ms`` after the first): a burst (a flow's fan-out, clients at once) is
    # prefilled as one batch, and its first request does not start alone on the single lane.
    burst_gap_ms: float = 2.0
    # Continuous groups of plain text rows run in the text lane (``text_loop``), which steps
    # faster at high concurrency and interleaves prefill chunks with decode; off: every batch
    # runs in mlx-vlm's loop.
    text_lane: bool = True
    # In the text lane a finished row's slot can idle in the batch until half the batch has
    # finished or rows join (one compaction for many finishes) instead of being dropped at once.
    # None (the default) decides by what bounds the step: idle on MLX's CUDA backend, where the
    # host encoding kernels bounds it and idle slots cost no host work; dropped at once elsewhere
    # (on the CPU each idle row adds its compute to every step).
    idle_finished_rows: bool | None = None
    # The text lane pads prompt chunks to a few lengths and runs those prefill shapes once when
    # the model loads (``prefill_shapes``): on MLX's CUDA backend a shape's first run costs
    # 60-470 ms of setup. Off by default: on the H200 it did not raise throughput at 16-64
    # concurrent requests, and the warm-up adds seconds to a load (docs/benchmarks.md).
    prefill_buckets: bool = False
    # On MLX's CUDA backend the text lane's decode attention runs in one kernel per layer that
    # takes each row's left padding as its start (``cuda_attention``), instead of upstream's
    # unfused masked path; elsewhere (CPU, Metal) this changes nothing.
    fused_decode_attention: bool = True
    # On MLX's CUDA backend short prompt chunks of text rows (the text lane's and the single
    # lane's) compute attention in plain MLX ops (``cuda_attention``) instead of cuDNN, whose
    # plan for each new shape costs up to ~1 s of host time to build; elsewhere (CPU, Metal)
    # this changes nothing.
    prefill_attention_ops: bool = True
    # The text lane's model computes each layer's query/key/value projections in one matmul and
    # its MLP's gate/up projections in another (``fused_projections``): fewer kernels for the
    # host to build and encode per step. Same weights, held once.
    fused_projections: bool = True
    # Removed: refused with ``OptionRemoved`` (``REMOVED``), never silently ignored.
    own_text_loop: InitVar[object] = None
    admission_wave_steps: InitVar[object] = None

    def __post_init__(self, own_text_loop: object, admission_wave_steps: object) -> None:
        for name, value in (("own_text_loop", own_text_loop), ("admission_wave_steps", admission_wave_steps)):
            if value is not None:
                raise OptionRemoved(name, REMOVED[name])


# Options that no longer exist, and what replaced them (the provider's ``mlx_`` names too).
REMOVED: dict[str, str] = {
    "own_text_loop": "the text lane always steps its own loop (mlx-lm's BatchGenerator measured 1.19-1.47x slower)",
    "admission_wave_steps": "each text-lane step admits whatever arrived (waves measured 0.96-1.07x)",
}
