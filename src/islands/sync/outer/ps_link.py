"""How pushes reach the parameter server and answers come back (issue #36): one server loop, fed in an order.

    loop = ServerLoop(state, islands=M, arrivals=VirtualClock([1.0, 2.0]), inbox=LocalInbox())
    loop.start()                                   # a thread of the host (rank 0, or the simulating process)
    link = LocalLink(loop.inbox, island=0)         # an island in the host's process
    reply = link.push(Message(PUSH, 0, version, samples, delta))  -> Reply(ack, version, global flat)

The loop takes one message at a time from its inbox, in the order its `arrivals` names: FirstCome() takes whatever
arrives first (a real job), VirtualClock(round_seconds) takes island i's k-th message at virtual time k * t_i (ties:
the lower island first), so a simulated run and a multi-process run of the same schedule apply the same pushes in
the same order and end on the same global model bit for bit. A push is answered at once with the ack and the
current global model (the island's pull); an island's DONE is answered only when every island is done, with the
final model, so every island ends on the same global model (the job's end is the only barrier).

Transports, no new one: LocalInbox/LocalLink in one process (islands.simulate's islands, and rank 0's own island);
GlooReceiver/GlooLink over torch.distributed point-to-point on two gloo groups of their own (pushes to the server,
answers back), for islands on other ranks: a receiver thread on the host takes whichever rank sends first and
queues the message into the same LocalInbox, so the loop sees one inbox whatever the transport.
A message on the wire: a float64 header [kind, island, version, samples, payload bytes, held], then the payload (the
fp32 delta, or a PayloadCodec's uint8 payload, decoded on the server); held names the model copy the island holds
(ps_pulls: compressed pulls). The answer: a float64 header [accepted, version, staleness, stepped, token, coded
bytes], then the fp32 global model, or with compressed pulls (coded bytes > 0) the payload that steps the island's
copy to it, which the link resolves (the island's Reply holds the model either way). A model with buffers
(ps_buffers.py) adds one tensor to each: a push's float64 buffer vector after its payload, and after each answer's
model [held, the buffers' mean] (held 0: the server holds none, the island keeps its own); both sides know the
layout from the model, so a model without buffers sends exactly what it sent before. In a job with authenticated
payloads (outer.authenticate, runtime/payload_auth.py) every one of these tensors travels sealed (Sealer): its bytes
and an HMAC under the job's payload key, bound to what it is, its sender and receiver and the message's number on
that pair, so a push or an answer altered, injected or replayed on the way is refused before any byte is used.
"""

from __future__ import annotations

import copy
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from islands.runtime.payload_auth import TAG, PayloadAuthError, PayloadTags
from islands.sync.outer.ps_buffers import NO_BUFFERS, BufferTable, Layout, pushed_vector
from islands.sync.outer.ps_pulls import WHOLE, HeldCopies, HeldModel, PullCodec, Pulled
from islands.sync.outer.ps_server import Ack, Contribution, ServerState
from islands.sync.outer.ps_wait import WindowWait, window_wait
from islands.sync.outer.quant4 import PayloadCodec

PUSH, DONE = 1, 2
_HEADER, _ANSWER = 6, 6
HEADER_BYTES, ANSWER_BYTES = _HEADER * 8, _ANSWER * 8  # what a message's and an answer's header cost


@dataclass(frozen=True)
class Message:
    kind: int  # PUSH or DONE
    island: int
    version: int = 0
    samples: float = 0.0
    payload: torch.Tensor | None = None  # PUSH: the fp32 delta, or the codec's uint8 payload
    buffers: torch.Tensor | None = None  # PUSH: the island's buffers now, float64 (ps_buffers.IslandBuffers)
    held: int = WHOLE  # the token of the model copy the island holds (ps_pulls; the link fills it in)


