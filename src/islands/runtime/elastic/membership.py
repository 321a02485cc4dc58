"""Who is in an elastic job: the token handshake, heartbeats, liveness, and the coordinator.

Everything goes through one torch.distributed Store that no worker and not the launcher hosts, so any of them
may die: the TCPStore of the job host (islands.runtime.launch.job_host, a detached process), or, with `--store
etcd://...`, the job's namespace in an etcd cluster (islands.runtime.elastic.etcd_store), where no single process is
needed: the coordinator then runs wherever a CoordinatorSeat holds the leadership lease. Keys (all under
"islands/"):
  job                    the JobSpec as JSON: what every worker runs and with which timeouts (joiners
                         need nothing but the address and the token)
  join/tickets           counter; a process asking to join takes ticket t
  join/floor             every ticket below it is answered or skipped (a coordinator taking over starts there)
  join/<t>/name          the asker's name;  join/<t>/challenge  a fresh random nonce
  join/<t>/proof         HMAC-SHA256(token, "islands-join|<name>|<challenge>")
  join/<t>/verdict       {"admitted": true, "slot", "shard", "initial"} or {"admitted": false, "reason"}
  name/<name>, slot/<n>, slot/<n>/shard   the coordinator's decisions, each a compare-and-set (Coordinator)
  pending                admitted joiners not yet in an epoch: [[slot, name, shard], ...]
  joinat/<name>          the epoch a joiner enters (written by the members that admit it)
  e/<e>/members          the members of epoch e: [[slot, name, shard], ...] sorted by slot
  ready/<name>           a joiner has built its model and strategy and waits to enter
  round/<r>/join         the joiners the members admit at the boundary after round r (compare-and-set)
  hb/<name>              heartbeat count;  dead/<name>  set by a supervisor when the process exits or
                         stops beating, or by the process itself when it finishes ("finished")
  e/<e>/s/<seq>/ok/<name>, e/<e>/s/<seq>/done   one collective's per-member success and its verdict
                         (islands.runtime.elastic); pg/<e>/...  gloo's rendezvous of epoch e's group
The token itself never enters the store, a log or a file other than the one the user chose: only
challenge-bound HMACs do, so replaying an old proof does not admit anyone. torch's TCPStore lets anyone
who reaches its port write keys, so every value after the handshake is an authenticated envelope
(islands.runtime.elastic.auth): "job" under a key derived from the token alone (it names the job's random id),
everything else under a key derived from the token and that id, bound to its store key, its sender and a
growing counter; the verdict carries an HMAC bound to the ticket's challenge. Members read through an
AuthStore, to which forged, altered and replayed values are absent (docs/membership.md, "Security").
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import json
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.distributed as dist

from islands.runtime.elastic.auth import AuthStore, ControlAuth
from islands.runtime.elastic.etcd_store import (
    EtcdAddress,
    EtcdStore,
    NotLeader,
    cmp_absent,
    is_etcd,
    leader_key,
    op_put,
)
from islands.runtime.elastic.starvation import PROC_KEY, identity
from islands.runtime.netns import entered as netns_entered

PREFIX = "islands/"
HEARTBEAT_INTERVAL = 0.2  # seconds between heartbeats; the timeout (JobSpec.heartbeat_timeout) is a multiple
REFUSED_EXIT_CODE = 3
JOB_ENDED_EXIT_CODE = 4  # `islands join`: the job finished before it admitted this worker
# The environment of every elastic worker (the launcher and `islands join` set them):
ELASTIC_ENV = "ISLANDS_ELASTIC"  # HOST:PORT of the job's store; islands.init_world() joins the job there
TOKEN_ENV = "ISLANDS_TOKEN"  # the job's secret (never printed or stored)
NAME_ENV = "ISLANDS_NAME"  # this process's name in the job
LAUNCHER = "launcher"  # the sender name of the launcher's (coordinator's and supervisor's) control messages
TICKET_NAME_WAIT = 10.0  # seconds a taken ticket may stay without a name before the coordinator skips it
NAMELESS_MAX = 256  # nameless tickets watched at once; past it the oldest are skipped (a flood of counter bumps)


class Refused(RuntimeError):
    """The coordinator refused this process (wrong token, or the job is over)."""

    exit_code = REFUSED_EXIT_CODE


def parse_address(text: str) -> tuple[str, int]:
    """HOST:PORT of an embedded store, or an etcd store's address (etcd://HOST:PORT,...[/NAMESPACE],
    islands.runtime.elastic.etcd_store), which is returned whole as the host with port 0: `connect` takes both."""
    if is_etcd(text):
        return str(EtcdAddress.parse(text)), 0
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"address must be HOST:PORT (e.g. 127.0.0.1:29500) or etcd://HOST:PORT,HOST:PORT,.../NAMESPACE; "
            f"got {text!r}"
        )
    return host, int(port)


@dataclass(frozen=True)
class JobSpec:
    """What every worker of an elastic job reads from the job's store (key "job"), joiners included.

    workers            the job's data shards: the first `workers` admitted form epoch 0
    heartbeat_timeout  seconds without a heartbeat before a member counts as gone
    timeout            seconds a collective may take before a member counts as stuck
    config             `islands train --elastic`: the job's config as a mapping (islands.app reads it)
    script             `islands run --elastic`: the script's absolute path and its arguments
    cwd                the directory the launcher ran in: a joiner runs the script there, so relative
                       paths in the script (checkpoints, data) name the same files
    island_size        workers per island (the members are the islands' leaders; islands.runtime.elastic.island_comm):
                       `islands join` starts one worker, so it refuses a job whose islands have more
    served             a joiner takes the global model from a service of the job's own, not from the members
                       (contracts.ServedParticipant, the parameter server's processes): it needs no live member to
                       enter, and the job lives while that service does (the launcher's restart rule)
    """

    workers: int
    heartbeat_timeout: float = 3.0
    timeout: float = 120.0
    config: dict | None = None
    script: tuple[str, ...] = ()
    cwd: str = ""
    job_id: str = ""  # random per launch (the Coordinator draws it): scopes the control plane's MAC key
    island_size: int = 1
    served: bool = False

    def __post_init__(self):
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be an integer >= 1; got {self.workers!r}")
        for name in ("heartbeat_timeout", "timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds; got {getattr(self, name)!r}")
        if isinstance(self.island_size, bool) or not isinstance(self.island_size, int) or self.island_size < 1:
            raise ValueError(f"island_size must be an integer >= 1; got {self.island_size!r}")
        if self.config is not None and self.script:
            raise ValueError("a job runs either a config (islands train) or a script (islands run), not both")
        if not isinstance(self.served, bool):
            raise ValueError(f"served must be True or False; got {self.served!r}")
        object.__setattr__(self, "script", tuple(self.script))

    def to_json(self) -> str:
        return json.dumps(
            {
                "workers": self.workers,
                "heartbeat_timeout": self.heartbeat_timeout,
                "timeout": self.timeout,
                "config": self.config,
                "script": list(self.script),
                "cwd": self.cwd,
                "job_id": self.job_id,
                "island_size": self.island_size,
                "served": self.served,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        d = json.loads(text)
        return cls(
            workers=int(d["workers"]),
            heartbeat_timeout=float(d["heartbeat_timeout"]),
            timeout=float(d["timeout"]),
            config=d.get("config"),
            script=tuple(d.get("script") or ()),
            cwd=d.get("cwd", ""),
            job_id=d.get("job_id", ""),
            island_size=int(d.get("island_size", 1)),
            served=bool(d.get("served", False)),  # a record written before the field: members admit
        )

    def lone_joiner_refusal(self) -> str | None:
        """Why `islands join` (one worker, no island place) cannot enter this job, or None when it can."""
        k = self.island_size
        if k == 1 and self.config is not None:  # a record written without island_size: the config says it
            world = self.config.get("world", {})
            k = int(world.get("workers", 1)) // max(int(world.get("islands", 1)), 1)
        if k == 1:
            return None
        return (
            f"this job's islands have {k} workers each and join or leave as a whole; `islands "
            "join` starts one worker, so it cannot add an island: the launcher restarts a failed island itself "
            "(--max-restarts)"
        )

    def seal(self, token: str) -> bytes:
        """The job record as the store holds it: signed under the token (what a joiner runs comes from it)."""
        return ControlAuth(token, "job", LAUNCHER).seal("job", self.to_json())

    @classmethod
    def read(cls, store, token: str, timeout_s: float = 30.0, name: str = "") -> JobSpec:
        """The job record from `store` (a raw client), verified with `token`. A record that does not verify
        raises Refused; given `name`, the coordinator is asked first, so a wrong token gets its verdict
        (and the launcher logs the refusal) rather than this process's guess."""
        raw = wait_key(store, "job", timeout_s, "job description in the store")
        opened = ControlAuth(token, "job", LAUNCHER).open("job", raw)
        if not isinstance(opened, str):
            return cls.from_json(opened[2])
        if name:
            ask_to_join(store, name, token, timeout_s)  # raises Refused("wrong token ...") when it is the token
        raise Refused(
            "the job record in the store does not verify with this token: it was written or altered "
            "by a process without it"
        )


def connect(host: str, port: int, timeout_s: float = 30.0, netns: str | None = None) -> dist.Store:
    """A client of the job's store, all keys under islands/: the embedded TCPStore at HOST:PORT, or, when
    `host` is an etcd address (parse_address), the job's namespace in that etcd cluster. `netns`: a named
    network namespace to connect from (a launcher outside a testbed whose store is on the testbed's hub,
    islands.runtime.netns); the process's other threads are not moved."""
    if is_etcd(host):
        # the prefix inside the store: a PrefixStore over a Python Store would not keep the Python object alive
        return EtcdStore(EtcdAddress.parse(host), timeout_s=timeout_s, key_prefix=PREFIX, netns=netns)
    with netns_entered(netns):  # TCPStore's client makes its one socket in its constructor
        raw = dist.TCPStore(host, port, is_master=False, timeout=_dt.timedelta(seconds=timeout_s))
    return dist.PrefixStore(PREFIX.rstrip("/"), raw)


def host_store(port: int = 0, timeout_s: float = 30.0) -> tuple[dist.TCPStore, dist.Store]:
    """The launcher's store (the server) and a prefixed client view of it."""
    raw = dist.TCPStore(
        "0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=_dt.timedelta(seconds=timeout_s)
    )
    return raw, dist.PrefixStore(PREFIX.rstrip("/"), raw)


def proof(token: str, name: str, challenge: str) -> str:
    return hmac.new(token.encode(), f"islands-join|{name}|{challenge}".encode(), hashlib.sha256).hexdigest()


def verdict_mac(token: str, name: str, challenge: str, verdict: str) -> str:
    """The coordinator's verdict, bound to the ticket's fresh challenge: a joiner trusts no admission it did
    not get from a holder of the token, and an old verdict does not verify for a new challenge."""
    return hmac.new(
        token.encode(), f"islands-verdict|{name}|{challenge}|{verdict}".encode(), hashlib.sha256
    ).hexdigest()


def get_json(store, key: str, default=None):
    return json.loads(store.get(key)) if store.check([key]) else default


def wait_key(store, key: str, timeout_s: float, what: str, poll: float = 0.01) -> bytes:
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s (store key {key!r})")
        time.sleep(poll)
    return store.get(key)


@dataclass(frozen=True)
class Admission:
    slot: int  # admission order; ranks in every epoch follow it
    shard: int  # data shard of job.workers shards (see Coordinator.shard_for)
    initial: bool  # one of the first job.workers: member of epoch 0


def ask_to_join(store, name: str, token: str, timeout_s: float = 30.0) -> Admission:
    """Client side of the handshake; raises Refused with the coordinator's reason."""
    ticket = store.add("join/tickets", 1)
    store.set(f"join/{ticket}/name", name)
    challenge = wait_key(store, f"join/{ticket}/challenge", timeout_s, "challenge from the coordinator").decode()
    store.set(f"join/{ticket}/proof", proof(token, name, challenge))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            signed = json.loads(wait_key(store, f"join/{ticket}/verdict", timeout_s, "verdict from the coordinator"))
        except ValueError:
            signed = {}
        body = signed.get("verdict", "") if isinstance(signed, dict) else ""
        genuine = isinstance(body, str) and hmac.compare_digest(
            str(signed.get("mac", "")), verdict_mac(token, name, challenge, body)
        )
        verdict = json.loads(body) if genuine else {}
        if genuine and verdict["admitted"]:
            return Admission(verdict["slot"], verdict["shard"], verdict["initial"])
        if genuine:
            raise Refused(verdict["reason"])
        # A verdict that does not verify: the coordinator's refusal of a wrong token (its MAC is under the
        # right one) or a forgery. A refusal is believed (it admits nothing); an admission never is.
        try:
            claimed = json.loads(body)
        except (TypeError, ValueError):
            claimed = {}
        if isinstance(claimed, dict) and claimed.get("admitted") is False:
            raise Refused(str(claimed.get("reason", "refused")))
        if time.monotonic() > deadline:
            raise Refused("the admission verdict in the store does not verify with this token")
        time.sleep(0.05)  # a forged one may still be overwritten by the coordinator's


@dataclass
class Session:
    """What join_job returns: the authenticated store of a member, how it makes more clients, and its place."""

    store: AuthStore
    auth: ControlAuth
    admission: Admission
    job: JobSpec
    new_client: Callable[[], AuthStore]
    stores: list | None = None  # every AuthStore of this member (the main one, its heartbeat's, its threads')
    seat: CoordinatorSeat | None = None  # with an etcd store: this member's standby coordinator

    def snapshot(self) -> dict:
        """Values this member accepted and refused, over all its store clients (for its run record)."""
        total: dict = {}
        for store in self.stores or [self.store]:
            for k, v in store.snapshot().items():
                total[k] = total.get(k, 0) + v
        return total

    def accepted_digests(self) -> dict[str, list]:
        """AuthStore.accepted_digests over all its store clients, the latest acceptance of each (audit mode)."""
        out: dict[str, list] = {}
        for store in self.stores or [self.store]:
            for k, entry in (store.accepted_digests or {}).items():
                if k not in out or entry[0] > out[k][0]:
                    out[k] = entry
        return out


def authed(raw, auth: ControlAuth, log=None) -> AuthStore:
    return AuthStore(raw, auth, log=log if log is not None else _stderr, audit=bool(os.environ.get(AUDIT_ENV)))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


AUDIT_ENV = "ISLANDS_AUTH_AUDIT"  # set: AuthStores keep digests of what they accepted (control-plane experiment)


def join_job(host: str, port: int, name: str, token: str, timeout_s: float = 30.0) -> Session:
    """Admission (the token handshake) and the job record, then the member's authenticated store."""
    raw = connect(host, port, timeout_s)
    admission = ask_to_join(raw, name, token, timeout_s)
    job = JobSpec.read(raw, token, timeout_s)
    auth = ControlAuth(token, job.job_id, name)
    stores = [authed(raw, auth)]

    def new_client() -> AuthStore:
        stores.append(authed(connect(host, port, timeout_s), auth))
        return stores[-1]

    session = Session(stores[0], auth, admission, job, new_client, stores)
    if is_etcd(host):  # a replicated store: every member is a standby coordinator (no single point of failure)
        session.seat = CoordinatorSeat(host, token, job, name, log=_stderr).start()
    return session


def observe(address: str, token: str, timeout_s: float = 30.0) -> AuthStore:
    """A verified view of a running job's store at HOST:PORT for a holder of its token that is not a member
    (experiments and tests watching the job): it reads what members read and signs what it writes."""
    host, port = parse_address(address)
    raw = connect(host, port, timeout_s)
    job = JobSpec.read(raw, token, timeout_s)
    return authed(raw, ControlAuth(token, job.job_id, "observer"))


class Heartbeat:
    """A thread bumping hb/<name> every HEARTBEAT_INTERVAL on its own store connection. With `auth` each beat
    is a signed count written through `new_client()` (an AuthStore; a replayed older beat is no progress to
    a reader); without, a plain counter on a raw client of HOST:PORT."""

    def __init__(self, host: str, port: int, name: str, auth: ControlAuth | None = None, new_client=None):
        if new_client is None:

            def new_client():
                return connect(host, port) if auth is None else authed(connect(host, port), auth)

        self._new_client = new_client
        self.store = new_client()
        self.name, self.signed, self.count = name, auth is not None, 0
        self.failures = 0  # beats that raised (the thread reconnected and went on)
        self._stop = threading.Event()
        ident = identity()
        if ident is not None:  # before the first beat: a watcher on this machine that sees the beat can tell a
            self.store.set(PROC_KEY.format(name), ident)  # starved process from a hung one (runtime.starvation)
        self.beat()
        self._thread = threading.Thread(target=self._run, name="islands-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self.count += 1
        if self.signed:
            self.store.set(f"hb/{self.name}", str(self.count))
        else:
            self.store.add(f"hb/{self.name}", 1)

    def _run(self) -> None:
        # A beat that raises does not end the thread: a worker whose heartbeat stopped over one transient store
        # error (a reset connection, a timeout under load) would be killed as silent while it trains on. It
        # reconnects and beats on; if the store is gone for good the main thread ends the process anyway.
        while not self._stop.wait(HEARTBEAT_INTERVAL):
            try:
                self.beat()
            except Exception as e:  # noqa: BLE001 - any failed beat: count it, reconnect, beat on (above)
                self.failures += 1
                if self.failures == 1:
                    print(
                        f"islands: {self.name}: a heartbeat failed ({type(e).__name__}: {e}); beating on over a "
                        "new connection",
                        file=sys.stderr,
                        flush=True,
                    )
                try:
                    self.store = self._new_client()
                except Exception:  # noqa: BLE001 - the next beat tries again
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class Liveness:
    """Who is gone: a supervisor's dead/<name> flag (immediate) or a heartbeat stale past the timeout."""

    def __init__(self, store, timeout_s: float):
        self.store, self.timeout = store, timeout_s
        self._seen: dict[str, tuple[int, float]] = {}  # name -> (beat, when it was first seen)
        self._unseen: dict[str, float] = {}  # name -> since when every look found a value that did not verify
        self._looked: dict[str, float] = {}  # name -> when this Liveness last read its beat

    def gone(self, names) -> set[str]:
        out = {name for name in names if self.store.check([f"dead/{name}"])}
        return out | self.silent(set(names) - out)

    def silent(self, names) -> set[str]:
        """The names whose heartbeat has not moved for longer than the timeout (dead flags aside), as seen by
        looks no further apart than half the timeout: the first look after a longer pause starts the watch
        again. Through an AuthStore the store may hold an older genuine beat written back, or a forged one,
        just when a member looks after a round without looking; it then reads a beat it saw long ago, which
        says nothing about now. Members watch continuously while they wait in an exchange, the launcher
        always. A look that found a value that does not verify (`fresh` False) neither refreshes nor
        convicts; if every look fails that way for longer than the timeout the name counts as silent (its
        beats cannot be seen: an overwrite faster than it beats denies service, docs/membership.md)."""
        now, out = time.monotonic(), set()
        fresh = self.store.fresh if isinstance(self.store, AuthStore) else None
        for name in names:
            key = f"hb/{name}"  # a signed count through an AuthStore, or a plain counter
            present = self.store.check([key])
            beat = int(self.store.get(key)) if present else 0
            looked, self._looked[name] = self._looked.get(name), now
            if looked is None or now - looked > self.timeout / 2:
                self._seen[name] = (beat, now)  # (re)start the watch
                self._unseen.pop(name, None)
                continue
            if fresh is not None and present and not fresh(key):  # fresh: what this get() found
                since = self._unseen.setdefault(name, now)
                if now - since > self.timeout:
                    out.add(name)
                continue
            self._unseen.pop(name, None)
            last = self._seen.get(name)
            if last is None or last[0] != beat:
                self._seen[name] = (beat, now)
            elif now - last[1] > self.timeout:
                out.add(name)
        return out

    def silent_for(self, name: str) -> float:
        """Seconds since `name`'s heartbeat last moved, as this Liveness saw it (0 if never looked at)."""
        last = self._seen.get(name)
        return 0.0 if last is None else time.monotonic() - last[1]


def no_member_alive(store, liveness: Liveness) -> bool:
    """Every member of the newest epoch is gone (finished, reported dead, or silent past the timeout)."""
    latest = int(store.get("latest")) if store.check(["latest"]) else 0
    names = [m[1] for m in get_json(store, f"e/{latest}/members", [])]
    return bool(names) and len(liveness.gone(names)) == len(names)


class Coordinator:
    """Answers join handshakes, forms epoch 0, keeps the pending list. Runs in the job host
    (islands.runtime.launch.job_host); with a replicated store also as a standby in every worker (CoordinatorSeat).

    Every decision is a compare-and-set in the store and can be re-made from it, so a coordinator that
    takes over from a dead one continues where it stopped, and two coordinators racing (a deposed leader not
    yet aware) reach the same verdicts:
      name/<name>     the ticket that claimed the name (first wins; a later ticket is refused "taken")
      slot/<n>        {"ticket", "name"}: slots are claimed in order, each ticket takes the first slot that
                      is free or already its own, so two coordinators judging one ticket agree on its slot
      slot/<n>/shard  the data shard decided for slot n (first decision wins)
      join/<t>/verdict  written create-if-absent; one that does not verify under the token (planted by an
                      outsider) is replaced by compare-and-set against exactly that value
      e/0/members     create-if-absent, from slots 0..workers-1
    Judging a ticket is idempotent: a coordinator re-judges every ticket without a genuine verdict, reusing
    the challenge already in the store, so a proof computed for a dead coordinator's challenge still counts.

    Shard policy: shards are 0..workers-1 (job.workers). The first `workers` admitted take their
    admission order; a later joiner takes the lowest shard no member of the newest epoch (and no
    pending joiner) holds, i.e. it takes over a departed worker's data; if every shard is held it
    shares shard slot % workers.
    """

    def __init__(self, store, token: str, job: JobSpec, log=print, publish: bool = True, sender: str = LAUNCHER):
        if not token:
            raise ValueError("an elastic job needs a non-empty token")
        if not isinstance(job, JobSpec):
            raise TypeError(f"Coordinator takes the job's JobSpec; got {type(job).__name__}")
        job = job if job.job_id else replace(job, job_id=secrets.token_hex(16))
        self.raw, self._token, self.workers, self.log, self.job = store, token, job.workers, log, job
        self.auth = ControlAuth(token, job.job_id, sender)
        # the coordinator's authenticated view: what it writes is signed, what it reads must verify
        self.store = authed(store, self.auth, log)
        if publish:
            store.set("job", job.seal(token))
        self.next_ticket: int | None = None  # read from join/floor at the first poll
        self.nameless: dict[int, float] = {}  # ticket -> when first seen, while it has no name
        self.settled: set[int] = set()  # tickets at or above the floor that need no more looks
        self.floor = 1  # every ticket below it is settled (answered, expired or skipped)
        self.admitted: list[list] = []  # [slot, name, shard], from the slot/<n> keys
        self.open: dict[int, tuple[str, str, float]] = {}  # ticket -> (name, challenge, deadline)
        self.formed = False
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="islands-coordinator", daemon=True)

    def start(self) -> Coordinator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def mark_dead(self, name: str) -> None:
        self.store.set(f"dead/{name}", "1")

    def latest_epoch(self) -> int:
        return int(self.store.get("latest")) if self.store.check(["latest"]) else 0

    def _loop(self) -> None:
        said: set[str] = set()
        while not self._stop.wait(0.01):
            try:
                self.poll()
            except dist.DistNetworkError as e:  # the store closed under us at shutdown
                if not self._stop.is_set():
                    self.log(f"elastic coordinator: {e}")
                return
            except Exception as e:  # noqa: BLE001 - e.g. a key overwritten from outside: keep answering joiners
                if str(e) not in said and not self._stop.is_set():
                    said.add(str(e))
                    self.log(f"elastic coordinator: {e}")

    def poll(self) -> None:
        raw = self.raw  # the handshake's own keys: the proof and the verdict carry their own HMACs
        if self.next_ticket is None:  # a coordinator taking over starts where its predecessor settled
            self.floor = self.next_ticket = int(self.store.get("join/floor")) if self.store.check(["join/floor"]) else 1
        tickets = raw.add("join/tickets", 0)
        now = time.monotonic()
        while self.next_ticket <= tickets:
            self.nameless[self.next_ticket] = now
            self.next_ticket += 1
        # The counter is the one key an outsider can move (an add carries no MAC): a ticket nobody names holds no
        # later joiner back (each is looked at on its own), and a flood of them is cut to the newest NAMELESS_MAX.
        for t in sorted(self.nameless)[: max(0, len(self.nameless) - NAMELESS_MAX)]:
            del self.nameless[t]
            self.settled.add(t)
        for t, seen in sorted(self.nameless.items()):
            if raw.check([f"join/{t}/name"]):
                del self.nameless[t]
                self._open(t, raw.get(f"join/{t}/name").decode(errors="replace"))
            elif now - seen > TICKET_NAME_WAIT:
                del self.nameless[t]
                self.settled.add(t)
        for t, (name, challenge, deadline) in list(self.open.items()):
            if raw.check([f"join/{t}/proof"]):
                del self.open[t]
                try:
                    self._judge(t, name, challenge, raw.get(f"join/{t}/proof").decode(errors="replace"))
                finally:
                    self.settled.add(t)
            elif time.monotonic() > deadline:
                del self.open[t]
                self.settled.add(t)
        self._raise_floor()
        if not self.formed:
            self._form()
        if self.formed:
            self._prune_pending()

    def _open(self, t: int, name: str) -> None:
        """Issue ticket t's challenge, or find it judged already."""
        # a challenge already there is kept: another coordinator issued it and the joiner may have answered
        challenge = _text(self.raw.compare_set(f"join/{t}/challenge", "", secrets.token_hex(16)))
        if self._genuine_verdict(t, name, challenge):
            self.settled.add(t)  # judged by a coordinator before this one
        else:
            self.open[t] = (name, challenge, time.monotonic() + 30)

    def _raise_floor(self) -> None:
        """join/floor: below it every ticket is settled, so a coordinator taking over reads only the tickets from
        there on (it used to re-read every ticket of the job, which after ~90 restarts outlasted its lease)."""
        floor = self.floor
        while floor in self.settled:
            self.settled.discard(floor)
            floor += 1
        if floor != self.floor:
            self.store.set("join/floor", str(floor))  # authenticated, and fenced under a lease: only the leader's
            self.floor = floor

    def _genuine_verdict(self, ticket: int, name: str, challenge: str) -> bool:
        key = f"join/{ticket}/verdict"
        return self.raw.check([key]) and self._verifies(self.raw.get(key), name, challenge)

    def _verifies(self, raw, name: str, challenge: str) -> bool:
        try:
            signed = json.loads(raw)
            return (
                isinstance(signed, dict)
                and isinstance(signed.get("verdict"), str)
                and hmac.compare_digest(
                    str(signed.get("mac", "")), verdict_mac(self._token, name, challenge, signed["verdict"])
                )
            )
        except (TypeError, ValueError):
            return False

    def _judge(self, ticket: int, name: str, challenge: str, given: str) -> None:
        if not hmac.compare_digest(given, proof(self._token, name, challenge)):
            self.refused += 1
            self.log(f"elastic: refused {name!r}: its token does not match this job's")
            self._verdict(
                ticket,
                name,
                challenge,
                admitted=False,
                reason="wrong token: the join proof does not match this job's token",
            )
            return
        if _text(self.store.compare_set(f"name/{name}", "", str(ticket))) != str(ticket):
            self._verdict(ticket, name, challenge, admitted=False, reason=f"name {name!r} is already taken in this job")
            return
        slot = self._claim_slot(ticket, name)
        initial = slot < self.workers
        shard = int(self.store.compare_set(f"slot/{slot}/shard", "", str(slot if initial else self.shard_for(slot))))
        self._refresh()
        if not self._verdict(ticket, name, challenge, admitted=True, slot=slot, shard=shard, initial=initial):
            return
        if not initial:
            self._prune_pending()
            self.log(f"elastic: admitted {name!r} (slot {slot}, shard {shard}); it joins at the next round")
        elif not self.formed:
            self._form()

    def _claim_slot(self, ticket: int, name: str) -> int:
        """The first slot that is free or already this ticket's (compare-and-set, so racing coordinators agree)."""
        n = 0
        while True:
            held = json.loads(self.store.compare_set(f"slot/{n}", "", json.dumps({"ticket": ticket, "name": name})))
            if held["ticket"] == ticket:
                return n
            n += 1

    def _refresh(self) -> None:
        """self.admitted from the slot keys (another coordinator may have admitted some)."""
        n = len(self.admitted)
        while self.store.check([f"slot/{n}", f"slot/{n}/shard"]):
            self.admitted.append(
                [n, json.loads(self.store.get(f"slot/{n}"))["name"], int(self.store.get(f"slot/{n}/shard"))]
            )
            n += 1

    def _form(self) -> None:
        self._refresh()
        if len(self.admitted) >= self.workers:
            mine = json.dumps(self.admitted[: self.workers])
            self.formed = True
            # a coordinator taking over finds it formed (slots are decided in the store, so its own list is the
            # same): nothing to say then; the line used to repeat at every takeover, like a second epoch 0
            if not self.store.check(["e/0/members"]) and _text(self.store.compare_set("e/0/members", "", mine)) == mine:
                self.log(f"elastic: epoch 0 formed with {self.workers} workers")

    def _verdict(self, ticket: int, name: str, challenge: str, **verdict) -> bool:
        """Writes the verdict unless a genuine one is there; True when this one (or an equal one) stands."""
        body = json.dumps(verdict)
        mine = json.dumps({"verdict": body, "mac": verdict_mac(self._token, name, challenge, body)})
        key = f"join/{ticket}/verdict"
        current = self.raw.compare_set(key, "", mine)
        for _ in range(8):  # an outsider's planted verdict is replaced; one racing us each time only delays
            if self._verifies(current, name, challenge):
                return json.loads(json.loads(current)["verdict"]) == verdict
            current = self.raw.compare_set(key, current, mine)
        raise RuntimeError(f"store key {key!r} keeps being overwritten without the job's token")

    def shard_for(self, slot: int) -> int:
        """A joiner's data shard: the first one no live worker holds (members of the newest epoch and admitted
        joiners without an epoch, less those a supervisor flagged dead), else slot % workers. The dead are left
        out because a joiner can be admitted before a dead worker leaves the epoch (the members drop it at their
        next exchange; in a parameter server job no epoch forms during training at all): counted, they gave the
        joiner another worker's shard, trained twice while the dead one's went untrained. (A launcher's restarted
        islands train on their island's own shard whatever this says; it is the data shard of a worker without an
        island place, docs/membership.md.)"""
        members = get_json(self.store, f"e/{self.latest_epoch()}/members", [])
        holders = [(m[1], m[2]) for m in members] + [(p[1], p[2]) for p in get_json(self.store, "pending", [])]
        held = {shard for name, shard in holders if not self.store.check([f"dead/{name}"])}
        free = [s for s in range(self.workers) if s not in held]
        return free[0] if free else slot % self.workers

    def _prune_pending(self) -> None:
        """pending = admitted joiners (slots past epoch 0's) not yet given an epoch; recomputed from the slots,
        so a coordinator that took over, or two that race, write the same list."""
        self._refresh()
        pending = get_json(self.store, "pending", [])
        want = [a for a in self.admitted[self.workers :] if not self.store.check([f"joinat/{a[1]}"])]
        if want != pending and (want or pending):
            self.store.set("pending", json.dumps(want))


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


LEASE_TTL_S = 2  # seconds: a dead coordinator's lease lapses after this (etcd may round it up to its minimum)
SEAT_POLL_S = 0.05  # a leading seat's poll of joins: each look is a few HTTP round trips to etcd, on a shared machine


class CoordinatorSeat:
    """A Coordinator that runs only while it holds the job's leadership lease in etcd (a replicated store).

    Every candidate (the job host and, as standbys, every worker) keeps a seat. A seat without the lead looks
    at the leader key every TTL/4; when it is gone (its holder died or was cut off, so its lease lapsed) the
    seat grants itself a lease and creates the key under it (create-if-absent: one wins). The leader keeps its
    lease alive every TTL/3 on a thread of its own (a poll may take longer than the TTL: a new leader re-read
    every ticket of the job, before join/floor, and on a loaded machine that took more than 2 s after ~90
    restarts; with the keep-alive behind the poll the lease lapsed before the first poll ended, again and
    again, and no joiner was answered: chaos run 8, docs/membership.md) and coordinates through a fenced view
    of the store: each write is a transaction that holds only while its key still exists with the revision it
    created, so a deposed leader (frozen past its TTL, then resumed) cannot write a verdict; its next write
    raises NotLeader and it becomes a standby again. The new leader's Coordinator re-reads every decision from
    the store (Coordinator docstring)."""

    def __init__(
        self,
        address: str,
        token: str,
        job: JobSpec,
        holder: str,
        log=print,
        ttl_s: int = LEASE_TTL_S,
        timeout_s: float = 30.0,
    ):
        self.etcd = EtcdStore(EtcdAddress.parse(address), timeout_s=timeout_s)
        self.client, self.key = self.etcd.client, leader_key(self.etcd.root)
        self.token, self.job, self.holder, self.log, self.ttl = token, job, holder, log, ttl_s
        self.coordinator: Coordinator | None = None
        self.lease = 0
        self.terms: list[dict] = []  # {"holder", "since", "until", "why"}: this seat's terms as leader
        self._kept = 0.0  # monotonic time of the lease's last successful keep-alive (or grant)
        self._lapsed = 0  # a lease the keeper found expired
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="islands-coordinator-seat", daemon=True)
        self._keeper = threading.Thread(target=self._keep, name="islands-coordinator-lease", daemon=True)

    def start(self) -> CoordinatorSeat:
        self._thread.start()
        self._keeper.start()
        return self

    def stop(self, release: bool = True) -> None:
        self._stop.set()
        for thread in (self._thread, self._keeper):
            if thread.is_alive():
                thread.join(timeout=5)
        if release and self.lease:
            try:
                self.client.revoke(self.lease)  # a clean exit hands the lead over at once, not after the TTL
            except Exception:  # noqa: BLE001 - etcd unreachable: the lease lapses by itself
                pass

    @property
    def leading(self) -> bool:
        return self.coordinator is not None

    def leader(self) -> str | None:
        """The holder named in the leader key (None: no leader right now)."""
        value = self.client.get(self.key)
        return value.decode(errors="replace") if value is not None else None

    def _try_lead(self) -> bool:
        if self.client.get(self.key) is not None:
            return False
        lease = self.client.grant(self.ttl)
        answer = self.client.txn([cmp_absent(self.key)], [op_put(self.key, self.holder.encode(), lease)], [])
        if not answer.get("succeeded"):
            self.client.revoke(lease)
            return False
        revision = int(answer["header"]["revision"])  # the put's revision is the key's create_revision
        self._kept, self.lease = time.monotonic(), lease
        fenced = EtcdStore(
            self.etcd.address, self.etcd.timeout_s, fence=(self.key, revision), client=self.client, key_prefix=PREFIX
        )
        self.coordinator = Coordinator(
            fenced, self.token, self.job, log=self.log, publish=False, sender=f"coordinator:{self.holder}"
        )
        self.terms.append({"holder": self.holder, "since": time.time()})
        self.log(f"elastic: {self.holder} took the coordinator's lease (revision {revision})")
        return True

    def _lose(self, why: str) -> None:
        self.coordinator, self.lease = None, 0
        if self.terms:
            self.terms[-1].update(until=time.time(), why=why)
        self.log(f"elastic: {self.holder} no longer coordinates ({why})")

    def _keep(self) -> None:
        """The lease's keep-alive, every TTL/3 whatever the poll is doing (the class docstring). The client keeps
        one connection per thread, so this thread's requests never wait behind the poll's."""
        while not self._stop.wait(self.ttl / 3):
            lease = self.lease
            if not lease:
                continue
            try:
                alive = self.client.keepalive(lease)
            except Exception:  # noqa: BLE001 - etcd unreachable: the poll's TTL rule decides
                continue
            if alive:
                self._kept = time.monotonic()
            elif lease == self.lease:
                self._lapsed = lease

    def _run(self) -> None:
        said: set[str] = set()
        while not self._stop.is_set():
            try:
                if self.coordinator is None and not self._try_lead():
                    self._stop.wait(self.ttl / 4)
                    continue
                if self._lapsed and self._lapsed == self.lease:
                    self._lose("its lease expired")
                    continue
                assert self.coordinator is not None, "held since a loop before, or _try_lead just built it"
                self.coordinator.poll()
            except NotLeader:
                self._lose("another coordinator holds the lease")
            except dist.DistNetworkError as e:  # no etcd majority reachable, or the job ended
                if "ended" in str(e):
                    return
                if self.coordinator is not None and time.monotonic() - self._kept > self.ttl:
                    self._lose("etcd unreachable past the lease's TTL")
                if str(e) not in said:
                    said.add(str(e))
                    self.log(f"elastic coordinator seat {self.holder}: {e}")
            except Exception as e:  # noqa: BLE001 - a value overwritten from outside: keep answering joiners
                if str(e) not in said:
                    said.add(str(e))
                    self.log(f"elastic coordinator seat {self.holder}: {e}")
            self._stop.wait(SEAT_POLL_S)
