"""Islands of k workers as the unit of elastic membership (issue #20 item 1; docs/membership.md).

An island's leader (local index 0) is its one member of the job's epochs (IslandLeader, a Membership):
admission, heartbeat-checked epochs, joins at round boundaries, as for a one-worker island. The island's k
workers share a local gloo group, the default process group of each of them (PrefixStore
"island/<index>.<incarnation>/pg" on the job's authenticated store), which the inner strategy (DDP, ZeRO-1)
uses every step.

The outer strategy's cross-island Comm on every worker of the island is an IslandComm: on the leader a
collective runs on the ElasticComm (fail-over, retries and all) and its result is then broadcast over the
local group with a small header (the island's rank, the number of member islands, the epoch); a follower
takes both from that broadcast. Inner DDP keeps the island's replicas bit-identical, so the leader's input
stands for the island's and every worker of the island holds the leader's result bit for bit: exact.
Gossip's point-to-point round (`exchange_planned`) is relayed the same way: the leader's plan and what arrived.

With fsdp inside, worker j of an island holds shard j of every parameter and its outer strategy works on that
shard alone, so the leader's tensors no longer stand for the island. The outer strategy then talks to a SlotComm
(`IslandComm.per_slot`), which packs the island's shard vectors for the leader's one collective and gives each
worker its own slot of the result: worker j meets worker j of every other island, as the fixed world's "cross"
group pairs them. A join serves the island's whole state: a holder's followers build it with their leader
(`island_state`), and a restarted island's workers each load the global model and their own slot (hand_over).

Exchanges in flight across steps (DiLoCo tau > 0, streaming fragments) run on the strategy's exchange thread
while the training thread's DDP all-reduces go on over the local group. Two threads issuing collectives on one
gloo group would interleave them differently on different workers, so a relay from any thread but the one that
built the IslandComm goes over a second local group (`side`), made beside the first on every worker of the
island; the exchange thread is one thread that runs exchanges in call order, so the side group's order is the
same on every worker too.

A worker that dies breaks the local group: its mates fail at their next local collective (gloo reports a
closed connection at once) and exit non-zero; the launcher stops the rest of the island, the leader's
dead flag makes the other islands fail over without it, and the launcher starts the island again (a new
incarnation: new names, a new local group) while `max_restarts` allows. The new leader is admitted as any
joiner, receives the global state in its strategy's wrap, and hands it to its followers (IslandLeader.enter,
IslandFollower.enter) before the island trains.

A follower that stops without dying (SIGSTOP, cut off, a main thread that holds the GIL) breaks nothing that
gloo sees: its leader waits in the local collective while its own heartbeat beats on, so the other islands
would wait for it until their collective timeout. The leader's FollowerWatch reads its followers' heartbeats
and, when one is silent past the heartbeat timeout or reported dead, reports the leader itself dead: the
members fail over without the island then, with or without a launcher (one killed, or islands started by
hand), and the launcher's own reaper, when there is one, stops and restarts the island.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from islands.runtime.comm import CommLedger
from islands.runtime.contracts import Collectives, ElasticCollectives, ElasticParticipant
from islands.runtime.elastic import (
    ElasticComm,
    Epochs,
    Membership,
    StateTransfer,
    counted_rounds,
    global_digest,
    state_digest,
    take_part,
)
from islands.runtime.elastic.membership import Liveness
from islands.runtime.elastic.starvation import PROC_KEY, Starvation, local_pid

ISLAND_ENV = "ISLANDS_ISLAND"  # "INDEX,LOCAL,SIZE,INCARNATION": the launcher's placement of one island worker
# between a leader's looks at its followers' heartbeats (Liveness wants < timeout / 2); each look is ~3 store
# reads per follower, and an etcd store on a 2-core machine shared with the workers feels every request
FOLLOWER_LOOK_S = 0.25
RELAY_KIND = "island_relay"  # ledger kind of the leader's local broadcasts (not cross-island traffic)


class IslandBroken(RuntimeError):
    """A worker of this island is gone (the local group failed): the island leaves the job."""

    exit_code = 1


@contextmanager
def island_collective(where: str = "local group", then: str = "; the island leaves the job"):
    """Around a collective on an island's own group: a worker of it that is gone (killed with its island, or its
    leader) fails it at once (gloo's closed connection), and the island then leaves as a whole: IslandBroken, one
    line naming `where` and the error's first line, followed by `then`."""
    try:
        yield
    except IslandBroken:
        raise
    except (RuntimeError, dist.DistError) as e:
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise IslandBroken(f"a worker of this island is gone ({where}: {first}){then}") from None


@dataclass(frozen=True)
class IslandPlace:
    """Where the launcher put one worker: island `index`, local index `local` of `size`, started for the
    `incarnation`-th time (0 first, then one per restart)."""

    index: int
    local: int
    size: int
    incarnation: int = 0

    def __post_init__(self):
        for key in ("index", "local", "incarnation"):
            if getattr(self, key) < 0:
                raise ValueError(f"island {key} must be >= 0; got {getattr(self, key)}")
        if self.size < 1 or self.local >= self.size:
            raise ValueError(f"island local index {self.local} must be below its size {self.size} (>= 1)")

    @property
    def leader(self) -> bool:
        return self.local == 0

    @property
    def tag(self) -> str:
        """The store prefix of this incarnation's local group: a restart never meets a dead one's keys."""
        return f"island/{self.index}.{self.incarnation}"

    def name(self, local: int | None = None) -> str:
        return worker_name(self.index, self.local if local is None else local, self.size, self.incarnation)

    def to_env(self) -> str:
        return f"{self.index},{self.local},{self.size},{self.incarnation}"

    @classmethod
    def from_env(cls, text: str | None) -> IslandPlace | None:
        if not text:
            return None
        try:
            parts = [int(p) for p in text.split(",")]
            if len(parts) != 4:
                raise ValueError
        except ValueError:
            raise ValueError(f"{ISLAND_ENV} must be INDEX,LOCAL,SIZE,INCARNATION (integers); got {text!r}") from None
        return cls(*parts)


JOINING = 1  # a header's `extra` at a round boundary: joiners enter now (followers settle their saves first)


def island_workers(leader: str, size: int) -> list[str]:
    """The names of the workers of the island whose leader is `leader` (worker_name's inverse)."""
    if size == 1:
        return [leader]
    base, _, inc = leader.partition(".")
    if not (base.startswith("i") and base.endswith("w0") and base[1:-2].isdigit() and (not inc or inc.isdigit())):
        raise ValueError(f"{leader!r} is not the name of an island's leader (i<index>w0[.<incarnation>])")
    return [worker_name(int(base[1:-2]), local, size, int(inc or 0)) for local in range(size)]


def worker_name(index: int, local: int, size: int, incarnation: int = 0) -> str:
    """w<i> (one-worker islands, as before) or i<i>w<l>; a restart appends .<incarnation>: names are never
    reused, so the coordinator admits the restarted leader as a new worker."""
    base = f"w{index}" if size == 1 else f"i{index}w{local}"
    return base if incarnation == 0 else f"{base}.{incarnation}"


def local_timeout(collective_timeout: float, heartbeat_timeout: float) -> float:
    """How long a local collective may wait. A follower waits in the relay while its leader's exchange fails
    over (up to one collective timeout for the failed attempt, one for the new epoch to form, one to
    connect) and DDP's next all-reduce waits while the leader serves a joiner; a dead mate is not found by
    this timeout (gloo sees the closed connection, the launcher the exit or the stale heartbeat)."""
    return 4 * collective_timeout + 2 * heartbeat_timeout


class IslandComm:
    """The cross-island Comm of one worker of a k-worker island (module docstring).

    `cross`: the leader's Comm over the member islands (an ElasticComm in a job; any Comm in tests), None on a
    follower. `group`: the island's local process group (None: the default group). `rank` and `size` are the
    island's rank among the member islands and their count, as of the latest collective (a follower learns
    them from the leader's header). `side`: the island's second local group, for relays from another thread
    than the one that built this (module docstring; None: such relays are refused)."""

    elastic = True  # strategies read this to refuse what churn would break (contracts.Collectives)

    def __init__(self, cross: Collectives | None, ledger: CommLedger, group=None, on_change=None, side=None):
        self.cross, self.ledger, self.group, self.on_change, self.side = cross, ledger, group, on_change, side
        self._rank, self._size, self._epoch = 0, 0, -1
        self._named: int | None = None  # the epoch whose member names were last relayed
        self.names: list[str] = []  # the member islands' leaders, in rank order (as the leader last relayed)
        self._home = threading.get_ident()
        self._away: int | None = None  # the one other thread that relays over `side`
        # inner fsdp: each worker holds its own shard, so the leader's tensors no longer speak for the island
        # (per_slot); the joins' state is then the island's, built by all its workers (island_state)
        self.sharded = False

    @property
    def leader(self) -> bool:
        return self.cross is not None

    @property
    def rank(self) -> int:
        if (cross := self.cross) is not None:  # the leader
            return cross.rank if cross.size else 0
        return self._rank

    @property
    def size(self) -> int:
        return self.cross.size if self.cross is not None else self._size

    @property
    def epoch(self) -> int:
        if (cross := self.cross) is None:  # a follower
            return self._epoch
        return 0 if cross.epoch is None else cross.epoch  # a fixed-group cross (tests) has no epochs

    # ---- the relay --------------------------------------------------------------------------------
    def _local(self):
        """The local group this thread relays over: `group` on the building thread, `side` on the one other."""
        me = threading.get_ident()
        if me == self._home:
            return self.group
        if self.side is None:
            raise RuntimeError(
                "this island relay has no side group, so it relays only on the thread that built it; "
                "an exchange in flight on another thread needs one (world.py makes it)"
            )
        if self._away is None:
            self._away = me
        elif self._away != me:
            raise RuntimeError(
                "an island relay serves two threads at most (training and one exchange thread): the "
                "order of collectives on its side group would differ between workers"
            )
        return self.side

    def _bcast(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        self.ledger.record(RELAY_KIND, nbytes if self.leader else 0, 0 if self.leader else nbytes)
        with island_collective():
            dist.broadcast(tensor, group=self._local(), group_src=0)
        return tensor

    def sync(self, extra: int = 0) -> int:
        """Leader: send the header (rank, size, epoch, `extra`); follower: receive it. Returns `extra`. When the
        epoch is new to this relay, the members' names follow (a checkpoint's parts are named after them)."""
        head = (
            torch.tensor([self.rank, self.size, self.epoch, extra], dtype=torch.int64)
            if self.leader
            else torch.zeros(4, dtype=torch.int64)
        )
        self._bcast(head)
        rank, size, epoch, extra = (int(v) for v in head.tolist())
        if not self.leader:
            changed = (rank, size) != (self._rank, self._size)
            self._rank, self._size, self._epoch = rank, size, epoch
            if changed and self.on_change is not None:
                self.on_change(rank, size)
        if epoch != self._named:  # decided from the header alone: leader and followers relay alike
            self._named = epoch
            # a fixed-group cross (tests) names no members
            cross = self.cross
            # an elastic cross is an ElasticCollectives (contracts), which names its members
            names = list(cast(ElasticCollectives, cross).names) if cross is not None and cross.elastic else []
            self.names = list(self.relay_object(names if self.leader else None))
        return extra

    def worker_names(self, k: int) -> list[str]:
        """Every worker of the member islands in global rank order (island rank * k + local index)."""
        return [name for leader in self.names for name in island_workers(leader, k)]

    def relay_object(self, obj=None):
        """The leader's `obj` on every worker of the island (pickled; bookkeeping and the joiner's state)."""
        box = [obj if self.leader else None]
        with island_collective():
            dist.broadcast_object_list(box, group=self._local(), group_src=0)
        return box[0]

    def gather_object(self, obj) -> list | None:
        """Every worker's `obj` on the leader, in local order (None on a follower)."""
        out = [None] * dist.get_world_size(self.group) if self.leader else None
        with island_collective():
            dist.gather_object(obj, out, group=self._local(), group_dst=0)
        return out

    def scatter_object(self, objs: list | None = None):
        """The leader's objs[j] on worker j of the island (objs: one per worker, in local order; None on a follower)."""
        box = [None]
        with island_collective():
            dist.scatter_object_list(box, objs if self.leader else None, group=self._local(), group_src=0)
        return box[0]

    def per_slot(self) -> SlotComm:
        """The cross-island Comm of a sharded island (inner fsdp): worker j meets worker j of every other island,
        as the "cross" group of a fixed world has it (SlotComm)."""
        self.sharded = True
        return SlotComm(self)

    # ---- the Comm interface -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce") -> torch.Tensor:
        if self.cross is not None:  # the leader
            self.cross.all_reduce(tensor, op=op, kind=kind)
        self.sync()
        return self._bcast(tensor)

    def all_gather(self, tensor: torch.Tensor, kind: str = "all_gather") -> list[torch.Tensor]:
        tensor = tensor.contiguous()
        if self.cross is not None:  # the leader
            parts = self.cross.all_gather(tensor, kind=kind)
            stacked = torch.stack([p.reshape(tensor.shape) for p in parts])
            self.sync(len(parts))
        else:
            stacked = torch.empty((self.sync(), *tensor.shape), dtype=tensor.dtype)
        return list(self._bcast(stacked).unbind(0))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, kind: str = "broadcast") -> torch.Tensor:
        if self.cross is not None:  # the leader
            self.cross.broadcast(tensor, src=src, kind=kind)
        self.sync()
        return self._bcast(tensor)

    def exchange_planned(self, plan, like: torch.Tensor, kind: str = "p2p"):
        """Gossip's round (ElasticComm.exchange_planned): the leader runs it over the member islands with `plan`;
        every worker of the island gets (what arrived {peer: tensor}, send_to, recv_from) of the committed attempt.
        A follower's `plan` is never called: its payload is the leader's, bit for bit."""
        if self.cross is not None:  # the leader; gossip runs only over an elastic cross (an ElasticCollectives)
            cross = cast(ElasticCollectives, self.cross)
            got, send_to, recv_from = cross.exchange_planned(plan, like=like, kind=kind)
            self.sync()
            self.relay_object((list(send_to), list(recv_from)))
            stacked = (
                torch.stack([got[p].reshape(like.shape) for p in recv_from])
                if recv_from
                else torch.empty((0, *like.shape), dtype=like.dtype)
            )
        else:
            self.sync()
            send_to, recv_from = self.relay_object()
            stacked = torch.empty((len(recv_from), *like.shape), dtype=like.dtype)
        if recv_from:
            self._bcast(stacked)
        return dict(zip(recv_from, stacked.unbind(0))), list(send_to), list(recv_from)

    def all_gather_object(self, obj) -> list:
        """Bookkeeping over every worker of every member island, in global rank order (island rank, then local
        index): the run record's per-rank ledgers."""
        group = self._local()
        mine = [None] * dist.get_world_size(group)
        with island_collective(then=""):
            dist.all_gather_object(mine, obj, group=group)
        flat = None
        if self.cross is not None:  # the leader
            per_island = self.cross.all_gather_object(mine)
            flat = [o for island in per_island for o in island]
        self.sync()
        return self.relay_object(flat)


class SlotComm:
    """The cross-island Comm of every worker of a sharded island (inner fsdp; IslandComm.per_slot).

    Under fsdp worker j of an island holds shard j of every parameter, and an outer strategy exchanges per shard:
    worker j's vector meets worker j's of every other island (in a fixed world, over the "cross" group). Only the
    leader is a member of the job, so each collective packs the island's vectors in local order (an all-gather
    over the local group, each padded to the longest), the leader runs it once on the packed vector over the
    member islands (IslandComm: fail-over and all), the relay brings the packed result back, and each worker
    keeps its own slot. Every island has the same model and k, so slot j has the same length on every island
    and an elementwise collective of the packed vectors is the per-slot one, bit for bit."""

    elastic = True

    def __init__(self, island: IslandComm):
        self.island = island

    rank = property(lambda self: self.island.rank)
    size = property(lambda self: self.island.size)
    epoch = property(lambda self: self.island.epoch)
    names = property(lambda self: self.island.names)

    def _pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """(the island's vectors in local order, where this worker's starts, where it ends)."""
        flat = tensor.detach().contiguous().reshape(-1)
        group = self.island._local()
        k, me = dist.get_world_size(group), dist.get_rank(group)
        with island_collective():
            counts = [torch.zeros(1, dtype=torch.int64) for _ in range(k)]
            dist.all_gather(counts, torch.tensor([flat.numel()], dtype=torch.int64), group=group)
            lengths = [int(n.item()) for n in counts]
            padded = flat.new_zeros(max(lengths))
            padded[: flat.numel()] = flat
            parts = [torch.empty_like(padded) for _ in range(k)]
            dist.all_gather(parts, padded, group=group)
        nbytes = padded.numel() * padded.element_size()
        self.island.ledger.record(RELAY_KIND, nbytes, nbytes * (k - 1))
        lo = sum(lengths[:me])
        return torch.cat([p[:n] for p, n in zip(parts, lengths)]), lo, lo + flat.numel()

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce") -> torch.Tensor:
        packed, lo, hi = self._pack(tensor)
        self.island.all_reduce(packed, op=op, kind=kind)
        tensor.view(-1).copy_(packed[lo:hi])
        return tensor

    def all_gather(self, tensor: torch.Tensor, kind: str = "all_gather") -> list[torch.Tensor]:
        packed, lo, hi = self._pack(tensor)
        return [p[lo:hi].reshape(tensor.shape) for p in self.island.all_gather(packed, kind=kind)]

    def broadcast(self, tensor: torch.Tensor, src: int = 0, kind: str = "broadcast") -> torch.Tensor:
        packed, lo, hi = self._pack(tensor)
        self.island.broadcast(packed, src=src, kind=kind)
        tensor.view(-1).copy_(packed[lo:hi])
        return tensor

    def all_gather_object(self, obj) -> list:
        return self.island.all_gather_object(obj)

    def exchange_planned(self, plan, like, kind: str = "p2p"):
        raise TypeError("gossip is not wired for sharded parameters (inner fsdp); use diloco")


ISLAND_SLOTS = "island_slots"  # a sharded island's strategy state: every worker's own, in local order


def island_state(island: IslandComm, strategy, model, step: int) -> dict | None:
    """Collective over a sharded island (every worker calls it): what its leader serves a joiner. The global model
    whole (the inner strategy's eval_model gathers it) and every worker's own strategy state (DiLoCo's flat vectors
    and outer optimizer state are its shard's), gathered to the leader in local order; None on a follower."""
    full = {k: v.detach().clone() for k, v in strategy.eval_model(model).state_dict().items()}
    slots = island.gather_object(strategy.state_dict())
    return {"model": full, "strategy": {ISLAND_SLOTS: slots}, "step": int(step)} if island.leader else None


def rounds_of(participant: ElasticParticipant | None) -> int:
    """Rounds the outer strategy (the membership's participant) completed: the same on every worker of an island,
    so leader and followers meet in the same step's relay."""
    return 0 if participant is None else int(participant.rounds)


def hand_over(
    island: IslandComm,
    strategy,
    model,
    step: int,
    received: dict | None = None,
    participant: ElasticParticipant | None = None,
) -> tuple[int, str | None]:
    """After the leader's enter: every worker of the island loads the leader's global model, strategy state and
    step (a joiner's leader has just received them from the members; a first island's workers already agree,
    and the hand-over costs one local broadcast at the start). A sharded island hands over `received` (the
    leader's load_shared kept it: island_state's form) instead, each worker loading its own slot. Returns the step
    and, when a sharded island loaded a state, the digest of the global model its workers now hold together."""
    if island.sharded:
        return _hand_over_slots(island, strategy, model, step, received, participant)
    state = None
    if island.leader:
        state = {"model": strategy.eval_model(model).state_dict(), "strategy": strategy.state_dict(), "step": int(step)}
    island.sync()
    state = island.relay_object(state)
    if not island.leader:
        strategy.eval_model(model).load_state_dict(state["model"])
        strategy.load_state_dict(state["strategy"])
    return int(state["step"]), None


def _hand_over_slots(
    island: IslandComm, strategy, model, step: int, received: dict | None, participant: ElasticParticipant | None
) -> tuple[int, str | None]:
    """hand_over of a sharded island: no worker holds the island's state alone, so the leader relays what the
    members served (None for an island of the first epoch: its workers' shards already form the common start):
    the global model and step to every worker, strategy slot j to worker j only. Every worker loads them,
    collectively: the whole global model (FSDP writes each worker's slice), its own slot, then the joined hook
    (local <- global), as a one-worker joiner's transfer.load_state."""
    island.sync()
    head = None if received is None else {"model": received["model"], "step": received["step"]}
    head = island.relay_object(head if island.leader else None)
    if head is None:
        return int(step), None
    # the leader relayed head from `received`: past the return above, it has one
    mine = island.scatter_object(received["strategy"][ISLAND_SLOTS] if island.leader and received is not None else None)
    strategy.eval_model(model).load_state_dict(head["model"])
    strategy.load_state_dict(mine)
    if participant is not None:
        participant.joined()
    return int(head["step"]), global_digest(strategy.eval_model(model))


class FollowerWatch:
    """A leader's thread that reports the leader dead (dead/<leader>, with the reason) once one of `followers` is
    silent past `timeout_s` or reported dead, other than finished (module docstring). It looks only at followers
    that have beaten (a follower still starting has no hb key). A silent follower whose process runs on this
    machine, runnable but starved of CPU, is spared up to islands.runtime.elastic.starvation.LIMIT heartbeat
    timeouts, as the launcher's reaper spares it (the follower's heartbeat publishes its process identity under
    proc/<name>). The leader's own heartbeat is the control: its beats go through the same kind of client from the
    same machine, so while they too fail to land (a store re-electing its leader, a member cut off, every request
    walking the fail-over ladder) the store is what is silent, not the follower; a follower is convicted only once
    the store has carried the leader's beats for a whole timeout of its silence, or past
    islands.runtime.elastic.starvation.LIMIT timeouts of silence whatever the store did. After its one verdict it
    gives the process
    `exit_after_s` (default `timeout_s`) to fail by itself, then exits it (code 1, as IslandBroken would): the
    training thread may wait in the local collective with a stopped follower for minutes. stop() (the leader
    leaving) ends it.
    `store`: a client of its own (the training thread's may be blocked)."""

    def __init__(
        self, leader: str, followers: list[str], store, timeout_s: float, exit_after_s: float | None = None, out=None
    ):
        self.leader, self.followers, self.store = leader, list(followers), store
        self.exit_after_s = timeout_s if exit_after_s is None else exit_after_s
        self.liveness = Liveness(store, timeout_s)
        self.look_s = min(FOLLOWER_LOOK_S, timeout_s / 4)  # Liveness restarts its watch after a look > timeout / 2
        self.starvation = Starvation(timeout_s)
        self.out = sys.stderr if out is None else out
        self.verdict: str | None = None
        self._control: list[str] = []  # [the leader] once its own beat is in the store (it stays there)
        self._own_stalled_at: float | None = None  # the last look that found the leader's own beat stale
        self._excused: set[str] = set()  # followers whose silence was put down to the store (said once each)
        self._pids: dict[str, int | None] = {}  # follower -> its pid on this machine, once it published its identity
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="islands-follower-watch", daemon=True)

    def start(self) -> FollowerWatch:
        self._thread.start()
        return self

    def _pid(self, follower: str) -> int | None:
        """The follower's pid if its process runs on this machine (an island is one machine when the launcher
        places it; a follower started by hand elsewhere gets the plain timeout)."""
        if follower not in self._pids:
            key = PROC_KEY.format(follower)
            if not self.store.check([key]):
                return None  # not published yet: look again next time
            self._pids[follower] = local_pid(self.store.get(key))
        return self._pids[follower]

    def _waits_for_cpu(self, follower: str, now: float) -> bool:
        """A silent follower whose process is runnable but starved of CPU is spared, as the launcher's reaper
        spares it (islands.runtime.elastic.starvation), up to its limit of heartbeat timeouts."""
        pid = self._pid(follower)
        silent_for = self.liveness.silent_for(follower)
        starved = None if pid is None else self.starvation.waits_for_cpu(follower, pid, silent_for, now)
        if starved is not None and starved[2]:
            print(
                f"islands: {self.leader}: its follower {follower} is silent for {silent_for:.1f} s but its process "
                f"waits for a CPU (it used {starved[0]:.2f} s of CPU in {starved[1]:.1f} s); not leaving before "
                f"{self.starvation.limit * self.liveness.timeout:.1f} s of silence",
                file=self.out,
                flush=True,
            )
        return starved is not None

    def _store_was_silent(self, follower: str, now: float) -> bool:
        """The leader's own beats stalled within the last timeout, and the follower is silent for less than the
        starvation limit: the store, not the follower, may be what went quiet (class docstring)."""
        if self._own_stalled_at is None or now - self._own_stalled_at > self.liveness.timeout:
            return False
        silent_for = self.liveness.silent_for(follower)
        if silent_for > self.starvation.limit * self.liveness.timeout:
            return False
        if follower not in self._excused:
            self._excused.add(follower)
            print(
                f"islands: {self.leader}: its follower {follower} is silent for {silent_for:.1f} s, but this "
                f"leader's own heartbeat stalled {now - self._own_stalled_at:.1f} s ago: the store is slow, not "
                f"the follower; not leaving before the store has carried {self.liveness.timeout:.1f} s of beats "
                f"or {self.starvation.limit * self.liveness.timeout:.1f} s of silence",
                file=self.out,
                flush=True,
            )
        return True

    def look(self) -> str | None:
        """One look: the reason to report the leader dead, or None."""
        flagged = [f for f in self.followers if self.store.check([f"dead/{f}"])]
        for f in flagged:
            flag = self.store.get(f"dead/{f}")
            if flag != b"finished":  # finished: it ended the job with its leader, nothing to report
                why = f"reported dead ({flag.decode(errors='replace')})"
                return f"its follower {f} is {why}: the island cannot take part"
        beating = [f for f in self.followers if f not in flagged and self.store.check([f"hb/{f}"])]
        now = time.monotonic()
        for f in beating:
            pid = self._pid(f)
            if pid is not None:
                self.starvation.sample(f, pid, now)
        if not self._control and self.store.check([f"hb/{self.leader}"]):  # none yet: a watch in a test
            self._control = [self.leader]
        silent = self.liveness.silent(beating + self._control) - {self.leader}
        if self._control and self.liveness.silent_for(self.leader) > self.liveness.timeout / 4:
            self._own_stalled_at = now
        for f in sorted(silent):
            if not self._store_was_silent(f, now) and not self._waits_for_cpu(f, now):
                return (
                    f"its follower {f} is silent for {self.liveness.silent_for(f):.1f} s: the island cannot take part"
                )
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.look_s):
            try:
                why = self.look()
                if why is not None and not self._stop.is_set():
                    if not self.store.check([f"dead/{self.leader}"]):
                        self.store.set(f"dead/{self.leader}", why)
                    self.verdict = why
                    break
            except Exception:  # noqa: BLE001 - the store is gone: the job is over, the training thread sees it too
                return
        # the training thread waits in the local collective with the silent follower (up to local_timeout, minutes)
        # and the members no longer wait for this island: give it a heartbeat timeout to fail by itself (a killed
        # follower breaks gloo's connection at once), then end the process as the launcher would
        if self.verdict is not None and not self._stop.wait(self.exit_after_s):
            print(f"islands: {self.leader}: {self.verdict}; leaving the job", file=sys.stderr, flush=True)
            os._exit(1)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)


