"""Checkpointing inside a training loop: levels, interval, async persist, built from objects.

`CheckpointDriver(settings, world, run_dir=None, fingerprint="")`:
    settings     CheckpointSettings (islands.checkpoint.settings): levels, intervals, policy, retention
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
size and the data shard's size (for resharding, islands.checkpoint.resume).

With an AutoInterval policy the local-disk interval comes from CombinedIntervalPolicy (SOTA-054
overhead bound, SOTA-189 Young/Daly). Ranks must agree on every save step, so each decision is fed the
maximum over ranks of the measured iteration time, stall and persist time (one small gather per
checkpoint): identical inputs give identical decisions. The first auto checkpoint waits for its
persist, so the policy starts from a measured persist time (a one-off cost).
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from islands.checkpoint.policy.elastic_saves import (
    ElasticBarrier,
    Member,
    MembershipChanged,
    PersistBarrier,
    bind,
    can_persist_async,
    is_elastic,
    opens_clean,
)
from islands.checkpoint.policy.settings import CheckpointSettings, format_policy
from islands.checkpoint.policy.sharded_state import is_sharded
from islands.checkpoint.store.async_writer import AsyncCheckpointer, SaveHandle
from islands.checkpoint.store.directory import CheckpointStore, SaveResult
from islands.checkpoint.store.levels import DiskLevel, MemoryLevel, MultiLevelCheckpointer, Restored
from islands.checkpoint.store.packed import unpack_tree
from islands.checkpoint.store.peer import PeerReplica
from islands.runtime.comm import Comm
from islands.runtime.world import World

MAX_DECISIONS_KEPT = 100  # run.json keeps the first and last decisions, not one per checkpoint forever


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
    def shard_items(self) -> int: ...  # read-only: implementers derive it (LoopState, Trainer)

    def state_dict(self) -> dict: ...

    def load_state_dict(self, tree: dict) -> None: ...

    def model_state_dict(self) -> dict: ...


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
            assert run_dir is not None  # checked above
            self.root = Path(run_dir) / "ckpt"
        self.elastic = is_elastic(world)
        if self.elastic:
            self.check_elastic(settings)
        torch_dist = world.size > 1 and not self.elastic and world.comms is None
        barrier: Callable[[], None] | None = None
        self.elastic_barrier: ElasticBarrier | PersistBarrier | None = None
        if torch_dist:
            barrier = _Barrier(world, settings.timeout)
        elif self.elastic:  # members change between saves: islands.checkpoint.elastic_saves
            if settings.asynchronous and can_persist_async(world):
                m = world.membership
                assert m is not None and m.new_client is not None  # is_elastic, can_persist_async
                # ElasticComm has new_liveness; contracts.ElasticMembership does not declare it (yet)
                liveness = m.new_liveness  # type: ignore[attr-defined]
                self.elastic_barrier = PersistBarrier(m.new_client, liveness, lambda: m.epoch, settings.timeout)
            else:
                self.elastic_barrier = ElasticBarrier(world)
            barrier = self.elastic_barrier
        elif world.size > 1:  # other comms without a torch group of their own: meet on the main thread

            def meet() -> None:
                world.all_gather_object(None)

            barrier = meet
        self.async_ok = settings.asynchronous and (world.size == 1 or torch_dist or isinstance(barrier, PersistBarrier))
        self.abandoned: list[int] = []  # steps whose save a membership change abandoned (elastic)
        self.abandoned_why: list[str] = []

        self.share_replicas = settings.share_replicas and not self.elastic and world.size > 1

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
        levels: list[MemoryLevel | DiskLevel] = []
        if settings.memory_every:
            levels.append(
                MemoryLevel(
                    every=settings.memory_every, replicate=self.peer.replicate if self.peer is not None else None
                )
            )
        if settings.every or settings.policy is not None:
            levels.append(DiskLevel(store(self.root), every=settings.every or 1, name="local"))
        if settings.remote_dir is not None:
            levels.append(DiskLevel(store(Path(settings.remote_dir)), every=settings.remote_every, name="remote"))
        self.levels = MultiLevelCheckpointer(levels)
        self._by_name = {lv.name: lv for lv in levels}
        # Sink.save takes **kwargs; this save takes exactly the keywords its own writer passes (levels, member)
        self.writer = AsyncCheckpointer(self, when_busy="wait")  # type: ignore[arg-type]
        self.policy = settings.policy.build(world.size) if settings.policy is not None else None
        self.next_local: int | None = None  # auto: the step of the next local-disk save
        self.decisions: list[dict] = []
        self.saves = {lv.name: 0 for lv in levels}
        self.memory_skipped = 0
        self.stall_s = self.persist_s = 0.0
        self.disk_bytes = {"written": 0, "deduped": 0, "shared": 0}  # see SaveResult
        self.handles: list[SaveHandle] = []
        self.last_saved_step: int | None = None
        self.last_step_of: dict[str, int] = {}
        self.resumed_from: dict | None = None
        self._last_elapsed: float | None = 0.0
        self._iter_sum, self._iter_n = 0.0, 0
        self._uptime_mark = time.perf_counter()
        self._reserve_tried = False

    @property
    def remote_root(self) -> Path | None:
        return None if self.settings.remote_dir is None else Path(self.settings.remote_dir)

    # ---- sink: the persist thread calls this with the snapshot ----------------------------------
    def save(self, tree, step: int, *, levels: list[str], member: Member | None = None) -> dict:
        extra = {}
        if member is not None:  # elastic: as the member this process was at the snapshot
            stores = [lv.store for lv in (self._by_name[n] for n in levels) if isinstance(lv, DiskLevel)]
            extra["token"] = bind(stores, member, step, self.elastic_barrier)
        return {
            name: self._by_name[name].save(
                tree,
                step,
                fingerprint=self.fingerprint,
                **(extra if isinstance(self._by_name[name], DiskLevel) else {}),
            )
            for name in levels
        }

    # ---- called by the loop ---------------------------------------------------------------------
    def resumed(self, step: int, info: dict | None = None) -> None:
        """After a resume (islands.checkpoint.resume): intervals count from the resumed step; `info`
        (what resume returned) goes into record() as "resumed_from"."""
        self._last_elapsed = None
        self.last_saved_step = step
        self.last_step_of = {lv.name: step for lv in self.levels.levels}
        if info is not None:
            self.resumed_from = info
        if self.settings.policy is not None:  # self.policy was built from it
            self.next_local = step + self.settings.policy.first

    def due(self, step: int) -> list[str]:
        names = []
        for lv in self.levels.levels:
            if lv.name == "local" and self.policy is not None:
                if self.next_local is None:
                    assert self.settings.policy is not None  # self.policy was built from it
                    self.next_local = self.settings.policy.first
                hit = step >= self.next_local
            else:
                hit = step % lv.every == 0
            if hit:
                names.append(lv.name)
        return names

    def tree(self, state: TrainingState) -> dict:
        world = {"rank": self.world.rank, "size": self.world.size, "shard_items": int(state.shard_items)}
        if self.elastic:  # resume matches parts by data shard: ranks follow admission order, shards do not
            world["shard"] = int((self.world.data_shard or (self.world.rank, self.world.size))[0])
        return {"config_fingerprint": self.fingerprint, "world": world, **state.state_dict()}

    def after_step(self, state: TrainingState) -> SaveHandle | None:
        """Save the levels due at state.step (the steps completed); None when nothing was saved."""
        self._raise_failed()
        if self._last_elapsed is not None:
            self._iter_sum += state.elapsed - self._last_elapsed
            self._iter_n += 1
        self._last_elapsed = state.elapsed
        step = state.step
        names = self.due(step)
        if not self._reserve_tried:
            self._reserve(state, now=bool(names))
        if not names or step == self.last_saved_step:  # saved already (elastic: before a join, settle)
            return None
        if (
            names == ["memory"]
            and self.writer.in_flight is not None
            and self.peer is None
            and not is_sharded(state.model)
        ):
            # memory-only saves never wait for a disk persist (no barrier: per rank). With a peer, or
            # a sharded model whose state is gathered for the tree, they must: those are collectives,
            # so every rank has to save the same steps.
            self.memory_skipped += 1
            return None
        return self._save(state, step, names)

    def _reserve(self, state: TrainingState, now: bool) -> None:
        """After the first step (the optimizer has its state by then), make the staging buffers of the
        snapshots in the background, unless a save is due at once (it would only wait for them) or the
        state is sharded (its tree is gathered: a collective, not worth a second one at the start)."""
        self._reserve_tried = True
        if self.async_ok and not now and not is_sharded(state.model):
            self.writer.reserve(self.tree(state))

    def settle(self, state: TrainingState) -> None:
        """Elastic, before members change: save what is due at this step, then wait until no save is in
        flight (a new epoch would abandon it). The wait counts as stall."""
        names = self.due(state.step)
        if names and state.step != self.last_saved_step:
            self._save(state, state.step, names)
        start = time.perf_counter()
        self.writer.wait()
        self.stall_s += time.perf_counter() - start
        self._raise_failed()

    def save_now(self, state: TrainingState, names: list[str] | None = None) -> SaveHandle | None:
        """Save state.step to `names` (default: every disk level) unless that step is already there."""
        if names is None:
            names = [n for n in ("local", "remote") if n in self._by_name]
        names = [n for n in names if self.last_step_of.get(n) != state.step]
        unknown = [n for n in names if n not in self._by_name]
        if unknown:
            raise ValueError(f"no checkpoint level named {unknown}; this driver has {sorted(self._by_name)}")
        return self._save(state, state.step, names) if names else None

    def _save(self, state: TrainingState, step: int, names: list[str]) -> SaveHandle:
        previous = self.handles[-1] if self.handles else None
        member = {"member": Member.now(self.world)} if self.elastic else {}
        handle = self.writer.save(self.tree(state), step, levels=names, **member)
        handle.levels = names
        first_auto = self.policy is not None and "local" in names and not self.decisions
        if not self.async_ok or first_auto:
            handle.wait()
            if not self.async_ok:
                handle.stall_s += handle.persist_s  # a blocking save stalls for all of it
        self._raise_failed()  # before dropping finished handles: one may have been abandoned meanwhile
        self.handles = [h for h in self.handles if not h.done()] + [handle]
        self.stall_s += handle.stall_s
        self._account(previous)
        for name in names:  # an abandoned save is taken back off these in _raise_failed
            self.saves[name] += 1
            self.last_step_of[name] = step
        self.last_saved_step = step
        if self.policy is not None and "local" in names:
            self._decide(step, handle, previous)
        self._raise_failed()
        return handle

    def _account(self, previous: SaveHandle | None) -> None:
        if previous is not None and previous.done():
            self.persist_s += previous.persist_s
            results: dict[str, object] = previous.result or {}
            for res in results.values():  # disk levels: this rank's bytes, per save
                if isinstance(res, SaveResult):
                    for key in self.disk_bytes:
                        self.disk_bytes[key] += getattr(res, f"bytes_{key}")

    def _decide(self, step: int, handle: SaveHandle, previous: SaveHandle | None) -> None:
        persist = handle.persist_s if handle.done() else (previous.persist_s if previous else 0.0)
        iter_s = self._iter_sum / max(self._iter_n, 1)
        now = time.perf_counter()
        local = [iter_s, handle.stall_s, persist, now - self._uptime_mark]
        if self.world.size > 1:  # identical inputs on every rank -> identical save steps
            local = [max(col) for col in zip(*self.world.all_gather_object(local))]
        self._iter_sum, self._iter_n, self._uptime_mark = 0.0, 0, now
        iter_s, stall, persist, uptime = local
        policy = self.policy
        assert policy is not None  # _save decides only with a policy
        policy.observe_iteration(max(iter_s, 1e-9))
        policy.observe_checkpoint(stall, persist)
        policy.observe_uptime(uptime)
        decision = policy.decide()
        self.next_local = step + decision.steps
        entry = {
            "step": step,
            "interval_steps": decision.steps,
            "binding": decision.binding,
            "reason": decision.reason,
            "iter_s": iter_s,
            "stall_s": stall,
            "persist_s": persist,
        }
        self.decisions.append(entry)
        if len(self.decisions) > MAX_DECISIONS_KEPT:
            del self.decisions[MAX_DECISIONS_KEPT // 2]

    def _raise_failed(self) -> None:
        for h in list(self.handles):
            if h.done() and isinstance(h.error, MembershipChanged):  # elastic: abandoned, not fatal
                self.abandoned.append(h.step)
                self.abandoned_why.append(f"step {h.step}: {h.error}")
                self.handles.remove(h)
                for name in h.levels:  # counted as a save when it started; it is not one
                    self.saves[name] -= 1
                    if self.last_step_of.get(name) == h.step:
                        del self.last_step_of[name]  # finish() saves the final step again
            elif h.done() and h.error is not None:
                raise RuntimeError(f"checkpoint of step {h.step} failed: {h.error!r}") from h.error

    def wait(self) -> None:
        """Block until every save started so far is durable (or raise the error of one that failed)."""
        self.writer.close()
        if self.handles:
            self._account(self.handles[-1])
        self._raise_failed()

    def finish(self, state: TrainingState) -> None:
        """End of training: a final local/remote checkpoint unless this step was just saved, and the memory
        level's when this step is due for it (the loop saves the last step here, after the final
        synchronisation, not in after_step); wait for durability."""
        disk: list[str] = [n for n in ("local", "remote") if n in self._by_name]
        self.save_now(state, (["memory"] if "memory" in self.due(state.step) else []) + disk)
        self.wait()

    def restore(self, *, like=None) -> Restored:
        """Newest intact checkpoint across this process's levels (memory first on ties)."""
        return self.levels.restore(like=like, fingerprint=self.fingerprint)

    def restore_peer(self, *, like=None, lost: bool = False) -> Restored | None:
        """Collective over all ranks: each gets its memory checkpoint back from its successor's copy.

        lost=True: this rank is a replacement that lost its memory (its own level is cleared first).
        Returns None where no copy is held (no peer replication, or nothing saved yet). The caller
        loads the tree (e.g. state.load_state_dict(restored.tree)).
        """
        if self.peer is None:
            return None
        memory = self._by_name.get("memory")
        assert memory is None or isinstance(memory, MemoryLevel)  # the level named "memory" is one
        if lost and memory is not None:
            memory.data, memory.step = None, None
        self.writer.wait()  # no replication may be in flight while the copies travel back
        data, step = self.peer.recover()
        if data is None:
            return None
        step_saved, tree = unpack_tree(data, like=like, fingerprint=self.fingerprint)
        if memory is not None:
            memory.data, memory.step = data, step_saved
        return Restored(step=step_saved, tree=tree, level="memory-peer")

    def record(self) -> dict:
        """The run record's "checkpoint" section: levels, saves, stall, interval decisions, resume."""
        elapsed = max(self._last_elapsed or 0.0, 1e-9)
        policy = self.settings.policy
        rec = {
            "root": str(self.root),
            "async": self.async_ok,
            "levels": {
                lv.name: ("policy" if lv.name == "local" and self.policy else lv.every) for lv in self.levels.levels
            },
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
            "abandoned_membership_change": list(self.abandoned),
            "abandoned_why": self.abandoned_why[-MAX_DECISIONS_KEPT:],
            "stall_seconds_total": self.stall_s,
            "persist_seconds_total": self.persist_s,
            "staging_reserve_s": self.writer.reserve_s,
            "share_replicas": self.share_replicas,
            "disk_bytes_this_rank": dict(self.disk_bytes),
            "stall_fraction_of_training": self.stall_s / elapsed,
            "last_saved_step": self.last_saved_step,
            "policy": "fixed" if policy is None else {"spec": format_policy(policy), **vars(policy)},
            "decisions": self.decisions,
        }
        if self.decisions:
            rec["decision"] = self.decisions[-1]
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
