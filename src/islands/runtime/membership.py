"""Who is in an elastic job: the token handshake, heartbeats, liveness, and the coordinator.

Everything goes through one torch.distributed TCPStore hosted by the launcher, so any worker may die
(the store does not live in a worker). Keys (all under "islands/"):
  job                    the JobSpec as JSON: what every worker runs and with which timeouts (joiners
                         need nothing but the address and the token)
  join/tickets           counter; a process asking to join takes ticket t
  join/<t>/name          the asker's name;  join/<t>/challenge  a fresh random nonce
  join/<t>/proof         HMAC-SHA256(token, "islands-join|<name>|<challenge>")
  join/<t>/verdict       {"admitted": true, "slot", "shard", "initial"} or {"admitted": false, "reason"}
  pending                admitted joiners not yet in an epoch: [[slot, name, shard], ...]
  joinat/<name>          the epoch a joiner enters (written by the members that admit it)
  e/<e>/members          the members of epoch e: [[slot, name, shard], ...] sorted by slot
  ready/<name>           a joiner has built its model and strategy and waits to enter
  round/<r>/join         the joiners the members admit at the boundary after round r (compare-and-set)
  hb/<name>              heartbeat counter;  dead/<name>  set by a supervisor when the process exits
The token itself never enters the store, a log or a file other than the one the user chose: only
challenge-bound HMACs do, so replaying an old proof does not admit anyone. The store is
unauthenticated (torch's TCPStore): the token keeps out processes that lack it, not an attacker who
can inject traffic on the network; run elastic jobs on a private network.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

PREFIX = "islands/"
HEARTBEAT_INTERVAL = 0.2  # seconds between heartbeats; the timeout (JobSpec.heartbeat_timeout) is a multiple
REFUSED_EXIT_CODE = 3
JOB_ENDED_EXIT_CODE = 4  # `islands join`: the job finished before it admitted this worker
# The environment of every elastic worker (the launcher and `islands join` set them):
ELASTIC_ENV = "ISLANDS_ELASTIC"  # HOST:PORT of the job's store; islands.init_world() joins the job there
TOKEN_ENV = "ISLANDS_TOKEN"  # the job's secret (never printed or stored)
NAME_ENV = "ISLANDS_NAME"  # this process's name in the job


class Refused(RuntimeError):
    """The coordinator refused this process (wrong token, or the job is over)."""

    exit_code = REFUSED_EXIT_CODE


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be HOST:PORT (e.g. 127.0.0.1:29500); got {text!r}")
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
    """

    workers: int
    heartbeat_timeout: float = 3.0
    timeout: float = 120.0
    config: dict | None = None
    script: tuple[str, ...] = ()
    cwd: str = ""

    def __post_init__(self):
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be an integer >= 1; got {self.workers!r}")
        for name in ("heartbeat_timeout", "timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds; got {getattr(self, name)!r}")
        if self.config is not None and self.script:
            raise ValueError("a job runs either a config (islands train) or a script (islands run), not both")
        object.__setattr__(self, "script", tuple(self.script))

    def to_json(self) -> str:
        return json.dumps({"workers": self.workers, "heartbeat_timeout": self.heartbeat_timeout,
                           "timeout": self.timeout, "config": self.config, "script": list(self.script),
                           "cwd": self.cwd})

    @classmethod
    def from_json(cls, text: str | bytes) -> "JobSpec":
        d = json.loads(text)
        return cls(workers=int(d["workers"]), heartbeat_timeout=float(d["heartbeat_timeout"]),
                   timeout=float(d["timeout"]), config=d.get("config"), script=tuple(d.get("script") or ()),
                   cwd=d.get("cwd", ""))

    @classmethod
    def read(cls, store, timeout_s: float = 30.0) -> "JobSpec":
        return cls.from_json(wait_key(store, "job", timeout_s, "job description in the store"))


def connect(host: str, port: int, timeout_s: float = 30.0) -> dist.Store:
    """A client of the job's store, all keys under islands/."""
    raw = dist.TCPStore(host, port, is_master=False, timeout=_dt.timedelta(seconds=timeout_s))
    return dist.PrefixStore(PREFIX.rstrip("/"), raw)


def host_store(port: int = 0, timeout_s: float = 30.0) -> tuple[dist.TCPStore, dist.Store]:
    """The launcher's store (the server) and a prefixed client view of it."""
    raw = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                        timeout=_dt.timedelta(seconds=timeout_s))
    return raw, dist.PrefixStore(PREFIX.rstrip("/"), raw)


def proof(token: str, name: str, challenge: str) -> str:
    return hmac.new(token.encode(), f"islands-join|{name}|{challenge}".encode(), hashlib.sha256).hexdigest()


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
    verdict = json.loads(wait_key(store, f"join/{ticket}/verdict", timeout_s, "verdict from the coordinator"))
    if not verdict["admitted"]:
        raise Refused(verdict["reason"])
    return Admission(verdict["slot"], verdict["shard"], verdict["initial"])


