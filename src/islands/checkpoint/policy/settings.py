"""What a job's checkpointing is, as values: `CheckpointSettings` and the interval policy `AutoInterval`.

Components are built from these objects; the text forms (`parse_policy`, and the job config the
application layer reads) are the edge. Every rule about which settings go together lives in
`CheckpointSettings.__post_init__`, so a bad combination fails where it is made, naming the field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from islands.checkpoint.policy.interval import (
    DAY_S,
    DEFAULT_DEVICE_MTBF_DAYS,
    DEFAULT_OVERHEAD_BOUND,
    CheckFreqPolicy,
    CombinedIntervalPolicy,
    YoungDalyInterval,
)
from islands.spec import Registry, Spec


@dataclass(frozen=True)
class AutoInterval:
    """The local-disk interval chosen from measurements: CheckFreq's overhead bound (SOTA-054) and
    Young/Daly from the job's failure rate (SOTA-189); the binding one wins (CombinedIntervalPolicy).

    bound: the share of training time checkpoint stalls may take (issue #6: 3.5%).
    mtbf_days: mean time between failures of one device (LIT-222's fit).
    devices: devices the job's failure rate counts; 0 = the job's world size.
    first: the step of the first checkpoint (the policy has nothing measured before it).
    max: the longest interval, in steps.
    """

    bound: float = DEFAULT_OVERHEAD_BOUND
    mtbf_days: float = DEFAULT_DEVICE_MTBF_DAYS
    devices: int = 0
    first: int = 10
    max: int = 1_000_000

    def __post_init__(self):
        if not 0 < self.bound < 1:
            raise ValueError(f"AutoInterval: bound is a fraction in (0, 1), e.g. 0.035; got {self.bound}")
        if self.mtbf_days <= 0:
            raise ValueError(
                f"AutoInterval: mtbf_days must be > 0 (e.g. {DEFAULT_DEVICE_MTBF_DAYS}); got {self.mtbf_days}"
            )
        if not isinstance(self.devices, int) or self.devices < 0:
            raise ValueError(
                f"AutoInterval: devices must be an int >= 0 (0 = the job's world size); got {self.devices!r}"
            )
        for name in ("first", "max"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"AutoInterval: {name} must be an int >= 1 (steps); got {value!r}")

    def build(self, world_size: int) -> CombinedIntervalPolicy:
        """A fresh policy for a job of `world_size` processes (when devices is 0)."""
        checkfreq = CheckFreqPolicy(self.bound, smoothing=0.3, max_steps=self.max, initial_steps=self.first)
        failures = YoungDalyInterval(self.devices or world_size, per_device_mtbf_s=self.mtbf_days * DAY_S)
        return CombinedIntervalPolicy(checkfreq, failures)


POLICIES = Registry("checkpoint policy", {"auto": AutoInterval}, base=AutoInterval)


def parse_policy(text: str | Spec | None) -> AutoInterval | None:
    """The edge form: "" or None -> None (a fixed interval); "auto[:bound=0.035,mtbf_days=3748.25,devices=N,first=10,
    max=N]" (or its Spec) -> AutoInterval. Raises ValueError naming the malformed part (islands.spec)."""
    if text is None or text == "":
        return None
    return POLICIES.build(text)


def format_policy(policy: AutoInterval | None) -> str:
    """The text parse_policy reads back to an equal value."""
    if policy is None:
        return ""
    return "auto:" + ",".join(f"{k}={v}" for k, v in asdict(policy).items())


@dataclass(frozen=True)
class CheckpointSettings:
    """Where and how often a job checkpoints (islands.checkpoint.policy.driver.CheckpointDriver).

    dir: the local-disk level's root; None = <run_dir>/ckpt.
    every: steps between local-disk checkpoints; 0 = none (unless `policy` chooses).
    policy: None (a fixed `every`) or AutoInterval(...) choosing the local-disk interval.
    memory_every: steps between in-memory checkpoints (packed, checksummed bytes in the process); 0 = none.
    memory_peer: rank r's memory checkpoint is also held by rank (r+1) % n (SOTA-057).
    remote_dir, remote_every: a second directory standing for remote storage, and its interval.
    keep: checkpoints retention keeps per disk level.
    asynchronous: snapshot, then persist in the background (SOTA-056); False = a blocking save.
    share_replicas: tensors rank 0 saves in the same step are referenced, not written again, by other ranks.
    timeout: seconds the checkpoint barrier may wait for the other ranks.
    """

    dir: str | Path | None = None
    every: int = 0
    policy: AutoInterval | None = None
    memory_every: int = 0
    memory_peer: bool = False
    remote_dir: str | Path | None = None
    remote_every: int = 0
    keep: int = 3
    asynchronous: bool = True
    share_replicas: bool = True
    timeout: float = 120.0

    def __post_init__(self):
        for name in ("dir", "remote_dir"):  # "" reads as unset, as in a config file
            if getattr(self, name) == "":
                object.__setattr__(self, name, None)
        if self.policy is not None and not isinstance(self.policy, AutoInterval):
            hint = f" (parse text with parse_policy({self.policy!r}))" if isinstance(self.policy, str) else ""
            raise TypeError(
                f"CheckpointSettings.policy takes None or an AutoInterval(...); got {type(self.policy).__name__}{hint}"
            )
        for name in ("every", "memory_every", "remote_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"checkpoint {name} must be an int >= 0 steps (0 = off); got {value!r}")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"checkpoint keep must be >= 1 (the newest checkpoint is always kept); got {self.keep!r}")
        if self.timeout <= 0:
            raise ValueError(f"checkpoint timeout must be > 0 seconds; got {self.timeout}")
        if self.policy is not None and self.every:
            raise ValueError(
                f"an AutoInterval policy chooses the local-disk interval itself; leave every=0 "
                f"(got every={self.every}) or drop the policy"
            )
        if self.memory_peer and not self.memory_every:
            raise ValueError("memory_peer replicates the memory level: set memory_every > 0 too")
        if (self.remote_dir is None) != (not self.remote_every):
            raise ValueError(
                "remote_dir and remote_every go together: give both or neither "
                f"(got remote_dir={self.remote_dir!r}, remote_every={self.remote_every})"
            )
        if (
            self.remote_dir is not None
            and self.dir is not None
            and Path(self.remote_dir).resolve() == Path(self.dir).resolve()
        ):
            raise ValueError(
                f"remote_dir must differ from dir (it stands for a separate storage system); both are {str(self.dir)!r}"
            )

    @property
    def enabled(self) -> bool:
        """Whether any level saves at all."""
        return bool(self.every or self.policy is not None or self.memory_every or self.remote_every)