class IslandTransfer(StateTransfer):
    """The state transfer of an island's leader. A sharded island (inner fsdp): its state is spread over its workers,
    so a holder's leader builds what it serves together with its followers (they call island_state in at_step when
    told JOINING), and a joining leader keeps what it received until its island's workers load it together
    (hand_over). `island`: the leader's relay (IslandLeader.join_island)."""

    def __init__(self, comm: ElasticComm, participant):
        super().__init__(comm, participant)
        self.island: IslandComm | None = None
        self._snapshot: dict | None = None
        self._snapshot_digest: str | None = None
        self._received: dict | None = None

    def _relay(self) -> IslandComm:
        assert self.island is not None, "IslandLeader.join_island sets the relay before the leader takes part in a join"
        return self.island

    def take_received(self) -> dict | None:
        """What a sharded island's joining leader received and kept for hand_over (None otherwise), once."""
        received, self._received = self._received, None
        return received

    def share_state(self, strategy, model, step: int, holders: set[str]) -> int:
        if self._relay().sharded and self.comm.epochs.name in holders:
            self._snapshot = island_state(self._relay(), strategy, model, step)
        try:
            return super().share_state(strategy, model, step, holders)
        finally:
            self._snapshot_digest = None if self._snapshot is None else state_digest(self._snapshot["model"])
            self._snapshot = None

    def snapshot(self, strategy, model, step: int) -> dict:
        if not self._relay().sharded:
            return super().snapshot(strategy, model, step)
        assert self._snapshot is not None, "a holder serves only inside share_state, which built its snapshot"
        return self._snapshot

    def load_shared(self, strategy, model, state: dict) -> int:
        if not self._relay().sharded:
            return super().load_shared(strategy, model, state)
        self._received = state
        return int(state["step"])

    def global_sha(self, strategy, model) -> str | None:
        """Sharded: gathering the global model is a collective of the island, which its followers are not in at the
        join (the holder's digest is its snapshot's) nor at entry (what arrived; enter replaces it once loaded)."""
        if not self._relay().sharded:
            return super().global_sha(strategy, model)
        return self._snapshot_digest if self._received is None else state_digest(self._received["model"])


