"""islands.checkpoint.policy: when and what to save, and putting a job back where a checkpoint left it.

checkpointer   Checkpointer: checkpoints around a user's own training loop (public home: islands.Checkpointer)
settings       CheckpointSettings and the AutoInterval policy: a job's checkpointing, as values
driver         CheckpointDriver: levels, interval and async persist inside a loop; the TrainingState protocol
interval       CheckFreq overhead bound (SOTA-054) and Young/Daly from MTTF (SOTA-189)
interval_sim   failure simulator for interval policies
resume         exact resume across ranks, resharding N -> M for replicated state
fingerprint    the opaque string that says "the same model", compared on resume
rng            the random generators a step draws from, as checkpointable state
sharded_state  FSDP2 optimizer state, full and name-keyed, loadable on any world size
elastic_saves  saves of elastic jobs, bound to a membership epoch

The top of the package: it uses islands.checkpoint.store and islands.checkpoint.codec, neither imports it.
The settings, resume and fingerprint_of have their public home in islands.checkpoint.
"""

from islands.checkpoint.policy.driver import CheckpointDriver, TrainingState
from islands.checkpoint.policy.interval import (
    DEFAULT_DEVICE_MTBF_DAYS,
    CheckFreqPolicy,
    CombinedIntervalPolicy,
    IntervalDecision,
    YoungDalyInterval,
    checkfreq_interval,
    expected_waste_fraction,
    young_daly_seconds,
)
from islands.checkpoint.policy.interval_sim import SimulationResult, simulate_failures
from islands.checkpoint.policy.settings import parse_policy

__all__ = [
    "CheckpointDriver",
    "TrainingState",
    "parse_policy",
    "CheckFreqPolicy",
    "CombinedIntervalPolicy",
    "IntervalDecision",
    "YoungDalyInterval",
    "checkfreq_interval",
    "expected_waste_fraction",
    "young_daly_seconds",
    "SimulationResult",
    "simulate_failures",
    "DEFAULT_DEVICE_MTBF_DAYS",  # the per-device MTBF YoungDalyInterval assumes (LIT-222)
]
