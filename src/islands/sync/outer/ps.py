"""The parameter server outer strategy (issue #36): islands push and pull asynchronously, no barrier between them.

A round, on each island, on its own clock:
    delta  = global_at_pull - local          (the island's pseudo-gradient, as DiLoCo's)
    push   delta, the version it pulled and the samples behind it to the server
    pull   the server's answer: the ack and the current global model; local = global
The server (ps_server.ServerState) applies each push as it arrives with a staleness-aware outer step: by default plain
SGD at lr 1/sqrt(M) per push (islands' DiLoCo step spread over the pushes; DEFAULT_PS_RULE; with a `wait`, sqrt(2)
per full window of `quorum` pushes, DiLoCo's own step: WINDOWED_LR), or the delayed Nesterov
step of arXiv 2401.09135 (outer="delayed-nesterov", delayed_nesterov.py), samples-weighted merging over a window of
`quorum` distinct islands (quorum 1: fully asynchronous; more: Decoupled DiLoCo's semi-synchrony, arXiv 2604.21428),
contributions staler than `max_staleness` versions refused (the island's round is lost and it pulls fresh).
`inner_steps` H means what DiLoCo's does: inner steps per round. The job's end is the one barrier: every island's DONE
is answered with the final model once all are done, so every island ends on the same global model.

    ParameterServer(inner_steps=50)                                  SGD, lr 1/sqrt(M) per push
    ParameterServer(50, rule=outer_rule("delayed-nesterov"))         2401.09135's step, 0.7/0.9, N = M
    ParameterServer(50, quorum=2, max_staleness=2, aggregator=CoordinateMedian())
    make_outer("ps:inner_steps=50,quorum=2,bits=4")                  the spec string, at the edge
    make_outer("ps:inner_steps=50,compressor=(topkq:ratio=0.01,bits=2)")   any compressor that stands alone (ps_codecs)

Where the server runs (`host`): in a multi-process job, a thread of rank 0 (its own island pushes in memory, the
others over gloo groups of their own, ps_link.GlooLink); under islands.simulate, pass every island the same
InProcessServer() (a thread of the simulating process). `arrivals`: FirstCome() (default) applies pushes as they
come; VirtualClock(round_seconds) fixes the order by virtual round times, so simulated and multi-process runs end on
the same model bit for bit. Buffers (BatchNorm's running statistics and step counters) ride on the pushes: the
server keeps each island's latest and answers every push and pull with their mean (integer buffers: the largest),
which the island adopts as its own, as a DiLoCo round's average (ps_buffers.py; in process mode shard 0 holds them);
at the end one collective averages them over the islands once more (average_buffers_at_the_end), so all end on one
model. `statistics="own"` keeps each island's own instead, through the end.

Islands of k workers (ddp or zero1 inside; fixed jobs in either mode, elastic ones with servers=S): the island is
one participant, its number its index (in an elastic job the one its leader takes from the job's store). Its leader
(local index 0) pushes for it and its mates take every answer from the leader (ps_island.py), so the server's M
counts islands, not workers.

`service=ServerProcesses(S)` (spec `servers=S`) runs the server as S processes of its own instead, one parameter
range each, under a supervisor that restarts a killed or frozen one from its journal; islands join, leave, freeze or
die without blocking the others (ps_service.py, ps_journal.py, ps_remote.py; docs/parameter-server.md).

In an elastic job (`islands train --elastic`) ps runs in process mode only: the first epoch's rank 0 starts the
service and writes its address in the job's authenticated store, where every other island, restarted or joining,
reads it (ps_elastic.py); a joiner pulls the global model from the servers and starts at its data shard's last
acknowledged step (contracts.ServedParticipant), and the elastic runtime makes no island wait for another until
the job's end (docs/parameter-server.md, "Elastic jobs"). An elastic island of k workers is the fixed job's: its
leader (the epochs' member) alone connects, takes the island's number and keeps the store's records; its mates take
the number, every answer and, on a restart, the step from it (the elastic runtime's hand-over).
"""

from __future__ import annotations

import datetime as _dt
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from islands.aggregate.base import Aggregator
from islands.compress.base import Compressor
from islands.runtime.contracts import Counted, ServedEnd
from islands.runtime.payload_auth import PayloadTags
from islands.runtime.simulate import current_island
from islands.sync.outer import ps_host
from islands.sync.outer.base import STATISTICS, OuterStrategy, average_buffers_at_the_end
from islands.sync.outer.delayed_nesterov import DelayedNesterov
from islands.sync.outer.outer_opt import DEFAULT_OUTER_LR, OuterOptimizer, OuterSGD
from islands.sync.outer.ps_buffers import NO_BUFFERS, IslandBuffers
from islands.sync.outer.ps_codecs import codec_state, load_codec_state, push_codec
from islands.sync.outer.ps_elastic import ElasticService
from islands.sync.outer.ps_island import IslandSide, LoneWorker, island_side, leaders
from islands.sync.outer.ps_link import (
    DONE,
    PUSH,
    Arrivals,
    FirstCome,
    GlooLink,
    GlooReceiver,
    LocalInbox,
    LocalLink,
    Message,
    Reply,
    Sealer,
    ServerLoop,
    VirtualClock,
)
from islands.sync.outer.ps_pulls import pull_codec
from islands.sync.outer.ps_remote import RemoteLink
from islands.sync.outer.ps_report import (
    process_report,
    read_collected,
    report_taken,
    take_report,
    thread_report,
)
from islands.sync.outer.ps_server import ServerState, StaleCap, check_server_options
from islands.sync.outer.ps_service import SCRATCH, ServiceConfig, launch
from islands.sync.outer.ps_wait import MARGIN, REACH, PacedWait, WindowWait, window_wait
from islands.sync.outer.ps_wire import PULL, StoreSilent
from islands.sync.outer.quant4 import PayloadCodec, Quant4
from islands.sync.outer.zstd4 import Quant4Zstd


@runtime_checkable
class HasPayloadTags(Protocol):
    """A cross-island Comm that authenticates payloads (runtime.payload_auth.AuthenticatedComm): its tags seal the
    server's point-to-point messages too."""

    @property
    def tags(self) -> PayloadTags: ...


