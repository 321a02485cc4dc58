"""An island's side of the parameter server processes (issue #36, parts 2-3): one connection per shard server,
a heartbeat, and every wait bounded.

    link = RemoteLink(("10.0.0.1", port), island=3, bounds=config.bounds, timeout_s=60, lease_s=2)
    link.start()                                     # heartbeat: beat/<island> in the store every lease/4 s
    reply = link.send(Message(PULL, 3))              # a joiner starts from the current global model
    reply = link.send(Message(PUSH, 3, 0, samples, delta))     # each shard gets its range of the fp32 delta
    reply = link.send(Message(DONE, 3))              # polls until every island is done (or the timeout: then the
                                                     # last model it got, and `final` False)

A push carries the island's push number (seq) and a random nonce of this island process. When a connection breaks
(the server was killed, or the answer did not come within timeout_s) the link connects again, to whatever server
generation the store names by then (the supervisor's restart, rebuilt from its journal), and sends the same request
again: a push the shard had logged before it died is answered as a duplicate and not applied twice; one it had not is
applied now. Every retry happens within `timeout_s` of the request's start; past it, TimeoutError names the shard.
A payload that fails its MAC is not retried (PayloadAuthError).

Buffers (ps_buffers.py; `buffers` values per vector, 0 for a model without): shard 0 holds them. A push to it carries
the island's float64 buffer vector after the range's payload, in the same sealed tensor, and each of its answers
with a model carries the islands' mean after the model slice, or nothing while it holds none (before any island
pushed buffers; the table is journaled with the pushes, so a rebuilt server holds what it acknowledged): then the
reply's `buffers` is None and the island keeps its own.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from islands.runtime.payload_auth import PayloadAuthError, PayloadTags
from islands.sync.outer.ps_buffers import pushed_vector
from islands.sync.outer.ps_link import Link, Message, Reply
from islands.sync.outer.ps_pulls import HeldModel, PullCodec, Pulled
from islands.sync.outer.ps_server import Ack
from islands.sync.outer.ps_wire import (
    DONE,
    HOLDS_MODEL,
    KIND_NAMES,
    PUSH,
    REPLY_BYTES,
    REQUEST_BYTES,
    RESTORE,
    SNAPSHOT,
    WANTS_MODEL,
    Pair,
    Request,
    ShardReply,
    StoreCalls,
    as_bytes,
    new_client,
)
from islands.sync.outer.quant4 import PayloadCodec


class ServiceGone(RuntimeError):
    """The parameter server's store is gone: no request of this island will be answered any more."""


