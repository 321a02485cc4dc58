"""Checkpointing inside the training loop: levels, interval, async persist, built from one TrainConfig.

Config (islands.config.TrainConfig):
    ckpt_dir            local-disk level root ("" = <run_dir>/ckpt)
    ckpt_every          local-disk interval in steps (0 = none, unless ckpt_policy="auto")
    ckpt_policy         "" (fixed ckpt_every) or "auto[:bound=0.035,mtbf_days=3748.25,devices=N,first=10]"
    ckpt_memory_every   in-memory level interval (0 = none); in-process rollback via `restore()`
    ckpt_memory_peer    the memory level of rank r is also held by rank (r+1) % n (SOTA-057); a lost
                        rank's state comes back with `restore_peer()` (collective)
    ckpt_remote_dir     second directory standing for remote storage ("" = none)
    ckpt_remote_every   remote level interval in steps
    ckpt_keep           checkpoints retention keeps per disk level
    ckpt_async          two-phase snapshot-then-persist (SOTA-056) or a blocking save
    ckpt_share_replicas a tensor whose bytes rank 0 saves in the same step (data-parallel replicas)
                        is referenced by the other ranks' manifests, not written again (not elastic:
                        its members' states differ between syncs, and its barrier has two phases)

Every rank saves its own part (rankNNNNN files) of the same step; the stores' barrier runs on a
dedicated gloo group so the persist thread never shares a process group with training collectives;
rank 0 commits. The tree carries the config fingerprint (TrainConfig.fingerprint_fields), the saving
rank, the world size and the loader's shard size (for resharding, islands.checkpoint.resume).

With ckpt_policy="auto" the local-disk interval comes from CombinedIntervalPolicy (SOTA-054 overhead
bound, SOTA-189 Young/Daly). Ranks must agree on every save step, so each decision is fed the maximum
over ranks of the measured iteration time, stall and persist time (one small gather per checkpoint):
identical inputs give identical decisions. The first auto checkpoint waits for its persist, so the
policy starts from a measured persist time (a one-off cost).
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path

from islands.checkpoint.async_writer import AsyncCheckpointer, SaveHandle
from islands.checkpoint.elastic_saves import (ElasticBarrier, Member, MembershipChanged, PersistBarrier, bind,
                                              can_persist_async, is_elastic, opens_clean)
from islands.checkpoint.interval import (DAY_S, DEFAULT_DEVICE_MTBF_DAYS, DEFAULT_OVERHEAD_BOUND, CheckFreqPolicy,
                                         CombinedIntervalPolicy, YoungDalyInterval)
from islands.checkpoint.levels import DiskLevel, MemoryLevel, MultiLevelCheckpointer, Restored
from islands.checkpoint.packed import unpack_tree
from islands.checkpoint.peer import PeerReplica
from islands.checkpoint.sharded_state import is_sharded
from islands.checkpoint.store import CheckpointStore, SaveResult
from islands.runtime.comm import Comm

_AUTO_KEYS = {"bound": float, "mtbf_days": float, "devices": int, "first": int, "max": int}
MAX_DECISIONS_KEPT = 100  # run.json keeps the first and last decisions, not one per checkpoint forever


def config_fingerprint(cfg) -> str:
    """The model-defining config fields as canonical JSON: stored in every checkpoint, compared on load."""
    return json.dumps(cfg.fingerprint_fields(), sort_keys=True)


def parse_policy(spec: str) -> dict | None:
    """"" -> None (fixed interval); "auto[:k=v,...]" -> the policy's settings with defaults filled in."""
    if not spec:
        return None
    name, _, args = spec.partition(":")
    if name != "auto":
        raise ValueError(f"ckpt_policy must be '' (fixed ckpt_every) or 'auto[:bound=0.035,mtbf_days=3748.25,"
                         f"devices=N,first=10,max=N]'; got {spec!r}")
    out = {"bound": DEFAULT_OVERHEAD_BOUND, "mtbf_days": DEFAULT_DEVICE_MTBF_DAYS, "devices": 0, "first": 10,
           "max": 1_000_000}
    for part in filter(None, args.split(",")):
        key, eq, value = part.partition("=")
        if key not in _AUTO_KEYS or not eq:
            raise ValueError(f"ckpt_policy: unknown or malformed setting {part!r}; valid: {', '.join(_AUTO_KEYS)}")
        try:
            out[key] = _AUTO_KEYS[key](value)
        except ValueError:
            raise ValueError(f"ckpt_policy: {key} must be {_AUTO_KEYS[key].__name__}, got {value!r}") from None
    if not 0 < out["bound"] < 1:
        raise ValueError(f"ckpt_policy: bound is a fraction in (0, 1), e.g. 0.035; got {out['bound']}")
    if out["mtbf_days"] <= 0 or out["devices"] < 0 or out["first"] < 1 or out["max"] < 1:
        raise ValueError("ckpt_policy: need mtbf_days > 0, devices >= 0 (0 = the job's world size), first >= 1, max >= 1")
    return out


