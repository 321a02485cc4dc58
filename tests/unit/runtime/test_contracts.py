"""The written contracts (issue #33 item 1; islands.runtime.contracts, islands.sync.base): every comm class, every
comm test double, the elastic memberships and the strategies satisfy their protocols member by member (a missing
method or an incompatible signature fails here, not in a job), and Stack, WarmStart and the pipeline expose their
capabilities through the protocols."""

from __future__ import annotations

import inspect
import re
import typing

import pytest
import torch
from test_outer_units import _SameDeltaComm, _TwoIslandComm
from test_payload_auth import Tamper
from test_public_api import _TwinComm

from islands.parallel.pipeline.strategy import PipelineStages
from islands.runtime.comm import Comm
from islands.runtime.contracts import (
    Collectives,
    ElasticCollectives,
    ElasticMembership,
    ElasticParticipant,
    Holder,
    PointToPoint,
    ServedEnd,
    ServedParticipant,
)
from islands.runtime.elastic import ElasticComm, Membership
from islands.runtime.elastic.island_comm import IslandComm, IslandFollower, IslandLeader, SlotComm
from islands.runtime.payload_auth import AuthenticatedComm
from islands.runtime.simulate import SimComm
from islands.runtime.staging import StagedComm
from islands.runtime.world import LoneComm, World
from islands.sync.base import (
    CompilesByUnit,
    Composite,
    Describes,
    KeepsIslandsApart,
    OwnsStep,
    SkipsSteps,
    WritesReport,
    capability,
)
from islands.sync.ddp import DDP
from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.easgd import EASGD
from islands.sync.outer.gossip import Gossip
from islands.sync.outer.local_sgd import LocalSGD
from islands.sync.outer.ps import ParameterServer
from islands.sync.outer.streaming_diloco import StreamingDiLoCo
from islands.sync.outer.warm_start import WarmStart
from islands.sync.sharded import FSDP
from islands.sync.single import Single
from islands.sync.stack import Stack

COMMS = [Comm, LoneComm, SimComm, ElasticComm, IslandComm, SlotComm, AuthenticatedComm, StagedComm]
COMM_DOUBLES = [_SameDeltaComm, _TwoIslandComm, _TwinComm, Tamper]
ELASTIC_COMMS = [ElasticComm, IslandComm, SlotComm]
POINT_TO_POINT = [Comm, SimComm, AuthenticatedComm, StagedComm]
MEMBERSHIPS = [Membership, IslandLeader, IslandFollower]
PARTICIPANTS = [DiLoCo, StreamingDiLoCo, LocalSGD, Gossip, EASGD]


# ---- the structural check ---------------------------------------------------------------------------------
def protocol_members(proto) -> dict[str, object]:
    """Every member a protocol declares (its bases' too): name -> the function or property, or None for a data
    member."""
    out: dict[str, object] = {}
    for base in reversed(proto.__mro__):
        if base in (typing.Protocol, typing.Generic, object) or not getattr(base, "_is_protocol", False):
            continue
        for name in getattr(base, "__annotations__", {}):
            out.setdefault(name, None)
        out.update(
            {
                name: value
                for name, value in vars(base).items()
                if (callable(value) or isinstance(value, property)) and not name.startswith("_")
            }
        )
    return out


def _assigned_in_init(cls, name: str) -> bool:
    """Whether some __init__ of `cls`'s MRO assigns self.<name> (an instance attribute)."""
    pattern = re.compile(
        rf"self\.{name}\b[^=\n]*=(?!=)|self\.(\w+, )*{name}(, \w+)* *=(?!=)|self\.[\w, .]*\b{name}\b[\w, .]*=(?!=)"
    )
    for base in cls.__mro__:
        init = vars(base).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        if any(pattern.search(line) for line in inspect.getsource(init).splitlines() if "self." in line):
            return True
    return False


def _compatible(proto_fn, impl) -> str | None:
    """None when `impl` takes every parameter `proto_fn` declares (same name and kind; a default where the protocol
    has one) and needs no other; else why not."""
    want = list(inspect.signature(proto_fn).parameters.values())[1:]  # without self
    try:
        have = inspect.signature(impl)
    except (TypeError, ValueError):
        return None  # a builtin: nothing to read
    params = dict(have.parameters)
    params.pop("self", None)
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for p in want:
        got = params.get(p.name)
        if got is None:
            if not takes_kwargs:
                return f"no parameter {p.name!r}"
            continue
        if p.default is not p.empty and got.default is got.empty:
            return f"parameter {p.name!r} has no default (the protocol's has one)"
        if (p.kind is p.KEYWORD_ONLY) != (got.kind is got.KEYWORD_ONLY):
            return f"parameter {p.name!r} is {got.kind.description}, the protocol's {p.kind.description}"
    extra = [
        n
        for n, p in params.items()
        if n not in {w.name for w in want} and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is p.empty
    ]
    if extra:
        return f"needs parameters the protocol does not pass: {extra}"
    return None


