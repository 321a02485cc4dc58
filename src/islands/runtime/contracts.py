"""The runtime's written contracts (issue #33 item 1): what every Comm offers, what an elastic one adds, what a
World's elastic membership offers, and what a strategy hands that membership.

`Collectives` is the protocol; `islands.Comm` (runtime.comm.Comm) is one concrete class of it, the one over a torch
process group. The protocol is not named `Comm` because `islands.Comm(group)` is public and constructs that
class: renaming the concrete class would break every script that builds one, and a protocol named like a class
people construct reads as one. The other classes that satisfy it: LoneComm (runtime.world), SimComm
(runtime.simulate), ElasticComm (runtime.elastic), IslandComm and SlotComm (runtime.elastic.island_comm) and
AuthenticatedComm (runtime.payload_auth); tests/unit/runtime/test_contracts.py checks each of them member by member.

Strategies read what a Comm says instead of probing it: `comm.elastic` (members may change between two
collectives: refuse what churn would break), `comm.epoch` (the membership epoch of an elastic Comm, None for a
fixed group); an elastic Comm is an `ElasticCollectives` (member names, and a point-to-point round planned anew
over the ranks of the epoch it commits in). A fixed-world Comm that sends point to point is a `PointToPoint`.

An elastic World's `membership` (epochs and admission; None in a fixed world) is an `ElasticMembership`. The
strategy the loop drives `claim`s it first thing in its wrap (the `Holder`: it serves and receives the state a
joiner needs), and the outer strategy, whichever object wraps it, hands it the `ElasticParticipant` that counts
rounds, finishes the exchanges in flight before a join (`settle`) and restarts a joiner's local model
(`joined`): the runtime never looks for these hooks by name, nor walks a strategy's parts. A participant whose
islands share no collective while they train (the parameter server with servers of its own) is also a
`ServedParticipant`: a joiner takes its model from that service and starts at the step it names, the members never
stop at a round boundary to admit it, and the membership (a `ServedEnd`) puts it into an epoch at the job's end.
The runtime does not import the strategies (tests/unit/project/test_layering.py); they satisfy these protocols
structurally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Collectives(Protocol):
    """Collectives over the members of one scope, each counted in the caller's ledger. Synchronous."""

    elastic: bool  # True: members may change between two collectives (ElasticCollectives)

    @property
    def epoch(self) -> int | None:
        """The membership epoch of an elastic Comm; None for a fixed group (read-only: ElasticComm's is a property)."""
        ...

    @property
    def size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor, op=None, kind: str = "all_reduce") -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor, kind: str = "all_gather") -> list[torch.Tensor]: ...

    def broadcast(self, tensor: torch.Tensor, src: int, kind: str = "broadcast") -> torch.Tensor: ...

    def all_gather_object(self, obj: Any) -> list:
        """Bookkeeping gather of picklable objects (run records), in rank order."""
        ...


@runtime_checkable
class Counted(Protocol):
    """A Comm that counts its bytes in a ledger another party may count in too (a parameter server's island
    link records its pushes and pulls where the island's collectives go)."""

    ledger: Any  # islands.runtime.comm.CommLedger (not imported: comm imports torch.distributed)


@runtime_checkable
class PointToPoint(Collectives, Protocol):
    """A fixed-group Comm that also sends point to point in one batch (gossip's round)."""

    def exchange(
        self, sends: dict[int, torch.Tensor], recv_from: list[int], like: torch.Tensor | None = None, kind: str = "p2p"
    ) -> dict[int, torch.Tensor]: ...


@runtime_checkable
class ElasticCollectives(Collectives, Protocol):
    """A Comm whose members change (elastic is True): every collective commits on every member or none, and a
    point-to-point round is planned over the ranks of the epoch it commits in."""

    @property
    def names(self) -> list[str]:
        """The members' names in rank order, as of the latest collective."""
        ...

    def exchange_planned(
        self,
        plan: Callable[[int, int], tuple[dict[int, torch.Tensor], list[int]]],
        like: torch.Tensor,
        kind: str = "p2p",
    ) -> tuple[dict[int, torch.Tensor], list[int], list[int]]: ...


@runtime_checkable
class ElasticParticipant(Protocol):
    """The part of a strategy that takes part in an elastic job's rounds (an outer strategy): joins happen after
    its round counter moves; before a join its exchanges in flight finish; on a joiner, after the state loaded,
    `joined` restarts its local work from the global model."""

    rounds: int

    def settle(self) -> None: ...

    def joined(self) -> None: ...


@runtime_checkable
class ServedParticipant(ElasticParticipant, Protocol):
    """An ElasticParticipant whose islands train without any collective between them: a service of its own (the
    parameter server's processes) holds the global model. A joiner has taken the model from it by the end of its
    wrap and starts at `entry_step()` (the step its data shard's last island had reached), not at the members'
    step with their state; the members admit nobody at round boundaries (each island's rounds are its own, so a
    boundary every member reaches together does not exist) and the joiners enter an epoch only at the job's end
    (ServedEnd), where the end-of-run bookkeeping needs one."""

    def entry_step(self) -> int: ...


@runtime_checkable
class ServedEnd(Protocol):
    """The job's end as a membership runs it for a ServedParticipant (islands.runtime.elastic.Membership):
    `end_served(final)` runs `final` (the service's own end: it returns once every island that is still training
    is done, with facts for the membership's events: the final version, this island's pushes), then puts the
    joiners that finished into one last epoch with the members, with no state transfer (every island ends on the
    service's final model); a joiner waits there to be put in, or, with no member left alive, the joiners that
    finished form that epoch themselves."""

    def end_served(self, final: Callable[[], dict]) -> None: ...


@runtime_checkable
class Holder(Protocol):
    """The strategy the loop drives, as an elastic membership sees it: what a holder serves a joiner (its
    evaluation model and state) and what a joiner loads."""

    def eval_model(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class ElasticMembership(Protocol):
    """`world.membership` of an elastic World: epochs and admission (islands.runtime.elastic.Membership, an island
    leader's IslandLeader; a follower of a k-worker island has an IslandFollower that follows its leader)."""

    name: str
    before_join: list[Callable[[], None]]  # run before joiners enter (checkpoint drivers finish their saves)
    holder: Any  # the strategy that claimed it, or None
    new_client: Callable[[], Any] | None  # another client of the job's store, for a thread of its own
    control_plane: Any  # the job session (its authenticated stores' counts), or None

    @property
    def epoch(self) -> int: ...

    @property
    def names(self) -> list[str]: ...

    @property
    def events(self) -> list[dict]:
        """Membership changes, for reports and loggers (read-only: Membership's is a property over its Epochs)."""
        ...

    def new_liveness(self, client: Any) -> Any:
        """A liveness check (membership.Liveness) through `client`, one of new_client's: the persist thread's."""
        ...

    def claim(self, strategy: Holder) -> bool: ...

    def participate(self, participant: ElasticParticipant) -> None: ...

    def enter(self, strategy: Holder, model: torch.nn.Module) -> int: ...

    def at_step(self, strategy: Holder, model: torch.nn.Module, step: int) -> None: ...

    def authenticate(self, token: str, job_id: str | None = None) -> None: ...

    def leave(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
