"""Checkpoints of elastic jobs (islands.runtime.elastic): members come and go between saves.

An elastic world has no torch process group of its own; its members meet through the ElasticComm,
whose rank and size change when a worker dies or joins. So, per disk save:
- the training thread notes who this member is at the snapshot (`Member`: epoch, rank, size, names);
  each store writes as that rank of that size, into a staging directory named after the epoch
  (`step-N.tmp-e<epoch>`), which every member agrees on;
- the stores' barrier only has to tell whether every member of that epoch wrote its part. Two kinds:
  - `PersistBarrier` (asynchronous saves, the default): it meets the others through keys in the job's
    TCPStore, over a client connection of its own, so it runs in the persist thread while training goes
    on. The ElasticComm cannot serve there: its operations are numbered in the order the training thread
    issues them. While it waits it watches the members' heartbeats and the epoch: a member that dies
    or a new epoch abandons the save (MembershipChanged) within one heartbeat timeout, never a hang.
  - `ElasticBarrier` (blocking saves, CheckpointSettings(asynchronous=False)): a gather over the members
    on the training thread. A member dying during it makes the ElasticComm form a new epoch and retry
    with the survivors; they see the epoch moved and abandon.
  Either way nobody commits a checkpoint with a part missing. An abandoned save is counted, not fatal;
  the previous checkpoint stays `latest` and the partial directory is removed when a store next opens
  the root.
- before joiners enter (a new epoch), the members finish the save due at that step and wait for any
  save still in flight (CheckpointDriver.settle), so joins never abandon a save.
- a job's first members clean partial directories when they open the store; a joiner never does
  (the members may be writing one at that moment).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from islands.runtime.elastic.membership import Liveness


class MembershipChanged(RuntimeError):
    """The members changed while a checkpoint was being written: that save is abandoned."""


@dataclass(frozen=True)
class Member:
    """Who this process was in the job when a save's snapshot was taken."""

    epoch: int
    rank: int
    size: int
    names: tuple[str, ...]

    @classmethod
    def now(cls, world) -> Member:
        m = world.membership
        # islands of k workers: every worker saves its part; the members are the islands' leaders
        names = world.worker_names or m.names
        return cls(epoch=m.epoch, rank=world.rank, size=world.size, names=tuple(names))


class ElasticBarrier:
    """The stores' barrier on the training thread; raises MembershipChanged if the epoch moved."""

    def __init__(self, world):
        self.world = world
        self.epoch: int | None = None
        self.calls = 0

    def begin(self, member: Member, step: int) -> None:
        """Called before each save: the epoch every part of this save must belong to."""
        self.epoch, self.calls = member.epoch, 0

    def __call__(self) -> None:
        # A store calls its barrier twice per save: before rank 0 commits and after. Only the first may
        # abandon the save; after the second the checkpoint is committed, whoever left since.
        self.calls += 1
        self.world.all_gather_object(None)
        now = self.world.membership.epoch
        if self.epoch is not None and now != self.epoch and self.calls % 2 == 1:
            raise MembershipChanged(
                f"members changed during the save (epoch {self.epoch} -> {now}); "
                "abandoned, the previous checkpoint stays latest"
            )