class RemoteLink(Link):
    """The island's connections to S shard servers (module docstring). `bounds`: each shard's parameter range;
    `codec`: encodes each shard's range of a push (decoded on its server); `tags`: the job's payload tags."""

    def __init__(
        self,
        address: tuple[str, int],
        island: int,
        bounds: Sequence[tuple[int, int]],
        timeout_s: float = 600.0,
        lease_s: float = 2.0,
        codec: PayloadCodec | None = None,
        tags: PayloadTags | None = None,
        ledger=None,
        buffers: int = 0,
        pulls: PullCodec | None = None,
    ):
        self.host, self.port = address
        self.buffers = buffers  # values in a buffer vector, carried to and from shard 0 (module docstring)
        self.island, self.bounds = island, [tuple(b) for b in bounds]
        self.timeout_s, self.lease_s, self.codec, self.tags, self.ledger = timeout_s, lease_s, codec, tags, ledger
        self.connect_s = max(1.0, lease_s)
        self.store = new_client(self.host, self.port, self.connect_s * 5)
        self.calls = StoreCalls(f"{self.host}:{self.port}")  # bounded waits on self.store
        self.pairs: list[Pair | None] = [None] * len(self.bounds)
        self.versions = [0] * len(self.bounds)
        self.held = [HeldModel(pulls) for _ in self.bounds]  # each range's copy, which compressed pulls step
        self.nonce, self.seq = secrets.randbits(52), 0
        self.final = False  # the last DONE got every shard's final answer
        self.retries = 0  # requests sent again on a new connection (a server restarted, or a timeout)
        self.stopping = threading.Event()
        self.beat: threading.Thread | None = None

    # ---- liveness -----------------------------------------------------------------------------------
    def start(self) -> RemoteLink:
        self.beat = threading.Thread(target=self._beat, name="islands-ps-heartbeat", daemon=True)
        self.beat.start()
        return self

    def _beat(self) -> None:
        store = new_client(self.host, self.port, self.connect_s * 5)
        while not self.stopping.is_set():
            try:
                store.add(f"beat/{self.island}", 1)
                store.add("beats", 1)
            except RuntimeError:  # the store is gone (the job ended): nothing to beat for
                return
            self.stopping.wait(self.lease_s / 4)

    def close(self) -> None:
        self.stopping.set()
        for pair in self.pairs:
            if pair is not None:
                pair.close()
        self.pairs = [None] * len(self.bounds)

    # ---- requests -----------------------------------------------------------------------------------
    def send(self, msg: Message) -> Reply:
        if msg.kind == PUSH:
            assert msg.payload is not None, "a push carries its delta"
            self.seq += 1
            replies = [self._push(k, msg) for k in range(len(self.bounds))]
        elif msg.kind == DONE:
            replies = self._done()
        else:
            replies = [
                self.request(k, Request(msg.kind, self.island, held=self.held[k].token))
                for k in range(len(self.bounds))
            ]
        for k, r in enumerate(replies):
            self.versions[k] = r.version
        parts = [self._slice(k, r) for k, r in enumerate(replies)]
        flat = torch.cat([model for model, _ in parts])
        ack = Ack(
            all(r.accepted for r in replies),
            min(self.versions),
            max(r.staleness for r in replies),
            any(r.stepped for r in replies),
        )
        return Reply(ack, flat, parts[0][1])

    def _push(self, k: int, msg: Message) -> ShardReply:
        assert msg.payload is not None
        lo, hi = self.bounds[k]
        part = msg.payload[lo:hi].to(torch.float32)
        payload = self.codec.encode_part(part, k) if self.codec is not None else part  # its own state per range
        if k == 0 and self.buffers:  # shard 0 holds the buffers: they follow its range's payload
            mine = pushed_vector(self.island, msg.buffers, self.buffers)
            payload = torch.cat([as_bytes(payload), as_bytes(mine)])
        r = Request(PUSH, self.island, self.versions[k], msg.samples, payload, self.seq, self.nonce, self.held[k].token)
        return self.request(k, r)

    def _done(self) -> list[ShardReply]:
        """DONE to every shard, again every lease/4 s (at most 0.5 s) until each answers `final`, within timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        replies: list[ShardReply | None] = [None] * len(self.bounds)
        bodies: list[torch.Tensor | None] = [None] * len(self.bounds)  # a repeated DONE's answer has no model
        while True:
            for k, r in enumerate(replies):
                if r is None or not r.final:
                    wants = WANTS_MODEL if bodies[k] is None else HOLDS_MODEL
                    replies[k] = got = self.request(k, Request(DONE, self.island, samples=wants))
                    bodies[k] = got.body if got.body is not None else bodies[k]
            done = [r if r.body is not None else replace(r, body=bodies[k]) for k, r in enumerate(replies) if r]
            self.final = all(r.final for r in done)
            if self.final or time.monotonic() > deadline:
                return done
            time.sleep(min(0.5, self.lease_s / 4))

    def _slice(self, k: int, r: ShardReply) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Shard k's range of the model (its fp32 slice, or the island's copy stepped by a compressed pull), and
        (shard 0) the buffers' mean after it, None when it sent none."""
        assert r.body is not None, "a shard answers with its range of the model"
        lo, hi = self.bounds[k]
        cut = r.coded if r.coded else (hi - lo) * 4
        model, rest = r.body[:cut], r.body[cut:]
        if rest.numel() != 0 and (k != 0 or rest.numel() != self.buffers * 8):
            raise ValueError(
                f"parameter server shard {k} answered {rest.numel()} bytes past its range; expected "
                f"{self.buffers * 8 if k == 0 else 0}"
            )
        body = model.clone() if r.coded else model.clone().view(torch.float32)
        part = self.held[k].take(Pulled(body, r.token, bool(r.coded)))
        return part, (rest.clone().view(torch.float64) if rest.numel() else None)

    def request(self, k: int, r: Request) -> ShardReply:
        """Send `r` to shard k and wait for its answer, connecting again and resending on a broken connection,
        within timeout_s (module docstring)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                pair = self.pairs[k] or self._connect(k, deadline)
                self.pairs[k] = pair
                pair.send(r)
                reply = pair.reply()
                self._count(r, reply)
                return reply
            except PayloadAuthError:
                raise
            except RuntimeError as e:
                if self.pairs[k] is not None:
                    self.pairs[k].close()  # type: ignore[union-attr]
                    self.pairs[k] = None
                    self.retries += 1
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"parameter server shard {k} did not answer island {self.island}'s {KIND_NAMES[r.kind]} "
                        f"within {self.timeout_s:.0f} s: {e}"
                    ) from e
                if self._service_gone():
                    raise ServiceGone(
                        f"the parameter server's store at {self.host}:{self.port} no longer listens (its supervisor "
                        f"ended: the job stopped without island {self.island}, or the supervisor died) before "
                        f"island {self.island}'s {KIND_NAMES[r.kind]} was answered"
                    ) from e
                time.sleep(min(1.0, self.lease_s / 4))  # a killed server's successor needs a moment to rebuild

    def _service_gone(self) -> bool:
        """Nothing listens at the store's address any more: the supervisor, which hosts it for the job's whole life
        (a restarted server reuses it), has ended. A cut or congested link times out or is unreachable instead,
        and the request keeps trying until its timeout."""
        try:
            with socket.create_connection((self.host, self.port), timeout=self.connect_s):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False

    def _connect(self, k: int, deadline: float) -> Pair:
        """A new connection to shard k's current server; every wait on the store within its bound (a stopped
        supervisor's store answers nothing: ps_wire.StoreSilent, which request() retries until its deadline)."""

        def bound() -> float:  # the client's own timeout, or what is left of the request's
            return min(self.connect_s * 5, max(0.1, deadline - time.monotonic()))

        gen = self.calls(lambda: int(self.store.add(f"gen/{k}", 0)), bound())
        while gen == 0:  # no server of shard k has started yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"no server of shard {k} has started")
            time.sleep(0.05)
            gen = self.calls(lambda: int(self.store.add(f"gen/{k}", 0)), bound())
        n = self.calls(lambda: int(self.store.add(f"conn/{k}/{gen}", 1)), bound())
        self.calls(lambda: self.store.set(f"conn/{k}/{gen}/{n}", str(self.island)), bound())
        name = f"pair/{k}/{gen}/{n}"
        return self.calls(
            lambda: Pair.connect(
                new_client(self.host, self.port, self.connect_s), name, 1, self.connect_s, self.timeout_s, self.tags
            ),
            bound(),
        )

    def _count(self, r: Request, reply: ShardReply) -> None:
        if self.ledger is None:
            return
        sent = REQUEST_BYTES + (0 if r.payload is None else r.payload.numel() * r.payload.element_size())
        self.ledger.record("ps_push", sent, 0)
        self.ledger.record("ps_pull", 0, REPLY_BYTES + (0 if reply.body is None else reply.body.numel()))

    # ---- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"nonce": self.nonce, "seq": self.seq, "versions": list(self.versions)}

    def load_state_dict(self, state: dict) -> None:
        self.nonce, self.seq = int(state["nonce"]), int(state["seq"])
        self.versions = [int(v) for v in state["versions"]]

    # ---- the job's checkpoints ----------------------------------------------------------------------
    def snapshot(self) -> list[torch.Tensor]:
        """Every shard's whole state (its DurableShard.state_dict, serialised), for the job's checkpoint."""
        out = []
        for k in range(len(self.bounds)):
            body = self.request(k, Request(SNAPSHOT, self.island)).body
            assert body is not None, "a snapshot answers with the state"
            out.append(body.clone())
        return out

    def restore(self, states: Sequence[torch.Tensor]) -> None:
        """Put every shard back to a snapshot (a resumed job), each committed to its journal at once."""
        if len(states) != len(self.bounds):
            raise ValueError(f"a checkpoint of {len(states)} parameter server shards for {len(self.bounds)} servers")
        for k, state in enumerate(states):
            self.versions[k] = self.request(k, Request(RESTORE, self.island, payload=state)).version