def check_checkpoint_config(cfg) -> None:
    """Raise ValueError naming the field if the checkpoint settings cannot work together."""
    policy = parse_policy(cfg.ckpt_policy)
    for key in ("ckpt_every", "ckpt_memory_every", "ckpt_remote_every"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"{key} must be >= 0 steps (0 = off); got {getattr(cfg, key)}")
    if cfg.ckpt_keep < 1:
        raise ValueError(f"ckpt_keep must be >= 1 (the newest checkpoint is always kept); got {cfg.ckpt_keep}")
    if policy is not None and cfg.ckpt_every:
        raise ValueError(f"ckpt_policy='auto' chooses the interval itself; set ckpt_every=0 (got {cfg.ckpt_every})")
    if cfg.ckpt_memory_peer and not cfg.ckpt_memory_every:
        raise ValueError("ckpt_memory_peer replicates the memory level: set ckpt_memory_every > 0 too")
    if bool(cfg.ckpt_remote_dir) != bool(cfg.ckpt_remote_every):
        raise ValueError("ckpt_remote_dir and ckpt_remote_every go together: give both or neither")
    if cfg.ckpt_remote_dir and cfg.ckpt_dir and Path(cfg.ckpt_remote_dir).resolve() == Path(cfg.ckpt_dir).resolve():
        raise ValueError("ckpt_remote_dir must differ from ckpt_dir (it stands for a separate storage system)")


