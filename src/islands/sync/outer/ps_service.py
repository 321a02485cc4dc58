"""Parameter servers as processes of their own (issue #36, parts 2-3): S shard servers, each owning one parameter
range, and a supervisor that hosts their store and brings a killed or frozen server back from its journal.

    config = ServiceConfig(initial_flat, rule, servers=2, lease_s=2.0)
    config.save(dir)                        # the directory holds config.pt and one journal per shard
    sup = Supervisor(dir); sup.start()      # hosts the store; spawns `python -m islands.sync.outer.ps_process
                                            # serve DIR SHARD HOST PORT` per shard, restarts any that dies
    link = RemoteLink(("127.0.0.1", sup.port), 0, config.bounds).start()  # ps_remote.py: the island's side

A shard server (ShardServer) rebuilds its DurableShard from its journal (ps_journal.py: nothing it acknowledged is
lost), announces a new generation in the store (`gen/<shard>`), then accepts connections: an island adds one to
`conn/<shard>/<gen>` and both sides make a two-rank gloo group under that number (ps_wire.Pair), served by a
thread of its own, so an island that is killed or frozen stalls only its own connection. Under one lock each message
is applied: PULL (a joiner, or a reconnect: the current slice), PUSH (logged, applied, answered with the ack and the
slice; a push already applied is answered, not applied again), DONE (this island is done; the answer is `final` once
no island is still training), LEAVE (gone now, nobody waits), SNAPSHOT / RESTORE (the job's checkpoints).

Buffers (ps_buffers.py), for a model that has them (`ServiceConfig.buffers`): shard 0 alone holds them (they are
small, and one holder answers every island with one mean). A push to shard 0 carries the island's buffer vector
after its payload; each of shard 0's answers with a model carries the mean of every island's latest after the
slice. The table is durable as the pushes are (ps_journal.py): each vector is logged in its push's record, the
table is in every commit and in SNAPSHOT / RESTORE, so a rebuilt or restored shard 0 answers with the mean it would
have given had it not died. A push refused because the final answer has gone out keeps no buffers either. Only a
journal or checkpoint written before buffers were journaled gives an empty table: answers carry none until the
islands' next pushes (the island keeps its own meanwhile).

Membership is what the islands do, not a list fixed at the start: an island is live from its first message until its
DONE or LEAVE, or until its heartbeat (the counter `beat/<island>` its RemoteLink bumps every lease/4 seconds) stands
still for `lease_s`: then it has lapsed (killed, frozen or cut off), the quorum stops counting it and the final answer
stops waiting for it; a message from it makes it live again. The server bumps `sbeat/<shard>` the same way.

The supervisor (a thread of a test, or `python -m islands.sync.outer.ps_process supervise DIR`, a process of its own
session so it outlives the island that started it) hosts the TCPStore and watches each server: exited while the job
runs, or heartbeat still for `lease_s` (frozen: killed first), and it starts the shard again, which rebuilds from its
journal; only one process per shard ever writes the journal (the next starts after the previous is dead). The store
key `stop` ends the job: servers leave once every island they knew has its final answer (or has lapsed) and the
supervisor once its servers are gone; with no island heartbeat for `orphan_s` it stops on its own.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import io
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NoReturn, Protocol

import torch
import torch.distributed as dist

from islands.aggregate.base import Aggregator
from islands.runtime.payload_auth import PayloadTags
from islands.sync.outer.flat import fragment_bounds
from islands.sync.outer.outer_opt import OuterOptimizer
from islands.sync.outer.ps_buffers import NO_BUFFERS, BufferTable, Layout
from islands.sync.outer.ps_journal import COMMIT_EVERY, DurableShard, Journal
from islands.sync.outer.ps_pulls import HeldCopies, PullCodec, Pulled
from islands.sync.outer.ps_report import (
    REPORT,
    collect,
    process_usage,
    report_key,
    server_numbers,
    write_collected,
)
from islands.sync.outer.ps_server import Contribution, ServerState, check_server_options
from islands.sync.outer.ps_wait import JoinAlignment, WindowWait, window_wait
from islands.sync.outer.ps_wire import (
    DONE,
    HOLDS_MODEL,
    LEAVE,
    PULL,
    PUSH,
    RESTORE,
    SNAPSHOT,
    Pair,
    Request,
    ShardReply,
    StoreCalls,
    StoreSilent,
    as_bytes,
    new_client,
)
from islands.sync.outer.quant4 import PayloadCodec

CONFIG = "config.pt"
RATE_MIN_BYTES = 1 << 20  # a push this large measures its island's link; a smaller one is mostly latency
ADDRESS = "address"
# a shard server whose supervisor's store answers nothing this long (a TCPStore master answers from a C++ thread of
# its own, busy Python or not: only a stopped or dead process is this slow) ends itself (ShardServer._watch_supervisor)
SUPERVISOR_SILENT_S = 5.0
ORPHANED_EXIT = 3  # the exit code of a shard server that ended because its supervisor was gone or silent
HOLD_POLL_S = 0.005  # how often a held push looks for its window's step (ShardServer.hold)
SCRATCH = "scratch"  # in a service's directory: a temporary one its starting island made (ps_process.py removes it)


@dataclass
class ServiceConfig:
    """What every shard server and island of one parameter server job agree on; written once by the island that
    starts the service. `rule`: islands -> an outer optimizer (picklable: ps.OuterRule); `islands`: the islands
    expected (delayed Nesterov's default buffer); `key`/`domain`: the job's payload tags, when payloads are
    authenticated (the file is written 0600 in a private directory). `ends_with_starter`: a fixed job's service,
    which ends as soon as the island process that started it is gone (the job failed with it: nobody would restart
    it), instead of after `orphan_s`; an elastic job's outlives its starter, which may come back. `buffers`: the
    layout of the islands' buffer vectors (ps_buffers), (0, 0) for a model without buffers."""

    initial: torch.Tensor
    rule: Callable[[int], OuterOptimizer]
    islands: int = 1
    servers: int = 1
    shards: int = 1
    max_staleness: int = 4
    quorum: int = 1
    discount: float = 0.0
    aggregator: Aggregator | None = None
    codec: PayloadCodec | None = None
    pulls: PullCodec | None = None  # compressed pulls (ps_pulls): each shard keeps every live island's copy
    scale: Callable[[Sequence[int]], float] | None = None  # pushes per staleness -> lr factor (ps_server.StaleCap)
    per_push: bool = False  # the rule's lr is each push's: a window of k pushes steps k x its mean (ps_server)
    # a push short of its window's quorum waits for it by this rule (ps_wait; seconds or "auto" are made into one)
    wait: WindowWait | float | str | None = None
    lease_s: float = 2.0
    timeout_s: float = 600.0
    commit_every: int = COMMIT_EVERY
    key: bytes | None = None
    domain: bytes = b""
    orphan_s: float = 600.0
    start_s: float = 120.0  # a new server's first heartbeat may take this long (interpreter, torch, the rebuild)
    max_restarts: int = 20  # per shard: a server that keeps dying (a bad configuration) ends the job instead
    ends_with_starter: bool = False
    buffers: Layout = NO_BUFFERS  # the islands' buffer vectors (floating, integer values): held by shard 0
    bounds: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self):
        self.initial = self.initial.detach().to(torch.float32).flatten().clone()
        if isinstance(self.servers, bool) or not isinstance(self.servers, int) or self.servers < 1:
            raise ValueError(
                f"servers must be an int >= 1 (server processes, one parameter range each), got {self.servers!r}"
            )
        if self.servers > max(1, self.initial.numel()):
            raise ValueError(f"servers must be at most the parameter count {self.initial.numel()}, got {self.servers}")
        if not self.lease_s > 0 or not self.timeout_s > 0:
            raise ValueError(f"lease_s and timeout_s must be > 0 seconds, got {self.lease_s} and {self.timeout_s}")
        self.wait = window_wait(self.wait)
        check_server_options(self.shards, self.max_staleness, self.quorum, self.discount, self.wait)
        self.bounds = fragment_bounds(self.initial.numel(), self.servers)

    def tags(self) -> PayloadTags | None:
        return None if self.key is None else PayloadTags(self.key, self.domain)

    def shard_state(self, shard: int) -> ServerState:
        lo, hi = self.bounds[shard]
        return ServerState(
            self.initial[lo:hi],
            lambda: self.rule(self.islands),
            shards=min(self.shards, hi - lo),
            max_staleness=self.max_staleness,
            quorum=self.quorum,
            discount=self.discount,
            aggregator=self.aggregator,
            scale=self.scale,
            per_push=self.per_push,
        )

    def save(self, path: str | os.PathLike) -> Path:
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = d / (CONFIG + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            torch.save(self, f)
        os.replace(tmp, d / CONFIG)
        return d

    @staticmethod
    def load(path: str | os.PathLike) -> ServiceConfig:
        # weights_only=False: the file holds the rule, codec and aggregator objects; it is this job's own file, in
        # a directory only its user can read, written by the island that started the service
        config = torch.load(Path(path) / CONFIG, weights_only=False)
        if not isinstance(config, ServiceConfig):
            raise ValueError(f"{path}/{CONFIG} is not a parameter server configuration")
        return config


class Members:
    """Which islands are training, by their messages and heartbeats (module docstring)."""

    def __init__(self, store, lease_s: float):
        self.store, self.lease_s = store, lease_s
        self.state: dict[int, str] = {}  # island -> live | done | left | lapsed
        self.beats: dict[int, tuple[int, float]] = {}  # island -> (counter, when it last moved)
        self.final_sent: set[int] = set()
        self.busy: dict[int, int] = {}  # island -> its messages between header and answer, on any connection
        self.rate: dict[int, float] = {}  # island -> bytes/s its last large push arrived at (its link's pace)
        self.incoming: dict[int, int] = {}  # island -> its messages whose header is in and whose body is not yet

    def begin(self, island: int) -> None:
        """A message of `island` has started to arrive: it is alive until the answer has left. Its heartbeat shares
        the link with the message and may stand still behind it (a 7 MB push takes 2.8 s at 20 Mbit/s, longer
        than the default 2 s lease), which must not read as a death."""
        self.busy[island] = self.busy.get(island, 0) + 1
        self.incoming[island] = self.incoming.get(island, 0) + 1

    def landed(self, island: int) -> None:
        """The message begun has arrived whole (or its connection broke before it did)."""
        self.incoming[island] = max(0, self.incoming.get(island, 0) - 1)

    def receiving(self) -> bool:
        """Whether some island's message is on its way in: a held window's deadline waits for it (ShardServer.hold;
        a slow link's transfer is not a late island, as ps_link.FirstCome has it for thread mode)."""
        return any(self.incoming.values())

    def arrived(self, island: int, nbytes: int, seconds: float) -> None:
        """A push of `nbytes` took `seconds` from its header to its last byte: the pace of the island's link (only
        pushes large enough to measure it)."""
        if nbytes >= RATE_MIN_BYTES and seconds > 0:
            self.rate[island] = nbytes / seconds

    def end(self, island: int, answered_bytes: int = 0) -> None:
        """The answer has left (or the connection broke): the lease counts again once it can have arrived. gloo's
        send returns when the bytes are in this host's socket buffers, not at the island, and the island's
        heartbeat queues behind them: at 5 Mbit/s ~4 MB of buffered answer is 6 s more, past a 2 s lease
        (measured: the island lapsed, the job's end went on without it). So the lease starts after the answer's
        bytes at the pace the island's last push came in."""
        self.busy[island] = max(0, self.busy.get(island, 0) - 1)
        rate = self.rate.get(island)
        grace = answered_bytes / rate if rate else 0.0
        last = self.beats.get(island, (-1, 0.0))[0]
        self.beats[island] = (last, time.monotonic() + grace)

    def live_islands(self) -> set[int]:
        return {island for island, s in self.state.items() if s == "live"}

    def live(self) -> int:
        return len(self.live_islands())

    def mark(self, island: int, state: str) -> None:
        self.state[island] = state
        self.beats[island] = (self.beats.get(island, (-1, 0.0))[0], time.monotonic())

    def lapse(self) -> list[int]:
        """Islands whose heartbeat stood still for the lease: marked lapsed, returned. A training island, and one
        that is done but still waits for its final answer: it beats while it polls, so a silent one died there
        (session 38: an island SIGKILLed while it polled stayed done for good, the servers never settled, and they
        and their supervisor outlived the job by hours)."""
        now, gone = time.monotonic(), []
        for island, s in self.state.items():
            count = int(self.store.add(f"beat/{island}", 0))
            last, since = self.beats.get(island, (-1, now))
            waiting = s == "live" or (s == "done" and island not in self.final_sent)
            if count != last:
                self.beats[island] = (count, max(since, now))  # an answer's delivery time (end) stays ahead
            elif waiting and now - since > self.lease_s and not self.busy.get(island):
                self.state[island] = "lapsed"
                gone.append(island)
        return gone

    def settled(self) -> bool:
        """Every island known has its final answer, delivered, or is gone: a stopping server may leave. Delivered:
        the answer's bytes at the island's pace have had time to arrive (end); leaving closes the connections, and
        a final answer still in this host's socket buffers would be cut off (measured at 5 Mbit/s: the island's
        receive of its final model failed as the servers left)."""
        now = time.monotonic()

        def delivered(island: int) -> bool:  # its last answer has left (not busy) and can have arrived
            return not self.busy.get(island) and now >= self.beats.get(island, (-1, 0.0))[1]

        return all(
            s in ("left", "lapsed") or (s == "done" and i in self.final_sent and delivered(i))
            for i, s in self.state.items()
        )


class ShardServer:
    """One parameter range's server (module docstring); run() serves until the job stops."""

    def __init__(self, directory: str | os.PathLike, shard: int, host: str, port: int):
        self.dir, self.shard, self.host, self.port = Path(directory), shard, host, port
        self.config = ServiceConfig.load(self.dir)
        if not 0 <= shard < self.config.servers:
            raise ValueError(f"shard {shard} of {self.config.servers} servers")
        journal = Journal(self.dir / f"shard{shard}", self.config.commit_every)
        # shard 0: each island's latest buffers, journaled with its pushes (module docstring); None elsewhere
        table = BufferTable(self.config.buffers) if shard == 0 and self.config.buffers != NO_BUFFERS else None
        self.durable = DurableShard(self.config.shard_state(shard), journal, table)
        # with compressed pulls, the copy of this range each live island holds; not journaled: a rebuilt server's
        # first answer to each island is whole (ps_pulls)
        self.copies = HeldCopies(self.config.pulls, shard)
        self.store = new_client(host, port, 30.0)
        self.members = Members(self.store, self.config.lease_s)
        # this server's own rule, loaded from the directory: it times its own windows
        self.wait = window_wait(self.config.wait)
        self.window: tuple[int, float, set[int]] | None = None  # the held window: (version, opened, islands in it)
        self.lock = threading.Lock()
        self.tags = self.config.tags()
        self.gen = 0
        self.done = threading.Event()
        self.pairs: list[Pair] = []  # open connections, torn down when the server leaves
        self.startup = {"cpu_seconds": 0.0, "max_rss_bytes": 0}  # its usage once it served: interpreter, imports,
        # the journal's rebuild (what the report's numbers hold besides serving)

    @property
    def buffers(self) -> BufferTable | None:
        """Shard 0's buffer table (its DurableShard's), None on the others or for a model without buffers."""
        return self.durable.buffers

    def run(self) -> None:
        self.durable.open()  # the rebuild: the committed state plus the acknowledged pushes since
        self.gen = int(self.store.add(f"gen/{self.shard}", 1))
        self.startup = process_usage()
        parent = os.getppid()  # its supervisor
        threading.Thread(target=self._watch_supervisor, args=(parent,), name="islands-ps-watch", daemon=True).start()
        threading.Thread(target=self._accept, name="islands-ps-accept", daemon=True).start()
        try:
            while not self.done.is_set():
                self.store.add(f"sbeat/{self.shard}", 1)
                with self.lock:
                    lapsed = self.members.lapse()
                    for island in lapsed:  # a lapsed island that wakes gets a whole answer
                        self.copies.forget(island)
                    if lapsed:
                        self.durable.settle(self.members.live())
                    if self.store.check(["stop"]) and self.members.settled():
                        self.done.set()
                    self.publish(final=False)  # what a kill leaves of this process's numbers
                self.done.wait(self.config.lease_s / 4)
        except dist.DistError as e:  # any of the loop's store calls: the supervisor died with its store (the watch
            self._orphaned(f"its store is gone ({type(e).__name__})")  # may not have seen it yet)
        finally:
            with self.lock:
                self.durable.close()
                for pair in self.pairs:
                    pair.close()
                self.publish(final=True)

    def _watch_supervisor(self, parent: int) -> None:
        """End this server once its supervisor is gone or its store is silent for SUPERVISOR_SILENT_S: nobody would
        restart it, stop it or read its heartbeat any more, and a TCPStore client waits for ever on a stopped master
        (ps_wire.StoreSilent), so without this a frozen supervisor left its servers hung for good. Ending is as safe
        as a kill: every push this server acknowledged is in its journal already, for whichever server the shard
        gets next (a thawed supervisor restarts it; a new service on the same directory rebuilds it)."""
        store, calls = new_client(self.host, self.port, SUPERVISOR_SILENT_S), StoreCalls(f"{self.host}:{self.port}")
        silent = max(SUPERVISOR_SILENT_S, 2 * self.config.lease_s)
        while not self.done.wait(0.25):
            if os.getppid() != parent:  # a process that loses its parent is handed to another one
                self._orphaned(f"its supervisor (pid {parent}) has died")
            try:
                calls(lambda: store.check(["stop"]), silent)
            except StoreSilent:
                self._orphaned(f"its supervisor's store has not answered for {silent:.0f} s (stopped or hung)")
            except dist.DistError as e:
                self._orphaned(f"its store is gone ({type(e).__name__})")

    def _orphaned(self, why: str) -> NoReturn:
        print(
            f"islands-ps shard {self.shard} (pid {os.getpid()}): {why}; this server ends, and its journal keeps every "
            "push it acknowledged",
            file=sys.stderr,
            flush=True,
        )
        os._exit(ORPHANED_EXIT)

    def publish(self, final: bool) -> None:
        """This process's report (ps_report.py) in the store, for the supervisor to collect; the final one also
        measures the state's tensors. Under the lock."""
        report = {
            "shard": self.shard,
            "gen": self.gen,
            "pid": os.getpid(),
            "final": final,
            "parameters": list(self.config.bounds[self.shard]),
            "startup_cpu_seconds": self.startup["cpu_seconds"],
            "startup_max_rss_bytes": self.startup["max_rss_bytes"],
            "finals": sorted(self.members.final_sent),  # islands answered final: an elastic supervisor waits for them
            **process_usage(),
            **server_numbers(self.durable.state, self.durable.duplicates, memory=final),
        }
        if self.config.pulls is not None:  # answers whole and compressed (ps_pulls)
            report["pulls"] = self.copies.report()
        try:
            self.store.set(report_key(self.shard, self.gen), json.dumps(report))
        except RuntimeError:  # the store is gone (the supervisor was killed): nobody is left to read it
            pass

    def _accept(self) -> None:
        seen = 0
        while not self.done.is_set():
            count = int(self.store.add(f"conn/{self.shard}/{self.gen}", 0))
            for k in range(seen + 1, count + 1):
                threading.Thread(target=self._serve, args=(k,), name=f"islands-ps-conn{k}", daemon=True).start()
            seen = count
            time.sleep(0.01)

    def _serve(self, k: int) -> None:
        name = f"pair/{self.shard}/{self.gen}/{k}"
        try:
            island = int(self.store.get(f"conn/{self.shard}/{self.gen}/{k}"))
            client = new_client(self.host, self.port, 10.0)
            pair = Pair.connect(client, name, 0, 10.0, self.config.timeout_s, self.tags)
        except RuntimeError:  # the island gave up before we met: it connects again under a new number
            return
        with self.lock:
            self.pairs.append(pair)
        inflight = [0.0]  # this connection's message: when its header came (0: none between header and answer)
        coming = [False]  # its header is in and its body is not yet

        def started() -> None:
            with self.lock:
                self.members.begin(island)
                inflight[0], coming[0] = time.monotonic(), True

        def landed() -> None:
            with self.lock:
                if coming[0]:
                    self.members.landed(island)
                    coming[0] = False

        try:
            while not self.done.is_set():
                try:
                    msg = pair.request(started)
                finally:
                    landed()
                if msg.island != island:
                    raise ValueError(f"connection of island {island} sent a message as island {msg.island}")
                if msg.kind == PULL:
                    self.align(island)
                if msg.payload is not None:
                    with self.lock:
                        self.members.arrived(island, msg.payload.numel(), time.monotonic() - inflight[0])
                        if self.wait is not None and msg.kind == PUSH:
                            self.wait.arrived(island, time.monotonic())
                reply = self.handle(msg)
                if msg.kind == PUSH:
                    reply = self.hold(reply, msg)
                pair.answer(reply)
                with self.lock:
                    if self.wait is not None and msg.kind == PUSH:  # its next round starts
                        self.wait.answered(island, time.monotonic())
                    elif self.wait is not None and msg.kind == PULL:  # it starts (or starts again)
                        self.wait.started(island, time.monotonic())
                    self.members.end(
                        island, 0 if reply.body is None else reply.body.numel() * reply.body.element_size()
                    )
                    inflight[0] = 0.0
        except (RuntimeError, ValueError):  # killed, frozen past the timeout, or refused: this connection only
            with self.lock:
                if inflight[0]:  # broken between a header and its answer
                    self.members.end(island)
            pair.close()

    def handle(self, msg: Request) -> ShardReply:
        with self.lock:
            m, d = self.members, self.durable
            if msg.kind == SNAPSHOT:
                return ShardReply(True, d.state.version, 0, body=_state_bytes(d.state_dict()))
            if msg.kind == RESTORE:
                assert msg.payload is not None, "a restore carries the state"
                d.restore(_bytes_state(msg.payload))
                self.copies.forget_all()  # every island's next answer is whole
                return ShardReply(True, d.state.version, 0)
            stepped, duplicate, accepted, staleness = False, False, True, 0
            # once this shard has answered a final model, that slice is the job's: an island that lapsed and woke
            # after it (a thawed host, a heartbeat starved past the lease) has its pushes refused and its DONE
            # answered with the same slice, so no two islands end on different models
            ended = bool(m.final_sent)
            if msg.kind == PUSH:
                m.mark(msg.island, "live")
                msg, buffers = self.take_buffers(msg)
                if ended:  # refused, buffers too: the final answers' mean is the job's, as their slice
                    accepted = False
                else:
                    c = Contribution(msg.island, msg.version, self._decode(msg), msg.samples)
                    ack, duplicate = d.push(msg.island, msg.nonce, msg.seq, c, m.live(), buffers)
                    stepped, accepted, staleness = ack.stepped, ack.accepted, ack.staleness
            elif msg.kind in (DONE, LEAVE):
                m.mark(msg.island, "done" if msg.kind == DONE else "left")
                self.copies.forget(msg.island)  # DONE's answers are whole
                stepped = False if ended else d.settle(m.live())
            else:
                assert msg.kind == PULL
                m.mark(msg.island, "live")
            final = msg.kind == DONE and (ended or m.live() == 0)
            if final:
                m.final_sent.add(msg.island)
            version, flat = d.state.pull()
            if msg.kind == DONE and not final and msg.samples == HOLDS_MODEL:  # a poll: no model until the final
                return ShardReply(accepted, version, staleness, stepped, final, duplicate, None)
            reply = ShardReply(accepted, version, staleness, stepped, final, duplicate)
            return self.answered(reply, msg, flat)

    def take_buffers(self, msg: Request) -> tuple[Request, torch.Tensor | None]:
        """Shard 0 of a model with buffers: the push with its range's payload alone, and the island's buffer vector
        (the payload's tail; its own storage, so its journal record holds those bytes alone), which DurableShard.push
        logs in the push's record and then keeps; (msg, None) elsewhere."""
        table = self.buffers
        if table is None:
            return msg, None
        assert msg.payload is not None, "a push carries its delta"
        cut = msg.payload.numel() - table.numel * 8
        if cut < 0:
            raise ValueError(f"island {msg.island}'s push is shorter than its buffers ({table.numel} values)")
        return replace(msg, payload=msg.payload[:cut]), msg.payload[cut:].clone().view(torch.float64)

    def answered(self, reply: ShardReply, msg: Request, flat: torch.Tensor) -> ShardReply:
        """`reply` with its body: the model slice (with compressed pulls, a push's or pull's answer steps the copy
        the island holds, ps_pulls; a DONE's is whole), then on shard 0 the islands' buffer mean when it holds any.
        Under the lock."""
        pulled = self.copies.answer(msg.island, msg.held, flat) if msg.kind in (PUSH, PULL) else Pulled(flat)
        table = self.buffers
        shared = table.mean() if table is not None else None
        body = pulled.body if shared is None else torch.cat([as_bytes(pulled.body), as_bytes(shared)])
        coded = pulled.body.numel() if pulled.coded else 0
        return replace(reply, body=body, token=pulled.token, coded=coded)

    def align(self, island: int) -> None:
        """A pull of an island starting beside others mid-round, with a rule that aligns them (ps_wait.JoinAlignment):
        held until their next window steps or the rule's time runs out, then answered with the model as it is (so
        with that window's step). The puller is not live meanwhile: no window waits for it."""
        wait = self.wait
        if not isinstance(wait, JoinAlignment):
            return
        with self.lock:
            version = self.durable.state.version
            until = wait.align_until(time.monotonic(), self.members.live_islands() - {island})
        while not self.done.is_set() and time.monotonic() < until:
            with self.lock:
                if self.durable.state.version != version:
                    return
            time.sleep(HOLD_POLL_S)

    def hold(self, reply: ShardReply, msg: Request) -> ShardReply:
        """With a wait rule (ps_wait): a push accepted into a window short of its quorum is answered once the window
        steps, or, at the rule's deadline, steps the window with what it holds (ps_link.ServerLoop's rule, on this
        shard alone: each server times its own window). A push already on its way in at the deadline is waited for
        (its island is not late: its link is slow), up to the message timeout. The step is journaled as a settle,
        so a rebuilt shard replays it."""
        wait = self.wait
        if not (wait is not None and reply.accepted and not reply.stepped and not reply.duplicate):
            return reply
        with self.lock:
            if self.window is None or self.window[0] != reply.version:
                self.window = (reply.version, time.monotonic(), set())
            _, opened, held = self.window
            held.add(msg.island)
        limit = opened + self.config.timeout_s
        while not self.done.is_set():
            with self.lock:
                if self.durable.state.version != reply.version:
                    break
                end = wait.deadline(opened, self.members.live_islands() - held)
                now = time.monotonic()
                if now >= end and (now >= limit or not self.members.receiving()):
                    self.durable.settle(1)
                    break
            time.sleep(HOLD_POLL_S)
        with self.lock:
            version, flat = self.durable.state.pull()
            return self.answered(replace(reply, version=version, stepped=True), msg, flat)

    def _decode(self, msg: Request) -> torch.Tensor:
        assert msg.payload is not None, "a push carries its delta"
        numel = self.durable.state.numel
        if self.config.codec is not None:
            return self.config.codec.decode(msg.payload, numel)
        return msg.payload.view(torch.float32).clone()


def _state_bytes(state: dict) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _bytes_state(data: torch.Tensor) -> dict:
    return torch.load(io.BytesIO(as_bytes(data).numpy().tobytes()), weights_only=True)


# ---- the supervisor ------------------------------------------------------------------------------------------
def _pythonpath() -> str:
    """The server processes import this islands (a worktree's src/ wins over an installed copy)."""
    here = str(Path(__file__).resolve().parents[3])
    rest = os.environ.get("PYTHONPATH", "")
    return here + (os.pathsep + rest if rest else "")


class ShardProcess(Protocol):
    """A running shard server, as subprocess.Popen answers (pid, poll, kill, wait)."""

    pid: int

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


Starter = Callable[[Path, int, str, int], ShardProcess]  # (directory, shard, store host, store port) -> process


def start_shard(directory: Path, shard: int, host: str, port: int) -> ShardProcess:
    """A shard server as a fresh interpreter: `python -m islands.sync.outer.ps_process serve DIR SHARD HOST PORT`."""
    argv = [sys.executable, "-m", "islands.sync.outer.ps_process", "serve", str(directory), str(shard)]
    return subprocess.Popen([*argv, host, str(port)], env={**os.environ, "PYTHONPATH": _pythonpath()})


def serve(directory: str | os.PathLike, shard: int, host: str, port: int) -> None:
    """A shard server's whole life (the body of its process)."""
    ShardServer(directory, shard, host, port).run()


class Supervisor:
    """Hosts the store and keeps one live server per shard (module docstring). start() runs it in a thread;
    `python -m islands.sync.outer.ps_process supervise DIR` runs it as a process (its address in DIR/address).
    `starter`: how a shard's process starts (default a fresh interpreter; tests fork a preloaded one). `raw`: a
    store already hosted here (a server host's, ps_host.py) instead of a new one on `port`. `starter_alive`: whether
    the island process that started it still runs; with the configuration's `ends_with_starter` its end stops the
    servers at once."""

    def __init__(
        self,
        directory: str | os.PathLike,
        host: str = "127.0.0.1",
        port: int = 0,
        starter: Starter = start_shard,
        raw: dist.TCPStore | None = None,
        starter_alive: Callable[[], bool] | None = None,
    ):
        self.dir, self.starter = Path(directory), starter
        self.starter_alive = starter_alive  # whether the island process that started it lives (ends_with_starter)
        self.config = ServiceConfig.load(self.dir)
        if raw is None:
            raw = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=_dt.timedelta(seconds=30))
        self.raw = raw
        self.host, self.port = host, int(self.raw.port)
        self.store = dist.PrefixStore("islands-ps", self.raw)
        self.procs: list[ShardProcess | None] = [None] * self.config.servers
        self.restarts = [0] * self.config.servers
        self.beats: list[tuple[int, float, bool]] = [(0, 0.0, False)] * self.config.servers  # count, since, moved
        self.thread: threading.Thread | None = None
        self.stopped = threading.Event()
        (self.dir / REPORT).unlink(missing_ok=True)  # an earlier job's on the same directory is not this one's
        tmp = self.dir / (ADDRESS + ".tmp")
        tmp.write_text(f"{self.host}:{self.port}\n")
        os.replace(tmp, self.dir / ADDRESS)

    def start(self) -> Supervisor:
        self.thread = threading.Thread(target=self.run, name="islands-ps-supervisor", daemon=True)
        self.thread.start()
        return self

    def spawn(self, shard: int) -> None:
        self.procs[shard] = self.starter(self.dir, shard, self.host, self.port)
        self.beats[shard] = (int(self.store.add(f"sbeat/{shard}", 0)), time.monotonic(), False)

    def pid(self, shard: int) -> int:
        proc = self.procs[shard]
        assert proc is not None, "started"
        return proc.pid

    def run(self) -> None:
        for shard in range(self.config.servers):
            self.spawn(shard)
        island_beat, idle_since = -1, time.monotonic()
        orphaned_at: float | None = None  # when no island had beaten for orphan_s
        try:
            while True:
                stopping = self.store.check(["stop"])
                if not stopping and self.starter_gone():
                    self.store.set("stop", "the island process that started the servers is gone")
                    stopping = True
                # nobody is left to answer: a server still waiting for an island to settle is ended (its journal
                # holds every push it acknowledged), so no service outlives its islands for good
                abandon = orphaned_at is not None and time.monotonic() - orphaned_at > 2 * self.config.lease_s
                for shard, proc in enumerate(self.procs):
                    assert proc is not None
                    if proc.poll() is None and not self._frozen(shard) and not abandon:
                        continue
                    if proc.poll() is None:  # frozen (kill, then restart) or abandoned (kill; stopping)
                        proc.kill()
                    proc.wait()
                    if not stopping and self.restarts[shard] >= self.config.max_restarts:
                        self.store.set("stop", f"shard {shard} died {self.restarts[shard] + 1} times")
                        stopping = True
                    if not stopping:
                        self.restarts[shard] += 1
                        self.store.add(f"restarts/{shard}", 1)
                        self.spawn(shard)
                if stopping and all(p is not None and p.poll() is not None for p in self.procs):
                    return
                beat = int(self.store.add("beats", 0))
                if beat != island_beat:
                    island_beat, idle_since = beat, time.monotonic()
                elif time.monotonic() - idle_since > self.config.orphan_s and orphaned_at is None:
                    self.store.set("stop", "orphaned")  # no island has beaten for orphan_s: nobody is left
                    orphaned_at = time.monotonic()
                time.sleep(0.05)
        finally:
            for proc in self.procs:
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
            self.write_report()
            self.stopped.set()

    def starter_gone(self) -> bool:
        """A fixed job's service whose starting island process has exited (killed, or failed without a word)."""
        return self.config.ends_with_starter and self.starter_alive is not None and not self.starter_alive()

    def write_report(self) -> None:
        """Its servers' reports and its restarts, into DIR/report.json for island 0 (ps_report.py); the servers are
        gone by now, so each one's last report is in the store."""
        try:
            stop = self.store.get("stop").decode() if self.store.check(["stop"]) else None
            write_collected(self.dir, collect(self.store, self.config.servers, self.restarts, stop))
        except (RuntimeError, OSError) as e:  # the island reads no file and says the report is missing
            print(f"islands-ps supervisor: no server report written: {e}", file=sys.stderr)

    def _frozen(self, shard: int) -> bool:
        count = int(self.store.add(f"sbeat/{shard}", 0))
        last, since, moved = self.beats[shard]
        if count != last:
            self.beats[shard] = (count, time.monotonic(), True)
            return False
        # a new server imports torch and rebuilds from its journal before its first beat
        return time.monotonic() - since > (self.config.lease_s if moved else self.config.start_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        self.store.set("stop", "asked")
        if self.thread is not None:
            self.thread.join(timeout_s)


def advertised_host(env=None) -> str:
    """The address other machines reach this one's servers by: the IPv4 address of the interface gloo is bound to
    (GLOO_SOCKET_IFNAME, which a testbed host's workers and a multi-machine job set), else 127.0.0.1 (one machine).
    The store listens on every interface either way; this is only what the islands are told."""
    ifname = (os.environ if env is None else env).get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if not ifname:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # SIOCGIFADDR: the interface's address
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
    except OSError as e:
        raise RuntimeError(
            f"GLOO_SOCKET_IFNAME={ifname!r} names no interface with an IPv4 address here ({e}); the parameter "
            "server's address could not be told to the islands"
        ) from None
    return socket.inet_ntoa(packed[20:24])


def launch(
    directory: str | os.PathLike, timeout_s: float = 60.0, host: str | None = None
) -> tuple[subprocess.Popen, tuple[str, int]]:
    """Start the supervisor as a process of its own session (it outlives the island that started it, and a
    signal to that island's process group does not reach it); returns it and the store's address. `host`: the
    address the islands reach it by (default advertised_host(): this host's gloo interface, or 127.0.0.1)."""
    d = Path(directory)
    (d / ADDRESS).unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    host = advertised_host() if host is None else host
    argv = [sys.executable, "-m", "islands.sync.outer.ps_process", "supervise", str(d), host]
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not (d / ADDRESS).exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the parameter server supervisor exited with {proc.returncode} before it started")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"the parameter server supervisor gave no address within {timeout_s:.0f} s")
        time.sleep(0.02)
    host, port = (d / ADDRESS).read_text().strip().rsplit(":", 1)
    return proc, (host, int(port))
