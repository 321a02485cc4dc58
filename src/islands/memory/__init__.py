"""Device memory: exact accounting, activation checkpointing, reduced precision, micro-batch sizing.

    accounting   bytes saved for backward (saved_tensors_hooks) and bytes of training state
    recompute    activation checkpointing in segments (SOTA-249)
    step         one step's forward/backward: micro-batches (SOTA-031) under fp32 or bf16 (SOTA-118)
    sizer        the largest micro-batch under a memory budget (SOTA-031)
    build        from a TrainConfig to the step body
See docs/memory.md.
"""

from islands.memory.accounting import SavedTensorMeter, StateBytes, state_bytes
from islands.memory.recompute import enable_activation_checkpointing, run_checkpointed, split_segments, sqrt_segments
from islands.memory.sizer import MemoryPlan, activation_peak, plan_micro_batch, synthetic_batches
from islands.memory.step import ForwardBackward, resolve_precision

__all__ = [
    "SavedTensorMeter",
    "StateBytes",
    "state_bytes",
    "enable_activation_checkpointing",
    "run_checkpointed",
    "sqrt_segments",
    "split_segments",
    "MemoryPlan",
    "activation_peak",
    "plan_micro_batch",
    "synthetic_batches",
    "ForwardBackward",
    "resolve_precision",
]