def checkpointing_enabled(cfg) -> bool:
    return bool(cfg.ckpt_every or cfg.ckpt_policy or cfg.ckpt_memory_every or cfg.ckpt_remote_every)


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

    def __init__(self, cfg, world, run_dir: Path | None):
        check_checkpoint_config(cfg)
        if not cfg.ckpt_dir and run_dir is None:
            raise ValueError("checkpointing needs ckpt_dir or a run directory (<run_dir>/ckpt)")
        self.cfg, self.world = cfg, world
        self.fingerprint = config_fingerprint(cfg)
        self.policy_settings = parse_policy(cfg.ckpt_policy)
        self.root = Path(cfg.ckpt_dir) if cfg.ckpt_dir else Path(run_dir) / "ckpt"
        self.elastic = is_elastic(world)
        torch_dist = world.size > 1 and not self.elastic and world.comms is None
        barrier = None
        if torch_dist:
            barrier = _Barrier(world, cfg.timeout)
        elif self.elastic:  # members change between saves: islands.checkpoint.elastic_saves
            if cfg.ckpt_async and can_persist_async(world):
                m = world.membership
                barrier = PersistBarrier(m.new_client, m.new_liveness, lambda: m.epoch, cfg.timeout)
            else:
                barrier = ElasticBarrier(world)
            self.elastic_barrier = barrier
        elif world.size > 1:  # other comms without a torch group of their own: meet on the main thread
            barrier = lambda: world.all_gather_object(None)  # noqa: E731
        self.async_ok = cfg.ckpt_async and (world.size == 1 or torch_dist or isinstance(barrier, PersistBarrier))
        self.abandoned: list[int] = []  # steps whose save a membership change abandoned (elastic)
        self.abandoned_why: list[str] = []

        self.share_replicas = cfg.ckpt_share_replicas and not self.elastic and world.size > 1

        def store(root):
            return CheckpointStore(root, keep_last=cfg.ckpt_keep, rank=world.rank, world_size=world.size,
                                   barrier=barrier, clean=opens_clean(world), share_replicas=self.share_replicas)

        # Peer copies need every rank at every memory save: only with a torch group (not elastic).
        self.peer = PeerReplica(_peer_comm(world, cfg.timeout)) if cfg.ckpt_memory_peer and torch_dist else None
        levels = []
        if cfg.ckpt_memory_every:
            levels.append(MemoryLevel(every=cfg.ckpt_memory_every,
                                      replicate=self.peer.replicate if self.peer is not None else None))
        if cfg.ckpt_every or self.policy_settings is not None:
            levels.append(DiskLevel(store(self.root), every=cfg.ckpt_every or 1, name="local"))
        if cfg.ckpt_remote_dir:
            levels.append(DiskLevel(store(Path(cfg.ckpt_remote_dir)), every=cfg.ckpt_remote_every, name="remote"))
        self.levels = MultiLevelCheckpointer(levels)
        self._by_name = {lv.name: lv for lv in levels}
        self.writer = AsyncCheckpointer(self, when_busy="wait")
        self.policy = self._build_policy() if self.policy_settings is not None else None
        self.next_local: int | None = None  # auto: the step of the next local-disk save
        self.decisions: list[dict] = []
        self.saves = {lv.name: 0 for lv in levels}
        self.memory_skipped = 0
        self.stall_s = self.persist_s = 0.0
        self.disk_bytes = {"written": 0, "deduped": 0, "shared": 0}  # see SaveResult
        self.handles: list[SaveHandle] = []
        self.last_saved_step: int | None = None
        self.last_step_of: dict[str, int] = {}
        self._last_elapsed = 0.0
        self._iter_sum, self._iter_n = 0.0, 0
        self._uptime_mark = time.perf_counter()
        self._reserve_tried = False

    def _build_policy(self) -> CombinedIntervalPolicy:
        s = self.policy_settings
        checkfreq = CheckFreqPolicy(s["bound"], smoothing=0.3, max_steps=s["max"], initial_steps=s["first"])
        failures = YoungDalyInterval(s["devices"] or self.world.size, per_device_mtbf_s=s["mtbf_days"] * DAY_S)
        return CombinedIntervalPolicy(checkfreq, failures)

    # ---- sink: the persist thread calls this with the snapshot ----------------------------------
    def save(self, tree, step: int, *, levels: list[str], member: Member | None = None) -> dict:
        extra = {}
        if member is not None:  # elastic: as the member this process was at the snapshot
            stores = [self._by_name[n].store for n in levels if hasattr(self._by_name[n], "store")]
            extra["token"] = bind(stores, member, step, self.elastic_barrier)
        return {name: self._by_name[name].save(tree, step, fingerprint=self.fingerprint,
                                               **(extra if hasattr(self._by_name[name], "store") else {}))
                for name in levels}

    # ---- called by the trainer ------------------------------------------------------------------
    def resumed(self, step: int) -> None:
        """After a resume: the interval counts from the resumed step."""
        self._last_elapsed = None
        self.last_saved_step = step
        self.last_step_of = {lv.name: step for lv in self.levels.levels}
        if self.policy is not None:
            self.next_local = step + self.policy_settings["first"]

    def due(self, step: int) -> list[str]:
        names = []
        for lv in self.levels.levels:
            if lv.name == "local" and self.policy is not None:
                if self.next_local is None:
                    self.next_local = self.policy_settings["first"]
                hit = step >= self.next_local
            else:
                hit = step % lv.every == 0
            if hit:
                names.append(lv.name)
        return names

    def tree(self, trainer) -> dict:
        loader = trainer.task.loader
        sampler = getattr(loader, "sampler", None)
        world = {"rank": self.world.rank, "size": self.world.size, "shard_items": int(getattr(sampler, "n", -1))}
        if self.elastic:  # resume matches parts by data shard: ranks follow admission order, shards do not
            world["shard"] = int((self.world.data_shard or (self.world.rank, self.world.size))[0])
        return {"config_fingerprint": self.fingerprint, "world": world,
                **trainer.state_dict()}

    def after_step(self, trainer) -> SaveHandle | None:
        self._raise_failed()
        if self._last_elapsed is not None:
            self._iter_sum += trainer.elapsed - self._last_elapsed
            self._iter_n += 1
        self._last_elapsed = trainer.elapsed
        step = trainer.step
        names = self.due(step)
        if not self._reserve_tried:
            self._reserve(trainer, now=bool(names))
        if not names or step == self.last_saved_step:  # saved already (elastic: before a join, settle)
            return None
        if (names == ["memory"] and self.writer.in_flight is not None and self.peer is None
                and not is_sharded(trainer.model)):
            # memory-only saves never wait for a disk persist (no barrier: per rank). With a peer, or
            # a sharded model whose state is gathered for the tree, they must: those are collectives,
            # so every rank has to save the same steps.
            self.memory_skipped += 1
            return None
        return self._save(trainer, step, names)

    def _reserve(self, trainer, now: bool) -> None:
        """After the first step (the optimizer has its state by then), make the staging buffers of the
        snapshots in the background, unless a save is due at once (it would only wait for them) or the
        state is sharded (its tree is gathered: a collective, not worth a second one at the start)."""
        self._reserve_tried = True
        if self.async_ok and not now and not is_sharded(trainer.model):
            self.writer.reserve(self.tree(trainer))

    def settle(self, trainer) -> None:
        """Elastic, before members change: save what is due at this step, then wait until no save is in
        flight (a new epoch would abandon it). The wait counts as stall."""
        names = self.due(trainer.step)
        if names and trainer.step != self.last_saved_step:
            self._save(trainer, trainer.step, names)
        start = time.perf_counter()
        self.writer.wait()
        self.stall_s += time.perf_counter() - start
        self._raise_failed()

    def _save(self, trainer, step: int, names: list[str]) -> SaveHandle:
        previous = self.handles[-1] if self.handles else None
        member = {"member": Member.now(self.world)} if self.elastic else {}
        handle = self.writer.save(self.tree(trainer), step, levels=names, **member)
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
            for res in (previous.result or {}).values():  # disk levels: this rank's bytes, per save
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
        self.policy.observe_iteration(max(iter_s, 1e-9))
        self.policy.observe_checkpoint(stall, persist)
        self.policy.observe_uptime(uptime)
        decision = self.policy.decide()
        self.next_local = step + decision.steps
        entry = {"step": step, "interval_steps": decision.steps, "binding": decision.binding,
                 "reason": decision.reason, "iter_s": iter_s, "stall_s": stall, "persist_s": persist}
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

    def finish(self, trainer) -> None:
        """End of training: a final local/remote checkpoint unless this step was just saved; wait for durability."""
        names = [n for n in ("local", "remote") if n in self._by_name and self.last_step_of.get(n) != trainer.step]
        if names:
            self._save(trainer, trainer.step, names)
        self.writer.wait()
        if self.handles:
            self._account(self.handles[-1])
        self._raise_failed()

    def restore(self, *, like=None) -> Restored:
        """Newest intact checkpoint across this process's levels (memory first on ties)."""
        return self.levels.restore(like=like, fingerprint=self.fingerprint)

    def restore_peer(self, *, like=None, lost: bool = False) -> Restored | None:
        """Collective over all ranks: each gets its memory checkpoint back from its successor's copy.

        lost=True: this rank is a replacement that lost its memory (its own level is cleared first).
        Returns None where no copy is held (no peer replication, or nothing saved yet). The caller
        loads the tree (e.g. Trainer.load_state_dict(restored.tree)).
        """
        if self.peer is None:
            return None
        memory = self._by_name.get("memory")
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
        elapsed = max(self._last_elapsed or 0.0, 1e-9)
        rec = {"root": str(self.root), "async": self.async_ok,
               "levels": {lv.name: ("policy" if lv.name == "local" and self.policy else lv.every)
                          for lv in self.levels.levels},
               "remote_dir": self.cfg.ckpt_remote_dir or None,
               "memory_peer": None if self.peer is None else {
                   "held_step": self.peer.held_step, "bytes_sent": self.peer.bytes_sent,
                   "bytes_received": self.peer.bytes_received},
               "saves": dict(self.saves), "memory_skipped_busy": self.memory_skipped,
               "abandoned_membership_change": list(self.abandoned),
               "abandoned_why": self.abandoned_why[-MAX_DECISIONS_KEPT:],
               "stall_seconds_total": self.stall_s, "persist_seconds_total": self.persist_s,
               "staging_reserve_s": self.writer.reserve_s,
               "share_replicas": self.share_replicas,
               "disk_bytes_this_rank": dict(self.disk_bytes),
               "stall_fraction_of_training": self.stall_s / elapsed, "last_saved_step": self.last_saved_step,
               "policy": "fixed" if self.policy is None else {"spec": self.cfg.ckpt_policy, **self.policy_settings},
               "decisions": self.decisions}
        if self.decisions:
            rec["decision"] = self.decisions[-1]
        return rec


def build_checkpointing(cfg, world, run_dir: Path | None) -> CheckpointDriver | None:
    """The trainer's entry point: a driver when any checkpoint level is configured, else None."""
    return CheckpointDriver(cfg, world, run_dir) if checkpointing_enabled(cfg) else None


def checkpoint_record(trainer) -> dict | None:
    """What run.json records under "checkpoint": the driver's record and where a resume came from."""
    driver = getattr(trainer, "checkpoints", None)
    resumed = getattr(trainer, "resumed_from", None)
    if driver is None and resumed is None:
        return None
    rec = driver.record() if driver is not None else {}
    if resumed is not None:
        rec["resumed_from"] = resumed
    return rec
