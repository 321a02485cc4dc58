"""The parameter server's wire between an island and a server process (issue #36, parts 2-3): one gloo process group
of two ranks per connection (server rank 0, island rank 1), made through the job's store, so no new transport, and
a connection that breaks (its island or server killed, or silent past the timeout) breaks nothing else.

    pair = Pair.connect(new_client(), f"pair/{shard}/{gen}/{k}", rank=1, connect_s=10, timeout_s=600)
    pair.send(Request(PUSH, island, version, samples, payload, seq, nonce))
    reply = pair.reply()

A request: a float64 header [kind, island, version, samples, payload bytes, seq, nonce, held], then the payload as
bytes (a push's fp32 delta or a PayloadCodec's code; a RESTORE's state); held names the copy of the range the island
holds (ps_pulls). A reply: a float64 header [accepted, version, staleness, stepped, final, body bytes, duplicate,
token, coded bytes], then the body (the shard's fp32 model slice, or with compressed pulls its first `coded` bytes a
step from the island's copy; shard 0's buffer mean after either; or a SNAPSHOT's state as bytes). With the job's
payload tags every tensor travels sealed (runtime/payload_auth.py), bound to what it is, the island, the shard, the
connection and the message's number on it: altered, injected or replayed tensors are refused before use. A torn
connection raises RuntimeError on either side (gloo's read error, or its timeout).
"""

from __future__ import annotations

import datetime as _dt
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from islands.runtime.payload_auth import PayloadAuthError, PayloadTags

# message kinds: PUSH and DONE keep ps_link's numbers
PUSH, DONE, PULL, LEAVE, SNAPSHOT, RESTORE = 1, 2, 3, 4, 5, 6
KIND_NAMES = {PUSH: "push", DONE: "done", PULL: "pull", LEAVE: "leave", SNAPSHOT: "snapshot", RESTORE: "restore"}
_REQUEST, _REPLY = 8, 9
REQUEST_BYTES, REPLY_BYTES = _REQUEST * 8, _REPLY * 8  # what a request's and a reply's header cost
_SERVER, _ISLAND = 0, 1  # ranks in a connection's group
T = TypeVar("T")


HOLDS_MODEL, WANTS_MODEL = 1.0, 0.0  # a DONE poll: the island holds an earlier answer's model (a non-final answer
# comes without one: 7 MB per 0.5 s poll on a slow link otherwise), or wants the model with the answer


@dataclass(frozen=True)
class Request:
    kind: int
    island: int
    version: int = 0
    samples: float = 0.0  # PUSH: the samples behind the delta; DONE: HOLDS_MODEL or WANTS_MODEL
    payload: torch.Tensor | None = None  # uint8 bytes
    seq: int = 0  # the island's push number (PUSH)
    nonce: int = 0  # the island process's random number: a restarted island's seq starts again
    held: int = 0  # the token of the copy of this range the island holds (ps_pulls; 0: none)


@dataclass(frozen=True)
class ShardReply:
    accepted: bool
    version: int
    staleness: int
    stepped: bool = False
    final: bool = False  # DONE: every island is done, this is the final model
    duplicate: bool = False  # PUSH: applied before (a resend after a lost answer), not applied again
    body: torch.Tensor | None = None  # the fp32 slice (or a compressed pull's bytes), or a SNAPSHOT's bytes
    token: int = 0  # the copy of this range the island holds once it has taken the answer (ps_pulls)
    coded: int = 0  # bytes at the body's start that are a compressed pull of the slice (0: the fp32 slice)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class StoreSilent(RuntimeError):
    """The parameter server's store did not answer in time: its supervisor, which hosts it, is stopped (SIGSTOP) or
    hung. A TCPStore client waits for ever on such a master (its socket still accepts; torch's client timeout does
    not apply: measured with torch 2.13), so every wait on it is bounded here instead."""