class PersistBarrier:
    """The stores' barrier for asynchronous saves: keys in the job's TCPStore, from the persist thread.

    Per store and save: every rank sets `ckpt/s<step>/e<epoch>/<n>/part/<rank>` once its part is
    durable and waits for all of them (then rank 0 commits); rank 0 sets `.../committed` after the
    pointer moved and the others wait for that. `client` makes a store client of this thread's own;
    `liveness(client)` says which names are gone (membership.Liveness); `epoch_now()` is the training
    thread's current epoch. Waiting for the parts ends with MembershipChanged when a member of the
    save's epoch is gone, the epoch moved, or `timeout_s` passed; waiting for the commit, only when rank
    0 is gone or `timeout_s` passed (once every part is in, a member leaving does not undo the commit;
    and the store then counts the save anyway if rank 0 renamed the staging directory: it may have died
    just after, before or after moving `latest`).
    Rank 0 deletes a save's keys once every part of the next save is in: by then every member has
    finished that save (one persist at a time), so no one waits on them any more.
    """

    POLL = 0.01  # seconds between looks at the store (a round trip is ~0.2 ms)

    def __init__(
        self,
        client: Callable[[], Any],
        liveness: Callable[[Any], Liveness],
        epoch_now: Callable[[], int],
        timeout_s: float,
    ):
        self._make_client, self._make_liveness = client, liveness
        self.epoch_now, self.timeout_s = epoch_now, timeout_s
        self._client: Any = None  # a store client (TCPStore or its authenticated wrapper), made in the persist thread
        self._liveness: Liveness | None = None
        self.member: Member | None = None
        self.step, self.calls = -1, 0
        self._keys: list[str] = []  # rank 0: the keys of this save
        self._stale: list[str] = []  # rank 0: the keys of the save before, deleted during this one

    def begin(self, member: Member, step: int) -> None:
        self.member, self.step, self.calls = member, step, 0
        if self._keys:
            self._stale, self._keys = self._stale + self._keys, []

    def __call__(self) -> None:
        if self._client is None:  # made in the thread that uses it
            self._client = self._make_client()
            self._liveness = self._make_liveness(self._client)
        m, self.calls = self.member, self.calls + 1
        assert m is not None  # begin() names the member before a store calls its barrier
        key = f"ckpt/s{self.step}/e{m.epoch}/{(self.calls - 1) // 2}"
        if self.calls % 2 == 1:  # before the commit: every part written? Anyone leaving abandons the save.
            self._client.set(f"{key}/part/{m.rank}", "1")
            others = [n for i, n in enumerate(m.names) if i != m.rank]
            parts = [f"{key}/part/{r}" for r in range(m.size)]
            if m.rank == 0:  # an abandoned save's keys too: deleted once a later save's parts are in
                self._keys += parts + [f"{key}/committed"]
            self._wait(parts, "before the commit", others, epoch_matters=True)
            if m.rank == 0:
                for stale in self._stale:
                    self._client.delete_key(stale)
                self._stale = []
        elif m.rank == 0:
            self._client.set(f"{key}/committed", "1")
        else:  # every part is in and rank 0 commits: only rank 0 leaving can stop that now
            self._wait(
                [f"{key}/committed"],
                "while rank 0 committed (the commit may have happened)",
                [m.names[0]],
                epoch_matters=False,
            )

    def _wait(self, keys: list[str], when: str, watched: list[str], epoch_matters: bool) -> None:
        m, deadline = self.member, time.monotonic() + self.timeout_s
        assert m is not None and self._liveness is not None  # set by begin() and __call__
        while not self._client.check(keys):
            now_epoch = self.epoch_now()
            if epoch_matters and now_epoch != m.epoch:
                raise MembershipChanged(
                    f"members changed during the save of step {self.step} (epoch {m.epoch} "
                    f"-> {now_epoch}) {when}; abandoned, the previous checkpoint stays latest"
                )
            gone = self._liveness.gone(watched)
            if gone:
                raise MembershipChanged(
                    f"{sorted(gone)} left during the save of step {self.step} {when}; "
                    "abandoned, the previous checkpoint stays latest"
                )
            if time.monotonic() > deadline:
                raise MembershipChanged(
                    f"the members of epoch {m.epoch} did not all finish the save of step "
                    f"{self.step} within {self.timeout_s:.0f} s ({when}); abandoned"
                )
            time.sleep(self.POLL)


def is_elastic(world) -> bool:
    return world.membership is not None


def can_persist_async(world) -> bool:
    """Whether this elastic world can give the persist thread a store client of its own."""
    return world.membership.new_client is not None


def opens_clean(world) -> bool:
    """Whether this process may delete partial directories when its store opens."""
    if is_elastic(world):
        return world.membership.epoch == 0 and world.rank == 0  # a first member, before any save
    return world.rank == 0


def bind(stores, member: Member, step: int, barrier) -> str:
    """Point each store at `member`'s rank and size for this save; returns the staging token to use."""
    barrier.begin(member, step)
    for store in stores:
        store.rank, store.world_size = member.rank, member.size
    return f"e{member.epoch}"