class IslandLeader(Membership):
    """The membership of an island's leader: as any member's (its ElasticComm is the island's one member of the
    job's epochs), and after `enter` (a joiner receives the global state there) and after each round boundary's
    admissions (`at_step`) it relays to its followers over its IslandComm (`island`, from join_island)."""

    transfer: IslandTransfer  # the one __init__ passes

    def __init__(self, epochs: Epochs, comm: ElasticComm):
        super().__init__(epochs, comm, IslandTransfer(comm, lambda: self.participant))
        self.island: IslandComm | None = None
        self.place: IslandPlace | None = None
        self.follower_watch: FollowerWatch | None = None
        self._island_round: int | None = None  # the rounds at the latest relay of the members to the followers
        # first of the things done before joiners enter (a checkpoint driver's settle comes after): the followers
        # are told (a JOINING header), so that they finish the step's save with their leader before the epoch changes
        self.before_join.append(self._tell_joining)

    def _relay(self) -> IslandComm:
        assert self.island is not None, "the launcher's worker calls join_island before the leader trains"
        return self.island

    def _place(self) -> IslandPlace:
        assert self.place is not None, "the launcher's worker calls join_island before the leader trains"
        return self.place

    def _tell_joining(self) -> None:
        self._relay().sync(JOINING)

    def join_island(self, place: IslandPlace, side=None) -> IslandComm:
        """The leader of the island at `place`: its relay to its followers over the island's local groups."""
        self.place = place
        self.island = self.transfer.island = IslandComm(self.comm, self.comm.ledger, side=side)
        return self.island

    def watch_followers(self) -> None:
        """Start the FollowerWatch over this island's followers, on a store client of its own."""
        followers = island_workers(self.name, self._place().size)[1:]
        store = self.new_client() if self.new_client is not None else self.store
        self.follower_watch = FollowerWatch(self.name, followers, store, self.liveness.timeout).start()

    def leave(self) -> None:
        if self.follower_watch is not None:  # the followers stop beating as they finish
            self.follower_watch.stop()
        super().leave()

    def enter(self, strategy, model) -> int:
        step = super().enter(strategy, model)
        self.store.set(f"{self._place().tag}/entered", str(step))  # followers wait on it, not in a collective
        received = self.transfer.take_received()
        step, digest = hand_over(self._relay(), strategy, model, step, received, self.participant)
        self._island_round = rounds_of(self.participant)  # after a sharded island's workers loaded the members' counter
        if digest is not None:
            # the entry event tells what the island holds now, not only what arrived; the round it entered at is
            # the members' (the next boundary must not take this join for a new one)
            self._last_round = counted_rounds(self.participant)
            self.events[-1].update(global_sha256=digest, round=self._last_round)
        return step

    def at_step(self, strategy, model, step: int) -> None:
        super().at_step(strategy, model, step)
        rounds = rounds_of(self.participant)
        if rounds != self._island_round:  # members may have changed: tell the followers
            self._island_round = rounds
            self._relay().sync()

    def end_served(self, final: Callable[[], dict]) -> None:
        """A served job's end (contracts.ServedEnd): the members' end (a member that puts joiners in tells its
        followers JOINING first: before_join), then the followers learn the last epoch (a restarted island's leader
        enters it only now), so that the end-of-run collectives agree on its size (IslandFollower.end_served)."""
        super().end_served(final)
        self._relay().sync()


