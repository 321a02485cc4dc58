"""The epochs of an elastic job (islands.runtime.elastic): who the members are, and their gloo group.

Members of epoch e share ProcessGroupGloo(PrefixStore("pg/<e>", store)). Forming epoch e: each candidate registers
e/<e>/reg/<name>; once every candidate has registered or is gone (Liveness), the first to notice writes
e/<e>/members by compare-and-set. Ranks follow admission order (slot), so the lowest surviving slot is rank 0. The
group's connect is watched like a collective and commits under the key e/<e>/connect (islands.runtime.elastic.
commit). `Epochs` holds the current epoch, the number of the next operation in it and the history of membership
changes (`events`); the collectives (ElasticComm) and the admissions (islands.runtime.elastic.admission.Membership)
share one.
"""

from __future__ import annotations

import datetime as _dt
import json
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from islands.runtime.elastic.commit import Commit, Connecting, quiet_abort
from islands.runtime.elastic.membership import wait_key


class Excluded(RuntimeError):
    """This process was dropped from the membership (its heartbeat went stale while it was away)."""

    exit_code = 1


class Epochs:
    """The epochs one member goes through (module docstring). `on_change(rank, size)` runs after each new epoch;
    `new_client()` (optional) is another client of the job's store, for gloo's connect to wait in."""

    def __init__(
        self,
        store,
        name: str,
        commit: Commit,
        on_change: Callable[[int, int], None] | None = None,
        new_client: Callable[[], object] | None = None,
    ):
        self.store, self.name, self.commit = store, name, commit
        self.on_change, self.new_client = on_change, new_client
        self.epoch, self.seq = -1, 0
        self.members: list[list] = []  # [slot, name, shard]
        self.pg: dist.ProcessGroup | None = None
        self.epoch_base = 0  # epochs of the job this one resumed from (load_state_dict)
        self.events: list[dict] = []  # membership changes, with timings (for reports)
        # An exchange failed over since the last round boundary: that boundary proposes no joiners (Membership.at_step)
        self.failed_over = False
        self._retired: list = []  # aborted groups, kept alive until exit (see abort)
        self._connect_store = None  # _connect_client's

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        return self.names.index(self.name)

    @property
    def names(self) -> list[str]:
        return [m[1] for m in self.members]

    def op_key(self) -> str:
        """The key of the operation being attempted, the same on every member of the epoch."""
        return f"e/{self.epoch}/s/{self.seq}"

    def fail_over(self, kind: str, failed_at: float) -> None:
        """An operation of this epoch failed (its verdict is "fail"): retire the group and form the next epoch with
        the members still here."""
        before = list(self.names)
        self.abort()
        self.form(self.epoch + 1, self.members)
        gone = sorted(set(before) - set(self.names))
        self.events.append(
            {
                "type": "failure",
                "epoch": self.epoch + self.epoch_base,
                "gone": gone,
                "size": self.size,
                "detected": failed_at,
                "formed": time.time(),
                "kind": kind,
            }
        )
        self.failed_over = True

    def abort(self) -> None:
        """Retire the group without waiting: gloo's abort can block until a hung op times out."""
        if self.pg is not None:
            pg, self.pg = self.pg, None
            self._retired.append(pg)  # destroying it here could block just the same
            threading.Thread(target=quiet_abort, args=(pg,), daemon=True).start()

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
                members = json.loads(wait_key(self.store, key, self.commit.timeout, f"members of epoch {epoch}"))
            else:
                members = self._agree(epoch, candidates)
            if self.name not in [m[1] for m in members]:
                raise self.excluded(epoch)
            self.epoch, self.seq, self.members = epoch, 0, members
            try:
                self._build()
                break
            except RuntimeError:  # a member vanished while connecting: move on without it
                self.abort()
                candidates, epoch = members, epoch + 1
        if self.rank == 0:
            self.store.set("latest", str(epoch))
        if self.on_change is not None:
            self.on_change(self.rank, self.size)

    def excluded(self, epoch: int) -> Excluded:
        """What this member raises on finding itself left out of `epoch`: the line its process exits with."""
        return Excluded(
            f"{self.name} was dropped from epoch {epoch} (heartbeat stale past "
            f"{self.commit.liveness.timeout} s); start it again with `islands join`"
        )

    def _agree(self, epoch: int, candidates: list[list]) -> list[list]:
        key = f"e/{epoch}/members"
        names = [c[1] for c in candidates]
        deadline = time.monotonic() + self.commit.timeout
        while not self.store.check([key]):
            registered = {n for n in names if self.store.check([f"e/{epoch}/reg/{n}"])}
            gone = self.commit.liveness.gone(set(names) - registered)
            if epoch == 0:
                # the first epoch: a candidate that never beat is still starting (an island importing its
                # framework on a loaded machine), not silent, and only its dead flag or the deadline leaves it
                # out. Counted gone after the heartbeat timeout, a slow island missed the first epoch of islands
                # that were separate jobs, and if the others finished first it trained nothing (issue #35).
                # Later epochs' candidates were members, and beat: silence is death there
                gone = {n for n in gone if self.store.check([f"hb/{n}"]) or self.store.check([f"dead/{n}"])}
            if registered | gone >= set(names) or time.monotonic() > deadline:
                keep = [c for c in candidates if c[1] in registered]
                self.store.compare_set(key, "", json.dumps(sorted(keep)))
                break
            time.sleep(self.commit.POLL)
        return json.loads(self.store.get(key))

    def _build(self) -> None:
        if self.size == 1:
            self.pg = None
            return
        commit, timeout = self.commit, self.commit.timeout
        prefix = dist.PrefixStore(f"pg/{self.epoch}", self._connect_client())
        # a short connect timeout: everyone registered moments ago, so a slow connect means a death
        connect = _dt.timedelta(seconds=min(timeout, 4 * commit.liveness.timeout + 5))
        key = f"e/{self.epoch}/connect"
        # gloo's constructor blocks until every rank answered: a member that registered and then died or was
        # cut off would hold the join for the connect timeout (chaos, session 17: 4.5 s), so the connect
        # runs on a thread and is watched for deaths like any collective
        connecting = Connecting(lambda: dist.ProcessGroupGloo(prefix, self.rank, self.size, connect))
        if not commit.watch(connecting, key, self.names):
            connecting.abandon()
            self._connect_store = None  # still busy in the abandoned connect until its timeout
            commit.fail(key)
            raise RuntimeError(f"epoch {self.epoch}: a member failed while the group connected")
        self.pg = connecting.pg
        try:
            ok = commit.watch(self.pg.allreduce([torch.zeros(1)]), key, self.names)
        except RuntimeError:
            ok = False
        if not ok:
            commit.fail(key)
        if not commit.commit(key, self.names):
            raise RuntimeError(f"epoch {self.epoch}: a member failed while the group connected")
        self.pg.set_timeout(_dt.timedelta(seconds=timeout))

    def _connect_client(self):
        """The store client gloo's connect waits in. Not the shared one: a TCPStore client serves one request at
        a time, so the watch's own reads would queue behind the connect's blocking wait for a missing peer."""
        if self.new_client is None:
            return self.store
        if self._connect_store is None:
            self._connect_store = self.new_client()
        return self._connect_store

    # ---- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch + self.epoch_base,
            "members": [list(m) for m in self.members],
            "events": list(self.events),
        }

    def load_state_dict(self, state: dict) -> None:
        """A resumed job counts its epochs on from the saved one and keeps the saved history."""
        if not state:
            return
        self.epoch_base = int(state["epoch"]) + 1 - max(self.epoch, 0)
        self.events = list(state.get("events", [])) + [
            {"type": "resumed", "from_epoch": int(state["epoch"]), "previous_members": state["members"]}
        ]
