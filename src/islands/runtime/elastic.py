"""ElasticComm: the Comm interface over a gloo process group that is rebuilt when membership changes.

Members of epoch e share ProcessGroupGloo(PrefixStore("pg/<e>", store)). Every collective is one
numbered operation (e, seq) that commits only when every member reports success in the store:
  1. run it on the group, watching for a failed peer: a gloo error, a dead/<name> flag from a
     supervisor, a heartbeat stale past heartbeat_timeout, or another member's "fail" verdict;
  2. each member sets its own signed e/<e>/s/<seq>/ok/<name>; one that sees all of them sets the
     verdict "ok" (compare-and-set), anyone who sees a failure first sets "fail" (compare-and-set:
     exactly one verdict wins). The store is an AuthStore (islands.runtime.auth): values written
     without the job token are not seen;
  3. on "fail" every survivor aborts the group, forms epoch e+1 (below) and retries the same
     operation from its saved input. A committed operation is never redone, so nothing already
     synchronised is lost, and survivors never restart.
Forming epoch e: each candidate registers e/<e>/reg/<name>; once every candidate has registered or
is gone (Liveness), the first to notice writes e/<e>/members by compare-and-set. Ranks follow
admission order (slot), so the lowest surviving slot is rank 0.
Joins happen only at a round boundary. The strategy the loop drives (a Stack, or an outer strategy
used alone) holds the membership: the first strategy whose wrap runs in an elastic world claims it
(`claim`), calls `enter` at the end of its wrap and `at_step` at the start of every step's hooks
(after backward). At the first `at_step` after the outer round counter moved, the members agree on
which ready joiners enter, form the next epoch with them, and the joiners fetch the lowest-ranked old
member's {"model", "strategy", "step"} in checksummed chunks from every old member
(islands.runtime.recovery; `state_transfer = "broadcast"`: one gloo broadcast of torch.save bytes
instead). A joiner's `enter` blocks until the members put it in an epoch and loads what they sent, so its wrap returns with the global model, the strategy
state and the step its loop starts at. The hook sits after backward rather than at the end of the
round's after_step so that the step's own checkpoint (saved after after_step) is already taken: only
saves still in flight have to finish first (`before_join`).

Exchanges in flight across steps (issue #20 item 4: DiLoCo with tau > 0, streaming DiLoCo): the outer strategy
runs them on its exchange's one background thread, and each of their collectives is an operation as above, so a
death while one is in flight fails it over like any other: the survivors retry it from its saved input in the
next epoch and land the same result at the same step. Only that thread issues collectives while exchanges are
in flight (everything else waits behind them: the strategy's `in_order`). A join first lets them finish
(`settle` on the outer part), so the new epoch never forms under an operation in flight, and the joiner
receives their results with the strategy state (DiLoCo's `inflight`): it lands them at the same steps as the
members. After loading, the joiner's `joined` hook restarts its local model from the global one (a copy of
the holder's local work would be counted twice). Gossip (`exchange_planned`): a round's peers come from the
topology over the ranks of the epoch the round commits in, so a retried round re-plans with the survivors.

Authenticated payloads (`outer.authenticate`, `authenticate`): every tensor an operation sends carries an HMAC
tag (islands.runtime.payload_auth.PayloadTags) under a key from the job's token and id, binding the kind, the
operation's key e/<epoch>/s/<seq> (every member's the same; a retry in a new epoch tags anew under the new key),
the sender's name (stable across epochs), the receiver's name for point to point, dtype, shape and bytes. An
all-reduce then runs as an all-gather of tagged contributions that each member checks and sums itself in rank
order. Checks run after the bytes land and before the member's "ok": a contribution that fails sets the
verdict "fail" (so no member commits that operation, and nothing tampered is used) and raises
PayloadAuthError naming the sender and the operation; that worker leaves, and the others retry without it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import io
import json
import os
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from islands.runtime import recovery
from islands.runtime.comm import CommLedger, gather_objects
from islands.runtime.contracts import ElasticParticipant, Holder
from islands.runtime.membership import (JOB_ENDED_EXIT_CODE, Admission, Heartbeat, JobSpec, Liveness, get_json,
                                        no_member_alive, wait_key)
from islands.runtime.payload_auth import PayloadAuthError, PayloadTags, combine_in_order, elastic_tags


# Seconds past the heartbeat timeout a joiner waits, with no member of the newest epoch alive, before it
# calls the job over: the last members' final writes land, and one false death alone does not end a wait.
ADMIT_LINGER_S = 2.0


class Excluded(RuntimeError):
    """This process was dropped from the membership (its heartbeat went stale while it was away)."""

    exit_code = 1


class JobEnded(RuntimeError):
    """The job finished (its store went away) before admitting this joiner."""

    exit_code = JOB_ENDED_EXIT_CODE


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ElasticComm:
    POLL = 0.005  # seconds between checks of a running collective (store round trip is ~0.2 ms)
    elastic = True  # strategies read this to refuse what churn would break (contracts.Collectives)
    control_plane = None  # the job session, set by islands.runtime.world.join_elastic (run records)

    def __init__(self, store, name: str, ledger: CommLedger, heartbeat_timeout: float = 3.0,
                 collective_timeout: float = 120.0, on_change: Callable[[int, int], None] | None = None,
                 new_client: Callable[[], object] | None = None):
        self.store, self.name, self.ledger = store, name, ledger
        self.POLL = max(self.POLL, _store_attr(store, "poll_interval", 0.0))  # an etcd store asks for fewer reads
        # another client of the same store, for a thread of its own (checkpoint persists: elastic_saves)
        self.new_client = new_client
        # How a joiner receives the state: "chunks" (islands.runtime.recovery: checksummed chunks from every
        # holder over TCP, refetched when damaged) or "broadcast" (one gloo broadcast from the lowest holder)
        self.state_transfer = "chunks"
        self.transfers: list[dict] = []  # one FetchReport summary per state this process received in chunks
        self.liveness = Liveness(store, heartbeat_timeout)
        self.collective_timeout = collective_timeout
        self.on_change = on_change
        self.epoch, self.seq = -1, 0
        self.members: list[list] = []  # [slot, name, shard]
        self.pg = None
        self.epoch_base = 0  # epochs of the job this one resumed from (load_state_dict)
        self.events: list[dict] = []  # membership changes, with timings (for reports)
        self.syncs: list[dict] = []  # every committed operation: epoch, seq, kind, start, seconds
        self._last_round: int | None = None
        # An exchange failed over since the last round boundary: that boundary proposes no joiners (at_step)
        self.failed_over = False
        self._retired: list = []  # aborted groups, kept alive until exit (see _abort)
        self._connect_store = None  # _connect_client's
        # The strategy the loop drives: the first to claim() in its wrap; it shares and receives the state.
        self.holder = None
        # The outer strategy that counts the rounds joins wait for (participate(), from its wrap)
        self.participant: ElasticParticipant | None = None
        # Called before joiners enter: checkpoint drivers finish the saves in flight (a new epoch would abandon them).
        self.before_join: list[Callable[[], None]] = []
        # Set by islands.runtime.world.join_elastic: this process's heartbeat (stopped by leave), its admission
        # (slot, shard, initial) and the job it is in.
        self.heartbeat: Heartbeat | None = None
        self.admission: Admission | None = None
        self.job: JobSpec | None = None
        self.tags: PayloadTags | None = None  # set by authenticate: every operation's payloads are tagged

    def authenticate(self, token: str, job_id: str | None = None) -> None:
        """Tag and check every payload of this member's operations from now on (module docstring), under a key
        from `token` and the job's id (default: the job record's). Every member must call it, joiners too,
        before their first operation after entering; it trades nothing."""
        self.tags = elastic_tags(token, job_id if job_id is not None else (self.job.job_id if self.job else ""))

    def new_liveness(self, client) -> Liveness:
        """A liveness check through `client` (one of new_client's), with this job's heartbeat timeout."""
        return Liveness(client, self.liveness.timeout)

    # ---- Comm interface -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        return self.names.index(self.name)

    @property
    def names(self) -> list[str]:
        return [m[1] for m in self.members]

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce") -> torch.Tensor:
        if self.tags is not None:  # checked contributions, summed here in rank order
            self._gather_tagged(tensor, kind, lambda parts: tensor.copy_(combine_in_order(parts, op)))
            return tensor
        saved = tensor.detach().clone()

        def attempt(pg, rank, size):
            tensor.copy_(saved)
            self.ledger.record(kind, _nbytes(tensor), _nbytes(tensor))
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            return pg.allreduce([tensor], opts)

        # alone after a failed attempt: the sum of the survivors is this member's own input, not what the failed
        # attempt left in the tensor
        self._operate(kind, attempt, alone=lambda: tensor.copy_(saved))
        return tensor

    def all_gather(self, tensor: torch.Tensor, kind: str = "all_gather") -> list[torch.Tensor]:
        tensor = tensor.contiguous()
        out: list[torch.Tensor] = []
        if self.tags is not None:
            self._gather_tagged(tensor, kind, lambda parts: out.__setitem__(slice(None), parts))
            return out

        def attempt(pg, rank, size):
            out[:] = [torch.empty_like(tensor) for _ in range(size)]
            self.ledger.record(kind, _nbytes(tensor), (size - 1) * _nbytes(tensor))
            return pg.allgather([out], [tensor])

        self._operate(kind, attempt, alone=lambda: out.__setitem__(slice(None), [tensor.clone()]))  # not a failed try's
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0, kind: str = "broadcast") -> torch.Tensor:
        """`src` is a rank of the current epoch; after a rebuild the same rank number is used."""
        return self.broadcast_from(tensor, lambda: min(src, self.size - 1), kind)

    def broadcast_from(self, tensor: torch.Tensor, pick_src: Callable[[], int], kind: str = "broadcast"):
        if self.tags is not None:
            return self._broadcast_tagged(tensor, pick_src, kind)
        saved = tensor.detach().clone()

        def attempt(pg, rank, size):
            tensor.copy_(saved)
            src = pick_src()
            self.ledger.record(kind, _nbytes(tensor) if rank == src else 0, 0 if rank == src else _nbytes(tensor))
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            return pg.broadcast([tensor], opts)

        self._operate(kind, attempt, alone=lambda: tensor.copy_(saved))  # alone, it is its own source
        return tensor

    def exchange_planned(self, plan: Callable[[int, int], tuple[dict[int, torch.Tensor], list[int]]],
                         like: torch.Tensor, kind: str = "p2p") -> tuple[dict[int, torch.Tensor], list[int], list[int]]:
        """Point to point in one committed operation (gossip). `plan(rank, size)` -> (sends {peer: tensor},
        recv_from [peers]) over the ranks of the epoch the attempt runs in; a failed attempt is planned again
        with the survivors' ranks (a fixed peer list would name other workers after a change). Returns (what
        arrived {peer: tensor shaped like `like`}, send_to, recv_from) of the attempt that committed: the same
        plan on every member."""
        if self.tags is not None:
            return self._exchange_tagged(plan, like, kind)
        result: dict = {}

        def attempt(pg, rank, size):
            sends, recv_from = plan(rank, size)
            got = {p: torch.empty_like(like) for p in recv_from}
            result.update(got=got, send_to=sorted(sends), recv_from=list(recv_from))
            self.ledger.record(kind, sum(_nbytes(t) for t in sends.values()), sum(_nbytes(t) for t in got.values()))
            sent = [t.contiguous() for t in sends.values()]
            works = [pg.send([t], p, 0) for p, t in zip(sends, sent)] + [pg.recv([t], p, 0) for p, t in got.items()]
            return _Waited(works, keep=(sent, got))

        self._operate(kind, attempt, alone=lambda: result.update(got={}, send_to=[], recv_from=[]))
        return result["got"], result["send_to"], result["recv_from"]

    # ---- the same operations with tagged payloads (authenticate) ----------------------------------------
    def _op_key(self) -> str:
        """The key of the operation being attempted, the same on every member of the epoch."""
        return f"e/{self.epoch}/s/{self.seq}"

    def _open(self, packed: torch.Tensor, like: torch.Tensor, kind: str, sender: str, receiver: str = "") -> torch.Tensor:
        key = self._op_key()
        got = self.tags.open(packed, like, (kind, key, sender, receiver))
        if got is None:
            raise PayloadAuthError(
                f"the {kind} payload from member {sender} (operation {key}, epoch {self.epoch + self.epoch_base}) "
                "failed its MAC: it was altered, injected or replayed on the way, or its sender holds another token; "
                f"it was not used, the operation does not commit, and {self.name} leaves the job")
        return got

    def _gather_tagged(self, tensor: torch.Tensor, kind: str, use: Callable[[list[torch.Tensor]], Any]) -> None:
        """One operation that all-gathers every member's tagged `tensor`; `use` receives the contributions in rank
        order, each checked (this member's own as it is), before this member's ok. A retry packs the saved input
        again under its new operation key."""
        mine = tensor.detach().contiguous().clone()
        sent: list[torch.Tensor] = []
        parts: list[torch.Tensor] = []

        def attempt(pg, rank, size):
            sent[:] = [self.tags.pack(mine, (kind, self._op_key(), self.name, ""))]
            parts[:] = [torch.empty_like(sent[0]) for _ in range(size)]
            self.ledger.record(kind, _nbytes(sent[0]), (size - 1) * _nbytes(sent[0]))
            return pg.allgather([parts], sent)

        def landed():
            use([mine if n == self.name else self._open(p, mine, kind, n) for n, p in zip(self.names, parts)])

        self._operate(kind, attempt, alone=lambda: use([mine]), landed=landed)

    def _broadcast_tagged(self, tensor: torch.Tensor, pick_src: Callable[[], int], kind: str) -> torch.Tensor:
        mine = tensor.detach().contiguous().clone()
        sent: dict = {}

        def attempt(pg, rank, size):
            src = pick_src()
            buf = self.tags.pack(mine, (kind, self._op_key(), self.name, "")) if rank == src else PayloadTags.shell(mine)
            sent.update(src=src, buf=buf)
            self.ledger.record(kind, _nbytes(buf) if rank == src else 0, 0 if rank == src else _nbytes(buf))
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            return pg.broadcast([buf], opts)

        def landed():
            src = sent["src"]
            tensor.copy_(mine if self.rank == src else self._open(sent["buf"], mine, kind, self.names[src]))

        self._operate(kind, attempt, alone=lambda: tensor.copy_(mine), landed=landed)
        return tensor

    def _exchange_tagged(self, plan, like: torch.Tensor, kind: str):
        """exchange_planned with each message tagged for its receiver's name."""
        result: dict = {}

        def attempt(pg, rank, size):
            sends, recv_from = plan(rank, size)
            key, names = self._op_key(), self.names
            packed = {p: self.tags.pack(t, (kind, key, self.name, names[p])) for p, t in sends.items()}
            shells = {p: PayloadTags.shell(like) for p in recv_from}
            result.update(raw=shells, send_to=sorted(sends), recv_from=list(recv_from))
            self.ledger.record(kind, sum(_nbytes(t) for t in packed.values()), sum(_nbytes(t) for t in shells.values()))
            works = [pg.send([t], p, 0) for p, t in packed.items()] + [pg.recv([t], p, 0) for p, t in shells.items()]
            return _Waited(works, keep=(packed, shells))

        def landed():
            names = self.names
            result["got"] = {p: self._open(raw, like, kind, names[p], self.name) for p, raw in result["raw"].items()}

        self._operate(kind, attempt, alone=lambda: result.update(got={}, send_to=[], recv_from=[]), landed=landed)
        return result["got"], result["send_to"], result["recv_from"]

    def all_gather_object(self, obj) -> list:
        """Bookkeeping gather (end-of-run ledgers): pickled, padded to the longest, all-gathered."""
        return gather_objects(self, obj)

    # ---- one committed operation ----------------------------------------------------------------
    def _operate(self, kind: str, attempt, alone: Callable[[], None] | None = None,
                 landed: Callable[[], None] | None = None) -> None:
        """Run `attempt(pg, rank, size)` (it returns the work to wait on) until an attempt commits; `alone` runs
        instead in an epoch of one; `landed` (tagged payloads) checks and uses what arrived, before the ok."""
        start = time.time()
        failed_at = None
        while True:
            if self.size == 1:
                (alone or (lambda: None))()
                self.syncs.append({"epoch": self.epoch, "seq": self.seq, "kind": kind, "start": start,
                                   "seconds": time.time() - start, "size": 1})
                self.seq += 1
                return
            key = self._op_key()
            ok = self._verdict(key) != b"fail"
            if ok:
                try:
                    work = attempt(self.pg, self.rank, self.size)
                    ok = self._watch(work, key)
                except RuntimeError:
                    ok = False
            if ok and landed is not None:
                try:
                    landed()
                except PayloadAuthError:
                    self._fail(key)  # nobody commits what one member refused; the others retry without it
                    raise
            if ok:
                ok = self._commit(key)
            if ok:
                end = time.time()
                self.syncs.append({"epoch": self.epoch, "seq": self.seq, "kind": kind, "start": start,
                                   "seconds": end - start, "size": self.size})
                if failed_at is not None:
                    self.events[-1].update(resumed=end, stall_seconds=end - failed_at)
                self.seq += 1
                return
            self._fail(key)
            failed_at = failed_at or time.time()
            before = list(self.names)
            self._abort()
            self.form(self.epoch + 1, self.members)
            gone = sorted(set(before) - set(self.names))
            self.events.append({"type": "failure", "epoch": self.epoch + self.epoch_base, "gone": gone,
                                "size": self.size, "detected": failed_at, "formed": time.time(), "kind": kind})
            self.failed_over = True

    def _verdict(self, key: str) -> bytes | None:
        return self.store.get(f"{key}/done") if self.store.check([f"{key}/done"]) else None

    def _fail(self, key: str) -> None:
        try:
            self.store.compare_set(f"{key}/done", "", "fail")
        except RuntimeError:  # the key keeps being overwritten from outside (AuthStore): _commit gives up in time
            pass

    def _peer_gone(self) -> bool:
        others = [n for n in self.names if n != self.name]
        return bool(self.liveness.gone(others))

    def _watch(self, work, key: str) -> bool:
        """Wait for the local part of a collective; False as soon as any member is known to have failed."""
        deadline = time.monotonic() + self.collective_timeout
        last_live = 0.0
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline or self._verdict(key) == b"fail":
                return False
            if now - last_live > 0.1:
                last_live = now
                if self._peer_gone():
                    return False
            time.sleep(self.POLL)
        try:
            work.wait()
        except RuntimeError:
            return False
        return True

    def _commit(self, key: str) -> bool:
        # each member signs its own "ok" (a shared counter could be bumped from outside the job); whoever
        # sees all of them sets the verdict: the last to write its own sees the others'
        self.store.set(f"{key}/ok/{self.name}", "1")
        if self.store.check([f"{key}/ok/{n}" for n in self.names]):
            self.store.compare_set(f"{key}/done", "", "ok")
        deadline = time.monotonic() + self.collective_timeout
        last_live = 0.0
        while (verdict := self._verdict(key)) is None:
            now = time.monotonic()
            if now > deadline + self.collective_timeout:
                return False  # no genuine verdict could be set (the store is being tampered with): fail over
            if now > deadline:
                self._fail(key)
            elif now - last_live > 0.1:
                last_live = now
                if self._peer_gone():
                    self._fail(key)
            time.sleep(self.POLL / 5)
        return verdict == b"ok"

    def _abort(self) -> None:
        """Retire the group without waiting: gloo's abort can block until a hung op times out."""
        if self.pg is not None:
            pg, self.pg = self.pg, None
            self._retired.append(pg)  # destroying it here could block just the same
            threading.Thread(target=_quiet_abort, args=(pg,), daemon=True).start()

    # ---- forming an epoch ---------------------------------------------------------------------------
    def form(self, epoch: int, candidates: list[list] | None) -> None:
        """Enter `epoch`: register, agree on its members, build its process group.

        candidates None: join an epoch whose members others decide (a joiner, or epoch 0 written by
        the coordinator); else decide with the other candidates who is still here.
        """
        while True:
            self.store.set(f"e/{epoch}/reg/{self.name}", "1")
            key = f"e/{epoch}/members"
            if candidates is None:
                members = json.loads(wait_key(self.store, key, self.collective_timeout, f"members of epoch {epoch}"))
            else:
                members = self._agree(epoch, candidates)
            if self.name not in [m[1] for m in members]:
                raise Excluded(f"{self.name} was dropped from epoch {epoch} (heartbeat stale past "
                               f"{self.liveness.timeout} s); start it again with `islands join`")
            self.epoch, self.seq, self.members = epoch, 0, members
            try:
                self._build()
                break
            except RuntimeError:  # a member vanished while connecting: move on without it
                self._abort()
                candidates, epoch = members, epoch + 1
        if self.rank == 0:
            self.store.set("latest", str(epoch))
        if self.on_change is not None:
            self.on_change(self.rank, self.size)

    def _agree(self, epoch: int, candidates: list[list]) -> list[list]:
        key = f"e/{epoch}/members"
        names = [c[1] for c in candidates]
        deadline = time.monotonic() + self.collective_timeout
        while not self.store.check([key]):
            registered = {n for n in names if self.store.check([f"e/{epoch}/reg/{n}"])}
            gone = self.liveness.gone(set(names) - registered)
            if registered | gone >= set(names) or time.monotonic() > deadline:
                keep = [c for c in candidates if c[1] in registered]
                self.store.compare_set(key, "", json.dumps(sorted(keep)))
                break
            time.sleep(self.POLL)
        return json.loads(self.store.get(key))

    def _build(self) -> None:
        if self.size == 1:
            self.pg = None
            return
        prefix = dist.PrefixStore(f"pg/{self.epoch}", self._connect_client())
        # a short connect timeout: everyone registered moments ago, so a slow connect means a death
        connect = _dt.timedelta(seconds=min(self.collective_timeout, 4 * self.liveness.timeout + 5))
        key = f"e/{self.epoch}/connect"
        # gloo's constructor blocks until every rank answered: a member that registered and then died or was
        # cut off would hold the join for the connect timeout (chaos, session 17: 4.5 s), so the connect
        # runs on a thread and is watched for deaths like any collective
        connecting = _Connecting(lambda: dist.ProcessGroupGloo(prefix, self.rank, self.size, connect))
        if not self._watch(connecting, key):
            connecting.abandon()
            self._connect_store = None  # still busy in the abandoned connect until its timeout
            self._fail(key)
            raise RuntimeError(f"epoch {self.epoch}: a member failed while the group connected")
        self.pg = connecting.pg
        try:
            ok = self._watch(self.pg.allreduce([torch.zeros(1)]), key)
        except RuntimeError:
            ok = False
        if not ok:
            self._fail(key)
        if not self._commit(key):
            raise RuntimeError(f"epoch {self.epoch}: a member failed while the group connected")
        self.pg.set_timeout(_dt.timedelta(seconds=self.collective_timeout))

    def _connect_client(self):
        """The store client gloo's connect waits in. Not the shared one: a TCPStore client serves one request at
        a time, so the watch's own reads would queue behind the connect's blocking wait for a missing peer."""
        if self.new_client is None:
            return self.store
        if self._connect_store is None:
            self._connect_store = self.new_client()
        return self._connect_store

    # ---- joins at round boundaries --------------------------------------------------------------
    def claim(self, strategy) -> bool:
        """Called first thing in a strategy's wrap: the first caller is the strategy the loop drives (a Stack
        claims before its outer part's wrap runs), which holds the membership; True for it alone."""
        if self.holder is None:
            self.holder = strategy
        return self.holder is strategy

    def participate(self, participant: ElasticParticipant) -> None:
        """Called by the outer strategy's wrap (inside a Stack or a WarmStart too): the part whose round counter
        joins wait for, whose exchanges in flight settle before a join and whose `joined` runs on a joiner."""
        self.participant = take_part(self.participant, participant)

    def enter(self, strategy, model) -> int:
        """Called at the end of the holding strategy's wrap; returns the step the loop starts at.

        A member of epoch 0 starts at 0. A joiner marks itself ready (its model and strategy exist, so the
        members never wait on its start-up), waits until the members put it in an epoch at a round boundary,
        then loads the global model and the strategy state they send and returns their step."""
        if self.epoch >= 0:
            self._last_round = _rounds(self.participant)
            return 0
        self.store.set(f"ready/{self.name}", str(time.time()))
        try:
            entry = json.loads(self._await_admission())
        except dist.DistNetworkError:
            raise JobEnded("the job ended before admitting this worker: joiners enter at a round boundary and it "
                           "had none left; nothing was trained here") from None
        self.form(entry["epoch"], None)
        step = self.share_state(strategy, model, 0, set(entry["holders"]))
        self._last_round = _rounds(self.participant)
        self.events.append({"type": "entered", "epoch": self.epoch + self.epoch_base, "step": step,
                            "round": self._last_round, "time": time.time(),
                            "global_sha256": self.global_sha(strategy, model),
                            "transfer": self.transfers[-1] if self.transfers else {"via": "broadcast"}})
        return step

    def _await_admission(self) -> bytes:
        """The members' entry for this joiner (joinat/<name>), once they put it in an epoch. Only members
        admit, so the wait ends with JobEnded when none of the newest epoch's has been alive for the
        heartbeat timeout plus ADMIT_LINGER_S: the job is over, or lost. A closed store (the job host ended
        it) raises DistNetworkError. This is the joiner's own rule, not the launcher's nor the job host's:
        with both dead (chaos, session 14) a restarted island otherwise waited forever."""
        key, timeout = f"joinat/{self.name}", self.liveness.timeout
        look_s = min(0.25, timeout / 4)  # Liveness wants looks closer than half the timeout
        quiet_since, next_look = None, 0.0
        while not self.store.check([key]):
            now = time.monotonic()
            if now >= next_look:
                next_look = now + look_s
                if not no_member_alive(self.store, self.liveness):
                    quiet_since = None
                elif quiet_since is None:
                    quiet_since = now
                elif now - quiet_since > timeout + ADMIT_LINGER_S:
                    raise JobEnded(f"no member of the job's newest epoch has been alive for {now - quiet_since:.1f} "
                                   "s, so nobody can admit this worker: the job is over; nothing was trained here")
            time.sleep(0.02)
        return self.store.get(key)

    def at_step(self, strategy, model, step: int) -> None:
        """Called by the holding strategy at the start of each step's hooks (after backward), `step` being the
        steps done: after a round boundary, admit the joiners that are ready."""
        rounds = _rounds(self.participant)
        if self._last_round is None:  # enter() was not called: the first boundary is the end of the first round
            self._last_round = rounds
        if rounds == self._last_round:
            return
        self._last_round = rounds
        # only joiners that are ready (model built): the members must not wait on a joiner's start-up. A member
        # whose exchange of this round failed over proposes none: the failover and an admission in the same gap
        # between two steps add up (chaos, session 19: 1.64 + 0.53 s, the campaign's one stall over 2 s), so the
        # joiners wait for the next round. Joins happen only at a round's first step (the joiner runs that step
        # itself), and the first proposal stored is every member's verdict, so members that disagree (a
        # failover seen late on an exchange thread) still admit alike.
        failed_over, self.failed_over = self.failed_over, False
        pending = [] if failed_over else [
            p for p in get_json(self.store, "pending", []) if p[1] not in self.names
            and self.store.check([f"ready/{p[1]}"]) and not self.store.check([f"joinat/{p[1]}"])]
        self.store.compare_set(f"round/{rounds}/join", "", json.dumps(pending))
        joiners = json.loads(self.store.get(f"round/{rounds}/join"))
        if not joiners:
            return
        # exchanges still in flight (DiLoCo tau > 0, streaming) finish in the epoch they started in; their
        # results travel with the strategy state (a death meanwhile fails them over, the epoch moves on)
        self.participant.settle()
        for settle in self.before_join:
            # the step's checkpoint is already taken (the loop saves after after_step); one still persisting
            # must finish, or the new epoch would abandon it
            settle()
        nxt = self.epoch + 1
        holders = set(self.names)
        for j in joiners:
            self.store.set(f"joinat/{j[1]}", json.dumps({"epoch": nxt, "holders": sorted(holders)}))
        asked = time.time()
        self._abort()
        self.form(nxt, sorted(self.members + joiners))
        self.share_state(strategy, model, step, holders)
        self.events.append({"type": "join", "global_sha256": self.global_sha(strategy, model),
                            "epoch": self.epoch + self.epoch_base, "joined": [j[1] for j in joiners],
                            "round": rounds, "step": step, "size": self.size, "detected": asked,
                            "resumed": time.time(), "stall_seconds": time.time() - asked})

    def share_state(self, strategy, model, step: int, holders: set[str]) -> int:
        """The lowest-ranked holder sends {"model": the global model, "strategy": its state, "step"}; everyone
        else loads it into `strategy` and `model`. Returns the step (the sender's)."""
        def src() -> int:
            ranks = [i for i, n in enumerate(self.names) if n in holders]
            if not ranks:
                raise RuntimeError("every member holding the training state left during a join")
            return ranks[0]

        if self.state_transfer == "chunks":
            return self._share_in_chunks(strategy, model, step, holders, src)
        mine = self.names[src()] == self.name
        blob = torch.zeros(0, dtype=torch.uint8)
        if mine:
            buf = io.BytesIO()
            torch.save(self.snapshot(strategy, model, step), buf)
            blob = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        length = self.broadcast_from(torch.tensor([blob.numel()], dtype=torch.int64), src, kind="elastic_state")
        if not mine:
            blob = torch.zeros(int(length.item()), dtype=torch.uint8)
        blob = self.broadcast_from(blob, src, kind="elastic_state")
        if self.name in holders:
            return step
        state = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=False)
        return self.load_shared(strategy, model, state)

    # What a holder serves and a joiner loads. An island of k workers whose inner strategy shards the model
    # (fsdp) overrides all three (island_comm.IslandLeader): there the state is spread over the island's workers.
    def snapshot(self, strategy, model, step: int) -> dict:
        """The state a holder serves: {"model": the global model, "strategy": its state, "step"}."""
        return {"model": strategy.eval_model(model).state_dict(), "strategy": strategy.state_dict(), "step": int(step)}

    def load_shared(self, strategy, model, state: dict) -> int:
        """A joiner loads what it received; returns the step its loop starts at."""
        return _load_shared(strategy, model, state, self.participant)

    def global_sha(self, strategy, model) -> str:
        """The global model's digest for the join and entry events."""
        return global_digest(strategy.eval_model(model))

    def _share_in_chunks(self, strategy, model, step: int, holders: set[str], src) -> int:
        """Live recovery (issue #20): every holder serves its snapshot (recovery.StateServer on the address it
        reaches the store from) and publishes address + digest under e/<epoch>/state/<name>; a joiner fetches
        the lowest-ranked holder's state from every holder serving the same digest, in checksummed chunks.
        A committed all-reduce then keeps the servers up until every joiner has its state (a joiner that
        fails dies, and the members fail over without it). The joiner loads nothing before it is whole."""
        key = f"e/{self.epoch}/state"
        server = None
        if self.name in holders:
            image = recovery.StateImage.build(self.snapshot(strategy, model, step))
            server = recovery.StateServer(image, host=recovery.local_address_towards(_store_host(self.store)),
                                          secret=self._transfer_secret(key))
            host, port = server.address
            self.store.set(f"{key}/{self.name}", json.dumps({"address": f"{host}:{port}",
                                                            "digest": image.manifest.digest}))
        try:
            state = None if server is not None else self._fetch_state(key, holders, src)
            self.all_reduce(torch.zeros(1), kind="elastic_state_done")
        finally:
            if server is not None:
                server.close()
                self.ledger.record("elastic_state", server.bytes_sent, 0)
        if state is None:
            return step
        return self.load_shared(strategy, model, state)

    def _fetch_state(self, key: str, holders: set[str], src) -> dict:
        ranked = [n for n in self.names if n in holders]
        deadline = time.monotonic() + self.collective_timeout
        while True:  # every holder published, or is gone (then the others serve without it)
            published = {n: get_json(self.store, f"{key}/{n}") for n in ranked if self.store.check([f"{key}/{n}"])}
            missing = set(ranked) - set(published)
            if not missing or missing <= self.liveness.gone(missing) or time.monotonic() > deadline:
                break
            time.sleep(self.POLL)
        if not published:
            raise RuntimeError(f"no holder of the training state published it for epoch {self.epoch} within "
                               f"{self.collective_timeout:.0f} s")
        first = next(n for n in ranked if n in published)  # the lowest-ranked holder's state is the one to take
        peers = [published[n]["address"] for n in ranked if n in published]
        state, report = recovery.fetch_state(peers, secret=self._transfer_secret(key),
                                             expect_digest=published[first]["digest"], timeout=self.collective_timeout)
        self.ledger.record("elastic_state", 0, report.payload_bytes)
        self.transfers.append({"via": "chunks", "epoch": self.epoch + self.epoch_base, "bytes": report.payload_bytes,
                               "seconds": report.seconds, "peers": len(report.per_peer),
                               "refetched": report.refetched, "skipped": report.skipped})
        return state

    def _transfer_secret(self, key: str) -> bytes:
        """The recovery servers' secret: derived from the job's control-plane key (token and job id) when the
        store is authenticated (islands.runtime.auth), else a random one the first holder puts in the store."""
        auth = getattr(self.store, "auth", None)
        if auth is not None and getattr(auth, "key", None):
            return hmac.new(auth.key, b"islands-recovery|" + key.encode(), hashlib.sha256).digest()
        self.store.compare_set(f"{key}/secret", "", os.urandom(16).hex())
        return self.store.get(f"{key}/secret")

    # ---- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch + self.epoch_base, "members": [list(m) for m in self.members],
                "events": list(self.events)}

    def load_state_dict(self, state: dict) -> None:
        """A resumed job counts its epochs on from the saved one and keeps the saved history."""
        if not state:
            return
        self.epoch_base = int(state["epoch"]) + 1 - max(self.epoch, 0)
        self.events = list(state.get("events", [])) + [
            {"type": "resumed", "from_epoch": int(state["epoch"]), "previous_members": state["members"]}]

    def leave(self) -> None:
        """Stop the heartbeat, retire the group and tell the others this member finished."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self._abort()
        try:
            self.store.set(f"dead/{self.name}", "finished")
        except dist.DistNetworkError:
            # the launcher's store is gone: the job ended while this worker finished (a joiner is not the
            # launcher's child and may end last); nobody is left to tell
            pass


def global_digest(model: torch.nn.Module) -> str:
    """SHA-256 of a model's state (parameters and buffers): survivors must agree on the global model bit for bit."""
    return state_digest(model.state_dict())


