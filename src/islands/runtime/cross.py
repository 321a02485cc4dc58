"""Islands that are separate distributed jobs, joined across (issue #35 item 1; docs/frameworks.md).

Each island is an ordinary job: its own torchrun (or `accelerate launch`, or `islands run`) rendezvous and its own
default process group, which the framework inside it (the Hugging Face Trainer's DDP, Lightning's, accelerate's, a
script's own) uses as it always does. islands adds one group per local index j, across islands: worker j of every
island is a member of "slot j". Its members are the islands, and the group is an elastic one
(islands.runtime.elastic: Commit, Epochs, ElasticComm), so an island whose job dies is dropped at the next
collective and the others go on with the rest (`CrossIslands`). The islands meet through one store, the
`ISLANDS_CROSS_ADDR` below: a TCPStore (hosted by `islands run --separate-jobs`, by island 0's first worker, by
`islands cross-store`, or by anything else) or an etcd cluster (`etcd://host:port`, as `islands run --elastic --store`
takes).

Settings, read from the environment by `CrossSpec.from_env` (each island's launcher sets them; the names say which
island this is, the rest is the same on every island):

  ISLANDS_CROSS_ADDR              HOST:PORT of the cross-island store (setting it turns this mode on)
  ISLANDS_CROSS_ISLANDS           K, how many islands start
  ISLANDS_CROSS_INDEX             this island's index, 0..K-1
  ISLANDS_CROSS_HOST_STORE        1: this process hosts the store's TCPStore server on HOST:PORT; 0: no worker of
                                  this island does; default: island 0's worker 0 does (its job's death then ends the
                                  store: to survive it, host it with `islands cross-store` and set 0 on every island)
  ISLANDS_CROSS_TIMEOUT           seconds a cross-island collective may take before the island is dropped (300)
  ISLANDS_CROSS_HEARTBEAT_TIMEOUT seconds without a heartbeat after which an island counts as dead (10)
  ISLANDS_TOKEN                   the islands' shared secret (optional; the elastic jobs' variable): every value in
                                  the store is signed with it and every cross-island payload tagged, as in an
                                  elastic job (islands.runtime.elastic.auth); an island with another token is
                                  refused at the start, by name (`CrossRefused`)

The token: the first island to reach the store leaves a record there (key cross/auth), signed under the token and
holding a random id that scopes the MAC key of everything after it (auth.ControlAuth), or the word "open" when it has
no token. Every island checks the record before anything else: a record that does not verify under its token, or a
record of the other kind, is refused with an error that names ISLANDS_TOKEN. With a token, every store client is an
AuthStore (the prefixes of slots are applied over it, so writers and readers sign the same full keys), heartbeats are
signed counts, the ElasticComm tags its payloads, and a restarted island's state transfer uses a secret derived
from the token.

Rejoining: an island whose job starts after the islands formed their first epoch (a restarted island, same settings
and index, or one that came too late for epoch 0) joins as a new incarnation, `island<i>.<n>` (a fresh name: its
predecessor's heartbeat and flags say nothing about it). Each of its workers names itself island i's joiner on its
slot (rejoin/<i>); the outer strategy's wrap then enters it as in an elastic job (the World's `membership`,
islands.runtime.elastic.admission.Membership): the members admit it at their next round boundary and send it the
global model, the outer strategy's state and the step (StateTransfer). The members of every slot take one verdict
per round (`CrossMembership`), so all k workers of a restarted island enter at the same boundary, or none of them.
An island the others dropped while it lived (its exchange came after ISLANDS_CROSS_TIMEOUT) learns it at its next
exchange: Excluded, with a line that says why and how it comes back (`CrossEpochs`), which init_world's excepthook
prints alone before exiting 1, so a launcher that restarts failed jobs (torchrun --max-restarts) brings it back.
A payload that fails its MAC (PayloadAuthError: altered on the way, or sent under another key) ends the island that
refused it the same way (`exit_line`), as do settings or a token that cannot work (before anything is written).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from islands.runtime.comm import CommLedger
from islands.runtime.elastic.admission import Membership
from islands.runtime.elastic.auth import ControlAuth, derive_key
from islands.runtime.elastic.comm import ElasticComm
from islands.runtime.elastic.commit import Commit
from islands.runtime.elastic.epochs import Epochs, Excluded
from islands.runtime.elastic.etcd_store import is_etcd
from islands.runtime.elastic.membership import (
    TOKEN_ENV,
    Heartbeat,
    Liveness,
    Refused,
    authed,
    connect,
    parse_address,
)
from islands.runtime.payload_auth import PayloadAuthError

ADDR_ENV = "ISLANDS_CROSS_ADDR"
ISLANDS_ENV = "ISLANDS_CROSS_ISLANDS"
INDEX_ENV = "ISLANDS_CROSS_INDEX"
HOST_STORE_ENV = "ISLANDS_CROSS_HOST_STORE"
TIMEOUT_ENV = "ISLANDS_CROSS_TIMEOUT"
HEARTBEAT_ENV = "ISLANDS_CROSS_HEARTBEAT_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0  # 50 beats (HEARTBEAT_INTERVAL 0.2 s): a loaded machine misses a few, not 50


AUTH_KEY = "cross/auth"  # the store's record: signed {"job_id"} under the islands' token, or OPEN_RECORD
OPEN_RECORD = b"open"  # the islands of this store run without a token
RECORD_SCOPE, RECORD_SENDER = "cross-job", "island"


class CrossSettingsError(ValueError):
    """ISLANDS_CROSS_* settings that cannot work; the message names the variable and what would be right."""

    exit_code = 2  # a usage error, as the CLI's refusals (init_world's excepthook: exit_line)


class CrossRefused(Refused):
    """This island's token (ISLANDS_TOKEN) is not the one the islands of the cross store use."""