@dataclass(frozen=True)
class Reply:
    ack: Ack
    # the global model now (a push's pull; DONE: the final model); from the server to the link, with compressed
    # pulls, the PullCodec payload that steps the island's copy to it (`coded`), which the link resolves
    flat: torch.Tensor
    buffers: torch.Tensor | None = None  # the islands' buffers as the server holds them (None: it holds none)
    token: int = WHOLE  # the copy the island holds once it has taken this answer (ps_pulls)
    coded: bool = False  # `flat` is a compressed step from the island's copy, not the model

    def pulled(self) -> Pulled:
        return Pulled(self.flat, self.token, self.coded)


Answer = Callable[[Reply], None]


# ---- arrival orders ----------------------------------------------------------------------------------------
class Arrivals(ABC):
    """The order the server loop takes messages in, and the clock a held window's wait runs on (ServerLoop)."""

    @abstractmethod
    def take(self, inbox: Inbox, free: set[int], deadline: float | None) -> tuple[Message, Answer, float] | None:
        """The next message of one of the `free` islands (those not waiting for an answer), its answer and its time
        on this clock; or None when `deadline` (a held window's, on this clock) comes first."""

    def held(self, island: int, since: float, until: float) -> None:
        """`island` waited for its answer from `since` to `until` (its next message comes that much later)."""
        return

    def origin(self) -> float:
        """The time on this clock when the islands start their first round (a held window's rule learns from it)."""
        return time.monotonic()


class FirstCome(Arrivals):
    """A real job: the first message to arrive is the next one applied; waits run on the monotonic clock."""

    def take(self, inbox: Inbox, free: set[int], deadline: float | None) -> tuple[Message, Answer, float] | None:
        got = inbox.take(None, None if deadline is None else max(deadline - time.monotonic(), 0.0))
        while got is None and inbox.receiving():  # a push already on its way in: the window waits for it (a slow
            got = inbox.take(None, 0.05)  # link's transfer can outlast the wait; its island is not late)
        return None if got is None else (*got, time.monotonic())


class VirtualClock(Arrivals):
    """Island i's round takes `round_seconds[i]` virtual seconds: its k-th message arrives at k * t_i, plus whatever
    it waited for held answers. Deterministic, so a simulation and a multi-process run apply pushes in the same order
    (the islands' real speeds do not matter)."""

    def __init__(self, round_seconds: Sequence[float]):
        if not round_seconds or any(not t > 0 for t in round_seconds):
            raise ValueError(f"round_seconds must give every island a time > 0, got {list(round_seconds)}")
        self.round_seconds = [float(t) for t in round_seconds]
        self.taken = [0] * len(self.round_seconds)
        self.waited = [0.0] * len(self.round_seconds)  # virtual seconds each island spent on held answers

    def at(self, island: int) -> float:
        return self.waited[island] + (self.taken[island] + 1) * self.round_seconds[island]

    def take(self, inbox: Inbox, free: set[int], deadline: float | None) -> tuple[Message, Answer, float] | None:
        island = min(free, key=lambda i: (self.at(i), i)) if free else None
        if deadline is not None and (island is None or self.at(island) > deadline):
            return None
        assert island is not None, "every island is waiting and no window is held"
        when = self.at(island)
        got = inbox.take(island)
        assert got is not None, "a take without a timeout returns a message"
        self.taken[island] += 1
        return (*got, when)

    def held(self, island: int, since: float, until: float) -> None:
        self.waited[island] += until - since

    def origin(self) -> float:
        return 0.0


# ---- inboxes -----------------------------------------------------------------------------------------------
class Inbox(ABC):
    @abstractmethod
    def take(self, island: int | None, timeout: float | None = None) -> tuple[Message, Answer] | None:
        """The next message of `island` (None: of any island) and how to answer it, blocking up to `timeout`
        seconds (None: for ever); None when the timeout passes first."""

    def receiving(self) -> bool:
        """Whether a push is on its way in (its header here, its payload not yet): a held window waits for it."""
        return False