# 2401.09135's outer step (and LIT-212's DiLoCo): lr 0.7, momentum 0.9; the delayed form's N defaults to the islands
DEFAULT_PS_LR = 0.7
DEFAULT_PS_MOMENTUM = 0.9
RULES = ("delayed-nesterov", "nesterov", "sgd")
# The default step: islands' DiLoCo default (plain SGD, lr sqrt(M) on the mean of M deltas; docs/outer-strategies.md)
# spread over the pushes, lr 1/sqrt(M) per push, no momentum. The parameter-server experiment's quick tier (digits,
# 3 islands 1x/2x/4x) reached DDP's loss with it 3.07x sooner than synchronous DiLoCo, where delayed Nesterov at
# 0.7/0.9 never reached it; on the byte LM on loopback it took 60 s to fp32 DiLoCo's loss against delayed
# Nesterov's 198 s (results/parameter-server/quick; docs/parameter-server.md)
# Since session 30 that step is held under its stability limit for the pushes' staleness (stale_cap, on by default
# for it: ps_server.StaleCap): equal-speed islands' pushes are M - 1 versions stale, and lr 1/sqrt(M) sat at 93% of
# the limit for 3 islands and past it from 4 (results/parameter-server/churn-s30)
DEFAULT_PS_RULE = "sgd"


# A server whose windows wait for their quorum (quorum >= 2 with a wait) trains equal islands as synchronous DiLoCo
# does, so its default step is DiLoCo's: sqrt(2) on a full window's mean (outer_opt.DEFAULT_OUTER_LR), sqrt(2) / k
# per push for a window of k. 1/sqrt(M) per push moved a full window of 3 by sqrt(3) x the mean, and on digits (3
# equal islands, no faults) took 340 steps to DDP's loss against DiLoCo's 240; sqrt(2) / 3 took 240, DiLoCo's loss
# curve (session 38, scripts/ps_churn_quick.py --every 0)
WINDOWED_LR = DEFAULT_OUTER_LR

Rule = Callable[[int], OuterOptimizer]  # islands M -> one shard's outer optimizer


class OuterRule:
    """The server's outer step by name, as a picklable callable islands M -> one shard's outer optimizer (server
    processes load it from their configuration file): sgd (the default; heavy ball, plain with momentum 0),
    delayed-nesterov (2401.09135; buffer N, 0 = the island count) or nesterov (momentum updated at every push: the
    paper's naive baseline). `lr` None: 1/sqrt(M) for sgd, 0.7 for the Nesterov rules; `momentum` None: 0 for sgd,
    0.9 for the Nesterov rules (DEFAULT_PS_RULE says why). `window` > 1: the server's windows wait for that many
    islands (quorum with a wait), and sgd's default lr per push is sqrt(2) / min(window, M), so that a full window
    steps DiLoCo's default, sqrt(2) on the mean, for any M (WINDOWED_LR says why)."""

    def __init__(
        self,
        outer: str = DEFAULT_PS_RULE,
        lr: float | None = None,
        momentum: float | None = None,
        buffer: int = 0,
        window: int = 1,
    ):
        if outer not in RULES:
            raise ValueError(f"outer must be one of {', '.join(RULES)}; got {outer!r}")
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 0:
            raise ValueError(
                f"buffer must be an int >= 0 (pushes per momentum update; 0: the island count), got {buffer}"
            )
        if buffer and outer != "delayed-nesterov":
            raise ValueError(f"buffer= applies to outer=delayed-nesterov only; got outer={outer}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 (islands a window waits for), got {window!r}")
        self.outer, self.lr, self.momentum, self.buffer, self.window = outer, lr, momentum, buffer, window

    def lr_for(self, islands: int) -> float:
        """The step's lr for M islands: `lr`, else for sgd 1/sqrt(M) per push (asynchronous) or WINDOWED_LR over
        a full window (`window` > 1), and DEFAULT_PS_LR for the Nesterov rules."""
        if self.lr is not None:
            return self.lr
        if self.outer != "sgd":
            return DEFAULT_PS_LR
        return WINDOWED_LR / min(self.window, islands) if self.window > 1 else islands**-0.5

    def windowed(self, window: int) -> OuterRule:
        """This rule for a server whose windows wait for `window` islands."""
        return OuterRule(self.outer, self.lr, self.momentum, self.buffer, window)

    def plain(self) -> bool:
        """Plain SGD (no momentum): the step StaleCap's stability limit is about."""
        return self.outer == "sgd" and not self.momentum

    def __call__(self, islands: int) -> OuterOptimizer:
        sgd = self.outer == "sgd"
        lr = self.lr_for(islands)
        momentum = self.momentum if self.momentum is not None else 0.0 if sgd else DEFAULT_PS_MOMENTUM
        if self.outer == "delayed-nesterov":
            return DelayedNesterov(lr, momentum, self.buffer or islands)
        if self.outer == "nesterov":
            return OuterSGD(lr, momentum, nesterov=momentum > 0)
        return OuterSGD(lr, momentum)


def per_push(rule: Rule) -> bool:
    """Whether the rule's lr is each push's (plain SGD by name, DiLoCo's step spread over the pushes), so that a window
    of k pushes steps k times its mean (ps_server.ServerState)."""
    return isinstance(rule, OuterRule) and rule.outer == "sgd"


def outer_rule(
    outer: str = DEFAULT_PS_RULE, lr: float | None = None, momentum: float | None = None, buffer: int = 0
) -> Rule:
    """OuterRule(outer, lr, momentum, buffer): the server's outer step by name."""
    return OuterRule(outer, lr, momentum, buffer)


# Where a restarted (or joining) island of an elastic job starts its data shard: `own`, the step its shard's last
# island had reached at its last acknowledged push (only that island's unpushed round is lost, but the job's end
# waits while it trains its shard's steps again); `ahead`, the furthest step any island acknowledged (the steps in
# between are skipped, as a DiLoCo rejoiner skips to the members' step). Session 29's churn runs: no sooner to DDP's
# loss than `own` (14.3 against 14.1 s mean over 3; DiLoCo 8.0 s), so `own`, which loses no samples, stays the default
REJOIN = ("own", "ahead")


