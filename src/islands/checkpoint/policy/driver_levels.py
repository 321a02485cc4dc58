"""The checkpoint driver's levels (islands.checkpoint.policy.driver), built from CheckpointSettings for one world:
memory (optionally copied to a peer), local disk, remote; the stores' barrier; and the sink the persist
thread hands each snapshot to.

The stores' barrier: with a torch process group, a dedicated gloo group, so the persist thread never shares
a process group with training collectives; in an elastic world (members come and go between saves) the
barriers of islands.checkpoint.policy.elastic_saves, each save bound to the member this process was at its
snapshot; with other comms, a meeting on the main thread (saves then block).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

from islands.checkpoint.policy.elastic_saves import (
    ElasticBarrier,
    Member,
    PersistBarrier,
    bind,
    can_persist_async,
    opens_clean,
)
from islands.checkpoint.policy.settings import CheckpointSettings
from islands.checkpoint.store import CheckpointStore
from islands.checkpoint.store.levels import DiskLevel, MemoryLevel, MultiLevelCheckpointer, Restored
from islands.checkpoint.store.packed import unpack_tree
from islands.checkpoint.store.peer import PeerReplica
from islands.runtime.comm import Comm
from islands.runtime.world import World


class _Barrier:
    """All ranks of the job meet; runs on its own gloo group so a background thread may call it."""

    def __init__(self, world, timeout_s: float):
        import torch.distributed as dist

        self.dist, self.ledger = dist, world.ledger
        self.group = dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=timeout_s))

    def __call__(self) -> None:
        self.ledger.record("ckpt_barrier", 0, 0)  # no payload; counted so the ledger shows every call
        self.dist.barrier(group=self.group)


def _peer_comm(world, timeout_s: float) -> Comm:
    """Counted collectives on a gloo group of their own: replication runs in the persist thread."""
    import torch.distributed as dist

    return Comm(dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=timeout_s)), world.ledger)


class DriverLevels:
    def __init__(self, settings: CheckpointSettings, world: World, root: Path, fingerprint: str, elastic: bool):
        """`root`: the local level's directory; `elastic`: the world's members change (check_elastic passed)."""
        self.fingerprint = fingerprint
        torch_dist = world.size > 1 and not elastic and world.comms is None
        barrier: Callable[[], Any] | None = None
        self.elastic_barrier: ElasticBarrier | PersistBarrier | None = None
        if torch_dist:
            barrier = _Barrier(world, settings.timeout)
        elif elastic:  # members change between saves: islands.checkpoint.policy.elastic_saves
            m = world.membership
            assert m is not None  # an elastic world has one
            if settings.asynchronous and can_persist_async(world):
                assert m.new_client is not None  # can_persist_async checked it
                barrier = PersistBarrier(m.new_client, m.new_liveness, lambda: m.epoch, settings.timeout)
            else:
                barrier = ElasticBarrier(world)
            self.elastic_barrier = barrier
        elif world.size > 1:  # other comms without a torch group of their own: meet on the main thread
            barrier = lambda: world.all_gather_object(None)  # noqa: E731
        # saves persist in the background only where the barrier may run off the main thread
        self.asynchronous = settings.asynchronous and (
            world.size == 1 or torch_dist or isinstance(barrier, PersistBarrier)
        )
        self.share_replicas = settings.share_replicas and not elastic and world.size > 1

        def store(root):
            return CheckpointStore(
                root,
                keep_last=settings.keep,
                rank=world.rank,
                world_size=world.size,
                barrier=barrier,
                clean=opens_clean(world),
                share_replicas=self.share_replicas,
            )

        # Peer copies need every rank at every memory save: only with a torch group (not elastic).
        self.peer = PeerReplica(_peer_comm(world, settings.timeout)) if settings.memory_peer and torch_dist else None
        levels: list[Any] = []  # MemoryLevel, DiskLevel
        if settings.memory_every:
            levels.append(
                MemoryLevel(
                    every=settings.memory_every, replicate=self.peer.replicate if self.peer is not None else None
                )
            )
        if settings.every or settings.policy is not None:
            levels.append(DiskLevel(store(root), every=settings.every or 1, name="local"))
        if settings.remote_dir is not None:
            levels.append(DiskLevel(store(Path(settings.remote_dir)), every=settings.remote_every, name="remote"))
        self.checkpointer = MultiLevelCheckpointer(levels)
        self.by_name: dict[str, Any] = {lv.name: lv for lv in levels}

    @property
    def all(self) -> list:
        """The levels, fastest first."""
        return self.checkpointer.levels

    def disk(self) -> list[str]:
        """The names of the disk levels this driver has (local, remote)."""
        return [n for n in ("local", "remote") if n in self.by_name]

    def save(self, tree, step: int, *, levels: list[str], member: Member | None = None) -> dict:
        """The sink: the persist thread calls this with the snapshot, for the levels `levels`."""
        extra = {}
        if member is not None:  # elastic: as the member this process was at the snapshot
            stores = [self.by_name[n].store for n in levels if hasattr(self.by_name[n], "store")]
            extra["token"] = bind(stores, member, step, self.elastic_barrier)
        return {
            name: self.by_name[name].save(
                tree, step, fingerprint=self.fingerprint, **(extra if hasattr(self.by_name[name], "store") else {})
            )
            for name in levels
        }

    def restore(self, *, like=None) -> Restored:
        return self.checkpointer.restore(like=like, fingerprint=self.fingerprint)

    def forget_memory(self) -> None:
        """This rank is a replacement that lost its memory: its memory level holds nothing."""
        memory = self.by_name.get("memory")
        if memory is not None:
            memory.data, memory.step = None, None

    def recover_peer(self, *, like=None) -> Restored | None:
        """Collective: this rank's memory checkpoint back from its successor's copy (None where none is held);
        the memory level holds it again. No replication may be in flight."""
        assert self.peer is not None
        data, step = self.peer.recover()
        if data is None:
            return None
        step_saved, tree = unpack_tree(data, like=like, fingerprint=self.fingerprint)
        memory = self.by_name.get("memory")
        if memory is not None:
            memory.data, memory.step = data, step_saved
        return Restored(step=step_saved, tree=tree, level="memory-peer")
