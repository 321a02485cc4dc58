"""Byzantine attacks as roles given to chosen ranks, to rehearse an attack on a real job.

An AttackPlan binds one attack role (faults/roles.py) to a set of global ranks. Call it on EVERY
rank at the point where a tensor is about to be shared, and on the data path:

    plan = parse_attack("alie:count=2", world_size=world.size)
    sent = plan.corrupt(grad, world.rank, comm)       # honest ranks get their own tensor back
    agg = robust_all_reduce(sent, comm, aggregator)
    y = plan.flip_labels(y, num_classes, world.rank)  # only "label-flip" changes anything here

Threat model for ALIE and IPM (omniscient and colluding): they need the honest ranks' statistics,
so for those two `corrupt` runs one extra all-gather of every rank's honest tensor over the same
comm, recorded in the ledger under kind "attack" so that honest-traffic bytes stay clean. That makes
`corrupt` a collective for them: every rank of the comm calls it, in the same order. For all other
attacks it is local. `corrupt_all` applies a plan to one tensor per rank inside one process.

Spec syntax:  name[:key=value,...]  with the Byzantine ranks given as count=k (the LAST k ranks,
so rank 0 stays honest and keeps reporting) or ranks=i,j,...  "none" is the honest plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from islands.faults.roles import (
    ALIE,
    Attack,
    GaussianNoise,
    HonestView,
    InnerProductManipulation,
    LabelFlip,
    NonFinite,
    Scaled,
    SignFlip,
    SilentDropout,
    Straggler,
    alie_z,
    flip_targets,
)
from islands.runtime.comm import Comm

ATTACK_KIND = "attack"  # ledger kind of the omniscient attackers' extra all-gather


def _group_ranks(comm: Comm, rank: int) -> list[int]:
    """Global ranks of comm's members in the order all_gather returns them."""
    if not dist.is_initialized():
        return [rank]
    if comm.group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(comm.group))