def state_digest(state: dict) -> str:
    """global_digest of a model whose state_dict() is `state`."""
    h = hashlib.sha256()
    for t in state.values():
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _store_layers(store):
    """`store` and the stores under its wrappers (AuthStore.inner, PrefixStore.underlying_store), outermost first."""
    for _ in range(8):
        if store is None:
            return
        yield store
        store = getattr(store, "inner", None) or getattr(store, "underlying_store", None)


def _store_attr(store, name: str, default):
    """An attribute of the first store under `store`'s wrappers that has it."""
    return next((getattr(s, name) for s in _store_layers(store) if hasattr(s, name)), default)


def _store_host(store) -> str:
    """The host of the TCPStore under `store`'s wrappers."""
    return next((s.host for s in _store_layers(store) if isinstance(getattr(s, "host", None), str) and s.host),
                "127.0.0.1")


def _load_shared(strategy: Holder, model, state: dict, participant: ElasticParticipant) -> int:
    """A joiner loads the members' state, then its participant's `joined` hook runs (DiLoCo: local <- global)."""
    strategy.eval_model(model).load_state_dict(state["model"])
    strategy.load_state_dict(state["strategy"])
    participant.joined()
    return int(state["step"])


class _OnThread:
    """A blocking call run on a thread of its own, pollable like a gloo work (`is_completed`, `wait`), so `_watch`
    can wait on it and still see a death. A RuntimeError of the call (a peer died, refused or timed out; torch's
    DistError is one) is raised by `wait`; `_finish` receives the call's result."""

    def __init__(self, call: Callable[[], Any], name: str):
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(call,), daemon=True, name=name).start()

    def _run(self, call) -> None:
        try:
            self._finish(call())
        except RuntimeError as e:
            self._error = e
        finally:
            self._done.set()

    def _finish(self, result) -> None:
        pass

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class _Connecting(_OnThread):
    """A gloo group being built (its constructor blocks until every rank connected). When the builder gives up on
    it (`abandon`), a group that connects after all is aborted, not leaked."""

    def __init__(self, build: Callable[[], Any]):
        self.pg = None
        self._lock = threading.Lock()
        self._abandoned = False
        super().__init__(build, "islands-connect")

    def _finish(self, pg) -> None:
        with self._lock:
            if self._abandoned:
                _quiet_abort(pg)
            else:
                self.pg = pg

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            pg, self.pg = self.pg, None
        if pg is not None:
            threading.Thread(target=_quiet_abort, args=(pg,), daemon=True).start()


class _Waited(_OnThread):
    """Works whose completion gloo does not report by polling (point-to-point send/recv: `is_completed` stays
    False until `wait`), waited on in turn."""

    def __init__(self, works: list, keep=None):
        self._keep = keep  # the tensors must outlive the works
        super().__init__(lambda: [w.wait() for w in works], "islands-p2p")


def _quiet_abort(pg) -> None:
    try:
        pg.abort()
    except RuntimeError:
        pass


def take_part(current: ElasticParticipant | None, participant: ElasticParticipant) -> ElasticParticipant:
    """The one participant of a membership: a second outer strategy wrapping in the same world is a mistake."""
    if current is not None and current is not participant:
        raise ValueError(f"two outer strategies take part in one elastic job ({type(current).__name__} and "
                         f"{type(participant).__name__}); a job has one outer strategy")
    return participant


def _rounds(participant: ElasticParticipant | None) -> int:
    """Rounds the outer strategy (the membership's participant) completed."""
    if participant is not None:
        return int(participant.rounds)
    raise TypeError("an elastic job needs an outer strategy with a round counter (islands.outer.DiLoCo, LocalSGD, "
                    "...); none took part in this one (an outer strategy's wrap hands it to world.membership)")