class IslandFollower:
    """What a follower (local index > 0) has for `world.membership`: it holds the strategy's place like a
    Membership (claim/enter/at_step, and a served job's end_served), takes everything from its leader over the
    local group, and is never a member of the job's epochs itself."""

    def __init__(
        self,
        name: str,
        place: IslandPlace,
        island: IslandComm,
        store,
        liveness,
        heartbeat=None,
        job=None,
        new_client=None,
    ):
        self.name, self.place, self.island, self.store = name, place, island, store
        self.liveness, self.heartbeat, self.job = liveness, heartbeat, job
        self.new_client = new_client  # a store client of its own for the checkpoint persist thread
        self.holder = None
        self.participant: ElasticParticipant | None = None
        self.control_plane = None  # its leader's session counts the control plane
        self.before_join: list = []
        self.events: list[dict] = []
        self.syncs: list[dict] = []
        self.members: list = []
        self._island_round: int | None = None

    @property
    def epoch(self) -> int:
        return self.island.epoch

    @property
    def names(self) -> list[str]:
        return self.island.names

    def new_liveness(self, client) -> Liveness:
        """A liveness check through `client` (one of new_client's), with this job's heartbeat timeout."""
        return Liveness(client, self.liveness.timeout)

    def claim(self, strategy) -> bool:
        if self.holder is None:
            self.holder = strategy
        return self.holder is strategy

    def participate(self, participant: ElasticParticipant) -> None:
        self.participant = take_part(self.participant, participant)

    def authenticate(self, token: str, job_id: str | None = None) -> None:
        """Nothing to do: a follower sends nothing across islands (its leader tags what does)."""

    def enter(self, strategy, model) -> int:
        """Wait (on the store, for as long as the leader waits for admission) until the leader entered, then
        load what it hands over."""
        leader = self.place.name(0)
        key = f"{self.place.tag}/entered"
        while not self.store.check([key]):
            if self.liveness.gone([leader]):
                raise IslandBroken(f"{self.name}: the island's leader {leader} is gone before it entered the job")
            time.sleep(0.05)
        step, digest = hand_over(self.island, strategy, model, 0, participant=self.participant)
        self._island_round = rounds_of(self.participant)  # after loading: a joiner's counter is the members'
        self.events.append(
            {
                "type": "entered",
                "via": leader,
                "step": step,
                "epoch": self.island.epoch,
                "time": time.time(),
                **({"global_sha256": digest} if digest else {}),
            }
        )
        return step

    def at_step(self, strategy, model, step: int) -> None:
        rounds = rounds_of(self.participant)
        if self._island_round is None:
            self._island_round = rounds
        if rounds != self._island_round:
            self._island_round = rounds
            if self.island.sync() == JOINING:  # the leader settles its saves now: the same ones as here
                for settle in self.before_join:
                    settle()
                if self.island.sharded:  # the leader serves the island's state, which its workers hold together
                    island_state(self.island, strategy, model, step)
                self.island.sync()

    def end_served(self, final: Callable[[], dict]) -> None:
        """A served job's end (contracts.ServedEnd): `final` takes the service's final answer from the leader (the
        parameter server's relay), then the leader tells the last epoch (IslandLeader.end_served); a leader that
        puts joiners into it tells JOINING first (its before_join), and the saves here settle as at a boundary."""
        facts = final()
        self.events.append({"type": "served_end", "time": time.time(), **facts})
        if self.island.sync() == JOINING:
            for settle in self.before_join:
                settle()
            self.island.sync()

    def state_dict(self) -> dict:
        return {"epoch": self.island.epoch, "members": [], "events": list(self.events), "leader": self.place.name(0)}

    def load_state_dict(self, state: dict) -> None:
        pass

    def leave(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        try:
            self.store.set(f"dead/{self.name}", "finished")
        except dist.DistNetworkError:
            pass