class StoreCalls:
    """Store operations, each answered within its bound or failed with StoreSilent. The call runs on a thread of
    its own: one that never returns (a stopped master) is left behind, and until it returns the next call fails at
    once instead of leaving another behind it (a retry loop would otherwise leak a thread per try)."""

    def __init__(self, where: str):
        self.where = where
        self.pending: threading.Thread | None = None

    def __call__(self, call: Callable[[], T], timeout_s: float) -> T:
        if self.pending is not None and self.pending.is_alive():
            raise StoreSilent(f"the parameter server's store at {self.where} has not answered an earlier request")
        box: list = []

        def run() -> None:
            try:
                box.append((True, call()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                box.append((False, e))

        worker = threading.Thread(target=run, name="islands-ps-store-call", daemon=True)
        worker.start()
        worker.join(max(timeout_s, 0.0))
        if worker.is_alive():
            self.pending = worker
            raise StoreSilent(
                f"the parameter server's store at {self.where} did not answer within {timeout_s:.0f} s "
                "(its supervisor is stopped or hung)"
            )
        ok, value = box[0]
        if not ok:
            raise value
        return value


def new_client(host: str, port: int, timeout_s: float) -> dist.Store:
    """A store client of its own (a TCPStore client serves one request at a time: gloo's connect blocks in it),
    under the parameter server's prefix."""
    raw = dist.TCPStore(host, port, is_master=False, timeout=_dt.timedelta(seconds=timeout_s))
    return dist.PrefixStore("islands-ps", raw)


class Pair:
    """One connection: a two-rank gloo group and the message count each tag binds (module docstring)."""

    def __init__(self, pg, rank: int, fields: tuple, tags: PayloadTags | None, timeout_s: float = 600.0):
        self.pg, self.rank, self.fields, self.tags = pg, rank, fields, tags
        self.sent = self.received = 0
        # every send and receive waits with this bound: gloo's point-to-point ops keep the timeout the group was
        # made with (the short connect one; set_timeout does not reach them), and a 7 MB body takes 11 s at
        # 5 Mbit/s, past the island's 2 s connect timeout (measured: it retried the same pull for minutes)
        self.op_timeout = _dt.timedelta(seconds=timeout_s)

    @classmethod
    def connect(
        cls, store, name: str, rank: int, connect_s: float, timeout_s: float, tags: PayloadTags | None = None
    ) -> Pair:
        """Join the connection `name` (a key prefix in `store`) as `rank`; raises RuntimeError when the peer does
        not come within connect_s (store's own timeout); each message then waits up to timeout_s."""
        pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, 2, _dt.timedelta(seconds=connect_s))
        return cls(pg, rank, (name,), tags, timeout_s)

    def _send(self, t: torch.Tensor, what: str) -> None:
        t = t.contiguous()
        if self.tags is not None:
            t = self.tags.pack(t, (*self.fields, what, self.rank, self.sent))
        self.pg.send([t], 1 - self.rank, 0).wait(self.op_timeout)
        self.sent += 1

    def _recv(self, like: torch.Tensor, what: str) -> torch.Tensor:
        n, self.received = self.received, self.received + 1
        if self.tags is None:
            self.pg.recv([like], 1 - self.rank, 0).wait(self.op_timeout)
            return like
        packed = PayloadTags.shell(like)
        self.pg.recv([packed], 1 - self.rank, 0).wait(self.op_timeout)
        got = self.tags.open(packed, like, (*self.fields, what, 1 - self.rank, n))
        if got is None:
            raise PayloadAuthError(
                f"parameter server {what} on {self.fields[0]} failed its MAC: altered, injected or replayed on the "
                "way, or the sender holds another key; it was not used"
            )
        return got

    # ---- the island's side ------------------------------------------------------------------------
    def send(self, r: Request) -> None:
        payload = None if r.payload is None else as_bytes(r.payload)
        n = 0 if payload is None else payload.numel()
        head = torch.tensor([r.kind, r.island, r.version, r.samples, n, r.seq, r.nonce, r.held], dtype=torch.float64)
        self._send(head, "request")
        if payload is not None:
            self._send(payload, "payload")

    def reply(self) -> ShardReply:
        h = self._recv(torch.zeros(_REPLY, dtype=torch.float64), "reply").tolist()
        body = self._recv(torch.empty(int(h[5]), dtype=torch.uint8), "body") if h[5] > 0 else None
        return ShardReply(
            bool(h[0]), int(h[1]), int(h[2]), bool(h[3]), bool(h[4]), bool(h[6]), body, int(h[7]), int(h[8])
        )

    # ---- the server's side ------------------------------------------------------------------------
    def request(self, started: Callable[[], None] | None = None) -> Request:
        """The next request; `started()` runs once its header is in, before its payload (which a slow link may take
        seconds to bring)."""
        h = self._recv(torch.zeros(_REQUEST, dtype=torch.float64), "request").tolist()
        if int(h[0]) not in KIND_NAMES:
            raise ValueError(f"unknown parameter server message kind {h[0]}")
        if started is not None:
            started()
        payload = self._recv(torch.empty(int(h[4]), dtype=torch.uint8), "payload") if h[4] > 0 else None
        return Request(int(h[0]), int(h[1]), int(h[2]), float(h[3]), payload, int(h[5]), int(h[6]), int(h[7]))

    def answer(self, r: ShardReply) -> None:
        body = None if r.body is None else as_bytes(r.body)
        n = 0 if body is None else body.numel()
        flags = [
            *(float(r.accepted), r.version, r.staleness, float(r.stepped), float(r.final), n, float(r.duplicate)),
            *(r.token, r.coded),
        ]
        self._send(torch.tensor(flags, dtype=torch.float64), "reply")
        if body is not None:
            self._send(body, "body")

    def close(self) -> None:
        try:
            self.pg.abort()
        except RuntimeError:  # already torn down
            pass