def violations(cls, proto) -> list[str]:
    out = []
    for name, declared in protocol_members(proto).items():
        if hasattr(cls, name):
            impl = getattr(cls, name)
            if inspect.isfunction(declared) and not isinstance(inspect.getattr_static(cls, name), property):
                if not callable(impl):
                    out.append(f"{name}: not callable")
                elif (why := _compatible(declared, impl)) is not None:
                    out.append(f"{name}: {why}")
        elif declared is None or isinstance(declared, property):
            if not (_assigned_in_init(cls, name) or name in getattr(cls, "__annotations__", {})):
                out.append(f"{name}: missing")
        else:
            out.append(f"{name}: missing")
    return out


@pytest.mark.parametrize("cls", COMMS + COMM_DOUBLES, ids=lambda c: c.__name__)
def test_every_comm_and_comm_double_satisfies_the_collectives_protocol(cls):
    assert violations(cls, Collectives) == []


@pytest.mark.parametrize("cls", ELASTIC_COMMS, ids=lambda c: c.__name__)
def test_elastic_comms_satisfy_the_elastic_protocol_and_say_so(cls):
    assert violations(cls, ElasticCollectives) == []
    assert cls.elastic is True


@pytest.mark.parametrize(
    "cls", [c for c in COMMS if c not in ELASTIC_COMMS and c is not StagedComm], ids=lambda c: c.__name__
)
def test_fixed_comms_say_they_are_not_elastic_and_have_no_epoch(cls):
    assert cls.elastic is False and cls.epoch is None


def test_a_staged_comm_says_what_the_comm_it_wraps_says():
    fixed = StagedComm(Comm(None))
    assert fixed.elastic is False and fixed.epoch is None
    elastic = StagedComm(ElasticComm.__new__(ElasticComm))
    assert elastic.elastic is True


@pytest.mark.parametrize("cls", POINT_TO_POINT, ids=lambda c: c.__name__)
def test_point_to_point_comms(cls):
    assert violations(cls, PointToPoint) == []


@pytest.mark.parametrize("cls", MEMBERSHIPS, ids=lambda c: c.__name__)
def test_elastic_memberships_satisfy_their_protocol(cls):
    assert violations(cls, ElasticMembership) == []


@pytest.mark.parametrize("cls", PARTICIPANTS, ids=lambda c: c.__name__)
def test_outer_strategies_are_elastic_participants_and_holders(cls):
    assert violations(cls, ElasticParticipant) == []
    assert violations(cls, Holder) == []


def test_the_parameter_server_is_a_served_participant_and_every_worker_runs_a_served_end():
    """ps's islands share no collective while they train: its joiners enter at its entry_step, and the membership a
    leader holds runs the job's end (docs/parameter-server.md, "Elastic jobs"), a k-worker island's follower with it;
    no other outer strategy is served."""
    assert violations(ParameterServer, ElasticParticipant) == [] and violations(ParameterServer, Holder) == []
    assert violations(ParameterServer, ServedParticipant) == []
    assert [c for c in PARTICIPANTS if not violations(c, ServedParticipant)] == []
    for cls in (Membership, IslandLeader, IslandFollower):  # a follower takes the end from its leader
        assert violations(cls, ServedEnd) == []


def test_the_check_finds_a_missing_method_and_a_wrong_signature():
    class NoGather(LoneComm):
        all_gather_object = None  # type: ignore[assignment]

    class NoKind(LoneComm):
        def all_reduce(self, tensor, op=None):  # no kind=
            return tensor

    class ExtraArg(LoneComm):
        def broadcast(self, tensor, src, kind="broadcast", must=1, *, needed):
            return tensor

    class Bare:
        elastic, epoch = False, None
        size = rank = 1

    assert violations(NoGather, Collectives) == ["all_gather_object: not callable"]
    assert violations(NoKind, Collectives) == ["all_reduce: no parameter 'kind'"]
    assert violations(ExtraArg, Collectives) == ["broadcast: needs parameters the protocol does not pass: ['needed']"]
    assert sorted(violations(Bare, Collectives)) == [
        "all_gather: missing",
        "all_gather_object: missing",
        "all_reduce: missing",
        "broadcast: missing",
    ]
    assert violations(LoneComm, PointToPoint) == ["exchange: missing"]


def test_lone_comm_gathers_objects():
    assert LoneComm().all_gather_object({"a": 1}) == [{"a": 1}]
    assert World.single().comm("cross") is not None


# ---- strategy capabilities --------------------------------------------------------------------------------
def _pipeline() -> PipelineStages:
    return PipelineStages(
        stages=2, microbatches=2, cuts="equal", schedule="gpipe", batch=4, loss_fn=torch.nn.functional.cross_entropy
    )