@dataclass
class AttackPlan:
    attack: Attack | None  # None: nobody attacks
    byzantine: frozenset[int]
    world_size: int
    spec: str = "none"
    _checked_world: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.byzantine = frozenset(int(r) for r in self.byzantine)
        bad = sorted(r for r in self.byzantine if not 0 <= r < self.world_size)
        if bad:
            raise ValueError(f"Byzantine ranks {bad} are outside the world of {self.world_size} ranks (0..{self.world_size - 1})")
        if self.attack is not None and len(self.byzantine) >= self.world_size:
            raise ValueError(f"{len(self.byzantine)} Byzantine ranks in a world of {self.world_size}: at least one rank must stay honest")
        if self.attack is None:
            self.byzantine = frozenset()

    @property
    def f(self) -> int:
        return len(self.byzantine)

    def is_byzantine(self, rank: int) -> bool:
        return rank in self.byzantine

    def _check_world(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the plan's world of {self.world_size} ranks")
        if not self._checked_world and dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise ValueError(f"attack plan was built for {self.world_size} ranks but this job has {dist.get_world_size()}")
        self._checked_world = True

    def corrupt(self, tensor: torch.Tensor, rank: int, comm: Comm) -> torch.Tensor:
        """What global rank `rank` sends instead of `tensor` (the tensor itself for honest ranks)."""
        if self.attack is None:
            return tensor
        self._check_world(rank)
        view = None
        if self.attack.omniscient:
            members = _group_ranks(comm, rank)
            if rank not in members:
                raise ValueError(f"rank {rank} is not a member of this comm's group {members}")
            gathered = comm.all_gather(tensor.detach(), kind=ATTACK_KIND) if len(members) > 1 else [tensor]
            honest = [t for r, t in zip(members, gathered) if r not in self.byzantine]
            view = HonestView.of(honest, byzantine=sum(r in self.byzantine for r in members))
        if rank not in self.byzantine:
            return tensor
        return self.attack.forge(tensor, rank, view)

    def corrupt_all(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Simulation in one process: tensors[r] is rank r's honest tensor; returns what each sends.
        A straggler role sleeps once per Byzantine rank, serially."""
        if len(tensors) != self.world_size:
            raise ValueError(f"corrupt_all needs one tensor per rank ({self.world_size}), got {len(tensors)}")
        out = list(tensors)
        if self.attack is None:
            return out
        view = None
        if self.attack.omniscient:
            view = HonestView.of([t for r, t in enumerate(tensors) if r not in self.byzantine], byzantine=self.f)
        for r in sorted(self.byzantine):
            out[r] = self.attack.forge(tensors[r], r, view)
        return out

    def flip_labels(self, targets: torch.Tensor, num_classes: int, rank: int) -> torch.Tensor:
        """Targets rank `rank` trains on: C - 1 - y on label-flip Byzantine ranks, unchanged elsewhere."""
        if isinstance(self.attack, LabelFlip) and rank in self.byzantine:
            return flip_targets(targets, num_classes)
        return targets

    def state_dict(self) -> dict:
        inner = getattr(self.attack, "state_dict", None)
        return {"spec": self.spec, "attack": inner() if inner else {}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("spec", self.spec) != self.spec:
            raise ValueError(f"checkpoint holds attack {state['spec']!r}, this run uses {self.spec!r}")
        load = getattr(self.attack, "load_state_dict", None)
        if load:
            load(state.get("attack", {}))


class Byzantine:
    """An attack to rehearse, as an object: which role the Byzantine ranks play and which ranks they are.

        Byzantine(SignFlip(), count=1)            the last rank flips the sign of what it sends
        Byzantine(GaussianNoise(1.0), ranks=(1, 3))

    `count=k` names the LAST k ranks (rank 0 stays honest and keeps reporting), `ranks=` names them
    explicitly; give one. The world size is known only once the job runs, so a strategy calls
    `plan(world_size, seed)` then, for each exchange lane that needs its own state (a DDP bucket).
    """

    def __init__(self, role: Attack, count: int | None = None, ranks: Sequence[int] | None = None):
        if not hasattr(role, "forge"):
            raise TypeError(f"Byzantine(role, ...) takes an attack role (islands.robust.SignFlip(), ...); "
                            f"got {type(role).__name__}")
        if (count is None) == (ranks is None):
            raise ValueError("say which ranks attack: count=<k> (the last k ranks) or ranks=(i, j, ...), not both")
        if count is not None and count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if ranks is not None and len(set(ranks)) != len(tuple(ranks)):
            raise ValueError(f"ranks={tuple(ranks)} repeats a rank")
        self.role, self.count = role, count
        self.ranks = None if ranks is None else tuple(int(r) for r in ranks)
        self.name = getattr(role, "name", type(role).__name__)

    def ranks_in(self, world_size: int) -> frozenset[int]:
        if self.count is not None:
            if not 1 <= self.count < world_size:
                raise ValueError(f"attack {self.name}: count={self.count} must be between 1 and {world_size - 1} "
                                 f"(world size {world_size}; one rank stays honest)")
            return frozenset(range(world_size - self.count, world_size))
        return frozenset(self.ranks)

    @staticmethod
    def honest(world_size: int) -> AttackPlan:
        """The plan in which nobody attacks."""
        return AttackPlan(None, frozenset(), world_size)

    def plan(self, world_size: int, seed: int | None = None) -> AttackPlan:
        """A fresh AttackPlan for a world of `world_size` ranks (its own copy of the role's state)."""
        import copy

        role = copy.deepcopy(self.role)
        if seed is not None and hasattr(role, "seed"):
            role.seed = int(seed)
        who = "count=" + str(self.count) if self.count is not None else "ranks=" + ",".join(map(str, self.ranks))
        return AttackPlan(role, self.ranks_in(world_size), world_size, spec=f"{self.name}:{who}")

    def __repr__(self) -> str:
        who = f"count={self.count}" if self.count is not None else f"ranks={self.ranks}"
        return f"Byzantine({self.role!r}, {who})"


_REQUIRED = object()

# name -> (build(params, seed) -> Attack | None, {param: (type, default)})
ATTACKS: dict[str, tuple[Callable[[dict, int], Attack | None], dict[str, tuple[type, object]]]] = {
    "none": (lambda p, seed: None, {}),
    "sign-flip": (lambda p, seed: SignFlip(), {}),
    "scaled": (lambda p, seed: Scaled(p["factor"]), {"factor": (float, _REQUIRED)}),
    "gaussian": (lambda p, seed: GaussianNoise(p["sigma"], seed=seed), {"sigma": (float, 1.0)}),
    "alie": (lambda p, seed: ALIE(p["z"]), {"z": (float, None)}),
    "ipm": (lambda p, seed: InnerProductManipulation(p["eps"]), {"eps": (float, 0.1)}),
    "nan": (lambda p, seed: NonFinite(float("nan")), {}),
    "inf": (lambda p, seed: NonFinite(float("inf")), {}),
    "dropout": (lambda p, seed: SilentDropout(p["mode"]), {"mode": (str, "zeros")}),
    "straggler": (lambda p, seed: Straggler(p["delay"]), {"delay": (float, _REQUIRED)}),
    "label-flip": (lambda p, seed: LabelFlip(), {}),
}


def valid_attacks() -> str:
    def one(name, params):
        shown = [f"{k}=<{t.__name__}>" if d is _REQUIRED else f"{k}={'auto' if d is None else d}" for k, (t, d) in params.items()]
        return name + (":" + ",".join(shown) if shown else "")

    listed = ", ".join(one(n, p) for n, (_, p) in ATTACKS.items())
    return f"attacks: {listed}; every attack but none also takes count=<k> (the last k ranks) or ranks=<i,j,...>"


def _tokens(spec: str, rest: str) -> dict[str, str]:
    """key=value pairs split on commas; a bare value continues the previous key (ranks=1,5)."""
    values: dict[str, str] = {}
    last = None
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if eq and key.strip() and value.strip():
            last = key.strip().lower()
            if last in values:
                raise ValueError(f"{last} is given twice in attack spec {spec!r}")
            values[last] = value.strip()
        elif not eq and last == "ranks" and item.strip():
            values["ranks"] += "," + item.strip()
        else:
            raise ValueError(f"bad parameter {item!r} in attack spec {spec!r}: write key=value. {valid_attacks()}")
    return values


def _byzantine(name: str, given: dict[str, str], world_size: int, spec: str) -> frozenset[int]:
    count, ranks = given.pop("count", None), given.pop("ranks", None)
    if name == "none":
        if count is not None or ranks is not None:
            raise ValueError(f"'none' attacks nobody; drop count/ranks from {spec!r}")
        return frozenset()
    if (count is None) == (ranks is None):
        raise ValueError(f"say which ranks attack in {spec!r}: count=<k> (the last k ranks) or ranks=<i,j,...>, not both")
    def as_int(text: str, what: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{what} takes integers, got {text!r} in {spec!r}") from None

    if count is not None:
        k = as_int(count, "count")
        if not 1 <= k < world_size:
            raise ValueError(f"count={k} in {spec!r} must be between 1 and {world_size - 1} (world size {world_size}; one rank stays honest)")
        return frozenset(range(world_size - k, world_size))
    chosen = [as_int(r, "ranks") for r in ranks.split(",")]
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"ranks={ranks} in {spec!r} repeats a rank")
    return frozenset(chosen)  # AttackPlan checks the range and that one rank stays honest


def parse_attack(spec: str, world_size: int, seed: int = 0) -> AttackPlan:
    """Build an AttackPlan from e.g. "sign-flip:count=2", "ipm:eps=0.5,ranks=1,5", "none"."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"attack spec must be a non-empty string, got {spec!r}. {valid_attacks()}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in ATTACKS:
        raise ValueError(f"unknown attack {name!r} in {spec!r}. {valid_attacks()}")
    given = _tokens(spec, rest) if rest.strip() else {}
    byzantine = _byzantine(name, given, world_size, spec)
    build, params = ATTACKS[name]
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise ValueError(f"{name} does not take {', '.join(unknown)} (in {spec!r}). {valid_attacks()}")
    values: dict[str, object] = {}
    for key, (kind, default) in params.items():
        if key in given:
            try:
                values[key] = kind(given[key])
            except ValueError:
                raise ValueError(f"{name}: {key}={given[key]!r} is not a valid {kind.__name__} (in {spec!r})") from None
        elif default is _REQUIRED:
            raise ValueError(f"{name} needs {key}=<{kind.__name__}> (in {spec!r})")
        else:
            values[key] = default
    return AttackPlan(build(values, seed), byzantine, world_size, spec=spec.strip())


__all__ = [
    "ALIE", "ATTACKS", "ATTACK_KIND", "Attack", "AttackPlan", "Byzantine", "GaussianNoise", "HonestView",
    "InnerProductManipulation", "LabelFlip", "NonFinite", "Scaled", "SignFlip", "SilentDropout",
    "Straggler", "alie_z", "flip_targets", "parse_attack", "valid_attacks",
]