@dataclass(frozen=True)
class ServerProcesses:
    """Run the server as `servers` processes of their own, one parameter range each, under a supervisor that
    restarts a killed or frozen one from its journal (ps_service.py, ps_journal.py), instead of a thread of rank 0.
    `lease_s`: heartbeat lease (an island or server silent this long has lapsed: it is not waited for);
    `timeout_s`: the longest any request waits, retries included; `directory`: the servers' configuration and
    journals (default: a fresh private temporary directory); `address`: (host, port) of a running service's store
    to join (a late island); None: island 0 starts the service. `at`: (host, port) of a server host waiting for
    its job (`islands ps-host`, ps_host.py): island 0 sends it the configuration sealed with the job's token
    (ISLANDS_TOKEN) and the servers run there, on no island's machine. `rejoin`: where a restarted island of an
    elastic job starts (REJOIN)."""

    servers: int = 1
    lease_s: float = 2.0
    timeout_s: float = 600.0
    directory: str | None = None
    address: tuple[str, int] | None = None
    rejoin: str = "own"
    at: tuple[str, int] | None = None

    def __post_init__(self):
        if self.at is not None and (self.address is not None or self.directory is not None):
            raise ValueError(
                "at= names a server host that keeps its own directory and address: drop address= and directory="
            )
        if self.rejoin not in REJOIN:
            raise ValueError(f"rejoin must be one of {', '.join(REJOIN)}, got {self.rejoin!r}")
        if isinstance(self.servers, bool) or not isinstance(self.servers, int) or self.servers < 1:
            raise ValueError(f"servers must be an int >= 1 (server processes), got {self.servers!r}")
        if not self.lease_s > 0:
            raise ValueError(f"lease must be > 0 seconds (heartbeat lease), got {self.lease_s}")
        if not self.timeout_s > self.lease_s:
            raise ValueError(f"timeout must be > lease ({self.lease_s} s), got {self.timeout_s}")


class InProcessServer:
    """The meeting place of islands that share one process (islands.simulate): the first island to set up builds the
    server and starts its loop; every island gets a link to it. Give the same object to every island's strategy."""

    def __init__(self):
        self.lock = threading.Lock()
        self.loop: ServerLoop | None = None
        self.inbox: LocalInbox | None = None

    def attach(self, build: Callable[[LocalInbox], ServerLoop]) -> tuple[LocalInbox, ServerLoop, bool]:
        """(inbox, loop, built here): built by the first caller only."""
        with self.lock:
            if self.loop is None:
                self.inbox = LocalInbox()
                self.loop = build(self.inbox)
                self.loop.start()
                assert self.inbox is not None
                return self.inbox, self.loop, True
            assert self.inbox is not None
            return self.inbox, self.loop, False


def _first_epochs_rank_0(comm) -> bool:
    """Whether this island is rank 0 of an elastic job's first epoch, the one that sets up the service (a joiner,
    restarted islands included, is in no epoch yet)."""
    return comm.epoch is not None and comm.epoch >= 0 and comm.rank == 0