def test_the_pipeline_owns_its_step_and_describes_itself_and_a_stack_hands_both_on():
    pipe = _pipeline()
    assert isinstance(pipe, OwnsStep) and isinstance(pipe, Describes)
    stack = Stack(inner=pipe)
    assert isinstance(stack, Composite)
    assert not isinstance(stack, OwnsStep) and not isinstance(stack, Describes)  # its parts do, not itself
    assert capability(stack, OwnsStep) is pipe and capability(stack, Describes) is pipe
    plain = Stack(inner=DDP(), outer=DiLoCo(inner_steps=2))
    assert capability(plain, OwnsStep) is None and capability(plain, Describes) is None


def test_fsdp_keeps_islands_apart_when_a_stack_has_an_outer_part():
    assert isinstance(FSDP(), KeepsIslandsApart)
    assert Stack(inner=FSDP(), outer=DiLoCo(inner_steps=2)).inner.islands_apart
    assert not Stack(inner=FSDP()).inner.islands_apart
    assert capability(DDP(), KeepsIslandsApart) is None


def test_fsdp_names_its_compile_units_and_a_stack_hands_them_on():
    fsdp = FSDP()
    assert isinstance(fsdp, CompilesByUnit) and capability(Stack(inner=fsdp), CompilesByUnit) is fsdp
    assert fsdp.compile_units() == []  # nothing sharded yet: the whole model would compile as one
    assert capability(Stack(inner=DDP()), CompilesByUnit) is None  # DDP's graph is split at its buckets instead


def test_next_step_goes_through_stack_and_warm_start():
    class Skipping(DiLoCo):
        def next_step(self, done: int) -> int:
            return done + 10

    warm = WarmStart(Skipping(inner_steps=2), steps=3)
    stack = Stack(inner=DDP(), outer=warm)
    assert isinstance(warm, SkipsSteps) and isinstance(stack, SkipsSteps)
    assert capability(stack, SkipsSteps) is stack
    assert stack.next_step(2) == 2  # warm-up: every step counted
    assert stack.next_step(5) == 3 + 12
    assert Stack(inner=DDP()).next_step(7) == 7


def test_diloco_writes_its_report_where_the_app_says():
    from islands.app.build import report_writer

    d = DiLoCo(inner_steps=2)
    assert isinstance(d, WritesReport)
    assert report_writer(WarmStart(d, steps=2)) is d and report_writer(d) is d
    assert report_writer(Gossip()) is None and report_writer(None) is None


# ---- elastic participation: the strategy hands the membership its parts -----------------------------------
class _Membership:
    """A membership double (runtime.contracts.ElasticMembership) that records what the strategies hand it."""

    name, epoch, names = "w0", 0, ["w0"]
    new_client = control_plane = None

    def __init__(self):
        self.events, self.before_join, self.holder, self.participant, self.entered = [], [], None, None, []

    def claim(self, strategy) -> bool:
        if self.holder is None:
            self.holder = strategy
        return self.holder is strategy

    def participate(self, participant) -> None:
        self.participant = participant

    def enter(self, strategy, model) -> int:
        self.entered.append(strategy)
        return 0

    def at_step(self, strategy, model, step: int) -> None:
        pass

    def new_liveness(self, client):
        return None

    def authenticate(self, token: str, job_id: str | None = None) -> None:
        pass

    def leave(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _elastic_world(membership) -> World:
    return World(
        rank=0,
        size=1,
        islands=1,
        device=torch.device("cpu"),
        backend="gloo",
        comms={"cross": LoneComm(), "global": LoneComm(), "local": LoneComm()},
        membership=membership,
    )


def test_the_membership_double_satisfies_the_protocol():
    assert violations(_Membership, ElasticMembership) == []
    assert isinstance(_Membership(), ElasticMembership)


@pytest.mark.parametrize("outer", ["diloco", "warm", "alone"])
def test_the_strategy_hands_the_membership_its_holder_and_its_round_counting_participant(outer):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(inner_steps=2)
    membership = _Membership()
    if outer == "alone":
        holder = diloco
    else:
        holder = Stack(inner=Single(), outer=WarmStart(diloco, steps=2) if outer == "warm" else diloco)
    holder.wrap(model, opt, _elastic_world(membership))
    assert membership.holder is holder and membership.entered == [holder]
    assert membership.participant is diloco  # the part that counts rounds, inside a warm start too
    assert isinstance(membership.participant, ElasticParticipant) and isinstance(holder, Holder)


def test_an_inner_strategy_alone_in_an_elastic_world_is_refused():
    from islands.runtime.world import NO_OUTER

    with pytest.raises(ValueError, match=re.escape(NO_OUTER[:40])):
        Single().wrap(torch.nn.Linear(2, 2), None, _elastic_world(_Membership()))
    with pytest.raises(ValueError, match=re.escape(NO_OUTER[:40])):
        Stack(inner=Single()).wrap(torch.nn.Linear(2, 2), None, _elastic_world(_Membership()))


def test_two_outer_strategies_cannot_take_part_in_one_membership():
    from islands.runtime.elastic import take_part

    a, b = DiLoCo(inner_steps=2), DiLoCo(inner_steps=2)
    assert take_part(None, a) is a and take_part(a, a) is a
    with pytest.raises(ValueError, match="two outer strategies"):
        take_part(a, b)
