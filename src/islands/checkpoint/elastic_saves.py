"""Checkpoints of elastic jobs (islands.runtime.elastic): members come and go between saves.

An elastic world has no torch process group of its own; its members meet through the ElasticComm,
whose rank and size change when a worker dies or joins. So, per disk save:
- each store takes the member's current rank and the epoch's size just before writing, and the
  staging directory is named after the epoch (`step-N.tmp-e<epoch>`), which every member agrees on;
- the barrier is a bookkeeping gather over the members. A member that dies during the save makes
  the ElasticComm form a new epoch and retry the gather with the survivors; they then all see the
  epoch moved and raise MembershipChanged, so nobody commits a checkpoint with a part missing. The
  save is abandoned (counted, not fatal) and the previous checkpoint stays `latest`; the partial
  directory is removed when a store next opens the root.
- saves run on the main thread (blocking): the persist thread must not issue collectives on the
  ElasticComm, whose operations are numbered in the order the training thread issues them.
- a job's first members clean partial directories when they open the store; a joiner never does
  (the members may be writing one at that moment).
"""

from __future__ import annotations


class MembershipChanged(RuntimeError):
    """The members changed while a checkpoint was being written: that save is abandoned."""


class ElasticBarrier:
    """The stores' barrier in an elastic world; raises MembershipChanged if the epoch moved."""

    def __init__(self, world):
        self.world = world
        self.epoch: int | None = None
        self.calls = 0

    def begin(self) -> int:
        """Called before each save: the epoch every part of this save must belong to."""
        self.epoch, self.calls = self.world.membership.epoch, 0
        return self.epoch

    def __call__(self) -> None:
        # A store calls its barrier twice per save: before rank 0 commits and after. Only the first may
        # abandon the save; after the second the checkpoint is committed, whoever left since.
        self.calls += 1
        self.world.all_gather_object(None)
        now = self.world.membership.epoch
        if self.epoch is not None and now != self.epoch and self.calls % 2 == 1:
            raise MembershipChanged(f"members changed during the save (epoch {self.epoch} -> {now}); "
                                    "abandoned, the previous checkpoint stays latest")


def is_elastic(world) -> bool:
    return getattr(world, "membership", None) is not None


def opens_clean(world) -> bool:
    """Whether this process may delete partial directories when its store opens."""
    if is_elastic(world):
        return world.membership.epoch == 0 and world.rank == 0  # a first member, before any save
    return world.rank == 0


def bind(stores, world, barrier: ElasticBarrier) -> str:
    """Point each store at this member's current rank and size; returns the staging token to use."""
    epoch = barrier.begin()
    for store in stores:
        store.rank, store.world_size = world.rank, world.size
    return f"e{epoch}"