def exit_line(error: BaseException) -> str | None:
    """The one line a worker of a joined island prints, without a traceback, before it exits with `error.exit_code`
    (init_world's excepthook), or None for an error that is not the islands' to explain. An Excluded island was
    dropped (CrossEpochs says why and how it comes back); settings or a token that cannot work say which variable;
    a refused payload (PayloadAuthError) says what failed, what to check, and that a restart rejoins the island."""
    if isinstance(error, (Excluded, CrossRefused, CrossSettingsError)):
        return str(error)
    if isinstance(error, PayloadAuthError):
        return (
            f"{error}. Set the same {TOKEN_ENV} on every worker of every island and make sure nothing between the "
            "islands rewrites their traffic; restart this island's job with the same launch line and it rejoins at a "
            "round boundary (torchrun --max-restarts N does that by itself)"
        )
    return None


def cross_requested(env=None) -> bool:
    """Whether this process is an island of a joined job (ISLANDS_CROSS_ADDR is set)."""
    return bool((os.environ if env is None else env).get(ADDR_ENV, ""))


@dataclass(frozen=True)
class CrossSpec:
    """Where the islands meet and which one this is (module docstring)."""

    address: str
    islands: int
    index: int
    host_store: bool | None = None  # None: island 0's worker 0 hosts it
    timeout_s: float = DEFAULT_TIMEOUT_S
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    token: str = field(default="", repr=False)  # ISLANDS_TOKEN; "": the store is open (module docstring)

    def __post_init__(self):
        parse_address(self.address)  # a ValueError naming the right form
        if self.islands < 1:
            raise CrossSettingsError(f"{ISLANDS_ENV} must be >= 1 (how many islands start); got {self.islands}")
        if not 0 <= self.index < self.islands:
            raise CrossSettingsError(
                f"{INDEX_ENV} must be this island's index, 0..{self.islands - 1} for {self.islands} islands; "
                f"got {self.index}"
            )
        if self.timeout_s <= 0 or self.heartbeat_timeout_s <= 0:
            raise CrossSettingsError(f"{TIMEOUT_ENV} and {HEARTBEAT_ENV} must be positive seconds")
        if self.host_store and is_etcd(self.address):
            raise CrossSettingsError(
                f"{HOST_STORE_ENV}=1 hosts a TCPStore here, but {ADDR_ENV} names an etcd cluster, which runs on its "
                f"own: leave {HOST_STORE_ENV} unset (or 0) with etcd://"
            )

    def hosts_store(self, slot: int) -> bool:
        """Whether worker `slot` of this island hosts the store's TCPStore server: as told, else island 0's worker
        0; never for an etcd cluster (before, island 0 tried to host one at the etcd address and timed out)."""
        if is_etcd(self.address):
            return False
        return self.host_store if self.host_store is not None else self.index == 0 and slot == 0

    @classmethod
    def from_env(cls, env=None) -> CrossSpec:
        env = os.environ if env is None else env
        missing = [k for k in (ADDR_ENV, ISLANDS_ENV, INDEX_ENV) if not env.get(k)]
        if missing:
            raise CrossSettingsError(
                f"an island of a joined job needs {', '.join(missing)} set (e.g. {ADDR_ENV}=10.0.0.1:29600 "
                f"{ISLANDS_ENV}=2 {INDEX_ENV}=0 on island 0's machines); docs/frameworks.md"
            )
        host = env.get(HOST_STORE_ENV, "")
        if host not in ("", "0", "1"):
            raise CrossSettingsError(f"{HOST_STORE_ENV} must be 1 (host the store here) or 0; got {host!r}")
        try:
            return cls(
                address=env[ADDR_ENV],
                islands=int(env[ISLANDS_ENV]),
                index=int(env[INDEX_ENV]),
                host_store=None if host == "" else host == "1",
                timeout_s=float(env.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)),
                heartbeat_timeout_s=float(env.get(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_TIMEOUT_S)),
                token=env.get(TOKEN_ENV, ""),
            )
        except ValueError as e:
            if isinstance(e, CrossSettingsError):
                raise
            raise CrossSettingsError(
                f"{ISLANDS_ENV} and {INDEX_ENV} must be integers, {TIMEOUT_ENV} and {HEARTBEAT_ENV} seconds: {e}"
            ) from None

    def env(self) -> dict[str, str]:
        """The variables that say this to a process (what `islands run --separate-jobs` sets)."""
        out = {ADDR_ENV: self.address, ISLANDS_ENV: str(self.islands), INDEX_ENV: str(self.index)}
        if self.host_store is not None:
            out[HOST_STORE_ENV] = "1" if self.host_store else "0"
        out[TIMEOUT_ENV], out[HEARTBEAT_ENV] = str(self.timeout_s), str(self.heartbeat_timeout_s)
        if self.token:
            out[TOKEN_ENV] = self.token
        return out

    def name(self) -> str:
        return f"island{self.index}"