class LocalInbox(Inbox):
    """Messages in this process: one FIFO per island, plus the order they came in. Islands of this process put a
    message and wait on its Future (`ask`); a GlooReceiver puts the messages of other ranks with their answer."""

    def __init__(self):
        self.cv = threading.Condition()
        self.boxes: dict[int, deque] = {}
        self.seq = 0
        self.error: BaseException | None = None  # a receiver that failed: take raises it instead of waiting
        self.arriving: set[int] = set()  # islands whose push's header is in and its payload not yet (GlooReceiver)

    def begin(self, island: int) -> None:
        """`island`'s push has begun to arrive (its header is in); put() ends it."""
        with self.cv:
            self.arriving.add(island)

    def receiving(self) -> bool:
        with self.cv:
            return bool(self.arriving)

    def put(self, msg: Message, answer: Answer) -> None:
        with self.cv:
            self.arriving.discard(msg.island)
            self.boxes.setdefault(msg.island, deque()).append((self.seq, msg, answer))
            self.seq += 1
            self.cv.notify_all()

    def ask(self, msg: Message) -> Future:
        done: Future = Future()
        self.put(msg, done.set_result)
        return done

    def fail(self, error: BaseException) -> None:
        with self.cv:
            self.error = error
            self.cv.notify_all()

    def take(self, island: int | None, timeout: float | None = None) -> tuple[Message, Answer] | None:
        end = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            while True:
                if self.error is not None:
                    raise RuntimeError(f"parameter server receiver failed: {self.error!r}") from self.error
                boxes = [b for i, b in self.boxes.items() if b and (island is None or i == island)]
                if boxes:
                    _, msg, answer = min(boxes, key=lambda b: b[0][0]).popleft()
                    return msg, answer
                left = 0.05 if end is None else min(0.05, end - time.monotonic())
                if left <= 0:
                    return None
                self.cv.wait(timeout=left)


class Sealer:
    """Seals the parameter server's point-to-point tensors with the job's payload tags: `fields` (what the tensor
    is, sender, receiver, the message's number on that pair) are bound into each tag."""

    def __init__(self, tags: PayloadTags):
        self.tags = tags

    def send(self, t: torch.Tensor, dst: int, group, fields: tuple) -> None:
        dist.send(self.tags.pack(t, fields), dst=dst, group=group)

    def recv(
        self, like: torch.Tensor, src: int | None, group, fields: Callable[[int], tuple]
    ) -> tuple[torch.Tensor, int]:
        """(the opened tensor, its sender); `fields(sender)` names what it must be (src None: any rank)."""
        packed = PayloadTags.shell(like)
        sender = dist.recv(packed, src=src, group=group)
        return self.open(packed, like, fields(sender)), sender

    def open(self, packed: torch.Tensor, like: torch.Tensor, fields: tuple) -> torch.Tensor:
        got = self.tags.open(packed, like, fields)
        if got is None:
            raise PayloadAuthError(
                f"parameter server message {fields} failed its MAC: altered, injected or replayed on the way, or "
                "the sender holds another token; it was not used"
            )
        return got


def _send(t: torch.Tensor, dst: int, group, sealer: Sealer | None, fields: tuple) -> None:
    if sealer is None:
        dist.send(t.contiguous(), dst=dst, group=group)
    else:
        sealer.send(t, dst, group, fields)


def _recv(like: torch.Tensor, src: int | None, group, sealer: Sealer | None, fields) -> tuple[torch.Tensor, int]:
    """Receive into a tensor like `like` from `src` (None: any rank); `fields(sender)` for a sealed one."""
    if sealer is None:
        sender = dist.recv(like, src=src, group=group)
        return like, sender
    return sealer.recv(like, src, group, fields)