class ParameterServer(OuterStrategy):
    name = "ps"
    # no collective round averages buffers: the server carries them instead (each push's, the mean in each answer)
    buffer_policy = "own"

    def __init__(
        self,
        inner_steps: int = 100,
        rule: Rule | None = None,
        shards: int = 1,
        max_staleness: int = 4,
        quorum: int = 1,
        discount: float = 0.0,
        aggregator: Aggregator | None = None,
        compressor: PayloadCodec | Compressor | None = None,
        pulls: Compressor | None = None,
        arrivals: Arrivals | None = None,
        host: InProcessServer | None = None,
        service: ServerProcesses | None = None,
        stale_cap: bool | None = None,
        wait: float | str | WindowWait | None = None,
        statistics: str = "mean",
    ):
        """`inner_steps` H: inner steps per round. `rule`: islands M -> the server's outer optimizer for one
        shard (outer_rule(...) by name; default plain SGD, lr 1/sqrt(M), DEFAULT_PS_RULE). `shards`: parameter
        ranges the server state is split into, each with its own optimizer state. `max_staleness`: versions a push
        may lag before it is refused. `quorum`: distinct islands per outer step (1: asynchronous). `discount`: a
        push's weight times (1 + staleness)^-discount. `aggregator`: a robust aggregator over each window (then
        quorum >= 2 makes sense). `compressor`: for pushes, decoded on the server: a PayloadCodec (Quant4,
        Quant4Zstd) or an islands.compress compressor that stands alone on one island's vector (ps_codecs.py: error
        feedback per island; sign, powersgd and randomk-shared refused). `pulls`: an islands.compress compressor for
        the answers' model (ps_pulls.py): the server keeps the copy each island holds and answers with the compressed
        gap, which both ends add to their copy (EF21-P); contractive ones only (randomk, qsgd refused). `arrivals`:
        FirstCome() or VirtualClock(round_seconds). `host`: InProcessServer under simulate.
        `service`: ServerProcesses(...) to run the server as processes of its own (fault tolerant; first come).
        `stale_cap`: hold the step under the delayed step's stability limit for the staleness its pushes have had
        (ps_server.StaleCap); None (default): on for the plain SGD rule by name (outer_rule("sgd"), the default
        rule), off for the others; True with another rule is refused (momentum moves the limit). `wait`: how long a
        push short of its window's quorum waits for the window's step before the window steps without the rest
        (quorum >= 2; ps_wait): seconds (FixedWait), "auto" (PacedWait: the islands due soon by their turnarounds)
        or a WindowWait; None or 0: answered at once, the island trains on without its own push in the model.
        `statistics`: what becomes of the model's buffers (BatchNorm's running statistics) during training: mean,
        each push carries the island's and every answer the mean of every island's latest (ps_buffers); own, each
        island keeps its own, as a server without buffers would (islands whose data differ in distribution, the
        FedBN argument), to the end: the islands' models then differ in their buffers, and the job keeps island 0's."""
        super().__init__()
        if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
            raise ValueError(f"inner_steps must be an int >= 1, got {inner_steps!r}")
        if aggregator is not None and compressor is not None:
            raise ValueError("a robust aggregator ranks exact deltas; drop compressor= or aggregator=")
        if statistics not in STATISTICS:
            raise ValueError(f"statistics must be one of {', '.join(STATISTICS)}, got {statistics!r}")
        self.inner_steps, self.statistics = inner_steps, statistics
        self.wait = window_wait(wait)
        check_server_options(shards, max_staleness, quorum, discount, self.wait)
        self.rule = rule if rule is not None else outer_rule()
        if self.wait is not None and isinstance(self.rule, OuterRule):
            self.rule = self.rule.windowed(quorum)
        plain = isinstance(self.rule, OuterRule) and self.rule.plain()
        if stale_cap and not plain:
            raise ValueError(
                "stale_cap=true holds the plain SGD step under its stability limit: use outer=sgd without momentum "
                "(momentum moves the limit), or drop stale_cap"
            )
        self.stale_cap = plain if stale_cap is None else stale_cap
        self.shards, self.max_staleness, self.quorum = shards, max_staleness, quorum
        self.discount, self.aggregator, self.codec = discount, aggregator, push_codec(compressor)  # ps_codecs.py
        self.pulls = pull_codec(pulls)  # ps_pulls.py
        self.arrivals = arrivals if arrivals is not None else FirstCome()
        if service is not None and (host is not None or isinstance(self.arrivals, VirtualClock)):
            raise ValueError(
                "server processes apply pushes as they come: drop host= and arrivals=VirtualClock(...) with service="
            )
        self.host, self.service = host, service
        self.launched: subprocess.Popen | None = None  # the supervisor process, on the island that started it
        self.scratch: str | None = None  # the servers' directory when it is a temporary one of ours
        self.version = 0  # the server version this island's round started from
        self.samples = 0.0  # samples of this round so far (on_batch)
        self.counts = {"pushes": 0, "refused": 0}
        self.loop: ServerLoop | None = None  # the server, on the island that hosts it
        self.link: LocalLink | GlooLink | RemoteLink | None = None
        self.report: dict | None = None  # process mode: the servers' report island 0 collected at the end
        self.final_shards: list | None = None  # process mode: the servers' state island 0 took before they stopped
        self.island = 0  # this island's number on the server: its cross rank, or in an elastic job its own (wrap)
        self.elastic: ElasticService | None = None  # the job's store, in an elastic job (wrap)
        self.end: ServedEnd | None = None  # the elastic membership that runs the job's end (wrap)
        self.carried: IslandBuffers | None = None  # the buffers each push carries (setup; None: the model has none)
        self.relay: IslandSide = LoneWorker()  # who speaks for this worker's island on the server (setup)

    # ---- wiring -------------------------------------------------------------------------------------
    def server_state(self, islands: int) -> ServerState:
        return ServerState(
            self.global_flat,
            lambda: self.rule(islands),
            shards=self.shards,
            max_staleness=self.max_staleness,
            quorum=self.quorum,
            discount=self.discount,
            aggregator=self.aggregator,
            scale=self.stale_scale(islands),
            per_push=per_push(self.rule),
        )

    def stale_scale(self, islands: int) -> StaleCap | None:
        """The server's StaleCap for M islands' step, with stale_cap (None without)."""
        return StaleCap(self.rule.lr_for(islands)) if self.stale_cap and isinstance(self.rule, OuterRule) else None

    def wrap(self, model, optimizer, world):
        membership = world.membership
        if membership is not None and self.service is not None:  # elastic, process mode (else refused in wrap)
            if membership.new_client is None:
                raise ValueError("ps in an elastic job needs a client of the job's store of its own (new_client)")
            # the island's data shard: a k-worker island's workers hold shards index * k + local of islands * k, and
            # its records in the store (ps/clock/<shard>) are the island's, under its index
            shard, shards = world.shard
            k = world.workers_per_island
            self.elastic = ElasticService(
                membership.new_client(), membership.name, shard // k, self.service.timeout_s, shards // k
            )
            self.end = membership if isinstance(membership, ServedEnd) else None
        return super().wrap(model, optimizer, world)

    def setup(self) -> None:
        self.carried = IslandBuffers.of(self.local_buffers) if self.statistics == "mean" else None
        layout = self.carried.layout if self.carried is not None else NO_BUFFERS
        waits = self.service.timeout_s if self.service is not None else 0.0
        numel = self.global_flat.numel()
        # islands of k workers: the leader speaks for the island, its mates take its answers (ps_island.py)
        self.relay = island_side(self.island_comm, numel, sum(layout), waits, self.island_ledger())
        if self.service is not None:
            self.adopt(self.relay.share(self.connect(self.service)))
            if self.elastic is not None:  # a k-worker island's mates take the number their leader took
                self.island = self.relay.number(self.island)
                self.elastic.pulled(self.island)
            return
        islands, me = self.comm.size, self.comm.rank
        self.island = me
        if isinstance(self.arrivals, VirtualClock) and len(self.arrivals.round_seconds) != islands:
            raise ValueError(f"VirtualClock gives {len(self.arrivals.round_seconds)} round times for {islands} islands")
        if self.host is not None:
            inbox, loop, built = self.host.attach(
                lambda inbox: ServerLoop(
                    self.server_state(islands), islands, self.arrivals, inbox, self.codec, self.wait, layout, self.pulls
                )
            )
            self.loop = loop if built else None
            self.link = LocalLink(inbox, self.island_ledger(), buffers=sum(layout), pulls=self.pulls)
            return
        if islands > 1 and (current_island() is not None or not dist.is_initialized()):
            raise ValueError(
                "ps across islands in one process (islands.simulate) needs one server: give every island's "
                "ParameterServer the same host=InProcessServer()"
            )
        k = self.relay.workers
        if islands > 1 and dist.get_world_size() != islands * k:
            raise ValueError(
                f"ps's thread mode needs every island in one torch job (its gloo groups span them): this job has "
                f"{dist.get_world_size()} workers for {islands} islands of {k}; islands that are jobs of their own "
                "need servers=S"
            )
        # two groups of their own, over the islands' leaders: pushes to the server (its receiver thread) and answers
        # back (its loop thread); made on every worker (torch's new_group is collective over the default group)
        pushes = answers = None
        if islands > 1:
            ranks = leaders(islands, k)
            pushes, answers = dist.new_group(ranks, backend="gloo"), dist.new_group(ranks, backend="gloo")
        if not self.relay.leader:  # its island's leader talks to the server (push, final)
            return
        if me == 0:
            inbox = LocalInbox()
            state = self.server_state(islands)
            self.loop = ServerLoop(state, islands, self.arrivals, inbox, self.codec, self.wait, layout, self.pulls)
            if islands > 1:
                receiver = GlooReceiver(
                    pushes, answers, islands - 1, inbox, numel, self.codec, self.sealer(), buffers=sum(layout), stride=k
                )
                receiver.start()
            self.loop.start()
            self.link = LocalLink(inbox, self.island_ledger(), buffers=sum(layout), pulls=self.pulls)
        else:
            ledger, sealer = self.island_ledger(), self.sealer()
            self.link = GlooLink(pushes, answers, 0, numel, ledger, sealer, sum(layout), self.pulls)

    def connect(self, service: ServerProcesses) -> Reply | None:
        """Process mode: island 0 starts the service (unless given its address), every island connects, pulls the
        current global model (a joiner starts from it; the answer is returned) and heartbeats. In an elastic job the
        address travels through the job's store (elastic_address) and each island process takes a number of its own
        there. In an island of k workers only the leader connects (its mates return None); in a fixed job every
        worker takes part in the address's broadcast; in an elastic job the mates take the island's number from the
        leader afterwards (setup)."""
        tags = self.comm.tags if isinstance(self.comm, HasPayloadTags) else None
        config = ServiceConfig(
            self.global_flat,
            self.rule,
            islands=max(self.comm.size, 1),  # the first epoch's islands (a joiner, in no epoch yet, saves none)
            servers=service.servers,
            shards=self.shards,
            max_staleness=self.max_staleness,
            quorum=self.quorum,
            discount=self.discount,
            aggregator=self.aggregator,
            scale=self.stale_scale(max(self.comm.size, 1)),
            per_push=per_push(self.rule),
            wait=self.wait,
            codec=self.codec,
            pulls=self.pulls,
            lease_s=service.lease_s,
            timeout_s=service.timeout_s,
            key=None if tags is None else tags.key,
            domain=b"" if tags is None else tags.domain,
            ends_with_starter=self.elastic is None,  # a fixed job fails with its island 0; an elastic one goes on
            buffers=self.carried.layout if self.carried is not None else NO_BUFFERS,  # held by shard 0
        )
        if self.elastic is not None:
            if not self.relay.leader:  # the address, the number and the host's tags are its leader's business
                return None
            if service.at is not None:  # a server host of its own: the first epoch's rank 0 configures it
                address, starts = service.at, _first_epochs_rank_0(self.comm)
                tags = ps_host.elastic_island_tags(service.at, config, self.elastic, starts, service.timeout_s)
            else:
                address = service.address or self.elastic_address(service, config)
            self.island = self.elastic.take_island()
        elif service.at is not None:
            self.island = self.comm.rank
            if not self.relay.leader:
                return None
            address, tags = service.at, ps_host.island_tags(service.at, config, self.comm.rank, service.timeout_s)
        else:
            self.island = self.comm.rank
            address = self.fixed_address(service, config)
            if not self.relay.leader:
                return None
        ledger = self.island_ledger()
        link = RemoteLink(
            address,
            self.island,
            config.bounds,
            service.timeout_s,
            service.lease_s,
            self.codec,
            tags,
            ledger,
            buffers=sum(config.buffers),
            pulls=self.pulls,
        )
        self.link = link.start()
        return link.send(Message(PULL, self.island))

    def fixed_address(self, service: ServerProcesses, config: ServiceConfig) -> tuple[str, int]:
        """A fixed job: island 0 starts the service (unless given its address) and tells the others over gloo (every
        worker of the job: the group is made over all of them)."""
        islands, me = self.comm.size, self.comm.rank if self.relay.leader else -1
        address = service.address
        if address is None and islands > 1 and (current_island() is not None or not dist.is_initialized()):
            raise ValueError(
                "ps server processes for islands in one process (islands.simulate): start the service yourself "
                "(ps_service.Supervisor) and give every island ServerProcesses(address=(host, port))"
            )
        if address is None:
            if me == 0:
                address = self.start_service(service, config)
            if islands * self.relay.workers > 1:  # the others learn where the store is from island 0 (rank 0)
                box = [address]
                dist.broadcast_object_list(box, src=0, group=dist.new_group(backend="gloo"))
                address = box[0]
        assert address is not None
        return address

    def elastic_address(self, service: ServerProcesses, config: ServiceConfig) -> tuple[str, int]:
        """An elastic job: the first epoch's rank 0 starts the service and writes its address in the job's store;
        every other island (a restarted or joining one too) reads it there."""
        assert self.elastic is not None
        if _first_epochs_rank_0(self.comm):
            address = self.start_service(service, config)
            self.elastic.publish(address)
            return address
        return self.elastic.address()

    def start_service(self, service: ServerProcesses, config: ServiceConfig) -> tuple[str, int]:
        """Write the configuration and start the supervisor (a process of its own session: it outlives us)."""
        directory = service.directory or tempfile.mkdtemp(prefix="islands-ps-")
        self.scratch = None if service.directory else directory  # removed at the end, by us or the supervisor
        config.save(directory)
        if self.scratch is not None:
            (Path(directory) / SCRATCH).touch()
        self.launched, address = launch(directory)
        return address

    def sealer(self) -> Sealer | None:
        """Seals for the point-to-point messages where the job authenticates its payloads (outer.authenticate)."""
        return Sealer(self.comm.tags) if isinstance(self.comm, HasPayloadTags) else None

    def island_ledger(self):
        """The island's ledger, where its pushes and pulls are counted beside its collectives (None: not counted)."""
        return self.comm.ledger if isinstance(self.comm, Counted) else None

    def elastic_refusal(self) -> str | None:
        if self.service is None:
            return (
                "ps runs in an elastic job only with its server as processes of its own: add servers=S (S >= 1), "
                "e.g. ps:inner_steps=50,servers=1; with servers=0 the server is a thread of rank 0, which churn "
                "may kill with the global model (docs/parameter-server.md)"
            )
        return None

    def entry_step(self) -> int:
        """An elastic joiner (contracts.ServedParticipant): it pulled the global model in setup; it starts at the step
        its data shard's last island had reached at its last acknowledged push, so its round starts there too. On a
        k-worker island's leader only: its mates take the step, clock and all, with its state (elastic hand_over)."""
        assert self.elastic is not None, "entry_step in an elastic job only"
        step = self.elastic.start_step(ahead=self.service is not None and self.service.rejoin == "ahead")
        self.clock = self.synced_at = step
        return step

    # ---- the hooks ----------------------------------------------------------------------------------
    def on_batch(self, batch, step):
        first = batch[0] if isinstance(batch, (tuple, list)) else batch
        self.samples += float(len(first)) if hasattr(first, "__len__") else 1.0
        return batch

    def after_step(self, model, optimizer, step):
        done = self.tick(step)
        if done - self.synced_at >= self.inner_steps:
            self.push()

    def push(self) -> Reply:
        """End this island's round: push its pseudo-gradient, adopt the model the server answers with (every worker
        of the island: its leader pushes, all adopt the answer)."""
        # its statistics now, for the others: the mean over the island's workers, each of whom saw its own batches
        mine = self.relay.pool(self.carried.read()) if self.carried is not None else None
        reply = None
        if self.relay.leader:  # DDP keeps the island's replicas identical: the leader's delta is the island's
            assert self.link is not None, "push before wrap"
            delta = self.global_flat - self.local.read()
            remote = isinstance(self.link, RemoteLink)  # it encodes each server's range itself
            payload = self.codec.encode(delta) if self.codec is not None and not remote else delta
            # the samples behind it: the island's (its workers' batches are equal shares)
            samples = self.samples * self.relay.workers if self.samples > 0 else float(self.clock - self.synced_at)
            reply = self.link.send(Message(PUSH, self.island, self.version, samples, payload, mine))
        reply = self.relay.share(reply)
        self.counts["pushes"] += 1
        self.counts["refused"] += int(not reply.ack.accepted)
        self.adopt(reply)
        self.rounds += 1
        if self.elastic is not None and self.relay.leader:  # a restart of this island starts here: what it loses is
            # its unpushed round (its mates counted the same pushes: the leader's record is the island's)
            self.elastic.record(self.clock, self.island, self.accepted()["pushes"])
        return reply

    def adopt(self, reply: Reply) -> None:
        self.version = reply.ack.version
        self.global_flat = reply.flat.to(torch.float32).clone()
        self.publish()
        self.adopt_global()
        if reply.buffers is not None and self.carried is not None:  # the islands' mean (None before any push had some)
            self.carried.adopt(reply.buffers)
        self.samples = 0.0
        self.synced()  # the global model's buffers take the island's (synced_buffers)

    def finish(self, model) -> None:
        """Push what is left of the last round, then DONE: answered with the final model once every island is
        done (the job's one barrier); the hosting island then joins its server loop. In an elastic job the
        membership runs that end (end_served): joiners are ready before their DONE, and enter the job's last epoch
        after the final answer."""
        if self.clock > self.synced_at:
            self.push()
        if self.end is not None:
            self.end.end_served(self.final)
        else:
            self.final()
        if self.statistics == "mean":  # one model at the end, buffers included: the last answers' means differ by
            # the pushes after them, so the islands average their own once more in one collective
            average_buffers_at_the_end(self.comm, self.local_buffers, self.global_buffers)
        else:  # own: each island ends on the statistics of its own data (the job keeps island 0's)
            for own, glob in zip(self.local_buffers, self.global_buffers):
                glob.copy_(own)
        if self.loop is not None:
            self.loop.join(timeout=60.0)
        if isinstance(self.link, RemoteLink):
            if self.elastic is None and self.comm.rank == 0:
                # the job's final checkpoint is saved after this (the loop's fit_end), when the servers are gone:
                # island 0 takes their state now, as extra_state would (before, that save failed: ServiceGone)
                self.final_shards = self.link.snapshot()
            self.close_service(self.link)

    def final(self) -> dict:
        """DONE, answered with the final model once every island still training is done; returns what an elastic
        membership records of this island's end (its served_end event)."""
        reply = None
        if self.relay.leader:  # its mates take the final model from it
            assert self.link is not None, "finish before wrap"
            reply = self.link.send(Message(DONE, self.island))
        self.adopt(self.relay.share(reply))
        if self.elastic is not None:
            self.elastic.finished()
        final = self.link.final if isinstance(self.link, RemoteLink) else True
        return {"island": self.island, "version": self.version, "final": final, **self.accepted()}

    def accepted(self) -> dict:
        """This island process's pushes: applied by the server (with quorum 1 each one a version) and refused."""
        return {"pushes": self.counts["pushes"] - self.counts["refused"], "refused": self.counts["refused"]}

    def close_service(self, link: RemoteLink) -> None:
        """Process mode, at the end: the island that started the service asks it to stop (servers leave once every
        island they know has its final answer or has lapsed), waits for the supervisor within the timeout and reads
        the servers' report. In an elastic job every island asks (the one that started it may have died) and takes
        the report from the service's store, where the supervisor hands it over (ps_report.hand_over): which island
        writes run.json is settled only at the job's very end. The supervisor then removes its directory itself; its
        starter waits for it only when its store is silent (to kill it, and remove the directory in its place)."""
        # on a server host, a fixed job's island 0 takes the servers' report back (ps_host.collect_report)
        hosted = self.service is not None and self.service.at is not None and self.elastic is None and self.island == 0
        # an elastic job's supervisor, its own or a server host's (not one named by address=), hands its report over
        # to every island (island 0 may have been restarted under another number), and the one that writes run.json
        # keeps it there; the host, as its own supervisor, stays until each island answered final has taken it
        handed = self.elastic is not None and self.service is not None and self.service.address is None
        silent = None  # why the store did not take the stop: its supervisor is stopped or hung (ps_wire.StoreSilent)
        if self.launched is not None or self.elastic is not None or hosted:
            try:
                link.calls(lambda: link.store.set("stop", "done"), link.connect_s * 5)
            except StoreSilent as e:
                silent = str(e)
        if handed:  # while it waits its heartbeat goes on: the supervisor keeps the report up while islands beat
            taken = take_report(link.calls, link.store, link.timeout_s, link.connect_s * 5) if silent is None else None
            self.report = process_report(*(taken or (None, f"{silent}: it handed over no report")))
        # the heartbeat stops before the supervisor may leave: its thread would otherwise hit the store as the
        # supervisor closes it (torch logs a C++ stack for that); this island has its final answer (and report)
        link.close()
        if handed and silent is None:  # the supervisor leaves once every island answered final has taken it
            report_taken(link.calls, link.store, self.island, link.connect_s * 5)
        if self.launched is not None and (not handed or silent is not None):
            why = None
            try:
                self.launched.wait(timeout=0 if silent else link.timeout_s)
            except subprocess.TimeoutExpired:  # it would stop on its own (orphan timer); no need to wait for that
                self.launched.kill()
                why = silent or f"the supervisor did not stop within {link.timeout_s:.0f} s"
                why += " and was killed"
            if not handed:  # it writes its servers' report into the service's directory as it leaves (ps_report.py)
                directory = self.scratch or (self.service.directory if self.service is not None else None)
                collected = read_collected(directory) if why is None and directory is not None else None
                self.report = process_report(collected, why or "the supervisor exited without writing its report")
            if self.scratch is not None:  # read, or the supervisor was killed before it could remove it
                shutil.rmtree(self.scratch, ignore_errors=True)
        if hosted:  # the host publishes its servers' report in its store once they are gone
            assert self.service is not None and self.service.at is not None
            collected, why = ps_host.collect_report(self.service.at, link.timeout_s)
            self.report = process_report(collected, why)

    def run_report(self) -> dict:
        """What the servers did, for run.json (ps_report.py): from the island that hosts the thread mode's loop or
        started the server processes, in an elastic job from every island (each takes the report); {} on others."""
        if self.loop is not None:
            with self.loop.lock:
                pulls = self.loop.copies.report() if self.pulls is not None else None
                return {"parameter_server": thread_report(self.loop.state, self.loop.cpu_seconds, pulls)}
        return {"parameter_server": self.report} if self.report is not None else {}

    # ---- state --------------------------------------------------------------------------------------
    def extra_state(self) -> dict:
        state: dict = {"ps_version": self.version, "ps_counts": dict(self.counts), **codec_state(self.codec)}
        # process mode: island 0 carries every server's state; not in an elastic job, which has no checkpoints of its
        # own (its leader's state reaches its mates at entry, elastic hand_over, without asking the servers)
        if isinstance(self.link, RemoteLink) and self.elastic is None:
            state["ps_link"] = self.link.state_dict()
            if self.comm.rank == 0:
                state["ps_shards"] = self.final_shards if self.final_shards is not None else self.link.snapshot()
        if self.loop is not None:  # the hosting island carries the server's state in the job's checkpoint
            with self.loop.lock:
                state["ps_server"] = self.loop.state.state_dict()
                if self.loop.buffers is not None:  # each island's latest buffers (thread mode; process mode: ps_shards)
                    state["ps_buffers"] = self.loop.buffers.state_dict()
                if isinstance(self.loop.arrivals, VirtualClock):
                    state["ps_arrivals"] = list(self.loop.arrivals.taken)
        return state

    def load_extra_state(self, state: dict) -> None:
        self.version = int(state.get("ps_version", 0))
        self.counts = dict(state.get("ps_counts", self.counts))
        load_codec_state(self.codec, state)  # a compressor's residuals: the island's unsent part of its pushes
        if isinstance(self.link, RemoteLink) and "ps_link" in state:
            self.resume_service(self.link, state)
        if self.loop is not None and "ps_server" in state:
            with self.loop.lock:
                self.loop.state.load_state_dict(state["ps_server"])
                if self.loop.buffers is not None and "ps_buffers" in state:
                    self.loop.buffers.load_state_dict(state["ps_buffers"])
                if isinstance(self.loop.arrivals, VirtualClock) and "ps_arrivals" in state:
                    self.loop.arrivals.taken = [int(n) for n in state["ps_arrivals"]]

    def resume_service(self, link: RemoteLink, state: dict) -> None:
        """Process mode resume: island 0 puts every server back to its checkpoint (committed to the journals) and
        says so in the store; the others wait for that, within the timeout, before their first push. Pushes an
        island made after the servers' snapshot and before its own checkpoint are not in the restored model (the
        job rolled back); ones made after its checkpoint that the snapshot holds are answered as duplicates when
        the island pushes them again, not applied twice (their push numbers, ps_journal.py)."""
        link.load_state_dict(state["ps_link"])
        if self.comm.rank == 0:
            if "ps_shards" in state:
                link.restore(state["ps_shards"])
            link.store.set("restored", "1")
        else:
            link.store.wait(["restored"], _dt.timedelta(seconds=link.timeout_s))
        self.version = min(link.versions)


