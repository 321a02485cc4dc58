"""State transfer of an elastic job (islands.runtime.elastic): what a joiner receives from the members.

At a join the members and the joiners share the lowest-ranked old member's {"model", "strategy", "step"}: by
default in checksummed chunks from every old member (islands.runtime.elastic.recovery; `mode = "chunks"`), or as
one gloo broadcast of torch.save bytes (`mode = "broadcast"`). A joiner loads nothing before it is whole, then its
participant's `joined` hook restarts its local work from the global model (a copy of the holder's local work
would be counted twice). An island of k workers whose inner strategy shards the model (fsdp) serves and loads the
island's state instead (islands.runtime.elastic.island_comm.IslandTransfer overrides `snapshot`, `load_shared` and
`global_sha`).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import time
from collections.abc import Callable
from typing import cast

import torch

from islands.runtime.contracts import ElasticParticipant, Holder
from islands.runtime.elastic import recovery
from islands.runtime.elastic.comm import ElasticComm
from islands.runtime.elastic.commit import store_layers
from islands.runtime.elastic.membership import get_json


class StateTransfer:
    """How one member serves and receives the training state over its ElasticComm (module docstring).
    `participant()`: the membership's participant, whose `joined` runs after a joiner loaded."""

    def __init__(
        self, comm: ElasticComm, participant: Callable[[], ElasticParticipant | None], key: bytes | None = None
    ):
        """`key`: the control plane's MAC key (auth.derive_key), for a store whose clients are wrapped deeper than
        `secret` looks (islands.runtime.cross: prefixes over its AuthStore)."""
        self.comm, self.participant, self.key = comm, participant, key
        # How a joiner receives the state: "chunks" (islands.runtime.elastic.recovery: checksummed chunks from every
        # holder over TCP, refetched when damaged) or "broadcast" (one gloo broadcast from the lowest holder)
        self.mode = "chunks"
        self.transfers: list[dict] = []  # one FetchReport summary per state this process received in chunks

    def share_state(self, strategy, model, step: int, holders: set[str]) -> int:
        """The lowest-ranked holder sends {"model": the global model, "strategy": its state, "step"}; everyone
        else loads it into `strategy` and `model`. Returns the step (the sender's)."""
        comm, name = self.comm, self.comm.epochs.name

        def src() -> int:
            ranks = [i for i, n in enumerate(comm.names) if n in holders]
            if not ranks:
                raise RuntimeError("every member holding the training state left during a join")
            return ranks[0]

        if self.mode == "chunks":
            return self._share_in_chunks(strategy, model, step, holders, src)
        mine = comm.names[src()] == name
        blob = torch.zeros(0, dtype=torch.uint8)
        if mine:
            buf = io.BytesIO()
            torch.save(self.snapshot(strategy, model, step), buf)
            blob = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        length = comm.broadcast_from(torch.tensor([blob.numel()], dtype=torch.int64), src, kind="elastic_state")
        if not mine:
            blob = torch.zeros(int(length.item()), dtype=torch.uint8)
        blob = comm.broadcast_from(blob, src, kind="elastic_state")
        if name in holders:
            return step
        state = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=False)
        return self.load_shared(strategy, model, state)

    # What a holder serves and a joiner loads. An island of k workers whose inner strategy shards the model
    # (fsdp) overrides all three (island_comm.IslandTransfer): there the state is spread over the island's workers.
    def snapshot(self, strategy, model, step: int) -> dict:
        """The state a holder serves: {"model": the global model, "strategy": its state, "step"}."""
        return {"model": strategy.eval_model(model).state_dict(), "strategy": strategy.state_dict(), "step": int(step)}

    def load_shared(self, strategy, model, state: dict) -> int:
        """A joiner loads what it received; returns the step its loop starts at."""
        participant = self.participant()
        assert participant is not None, "elastic needs an outer strategy (validate), which participates at its wrap"
        return load_state(strategy, model, state, participant)

    def global_sha(self, strategy, model) -> str | None:
        """The global model's digest for the join and entry events (None: a sharded island's, before it has one)."""
        return global_digest(strategy.eval_model(model))

    def _share_in_chunks(self, strategy, model, step: int, holders: set[str], src) -> int:
        """Live recovery (issue #20): every holder serves its snapshot (recovery.StateServer on the address it
        reaches the store from) and publishes address + digest under e/<epoch>/state/<name>; a joiner fetches
        the lowest-ranked holder's state from every holder serving the same digest, in checksummed chunks.
        A committed all-reduce then keeps the servers up until every joiner has its state (a joiner that
        fails dies, and the members fail over without it). The joiner loads nothing before it is whole."""
        comm, epochs = self.comm, self.comm.epochs
        key = f"e/{epochs.epoch}/state"
        server = None
        if epochs.name in holders:
            image = recovery.StateImage.build(self.snapshot(strategy, model, step))
            server = recovery.StateServer(
                image, host=recovery.local_address_towards(store_host(epochs.store)), secret=self.secret(key)
            )
            host, port = server.address
            epochs.store.set(
                f"{key}/{epochs.name}", json.dumps({"address": f"{host}:{port}", "digest": image.manifest.digest})
            )
        try:
            state = None if server is not None else self._fetch_state(key, holders, src)
            comm.all_reduce(torch.zeros(1), kind="elastic_state_done")
        finally:
            if server is not None:
                server.close()
                comm.ledger.record("elastic_state", server.bytes_sent, 0)
        if state is None:
            return step
        return self.load_shared(strategy, model, state)

    def _fetch_state(self, key: str, holders: set[str], src) -> dict:
        epochs, commit = self.comm.epochs, self.comm.epochs.commit
        store, timeout = epochs.store, commit.timeout
        ranked = [n for n in epochs.names if n in holders]
        deadline = time.monotonic() + timeout
        while True:  # every holder published, or is gone (then the others serve without it)
            published = {n: get_json(store, f"{key}/{n}") for n in ranked if store.check([f"{key}/{n}"])}
            missing = set(ranked) - set(published)
            if not missing or missing <= commit.liveness.gone(missing) or time.monotonic() > deadline:
                break
            time.sleep(commit.POLL)
        if not published:
            raise RuntimeError(
                f"no holder of the training state published it for epoch {epochs.epoch} within {timeout:.0f} s"
            )
        first = next(n for n in ranked if n in published)  # the lowest-ranked holder's state is the one to take
        peers = [published[n]["address"] for n in ranked if n in published]
        state, report = recovery.fetch_state(
            peers, secret=self.secret(key), expect_digest=published[first]["digest"], timeout=timeout
        )
        self.comm.ledger.record("elastic_state", 0, report.payload_bytes)
        self.transfers.append(
            {
                "via": "chunks",
                "epoch": epochs.epoch + epochs.epoch_base,
                "bytes": report.payload_bytes,
                "seconds": report.seconds,
                "peers": len(report.per_peer),
                "refetched": report.refetched,
                "skipped": report.skipped,
            }
        )
        return cast(dict, state)  # what the holder served: its snapshot(), a dict

    def secret(self, key: str) -> bytes:
        """The recovery servers' secret: derived from the job's control-plane key (token and job id) when the
        store is authenticated (islands.runtime.elastic.auth), else a random one the first holder puts in the store."""
        store = self.comm.epochs.store
        auth = getattr(store, "auth", None)
        mac_key = self.key or (getattr(auth, "key", None) if auth is not None else None)
        if mac_key:
            return hmac.new(mac_key, b"islands-recovery|" + key.encode(), hashlib.sha256).digest()
        store.compare_set(f"{key}/secret", "", os.urandom(16).hex())
        return store.get(f"{key}/secret")


def global_digest(model: torch.nn.Module) -> str:
    """SHA-256 of a model's state (parameters and buffers): survivors must agree on the global model bit for bit."""
    return state_digest(model.state_dict())


def state_digest(state: dict) -> str:
    """global_digest of a model whose state_dict() is `state`."""
    h = hashlib.sha256()
    for t in state.values():
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def store_host(store) -> str:
    """The host of the TCPStore under `store`'s wrappers."""
    return next(
        (s.host for s in store_layers(store) if isinstance(getattr(s, "host", None), str) and s.host), "127.0.0.1"
    )


def load_state(strategy: Holder, model, state: dict, participant: ElasticParticipant) -> int:
    """A joiner loads the members' state, then its participant's `joined` hook runs (DiLoCo: local <- global)."""
    strategy.eval_model(model).load_state_dict(state["model"])
    strategy.load_state_dict(state["strategy"])
    participant.joined()
    return int(state["step"])