class GlooReceiver:
    """On the server's host: a thread that receives the other ranks' messages over `pushes` (a gloo group; island i
    is rank i x `stride`, its leader when islands have `stride` workers: ps_island.py), from whichever rank sends
    first, and puts them into the LocalInbox with an answer that goes back over `answers` (a second group: the
    receiver thread and the loop thread each use a group of their own). It stops after the DONE of every one of the
    `remote` islands."""

    def __init__(
        self,
        pushes,
        answers,
        remote: int,
        inbox: LocalInbox,
        numel: int,
        codec: PayloadCodec | None,
        sealer: Sealer | None = None,
        me: int = 0,
        buffers: int = 0,
        stride: int = 1,
    ):
        self.pushes, self.answers, self.remote, self.inbox = pushes, answers, remote, inbox
        self.numel, self.codec, self.sealer, self.me, self.stride = numel, codec, sealer, me, stride
        self.buffers = buffers  # values in a buffer vector (ps_buffers): 0 for a model without buffers
        self.count: dict[int, int] = {}  # messages received per island: the number each tag binds
        self.thread = threading.Thread(target=self._run, name="islands-ps-receiver", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            done = 0
            while done < self.remote:
                msg, src, n = self._receive()
                done += msg.kind == DONE
                self.inbox.put(msg, self._answer_to(src, n))
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which raises it
            self.inbox.fail(e)

    def _receive(self) -> tuple[Message, int, int]:
        """A message, its sender rank and its number from that sender. Tags bind island numbers, as the link's do."""
        me, stride = self.me, self.stride
        header, src = _recv(
            torch.zeros(_HEADER, dtype=torch.float64),
            None,
            self.pushes,
            self.sealer,
            lambda s: ("ps_header", s // stride, me, self.count.get(s // stride, 0)),
        )
        island = src // stride
        n = self.count.get(island, 0)
        self.count[island] = n + 1
        kind, nbytes = int(header[0].item()), int(header[4].item())
        if int(header[1].item()) != island or src % stride:
            raise ValueError(f"rank {src} sent a message as island {int(header[1].item())}")
        payload = None
        if kind == PUSH:
            self.inbox.begin(island)  # a held window waits for this push while its payload crosses the link
            like = torch.empty(nbytes, dtype=torch.uint8) if self.codec else torch.empty(self.numel)
            payload, _ = _recv(like, src, self.pushes, self.sealer, lambda s: ("ps_payload", island, me, n))
        buffers = None
        if kind == PUSH and self.buffers:
            like = torch.empty(self.buffers, dtype=torch.float64)
            buffers, _ = _recv(like, src, self.pushes, self.sealer, lambda s: ("ps_buffers", island, me, n))
        held = int(header[5].item())
        return Message(kind, island, int(header[2].item()), float(header[3].item()), payload, buffers, held), src, n

    def _answer_to(self, dst: int, n: int) -> Answer:
        to = dst // self.stride  # the island the tags name

        def answer(reply: Reply) -> None:
            a = reply.ack
            coded = reply.flat.numel() if reply.coded else 0  # a compressed pull's bytes (0: the fp32 model)
            fields = [float(a.accepted), a.version, a.staleness, float(a.stepped), reply.token, coded]
            head = torch.tensor(fields, dtype=torch.float64)
            _send(head, dst, self.answers, self.sealer, ("ps_answer", self.me, to, n))
            _send(reply.flat, dst, self.answers, self.sealer, ("ps_model", self.me, to, n))
            if self.buffers:
                _send(_held(reply.buffers, self.buffers), dst, self.answers, self.sealer, ("ps_held", self.me, to, n))

        return answer


def _held(buffers: torch.Tensor | None, numel: int) -> torch.Tensor:
    """An answer's buffer tensor on the wire: [1, the mean's values], or [0, zeros] when the server holds none."""
    out = torch.zeros(numel + 1, dtype=torch.float64)
    if buffers is not None:
        out[0] = 1.0
        out[1:] = buffers
    return out


# ---- the loop ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Held:
    """A push accepted into a window short of its quorum, its answer held until the window steps (ServerLoop)."""

    island: int
    answer: Answer
    ack: Ack
    since: float  # when it came, on the arrivals' clock
    token: int = WHOLE  # the copy its island holds (ps_pulls): the answer steps it


class ServerLoop:
    """Applies messages to a ServerState one at a time, in `arrivals` order, until every island is done (module
    docstring). run() in a thread of its own (start) or inline. `wait` (with the state's quorum >= 2; ps_wait): a push
    that leaves its window short of the quorum is answered only once the window steps, so its island starts its next
    round from the model its own push is in (equal islands: synchronous DiLoCo); a window still short at the rule's
    deadline steps with what it holds (a slow island is not waited for beyond that). Seconds are a FixedWait, "auto"
    a PacedWait. `buffers`: the layout of the islands' buffer vectors (ps_buffers): each push's replaces its island's,
    and every answer carries their mean. `pulls`: compressed pulls (ps_pulls): a push's answer carries a step from
    the copy its island holds; DONE's answer is the whole final model."""

    def __init__(
        self,
        state: ServerState,
        islands: int,
        arrivals: Arrivals,
        inbox: Inbox,
        codec: PayloadCodec | None = None,
        wait: float | str | WindowWait | None = None,
        buffers: Layout = NO_BUFFERS,
        pulls: PullCodec | None = None,
    ):
        self.state, self.islands, self.arrivals, self.inbox, self.codec = state, islands, arrivals, inbox, codec
        self.copies = HeldCopies(pulls)  # each island's copy of the model, with compressed pulls
        # each island's latest buffers, whose mean every answer carries (ps_buffers); None for a model without
        self.buffers = BufferTable(buffers) if sum(buffers) else None
        # None: every push answered at once; a rule object is copied, so its learnt paces are this loop's alone
        self.wait = copy.deepcopy(window_wait(wait))
        self.lock = threading.Lock()  # held while a message is applied: state_dict reads a consistent state
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.cpu_seconds: float | None = None  # the loop thread's own CPU, once it has ended (the server report)
        self.held: list[Held] = []  # pushes whose answer waits for their window's step

    def start(self) -> None:
        self.thread = threading.Thread(target=self._guarded, name="islands-ps-server", daemon=True)
        self.thread.start()

    def _guarded(self) -> None:
        try:
            self.run()
        except BaseException as e:  # noqa: BLE001 - kept for the host island to raise (join)
            self.error = e
            if isinstance(self.inbox, LocalInbox):  # islands of this process waiting on an answer raise it
                self.inbox.fail(e)
        finally:
            self.cpu_seconds = time.thread_time()  # this thread's alone: it runs nothing but the loop

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
        if self.error is not None:
            raise RuntimeError(f"parameter server loop failed: {self.error!r}") from self.error

    def decode(self, msg: Message) -> torch.Tensor:
        assert msg.payload is not None, "a push carries a payload"
        if self.codec is not None:
            return self.codec.decode(msg.payload, self.state.numel)
        return msg.payload.to(torch.float32)

    def run(self) -> None:
        active = set(range(self.islands))
        finished: list[Answer] = []
        wait = self.wait
        if wait is not None:  # every island starts its first round now
            for island in active:
                wait.started(island, self.arrivals.origin())
        while active:
            free = active - {h.island for h in self.held}  # not waiting for an answer
            deadline = None
            if self.held and wait is not None:
                deadline = wait.deadline(self.held[0].since, free)
            taken = self.arrivals.take(self.inbox, free, deadline)
            if taken is None:  # the held window's wait ran out before its quorum came: it steps with what it holds
                assert deadline is not None, "only a held window's deadline ends a take without a message"
                with self.lock:
                    self.state.settle(1)
                self.release(deadline)
                continue
            msg, answer, when = taken
            if msg.kind == DONE:  # answered with the whole final model: its copy goes
                active.discard(msg.island)
                finished.append(answer)
                with self.lock:
                    self.copies.forget(msg.island)
                    stepped = self.state.settle(len(active))
                if stepped:
                    self.release(when)
                continue
            if wait is not None:
                wait.arrived(msg.island, when)
            with self.lock:
                c = Contribution(msg.island, msg.version, self.decode(msg), msg.samples)
                ack = self.state.push(c, len(active))
                if self.buffers is not None and msg.buffers is not None:  # a refused push's statistics count too
                    self.buffers.put(msg.island, msg.buffers)
            if ack.stepped:
                self.release(when)
            if wait is not None and ack.accepted and not ack.stepped:
                self.held.append(Held(msg.island, answer, ack, when, msg.held))
                continue
            with self.lock:
                _, flat = self.state.pull()
                pulled = self.copies.answer(msg.island, msg.held, flat)
            if wait is not None:
                wait.answered(msg.island, when)
            answer(Reply(ack, pulled.body, self.shared(), pulled.token, pulled.coded))
        version, flat = self.state.pull()
        shared = self.shared()
        for answer in finished:
            answer(Reply(Ack(True, version, 0), flat, shared))

    def shared(self) -> torch.Tensor | None:
        """The buffers an answer carries: the mean of the islands' latest (None without buffers, or before any)."""
        return None if self.buffers is None else self.buffers.mean()

    def release(self, until: float) -> None:
        """Answer every held push with the model their window's step made (at `until` on the arrivals' clock)."""
        if not self.held:  # every step without a wait: no copy of the model to make
            return
        with self.lock:
            version, flat = self.state.pull()
        shared = self.shared()  # one mean for every held answer: no push comes in between
        for h in self.held:
            self.arrivals.held(h.island, h.since, until)
            if self.wait is not None:
                self.wait.answered(h.island, until)
            with self.lock:
                pulled = self.copies.answer(h.island, h.token, flat)
            ack = Ack(h.ack.accepted, version, h.ack.staleness, True)
            h.answer(Reply(ack, pulled.body, shared, pulled.token, pulled.coded))
        self.held = []


# ---- links (the island's side) -----------------------------------------------------------------------------
class Link(ABC):
    @abstractmethod
    def send(self, msg: Message) -> Reply:
        """Send one message and wait for its answer."""


THREAD_MODE_TIMEOUT_S = 1800.0  # the thread mode's longest wait for an answer: gloo's default group timeout


class LocalLink(Link):
    """An island in the server's process. The wait is a Future's: islands.simulate passes the turn meanwhile. An
    answer that does not come within `timeout_s` (a DONE waiting for an island that froze) raises TimeoutError."""

    def __init__(
        self,
        inbox: LocalInbox,
        ledger=None,
        timeout_s: float = THREAD_MODE_TIMEOUT_S,
        buffers: int = 0,
        pulls: PullCodec | None = None,
    ):
        self.inbox, self.ledger, self.timeout_s = inbox, ledger, timeout_s
        self.buffers = buffers  # values in a buffer vector: what GlooLink would add to each message (ledger only)
        self.held = HeldModel(pulls)  # the model this island holds, which compressed pulls step

    def send(self, msg: Message) -> Reply:
        answer = self.inbox.ask(replace(msg, held=self.held.token))
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                reply = answer.result(timeout=min(1.0, self.timeout_s))
                break
            except FutureTimeout:
                if self.inbox.error is not None:  # the server loop (or its receiver) failed: no answer will come
                    raise RuntimeError(f"parameter server failed: {self.inbox.error!r}") from self.inbox.error
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"island {msg.island}: no answer from the parameter server within {self.timeout_s:.0f} s "
                        "(thread mode waits for every island at the end; servers=S processes do not wait for a "
                        "frozen one)"
                    ) from None
        if self.ledger is not None:  # what the same message would cost on a wire (GlooLink's counts)
            p = msg.payload if msg.kind == PUSH else None
            sent = _HEADER * 8 + (0 if p is None else p.numel() * p.element_size() + self.buffers * 8)
            self.ledger.record("ps_push", sent, 0)
            held = (self.buffers + 1) * 8 if self.buffers else 0
            model = reply.flat.numel() * reply.flat.element_size()  # the fp32 model, or a compressed pull's bytes
            self.ledger.record("ps_pull", 0, _ANSWER * 8 + model + held)
        return replace(reply, flat=self.held.take(reply.pulled()), coded=False)


class GlooLink(Link):
    """An island on another rank than the server's: point-to-point over the server's gloo group, counted in the
    island's ledger (kinds ps_push, ps_pull)."""

    def __init__(
        self,
        pushes,
        answers,
        server_rank: int,
        numel: int,
        ledger=None,
        sealer: Sealer | None = None,
        buffers: int = 0,
        pulls: PullCodec | None = None,
    ):
        self.pushes, self.answers, self.server, self.numel, self.ledger = pushes, answers, server_rank, numel, ledger
        self.sealer = sealer
        self.held = HeldModel(pulls)  # the model this island holds, which compressed pulls step
        self.buffers = buffers  # values in a buffer vector (ps_buffers): 0 for a model without buffers
        self.sent = 0  # messages sent: the number each tag binds

    def send(self, msg: Message) -> Reply:
        payload = msg.payload if msg.kind == PUSH else None
        mine = pushed_vector(msg.island, msg.buffers, self.buffers) if payload is not None and self.buffers else None
        nbytes = 0 if payload is None else payload.numel() * payload.element_size()
        fields = [msg.kind, msg.island, msg.version, msg.samples, nbytes, self.held.token]
        header = torch.tensor(fields, dtype=torch.float64)
        me, server, n, sealer = msg.island, self.server, self.sent, self.sealer
        self.sent += 1
        _send(header, server, self.pushes, sealer, ("ps_header", me, server, n))
        if payload is not None:
            _send(payload, server, self.pushes, sealer, ("ps_payload", me, server, n))
        if mine is not None:
            _send(mine, server, self.pushes, sealer, ("ps_buffers", me, server, n))
        answer, _ = _recv(
            torch.zeros(_ANSWER, dtype=torch.float64),
            server,
            self.answers,
            sealer,
            lambda s: ("ps_answer", s, me, n),
        )
        coded = int(answer[5].item())  # a compressed pull's bytes, 0 for the fp32 model
        like = torch.empty(coded, dtype=torch.uint8) if coded else torch.empty(self.numel)
        flat, _ = _recv(like, server, self.answers, sealer, lambda s: ("ps_model", s, me, n))
        held = None
        if self.buffers:
            like = torch.empty(self.buffers + 1, dtype=torch.float64)
            held, _ = _recv(like, server, self.answers, sealer, lambda s: ("ps_held", s, me, n))
        if self.ledger is not None:
            tag = TAG if sealer is not None else 0  # a sealed tensor carries its 32-byte MAC, counted as the Comm does
            pushed = 0 if mine is None else mine.numel() * 8 + tag
            self.ledger.record("ps_push", header.numel() * 8 + nbytes + tag * (1 + (payload is not None)) + pushed, 0)
            got = 0 if held is None else held.numel() * 8 + tag
            body = flat.numel() * flat.element_size()  # the fp32 model, or a compressed pull's bytes
            self.ledger.record("ps_pull", 0, answer.numel() * 8 + body + 2 * tag + got)
        a = [int(x) for x in answer.tolist()]
        shared = held[1:].clone() if held is not None and held[0].item() else None
        model = self.held.take(Pulled(flat, a[4], bool(coded)))
        return Reply(Ack(bool(a[0]), a[1], a[2], bool(a[3])), model, shared, a[4])