def parameter_server(
    inner_steps: int = 100,
    outer: str = DEFAULT_PS_RULE,
    outer_lr: float | None = None,
    momentum: float | None = None,
    buffer: int = 0,
    shards: int = 1,
    max_staleness: int = 4,
    quorum: int = 1,
    discount: float = 0.0,
    aggregator: Aggregator | None = None,
    bits: int = 32,
    block: int = 1024,
    entropy: str = "none",
    servers: int = 0,
    lease: float = 2.0,
    timeout: float = 600.0,
    rejoin: str = "own",
    stale_cap: bool | None = None,
    at: str = "",
    wait: float | Literal["auto"] = 0.0,
    reach: float | None = None,
    margin: float | None = None,
    statistics: str = "mean",
    compressor: Compressor | None = None,
    pulls: Compressor | None = None,
) -> ParameterServer:
    """The parameter server (issue #36): islands push pseudo-gradients and pull the global model, no barrier.

    `inner_steps`: inner steps per round, H as in DiLoCo. `outer`: the server's step, sgd (the default,
    DEFAULT_PS_RULE), delayed-nesterov (arXiv 2401.09135) or nesterov. `outer_lr`: its lr (default 1/sqrt(M) for
    sgd, 0.7 for the Nesterov rules, as 2401.09135). `momentum`: its momentum (default 0 for sgd, else 0.9).
    `buffer`: delayed Nesterov's pushes per momentum update, 0 for the island count. `shards`: parameter ranges the
    server state is split into, each with its own optimizer state. `max_staleness`: versions a push may lag before
    it is refused. `quorum`: distinct islands per outer step, 1 for asynchronous, more for semi-synchronous (arXiv
    2604.21428). `discount`: a push's weight is multiplied by (1 + staleness)^-discount. `aggregator`: a robust
    aggregator over each window of contributions. `bits`: 32 for fp32 pushes, 4 for 4-bit blocks decoded on the
    server. `block`: values per 4-bit block. `entropy`: none, or zstd to pack 4-bit pushes further. `servers`: 0 for
    the server as a thread of rank 0; S >= 1 for S server processes (one parameter range each) under a supervisor
    that restarts a killed one from its journal. `lease`: seconds of heartbeat silence after which an island or a
    server process has lapsed (servers >= 1). `timeout`: the longest any push, pull or final wait lasts, retries
    included (servers >= 1). `rejoin`: in an elastic job, where a restarted island starts (servers >= 1): own, its
    data shard's last acknowledged step; ahead, the furthest step any island acknowledged (REJOIN). `stale_cap`:
    hold the plain SGD step under the delayed step's stability limit for the staleness its pushes have had, so
    equal-speed islands, whose every push is M - 1 versions stale, do not swing the global model
    (ps_server.StaleCap); unset: on for outer=sgd without momentum (the default), off for the others. `at`:
    'HOST:PORT' (quoted in a spec) of a server host started with `islands ps-host`, where the servers=S processes
    run instead of on island 0's machine (needs ISLANDS_TOKEN, the host's own). `wait`: how long a push short of its
    window's quorum waits for the window's step (quorum >= 2): equal islands then train as synchronous DiLoCo does,
    and a window still short at the deadline steps without the slow ones. Seconds, or auto: the server learns each
    island's turnaround and waits only for those due soon (ps_wait.PacedWait); 0: every push is answered at once.
    `reach`, `margin` (wait=auto only): a window waits for an island due within `reach` x the fastest island's
    turnaround, until it is due plus `margin` x its own turnaround (defaults ps_wait.REACH, ps_wait.MARGIN).
    `statistics`: mean (every answer carries the mean of the islands' latest buffers, and the end averages them once
    more) or own (each island keeps its own to the end; the job keeps island 0's). `compressor`: an islands.compress
    compressor for the pushes (bits=32 only), with its error feedback on the island and decoded on the server;
    those that need the other islands' payloads of the same round (sign, powersgd, randomk-shared) are refused
    (ps_codecs.py). `pulls`: an islands.compress compressor for the answers' model: the server keeps the copy each
    island holds and answers with the compressed gap to the global model (EF21-P); a first pull, a restarted
    island's and the final answer are whole (ps_pulls.py); topkq, dct-topk, topk, int8, int4, fp16, bf16."""
    if (reach is not None or margin is not None) and wait != "auto":
        raise ValueError(
            f"reach= and margin= tune wait=auto (how far ahead and how long past due a window waits); "
            f"add wait=auto or drop them (wait={wait!r})"
        )
    paced: float | str | WindowWait = wait
    if wait == "auto":
        paced = PacedWait(reach=REACH if reach is None else reach, margin=MARGIN if margin is None else margin)
    if bits not in (4, 32):
        raise ValueError(f"bits must be 4 or 32, got {bits}")
    if entropy not in ("none", "zstd"):
        raise ValueError(f"entropy must be 'none' or 'zstd', got {entropy!r}")
    if entropy != "none" and bits != 4:
        raise ValueError("entropy=zstd packs 4-bit pushes; use bits=4")
    if compressor is not None and bits != 32:
        raise ValueError(
            f"bits={bits} is the built-in 4-bit quantiser and compressor= another: pick one (int4 or topkq:bits=4 as "
            "a compressor, or bits=4 without compressor=)"
        )
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 0:
        raise ValueError(f"servers must be an int >= 0 (0: a thread of rank 0; S: S server processes), got {servers!r}")
    if rejoin != "own" and not servers:
        raise ValueError(f"rejoin={rejoin} places a restarted island of an elastic job, which needs servers=S >= 1")
    if at and not servers:
        raise ValueError("at=HOST:PORT runs the server processes on a host of their own: add servers=S (S >= 1)")
    where = None
    if at:
        try:
            where = ps_host.parse_at(at)
        except ValueError as e:
            raise ValueError(str(e)) from None
    service = ServerProcesses(servers, float(lease), float(timeout), rejoin=rejoin, at=where) if servers else None
    codec: PayloadCodec | None = None if bits == 32 else Quant4Zstd(block) if entropy == "zstd" else Quant4(block)
    return ParameterServer(
        inner_steps,
        outer_rule(outer, outer_lr, momentum, buffer),
        shards=shards,
        max_staleness=max_staleness,
        quorum=quorum,
        discount=discount,
        aggregator=aggregator,
        compressor=compressor if compressor is not None else codec,  # a refused one: ValueError (ps_codecs.py)
        pulls=pulls,  # a refused one: ValueError (ps_pulls.py)
        service=service,
        stale_cap=stale_cap,
        wait=paced,
        statistics=statistics,
    )
