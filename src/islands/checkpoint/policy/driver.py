"""Checkpointing inside a training loop: levels, interval, async persist, built from objects.

`CheckpointDriver(settings, world, run_dir=None, fingerprint="")`:
    settings     CheckpointSettings (islands.checkpoint.policy.settings): levels, intervals, policy, retention
    world        the job's World (rank, size, ledger; elastic: membership, data_shard)
    run_dir      where the local level goes when settings.dir is None (<run_dir>/ckpt)
    fingerprint  an opaque string stored in every checkpoint and compared on load (fingerprint.py)

The driver saves a `TrainingState` (below), never a trainer: whatever runs the loop (islands' Trainer,
the public `Checkpointer` around a user's own loop, a benchmark) implements it. The loop calls
`after_step(state)` after each optimizer step, `settle(state)` before elastic members change, and
`finish(state)` at the end; `record()` is what a run record keeps under "checkpoint".

Every rank saves its own part (rankNNNNN files) of the same step; the stores' barrier runs on a
dedicated gloo group so the persist thread never shares a process group with training collectives;
rank 0 commits. The tree carries the fingerprint (key "config_fingerprint"), the saving rank, the world
size and the data shard's size (for resharding, islands.checkpoint.policy.resume).

With an AutoInterval policy the local-disk interval comes from CombinedIntervalPolicy (SOTA-054
overhead bound, SOTA-189 Young/Daly). Ranks must agree on every save step, so each decision is fed the
maximum over ranks of the measured iteration time, stall and persist time (one small gather per
checkpoint): identical inputs give identical decisions. The first auto checkpoint waits for its
persist, so the policy starts from a measured persist time (a one-off cost).

The driver composes three parts with their own state and keeps the book of what was saved (saves per
level, the last step of each, the last saved step): the levels with their stores' barrier, peer and
elastic wiring (driver_levels.py: DriverLevels, also the persist thread's sink), which levels are due at a
step and the auto policy's decisions (save_steps.py: SaveSteps), and the saves in flight with their stall,
persist time and abandonment (in_flight.py: InFlightSaves).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from islands.checkpoint.policy.driver_levels import DriverLevels
from islands.checkpoint.policy.elastic_saves import Member, is_elastic
from islands.checkpoint.policy.in_flight import InFlightSaves
from islands.checkpoint.policy.save_steps import MAX_DECISIONS_KEPT, SaveSteps
from islands.checkpoint.policy.settings import CheckpointSettings, format_policy
from islands.checkpoint.policy.sharded_state import is_sharded
from islands.checkpoint.store.async_writer import AsyncCheckpointer, SaveHandle
from islands.checkpoint.store.levels import Restored
from islands.checkpoint.store.peer import PeerReplica
from islands.runtime.world import World


@runtime_checkable
class TrainingState(Protocol):
    """What the checkpoint driver and `resume` need from a training loop.

    world: World            the job's world (rank, size, all_gather_object; elastic: membership, data_shard)
    step: int               optimizer steps completed; a checkpoint taken now is "step N"
    elapsed: float          training seconds so far (the auto policy's iteration time comes from its changes)
    model: torch.nn.Module  the model as the loop runs it (wrapped); the driver only asks whether it is
                            sharded (FSDP2 DTensors: state_dict() is then a collective, so no rank may skip)
    shard_items: int        items in this rank's data shard (resharding scales data positions by it); -1 unknown

    state_dict() -> dict    everything to restore, as a tree of tensors and plain values. Keys the resume
                            policies know: "step"; "model", "optimizer", "strategy" (must be identical on
                            every saved rank to load into another world size); "data" (the data position:
                            {"epoch", "cursor"} is rescaled to the new shard, any other form is taken from
                            saved rank r mod N; "loader" is read the same way, as older checkpoints name it);
                            "elapsed", "series", "membership" (taken from saved rank 0). Other keys travel
                            as they are. The driver adds "config_fingerprint" and "world".
    load_state_dict(tree)   put that tree back (the tree may carry the driver's extra keys)
    model_state_dict() -> dict
                            the "model" entry state_dict() gives (its shapes and dtypes): a resume compares
                            them with the checkpoint's before loading anything and names each difference
    """

    world: World
    step: int
    elapsed: float
    model: torch.nn.Module

    @property
    def shard_items(self) -> int:
        """Read-only: the loops compute it from their data (a property there)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, tree: dict) -> None: ...

    def model_state_dict(self) -> dict: ...


class CheckpointDriver:
    """Decides, per step, which levels save; snapshots once; persists in the background."""

    @staticmethod
    def check_elastic(settings: CheckpointSettings) -> None:
        """What an elastic job's checkpoints cannot do (members come and go): a ValueError saying why, raised by the
        driver of an elastic world and asked by validation (app/validate) before any worker starts."""
        if settings.policy is not None:
            raise ValueError(
                "an elastic job needs a fixed checkpoint interval (every=N, no policy): the auto "
                "policy's decisions come from history a worker joining later does not have"
            )
        if settings.memory_peer:
            raise ValueError(
                "an elastic job does not replicate the memory level to a peer (ring neighbours change "
                "with membership); leave memory_peer off, the local and remote levels still work"
            )

    def __init__(
        self, settings: CheckpointSettings, world: World, run_dir: str | Path | None = None, fingerprint: str = ""
    ):
        if not isinstance(settings, CheckpointSettings):
            raise TypeError(f"CheckpointDriver takes CheckpointSettings(...); got {type(settings).__name__}")
        if not settings.enabled:
            raise ValueError(
                "no checkpoint level is set: give every=N, policy=AutoInterval(), memory_every=N "
                "or remote_dir with remote_every=N"
            )
        if settings.dir is None and run_dir is None:
            raise ValueError(
                "checkpointing needs a directory: CheckpointSettings(dir=...) or a run directory (<run_dir>/ckpt)"
            )
        if not isinstance(fingerprint, str):
            raise TypeError(
                f"fingerprint is an opaque str (e.g. fingerprint_of(fields)); got {type(fingerprint).__name__}"
            )
        self.settings, self.world, self.fingerprint = settings, world, fingerprint
        if settings.dir is not None:
            self.root = Path(settings.dir)
        else:
            assert run_dir is not None  # the check above raised when both are None
            self.root = Path(run_dir) / "ckpt"
        self.elastic = is_elastic(world)
        if self.elastic:
            self.check_elastic(settings)
        self.levels = DriverLevels(settings, world, self.root, fingerprint, self.elastic)
        self.in_flight = InFlightSaves(self.levels, self.levels.asynchronous)
        self.steps = SaveSteps(settings, world, self.levels.all)
        # the book of what was saved (an abandoned save is taken back off it: _abandoned)
        self.saves = {lv.name: 0 for lv in self.levels.all}
        self.memory_skipped = 0
        self.last_saved_step: int | None = None
        self.last_step_of: dict[str, int] = {}
        self.resumed_from: dict | None = None

    @property
    def remote_root(self) -> Path | None:
        return None if self.settings.remote_dir is None else Path(self.settings.remote_dir)

    @property
    def peer(self) -> PeerReplica | None:
        """The memory level's peer copy (memory_peer with a torch group), or None."""
        return self.levels.peer

    @property
    def writer(self) -> AsyncCheckpointer:
        """Snapshots once, persists in the background (one persist at a time)."""
        return self.in_flight.writer

    @property
    def stall_s(self) -> float:
        """Seconds training was blocked by saves so far."""
        return self.in_flight.stall_s

    @property
    def _by_name(self) -> dict[str, Any]:
        return self.levels.by_name

    # ---- sink: the persist thread hands each snapshot to the levels (DriverLevels.save) -----------
    def save(self, tree, step: int, *, levels: list[str], member: Member | None = None) -> dict:
        return self.levels.save(tree, step, levels=levels, member=member)

    # ---- called by the loop ---------------------------------------------------------------------
    def resumed(self, step: int, info: dict | None = None) -> None:
        """After a resume (islands.checkpoint.policy.resume): intervals count from the resumed step; `info`
        (what resume returned) goes into record() as "resumed_from"."""
        self.last_saved_step = step
        self.last_step_of = {lv.name: step for lv in self.levels.all}
        if info is not None:
            self.resumed_from = info
        self.steps.resumed(step)

    def due(self, step: int) -> list[str]:
        """The names of the levels due at `step`."""
        return self.steps.due(step)

    def tree(self, state: TrainingState) -> dict:
        world = {"rank": self.world.rank, "size": self.world.size, "shard_items": int(state.shard_items)}
        if self.elastic:  # resume matches parts by data shard: ranks follow admission order, shards do not
            world["shard"] = int((self.world.data_shard or (self.world.rank, self.world.size))[0])
        return {"config_fingerprint": self.fingerprint, "world": world, **state.state_dict()}

    def after_step(self, state: TrainingState) -> SaveHandle | None:
        """Save the levels due at state.step (the steps completed); None when nothing was saved."""
        self._raise_failed()
        self.steps.stepped(state.elapsed)
        step = state.step
        names = self.due(step)
        self.in_flight.reserve_once(lambda: self.tree(state), save_due=bool(names), model=state.model)
        if not names or step == self.last_saved_step:  # saved already (elastic: before a join, settle)
            return None
        if names == ["memory"] and self.in_flight.busy and self.peer is None and not is_sharded(state.model):
            # memory-only saves never wait for a disk persist (no barrier: per rank). With a peer, or
            # a sharded model whose state is gathered for the tree, they must: those are collectives,
            # so every rank has to save the same steps.
            self.memory_skipped += 1
            return None
        return self._save(state, step, names)

    def settle(self, state: TrainingState) -> None:
        """Elastic, before members change: save what is due at this step, then wait until no save is in
        flight (a new epoch would abandon it). The wait counts as stall."""
        names = self.due(state.step)
        if names and state.step != self.last_saved_step:
            self._save(state, state.step, names)
        self.in_flight.drain()
        self._raise_failed()

    def save_now(self, state: TrainingState, names: list[str] | None = None) -> SaveHandle | None:
        """Save state.step to `names` (default: every disk level) unless that step is already there."""
        if names is None:
            names = self.levels.disk()
        names = [n for n in names if self.last_step_of.get(n) != state.step]
        unknown = [n for n in names if n not in self.levels.by_name]
        if unknown:
            raise ValueError(f"no checkpoint level named {unknown}; this driver has {sorted(self.levels.by_name)}")
        return self._save(state, state.step, names) if names else None

    def _save(self, state: TrainingState, step: int, names: list[str]) -> SaveHandle:
        member = {"member": Member.now(self.world)} if self.elastic else {}
        handle, previous = self.in_flight.start(
            self.tree(state), step, names, wait=self.steps.waits_for_persist(names), **member
        )
        self._raise_failed()  # before dropping finished handles: one may have been abandoned meanwhile
        self.in_flight.track(handle, previous)
        for name in names:  # an abandoned save is taken back off these in _abandoned
            self.saves[name] += 1
            self.last_step_of[name] = step
        self.last_saved_step = step
        self.steps.saved(step, names, handle, previous)
        self._raise_failed()
        return handle

    def _raise_failed(self) -> None:
        self.in_flight.raise_failed(self._abandoned)

    def _abandoned(self, handle: SaveHandle) -> None:
        """Elastic: a membership change abandoned this save; counted as a save when it started, it is not one."""
        for name in handle.levels:
            self.saves[name] -= 1
            if self.last_step_of.get(name) == handle.step:
                del self.last_step_of[name]  # finish() saves the final step again

    def wait(self) -> None:
        """Block until every save started so far is durable (or raise the error of one that failed)."""
        self.in_flight.close()
        self._raise_failed()

    def finish(self, state: TrainingState) -> None:
        """End of training: a final local/remote checkpoint unless this step was just saved, and the memory
        level's when this step is due for it (the loop saves the last step here, after the final
        synchronisation, not in after_step); wait for durability."""
        disk = self.levels.disk()
        self.save_now(state, (["memory"] if "memory" in self.due(state.step) else []) + disk)
        self.wait()

    def restore(self, *, like=None) -> Restored:
        """Newest intact checkpoint across this process's levels (memory first on ties)."""
        return self.levels.restore(like=like)

    def restore_peer(self, *, like=None, lost: bool = False) -> Restored | None:
        """Collective over all ranks: each gets its memory checkpoint back from its successor's copy.

        lost=True: this rank is a replacement that lost its memory (its own level is cleared first).
        Returns None where no copy is held (no peer replication, or nothing saved yet). The caller
        loads the tree (e.g. state.load_state_dict(restored.tree)).
        """
        if self.peer is None:
            return None
        if lost:
            self.levels.forget_memory()
        self.writer.wait()  # no replication may be in flight while the copies travel back
        return self.levels.recover_peer(like=like)

    def record(self) -> dict:
        """The run record's "checkpoint" section: levels, saves, stall, interval decisions, resume."""
        elapsed = max(self.steps.last_elapsed or 0.0, 1e-9)
        policy = self.settings.policy
        flight, decisions = self.in_flight, self.steps.decisions
        rec = {
            "root": str(self.root),
            "async": flight.asynchronous,
            "levels": self.steps.intervals(),
            "remote_dir": None if self.remote_root is None else str(self.remote_root),
            "memory_peer": None
            if self.peer is None
            else {
                "held_step": self.peer.held_step,
                "bytes_sent": self.peer.bytes_sent,
                "bytes_received": self.peer.bytes_received,
            },
            "saves": dict(self.saves),
            "memory_skipped_busy": self.memory_skipped,
            "abandoned_membership_change": list(flight.abandoned),
            "abandoned_why": flight.abandoned_why[-MAX_DECISIONS_KEPT:],
            "stall_seconds_total": flight.stall_s,
            "persist_seconds_total": flight.persist_s,
            "staging_reserve_s": flight.writer.reserve_s,
            "share_replicas": self.levels.share_replicas,
            "disk_bytes_this_rank": dict(flight.disk_bytes),
            "stall_fraction_of_training": self.stall_s / elapsed,
            "last_saved_step": self.last_saved_step,
            "policy": "fixed" if policy is None else {"spec": format_policy(policy), **vars(policy)},
            "decisions": decisions,
        }
        if decisions:
            rec["decision"] = decisions[-1]
        if self.resumed_from is not None:
            rec["resumed_from"] = self.resumed_from
        return rec


def build_checkpointing(
    settings: CheckpointSettings, world: World, run_dir: str | Path | None = None, fingerprint: str = ""
) -> CheckpointDriver | None:
    """A driver when any checkpoint level is set, else None."""
    return CheckpointDriver(settings, world, run_dir, fingerprint) if settings.enabled else None


def checkpoint_record(driver: CheckpointDriver | None, resumed_from: dict | None = None) -> dict | None:
    """What a run record keeps under "checkpoint": the driver's record and where a resume came from
    (`resume`'s return value; given here for a job that resumed without checkpointing on)."""
    if driver is None and resumed_from is None:
        return None
    rec = driver.record() if driver is not None else {}
    if resumed_from is not None:
        rec["resumed_from"] = resumed_from
    return rec