def check_token(store, token: str, address: str, sender: str) -> ControlAuth | None:
    """The ControlAuth this island signs with (None: the islands run without a token), after checking the store's
    record (module docstring; the first island to arrive writes it). `store`: a raw client of the cross store.
    Raises CrossRefused, naming ISLANDS_TOKEN, when this island's token is not the islands' own."""
    record = ControlAuth(token, RECORD_SCOPE, RECORD_SENDER) if token else None
    offer = record.seal(AUTH_KEY, json.dumps({"job_id": secrets.token_hex(16)})) if record else OPEN_RECORD
    store.compare_set(AUTH_KEY, "", offer)
    held = bytes(store.get(AUTH_KEY))
    if record is None:
        if held == OPEN_RECORD:
            return None
        raise CrossRefused(
            f"the islands of the cross store at {address} use a token, and this island has none: set the same "
            f"{TOKEN_ENV} on every worker of every island"
        )
    if held == OPEN_RECORD:
        raise CrossRefused(
            f"the islands of the cross store at {address} run without a token, and this island has {TOKEN_ENV} "
            f"set: set it on every island's workers, or on none"
        )
    opened = record.open(AUTH_KEY, held)
    if isinstance(opened, str):
        raise CrossRefused(
            f"wrong token: this island's {TOKEN_ENV} is not the one the islands of the cross store at {address} "
            f"use (their record there does not verify under it: {opened}); set the same {TOKEN_ENV} on every "
            "worker of every island"
        )
    return ControlAuth(token, json.loads(opened[2])["job_id"], sender)


def mark_gone(spec: CrossSpec, slots: int, why: str = "failed") -> None:
    """Island `spec.index`'s job ended in failure (its launcher saw it): its dead flag in every slot's group, signed
    as the islands sign theirs, so the others drop it at once instead of after its heartbeat went stale, or, when it
    never beat (it failed while starting), after the cross timeout."""
    host, port = parse_address(spec.address)
    raw = connect(host, port, timeout_s=min(spec.timeout_s, 10.0))
    auth = check_token(raw, spec.token, spec.address, "launcher")
    store = raw if auth is None else authed(raw, auth)
    for slot in range(slots):
        dist.PrefixStore(f"cross/{slot}", store).set(f"dead/{spec.name()}", why)


