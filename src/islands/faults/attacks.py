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

Spec syntax (islands.spec):  name[:key=value,...]  with the Byzantine ranks given as count=k (the LAST k
ranks, so rank 0 stays honest and keeps reporting) or ranks=[i,j,...]; "none" is the honest plan. The names
and their parameters are ATTACKS, read from the role constructors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
from islands.spec import Registry, Spec, SpecError, bind, docs_of, format as format_spec, resolved_signature

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
            raise ValueError(
                f"Byzantine ranks {bad} are outside the world of {self.world_size} ranks (0..{self.world_size - 1})"
            )
        if self.attack is not None and len(self.byzantine) >= self.world_size:
            raise ValueError(
                f"{len(self.byzantine)} Byzantine ranks in a world of {self.world_size}: "
                "at least one rank must stay honest"
            )
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
            raise ValueError(
                f"attack plan was built for {self.world_size} ranks but this job has {dist.get_world_size()}"
            )
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
            raise TypeError(
                f"Byzantine(role, ...) takes an attack role (islands.robust.SignFlip(), ...); got {type(role).__name__}"
            )
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
                raise ValueError(
                    f"attack {self.name}: count={self.count} must be between 1 and {world_size - 1} "
                    f"(world size {world_size}; one rank stays honest)"
                )
            return frozenset(range(world_size - self.count, world_size))
        assert self.ranks is not None  # __init__ sets exactly one of count and ranks
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
        who = "count=" + str(self.count) if self.count is not None else "ranks=" + ",".join(map(str, self.ranks or ()))
        return AttackPlan(role, self.ranks_in(world_size), world_size, spec=f"{self.name}:{who}")

    def __repr__(self) -> str:
        who = f"count={self.count}" if self.count is not None else f"ranks={self.ranks}"
        return f"Byzantine({self.role!r}, {who})"


def no_attack() -> None:
    """No attack: attacks nobody, every rank is honest."""
    return None


_WHO = (
    "`count`: the last k ranks attack (rank 0 stays honest and keeps reporting); `ranks`: the ranks that "
    "attack, [i,j,...]; give one of them."
)


def _attack(role: Callable[..., Attack], doc: str | None = None) -> Callable[..., Byzantine]:
    """A registry entry: the role's constructor parameters, plus Byzantine's count= and ranks=."""
    who = [p for p in resolved_signature(Byzantine).parameters.values() if p.name != "role"]
    own = list(resolved_signature(role).parameters.values())

    def entry(**kwargs: Any) -> Byzantine:
        chosen = {p.name: kwargs.pop(p.name) for p in who if p.name in kwargs}
        return Byzantine(role(**kwargs), **chosen)

    # inspect.signature reads __signature__; mypy knows no such attribute on a function
    signature = inspect.Signature([p.replace(kind=p.KEYWORD_ONLY) for p in own + who])
    entry.__signature__ = signature  # type: ignore[attr-defined]
    entry.__doc__ = (doc or docs_of(role)) + "\n\n" + _WHO
    return entry


# Every attack role by spec name: "sign-flip:count=2", "ipm:eps=0.5,ranks=[1,5]", "none".
ATTACKS = Registry(
    "attack",
    {
        "none": no_attack,
        "sign-flip": _attack(SignFlip, "Sends its tensor with the sign flipped."),
        "scaled": _attack(
            Scaled, "Sends its tensor times `factor`: the scale (negative: a reversed, amplified gradient)."
        ),
        # the spec form keeps its noise scale of 1 (the constructor has no default)
        "gaussian": _attack(
            bind(GaussianNoise, sigma=1.0),
            "Sends its tensor plus N(0, sigma^2) noise. `sigma`: the noise's standard deviation; "
            "`seed`: seeds each Byzantine rank's noise stream (by default the job's seed).",
        ),
        "alie": _attack(
            ALIE,
            "A little is enough: every Byzantine rank sends mean - z * std of the honest tensors. "
            "`z`: none takes the paper's z_max for the world's size.",
        ),
        "ipm": _attack(
            InnerProductManipulation, "Inner-product manipulation: sends -eps times the honest mean. `eps`: the factor."
        ),
        "nan": _attack(bind(NonFinite, float("nan")), "Sends a tensor full of NaN: a diverged worker."),
        "inf": _attack(bind(NonFinite, float("inf")), "Sends a tensor full of +Inf: an overflowed worker."),
        "dropout": _attack(
            SilentDropout,
            "A worker that stopped computing but keeps answering. `mode`: zeros "
            "sends zeros, stale repeats the first tensor it sent.",
        ),
        "straggler": _attack(Straggler),
        "label-flip": _attack(LabelFlip),
    },
    base=Byzantine,
)


def valid_attacks() -> str:
    return ATTACKS.describe()


def parse_attack(spec: str | Spec, world_size: int, seed: int = 0) -> AttackPlan:
    """Build an AttackPlan from e.g. "sign-flip:count=2", "ipm:eps=0.5,ranks=[1,5]", "none". `seed` seeds a
    random role (gaussian) unless the spec gives its own."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    checked = ATTACKS.check(spec)
    attack = ATTACKS.build(checked, seed=seed)
    if attack is None:
        return AttackPlan(None, frozenset(), world_size, spec=format_spec(checked))
    try:
        plan = attack.plan(world_size)
    except ValueError as e:
        raise SpecError(f"attack {format_spec(checked)}: {e}") from None
    plan.spec = format_spec(checked)
    return plan


# One home per public name: the roles and Byzantine live in islands.robust, the registry and parsers in
# islands.faults (tests/unit/project/test_public_homes.py); the rest of this module is below the public face.
__all__ = ["Attack", "HonestView", "alie_z"]