class Heartbeat:
    """A thread bumping hb/<name> every HEARTBEAT_INTERVAL on its own store connection."""

    def __init__(self, host: str, port: int, name: str):
        self.store = connect(host, port)
        self.name = name
        self._stop = threading.Event()
        self.store.add(f"hb/{name}", 1)
        self._thread = threading.Thread(target=self._run, name="islands-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL):
            try:
                self.store.add(f"hb/{self.name}", 1)
            except Exception:  # the store is gone: the job is over; the main thread will see it too
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class Liveness:
    """Who is gone: a supervisor's dead/<name> flag (immediate) or a heartbeat stale past the timeout."""

    def __init__(self, store, timeout_s: float):
        self.store, self.timeout = store, timeout_s
        self._seen: dict[str, tuple[int, float]] = {}

    def gone(self, names) -> set[str]:
        now, out = time.monotonic(), set()
        for name in names:
            if self.store.check([f"dead/{name}"]):
                out.add(name)
                continue
            beat = self.store.add(f"hb/{name}", 0)
            last = self._seen.get(name)
            if last is None or last[0] != beat:
                self._seen[name] = (beat, now)
            elif now - last[1] > self.timeout:
                out.add(name)
        return out


class Coordinator:
    """Runs in the launcher: answers join handshakes, forms epoch 0, keeps the pending list.

    Shard policy: shards are 0..workers-1 (job.workers). The first `workers` admitted take their
    admission order; a later joiner takes the lowest shard no member of the newest epoch (and no
    pending joiner) holds, i.e. it takes over a departed worker's data; if every shard is held it
    shares shard slot % workers.
    """

    def __init__(self, store, token: str, job: JobSpec, log=print):
        if not token:
            raise ValueError("an elastic job needs a non-empty token")
        if not isinstance(job, JobSpec):
            raise TypeError(f"Coordinator takes the job's JobSpec; got {type(job).__name__}")
        self.store, self._token, self.workers, self.log = store, token, job.workers, log
        store.set("job", job.to_json())
        self.next_ticket = 1
        self.admitted: list[list] = []  # [slot, name, shard]
        self.open: dict[int, tuple[str, str, float]] = {}  # ticket -> (name, challenge, deadline)
        self.formed = False
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="islands-coordinator", daemon=True)

    def start(self) -> "Coordinator":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def mark_dead(self, name: str) -> None:
        self.store.set(f"dead/{name}", "1")

    def latest_epoch(self) -> int:
        return int(self.store.get("latest")) if self.store.check(["latest"]) else 0

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.poll()
            except Exception as e:  # the store closed under us at shutdown
                if not self._stop.is_set():
                    self.log(f"elastic coordinator: {e}")
                return

    def poll(self) -> None:
        tickets = self.store.add("join/tickets", 0)
        while self.next_ticket <= tickets:
            t = self.next_ticket
            if not self.store.check([f"join/{t}/name"]):
                break  # its name is on the way
            challenge = secrets.token_hex(16)
            self.open[t] = (self.store.get(f"join/{t}/name").decode(), challenge, time.monotonic() + 30)
            self.store.set(f"join/{t}/challenge", challenge)
            self.next_ticket += 1
        for t, (name, challenge, deadline) in list(self.open.items()):
            if self.store.check([f"join/{t}/proof"]):
                del self.open[t]
                self._judge(t, name, challenge, self.store.get(f"join/{t}/proof").decode())
            elif time.monotonic() > deadline:
                del self.open[t]
        if self.formed:
            self._prune_pending()

    def _judge(self, ticket: int, name: str, challenge: str, given: str) -> None:
        if not hmac.compare_digest(given, proof(self._token, name, challenge)):
            self.refused += 1
            self.log(f"elastic: refused {name!r}: its token does not match this job's")
            self._verdict(ticket, admitted=False, reason="wrong token: the join proof does not match this job's token")
            return
        if any(a[1] == name for a in self.admitted):
            self._verdict(ticket, admitted=False, reason=f"name {name!r} is already taken in this job")
            return
        slot = len(self.admitted)
        initial = not self.formed
        shard = slot if initial else self.shard_for(slot)
        self.admitted.append([slot, name, shard])
        self._verdict(ticket, admitted=True, slot=slot, shard=shard, initial=initial)
        if initial and len(self.admitted) == self.workers:
            self.store.set("e/0/members", json.dumps(self.admitted))
            self.formed = True
            self.log(f"elastic: epoch 0 formed with {self.workers} workers")
        elif not initial:
            pending = get_json(self.store, "pending", [])
            self.store.set("pending", json.dumps(pending + [[slot, name, shard]]))
            self.log(f"elastic: admitted {name!r} (slot {slot}, shard {shard}); it joins at the next round")

    def _verdict(self, ticket: int, **verdict) -> None:
        self.store.set(f"join/{ticket}/verdict", json.dumps(verdict))

    def shard_for(self, slot: int) -> int:
        members = get_json(self.store, f"e/{self.latest_epoch()}/members", [])
        held = {m[2] for m in members} | {p[2] for p in get_json(self.store, "pending", [])}
        free = [s for s in range(self.workers) if s not in held]
        return free[0] if free else slot % self.workers

    def _prune_pending(self) -> None:
        pending = get_json(self.store, "pending", [])
        keep = [p for p in pending if not self.store.check([f"joinat/{p[1]}"])]
        if len(keep) != len(pending):
            self.store.set("pending", json.dumps(keep))