class CrossMembership(Membership):
    """The admission of one slot's cross-island group (islands.runtime.elastic.admission.Membership), with one
    verdict for all slots: at a round boundary the first member of any slot to look stores which restarted islands
    enter (those whose every worker is ready), and every slot admits its own worker of each. Per-slot verdicts
    could let worker 0 of a restarted island enter a round before worker 1, and its framework's DDP would then
    pair workers at different steps."""

    def __init__(self, epochs: Epochs, comm: ElasticComm, root, slot: int, slots: int, islands: int):
        super().__init__(epochs, comm)
        self.root, self.slot, self.slots = root, slot, slots  # root: the store over every slot's keys
        self.islands = islands

    def _proposal(self, rounds: int) -> list[list]:
        epochs = self.epochs
        failed_over, epochs.failed_over = epochs.failed_over, False  # as Membership: a failover round admits none
        ready = [] if failed_over else self._ready_islands()
        key = f"round/{rounds}/join"
        self.root.compare_set(key, "", json.dumps(ready))
        mine = latest_pending(self.store, self.islands)
        return [mine[i] for i in json.loads(self.root.get(key)) if i in mine]

    def _ready_islands(self) -> list[int]:
        """The islands whose newest incarnation is ready on every slot and not yet admitted on any."""
        by_slot = [latest_pending(PrefixStoreView(self.root, str(s)), self.islands) for s in range(self.slots)]
        out = []
        for i, entry in sorted(by_slot[self.slot].items()):
            if entry[1] in self.epochs.names:
                continue
            if all(
                i in pending
                and self.root.check([f"{s}/ready/{pending[i][1]}"])
                and not self.root.check([f"{s}/joinat/{pending[i][1]}"])
                for s, pending in enumerate(by_slot)
            ):
                out.append(i)
        return out

    def leave(self) -> None:
        """Retire the group; the heartbeat and the finished flag are CrossIslands.leave's (which runs first)."""
        self.epochs.abort()


class CrossEpochs(Epochs):
    """The epochs of one slot's cross-island group. An island that finds itself left out of one is alive (it is
    the one asking), so the others dropped it as slow: its line says why and how it comes back (docs/frameworks.md,
    "Faults"), where an elastic worker's names `islands join`."""

    def excluded(self, epoch: int) -> Excluded:
        timeout, heartbeat = self.commit.timeout, self.commit.liveness.timeout
        return Excluded(
            f"{self.name} was dropped by the other islands (cross epoch {epoch}): its exchange came after "
            f"{TIMEOUT_ENV} ({timeout:g} s), or its heartbeat stopped for {HEARTBEAT_ENV} ({heartbeat:g} s). "
            f"Restart this island's job with the same launch line and it rejoins at a round boundary (torchrun "
            f"--max-restarts N does that by itself); raise {TIMEOUT_ENV} if the island is just slow"
        )


class PrefixStoreView:
    """Reads one slot's keys through the root store (a PrefixStore per slot would be a connection per slot)."""

    def __init__(self, root, prefix: str):
        self.root, self.prefix = root, prefix

    def check(self, keys: list[str]) -> bool:
        return self.root.check([f"{self.prefix}/{k}" for k in keys])

    def get(self, key: str) -> bytes:
        return self.root.get(f"{self.prefix}/{key}")


def latest_pending(store, islands: int) -> dict[int, list]:
    """Island index -> the [index, name, index] entry of its newest incarnation waiting on a slot (rejoin/<i>)."""
    return {i: json.loads(store.get(f"rejoin/{i}")) for i in range(islands) if store.check([f"rejoin/{i}"])}


