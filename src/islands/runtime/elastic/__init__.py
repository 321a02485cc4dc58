"""The elastic runtime: collectives over a gloo group rebuilt when membership changes, in four parts.

- commit.py: the commit protocol (`Commit`): every operation commits on every member or on none;
- epochs.py: the epochs (`Epochs`): forming epoch e+1 with the members still here or with joiners, its group;
- comm.py: the collectives (`ElasticComm`, contracts.ElasticCollectives) over the epochs, retried after a failure;
- transfer.py: the state a joiner receives (`StateTransfer`: checksummed chunks, or one broadcast);
- admission.py: claims, rounds and joins (`Membership`: an elastic World's `membership`, contracts.ElasticMembership).

`elastic_member` composes the parts of one member; islands.runtime.world.join_elastic uses it, and tests build
members with it directly.
"""

from __future__ import annotations

from collections.abc import Callable

from islands.runtime.comm import CommLedger
from islands.runtime.elastic.admission import ADMIT_LINGER_S, JobEnded, Membership, counted_rounds, take_part
from islands.runtime.elastic.comm import ElasticComm
from islands.runtime.elastic.commit import Commit
from islands.runtime.elastic.epochs import Epochs, Excluded
from islands.runtime.elastic.membership import Liveness
from islands.runtime.elastic.transfer import StateTransfer, global_digest, state_digest

__all__ = [
    "ADMIT_LINGER_S",
    "Commit",
    "ElasticComm",
    "Epochs",
    "Excluded",
    "JobEnded",
    "Membership",
    "StateTransfer",
    "counted_rounds",
    "elastic_member",
    "global_digest",
    "state_digest",
    "take_part",
]


def elastic_member(
    store,
    name: str,
    ledger: CommLedger,
    heartbeat_timeout: float = 3.0,
    collective_timeout: float = 120.0,
    on_change: Callable[[int, int], None] | None = None,
    new_client: Callable[[], object] | None = None,
    membership: type = Membership,
    **parts,
):
    """One member of an elastic job over `store` as `name`: its Commit, Epochs and ElasticComm, and the
    `membership` (Membership or a subclass; `parts`: its further arguments) that holds them, which is returned
    (its `.comm`, `.epochs` and `.transfer` are the parts). Not yet in an epoch: a first member calls
    `.epochs.form(0, None)`, a joiner `enter`."""
    commit = Commit(store, name, Liveness(store, heartbeat_timeout), collective_timeout)
    epochs = Epochs(store, name, commit, on_change=on_change, new_client=new_client)
    return membership(epochs, ElasticComm(epochs, ledger), **parts)
