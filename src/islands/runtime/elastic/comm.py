"""ElasticComm: the Comm interface over a gloo process group that is rebuilt when membership changes.

Every collective is one numbered operation (e, seq) of the current epoch (islands.runtime.elastic.epochs.Epochs)
that commits only when every member reports success in the store (islands.runtime.elastic.commit):
  1. run it on the epoch's group, watching for a failed peer (Commit.watch);
  2. each member signs its own ok, one verdict ("ok" or "fail") wins (Commit.commit);
  3. on "fail" every survivor aborts the group, forms epoch e+1 (Epochs.fail_over) and retries the same
     operation from its saved input. A committed operation is never redone, so nothing already
     synchronised is lost, and survivors never restart.

Exchanges in flight across steps (issue #20 item 4: DiLoCo with tau > 0, streaming DiLoCo): the outer strategy
runs them on its exchange's one background thread, and each of their collectives is an operation as above, so a
death while one is in flight fails it over like any other: the survivors retry it from its saved input in the
next epoch and land the same result at the same step. Only that thread issues collectives while exchanges are
in flight (everything else waits behind them: the strategy's `in_order`). Gossip (`exchange_planned`): a round's
peers come from the topology over the ranks of the epoch the round commits in, so a retried round re-plans with
the survivors.

Authenticated payloads (`outer.authenticate`, `Membership.authenticate`, `authenticate`): every tensor an
operation sends carries an HMAC tag (islands.runtime.payload_auth.PayloadTags) under a key from the job's token
and id, binding the kind, the operation's key e/<epoch>/s/<seq> (every member's the same; a retry in a new epoch
tags anew under the new key), the sender's name (stable across epochs), the receiver's name for point to point,
dtype, shape and bytes. An all-reduce then runs as an all-gather of tagged contributions that each member checks
and sums itself in rank order. Checks run after the bytes land and before the member's "ok": a contribution that
fails sets the verdict "fail" (so no member commits that operation, and nothing tampered is used) and raises
PayloadAuthError naming the sender and the operation; that worker leaves, and the others retry without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from islands.runtime.comm import CommLedger, gather_objects
from islands.runtime.elastic.commit import Waited
from islands.runtime.elastic.epochs import Epochs
from islands.runtime.payload_auth import PayloadAuthError, PayloadTags, combine_in_order, elastic_tags


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ElasticComm:
    """The collectives of one member of an elastic job over its `epochs` (contracts.ElasticCollectives)."""

    elastic = True  # strategies read this to refuse what churn would break (contracts.Collectives)

    def __init__(self, epochs: Epochs, ledger: CommLedger):
        self.epochs, self.ledger = epochs, ledger
        self.syncs: list[dict] = []  # every committed operation: epoch, seq, kind, start, seconds
        self.tags: PayloadTags | None = None  # set by authenticate: every operation's payloads are tagged

    def authenticate(self, token: str, job_id: str) -> None:
        """Tag and check every payload of this member's operations from now on (module docstring), under a key
        from `token` and the job's id. Every member must call it, joiners too, before their first operation
        after entering; it trades nothing."""
        self.tags = elastic_tags(token, job_id)

    # ---- Comm interface -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """This member's name (stable across epochs)."""
        return self.epochs.name

    @property
    def epoch(self) -> int:
        return self.epochs.epoch

    @property
    def size(self) -> int:
        return self.epochs.size

    @property
    def rank(self) -> int:
        return self.epochs.rank

    @property
    def names(self) -> list[str]:
        return self.epochs.names

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

    def exchange_planned(
        self,
        plan: Callable[[int, int], tuple[dict[int, torch.Tensor], list[int]]],
        like: torch.Tensor,
        kind: str = "p2p",
    ) -> tuple[dict[int, torch.Tensor], list[int], list[int]]:
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
            return Waited(works, keep=(sent, got), timeout_s=self.epochs.commit.timeout)

        self._operate(kind, attempt, alone=lambda: result.update(got={}, send_to=[], recv_from=[]))
        return result["got"], result["send_to"], result["recv_from"]

    # ---- the same operations with tagged payloads (authenticate) ----------------------------------------
    def _open(
        self, packed: torch.Tensor, like: torch.Tensor, kind: str, sender: str, receiver: str = ""
    ) -> torch.Tensor:
        key, epoch = self.epochs.op_key(), self.epochs.epoch + self.epochs.epoch_base
        assert self.tags is not None, "only the tagged operations open payloads; they run once authenticate set tags"
        got = self.tags.open(packed, like, (kind, key, sender, receiver))
        if got is None:
            raise PayloadAuthError(
                f"the {kind} payload from member {sender} (operation {key}, epoch {epoch}) "
                "failed its MAC: it was altered, injected or replayed on the way, or its sender holds another token; "
                f"it was not used, the operation does not commit, and {self.name} leaves the job"
            )
        return got

    def _gather_tagged(self, tensor: torch.Tensor, kind: str, use: Callable[[list[torch.Tensor]], Any]) -> None:
        """One operation that all-gathers every member's tagged `tensor`; `use` receives the contributions in rank
        order, each checked (this member's own as it is), before this member's ok. A retry packs the saved input
        again under its new operation key."""
        mine = tensor.detach().contiguous().clone()
        sent: list[torch.Tensor] = []
        parts: list[torch.Tensor] = []

        def attempt(pg, rank, size):
            sent[:] = [self.tags.pack(mine, (kind, self.epochs.op_key(), self.name, ""))]
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
            buf = (
                self.tags.pack(mine, (kind, self.epochs.op_key(), self.name, ""))
                if rank == src
                else PayloadTags.shell(mine)
            )
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
            key, names = self.epochs.op_key(), self.names
            packed = {p: self.tags.pack(t, (kind, key, self.name, names[p])) for p, t in sends.items()}
            shells = {p: PayloadTags.shell(like) for p in recv_from}
            result.update(raw=shells, send_to=sorted(sends), recv_from=list(recv_from))
            self.ledger.record(kind, sum(_nbytes(t) for t in packed.values()), sum(_nbytes(t) for t in shells.values()))
            works = [pg.send([t], p, 0) for p, t in packed.items()] + [pg.recv([t], p, 0) for p, t in shells.items()]
            return Waited(works, keep=(packed, shells), timeout_s=self.epochs.commit.timeout)

        def landed():
            names = self.names
            result["got"] = {p: self._open(raw, like, kind, names[p], self.name) for p, raw in result["raw"].items()}

        self._operate(kind, attempt, alone=lambda: result.update(got={}, send_to=[], recv_from=[]), landed=landed)
        return result["got"], result["send_to"], result["recv_from"]

    def all_gather_object(self, obj) -> list:
        """Bookkeeping gather (end-of-run ledgers): pickled, padded to the longest, all-gathered."""
        return gather_objects(self, obj)

    # ---- one committed operation ----------------------------------------------------------------
    def _operate(
        self, kind: str, attempt, alone: Callable[[], object] | None = None, landed: Callable[[], None] | None = None
    ) -> None:
        """Run `attempt(pg, rank, size)` (it returns the work to wait on) until an attempt commits; `alone` runs
        instead in an epoch of one; `landed` (tagged payloads) checks and uses what arrived, before the ok."""
        epochs, commit = self.epochs, self.epochs.commit
        start = time.time()
        failed_at = None
        while True:
            if epochs.size == 1:
                (alone or (lambda: None))()
                self.syncs.append(
                    {
                        "epoch": epochs.epoch,
                        "seq": epochs.seq,
                        "kind": kind,
                        "start": start,
                        "seconds": time.time() - start,
                        "size": 1,
                    }
                )
                epochs.seq += 1
                return
            key = epochs.op_key()
            ok = commit.verdict(key) != b"fail"
            if ok:
                try:
                    work = attempt(epochs.pg, epochs.rank, epochs.size)
                    ok = commit.watch(work, key, epochs.names)
                except RuntimeError:
                    ok = False
            if ok and landed is not None:
                try:
                    landed()
                except PayloadAuthError:
                    commit.fail(key)  # nobody commits what one member refused; the others retry without it
                    raise
            if ok:
                ok = commit.commit(key, epochs.names)
            if ok:
                end = time.time()
                self.syncs.append(
                    {
                        "epoch": epochs.epoch,
                        "seq": epochs.seq,
                        "kind": kind,
                        "start": start,
                        "seconds": end - start,
                        "size": epochs.size,
                    }
                )
                if failed_at is not None:
                    epochs.events[-1].update(resumed=end, stall_seconds=end - failed_at)
                epochs.seq += 1
                return
            commit.fail(key)
            failed_at = failed_at or time.time()
            epochs.fail_over(kind, failed_at)