class CrossIslands:
    """Worker `slot` of this island's place in the cross-island group of slot `slot`: its heartbeat and the
    ElasticComm (contracts.ElasticCollectives) whose members are the islands still alive. `on_change(rank,
    size)`: after each epoch (the first, each one an island's death forms, each one a restarted island joins).
    `membership`: the admission (CrossMembership) the World hands its outer strategy; a restarted island's
    workers are not in an epoch until its `enter` (in the strategy's wrap) lets them in."""

    def __init__(
        self,
        spec: CrossSpec,
        slot: int,
        ledger: CommLedger,
        on_change: Callable[[int, int], None],
        slots: int = 1,
    ):
        host, port = parse_address(spec.address)
        hosting = spec.hosts_store(slot)
        self.server = None
        if hosting:  # the TCPStore server lives as long as this object (clients connect to it below)
            self.server = dist.TCPStore(
                host, port, is_master=True, wait_for_workers=False, timeout=_dt.timedelta(seconds=spec.timeout_s)
            )
        prefix = f"cross/{slot}"
        # before anything else: an island with another token is refused here, by name (check_token)
        self.auth = check_token(connect(host, port, timeout_s=spec.timeout_s), spec.token, spec.address, f"{slot}")
        self._authed: list = []  # the AuthStores under the prefixes (a PrefixStore does not keep a Python store alive)

        def client():
            raw = connect(host, port, timeout_s=spec.timeout_s)
            if self.auth is None:
                return raw
            self._authed.append(authed(raw, self.auth))  # full keys signed: every slot's readers see the same
            return self._authed[-1]

        def new_client():
            return dist.PrefixStore(prefix, client())

        self.store = new_client()
        root = dist.PrefixStore("cross", client())
        # the islands formed their first epoch already: this island's job restarted (or started too late)
        self.rejoining = self.store.check(["e/0/members"])
        name = spec.name()
        if self.rejoining:
            name = f"{name}.{self.store.add(f'incarnations/{name}', 1)}"
        self.heartbeat = Heartbeat(host, port, name, auth=self.auth, new_client=new_client)
        commit = Commit(self.store, name, Liveness(self.store, spec.heartbeat_timeout_s), spec.timeout_s)
        self.epochs = CrossEpochs(self.store, name, commit, on_change=on_change, new_client=new_client)
        self.comm = ElasticComm(self.epochs, ledger)
        self.membership = CrossMembership(self.epochs, self.comm, root, slot, slots, spec.islands)
        if self.auth is not None:  # every payload across islands tagged, the state transfer's secret from the token
            self.membership.authenticate(spec.token, self.auth.scope)
            self.membership.transfer.key = derive_key(spec.token, self.auth.scope)
        if not self.rejoining:
            try:  # epoch 0: every island started, less those that died before registering (heartbeat went stale)
                self.epochs.form(0, [[i, f"island{i}", i] for i in range(spec.islands)])
            except Excluded:  # the others formed it without this late island: it joins like a restarted one
                self.rejoining = True
        if self.rejoining:  # the members admit it at a round boundary once it is ready (Membership.enter)
            self.store.set(f"rejoin/{spec.index}", json.dumps([spec.index, name, spec.index]))

    def _others(self) -> list[tuple[Liveness, list[str]]]:
        """Per slot: its liveness check and the other members of its newest epoch (a slot's workers may still be in
        their last exchange when this one's are done)."""
        root, timeout = self.membership.root, self.epochs.commit.liveness.timeout
        out = []
        for s in range(self.membership.slots):
            view = PrefixStoreView(root, str(s))
            latest = int(view.get("latest")) if view.check(["latest"]) else 0
            raw = view.get(f"e/{latest}/members") if view.check([f"e/{latest}/members"]) else b"[]"
            names = [m[1] for m in json.loads(raw) if m[1] != self.epochs.name]
            out.append((Liveness(view, timeout), names))
        return out

    @property
    def events(self) -> list[dict]:
        """The membership changes (an island dropped: type "failure", the names gone, the new size)."""
        return self.epochs.events

    def leave(self) -> None:
        """Stop beating and say this island finished, so a survivor does not wait for its heartbeat to go stale."""
        self.heartbeat.stop()
        try:
            self.store.set(f"dead/{self.epochs.name}", "finished")
            if self.server is not None:  # the store's host stays until the others, of every slot, are done with it
                deadline = time.monotonic() + self.epochs.commit.timeout
                waits = self._others()
                while time.monotonic() < deadline and any(len(live.gone(ns)) < len(ns) for live, ns in waits):
                    time.sleep(0.05)
        except RuntimeError:  # the store is gone (its host finished first): nobody is left to tell
            pass
