"""Live recovery (islands.runtime.elastic.recovery): a joiner fetches a state from several peers in checksummed chunks.

Servers run as threads in this process over loopback; damage and deaths are injected by subclassing the
server (a peer that flips a byte of one chunk, a peer that breaks its connections mid-transfer).
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time

import pytest
import torch

from islands.checkpoint.codec import TensorCodec, decode_tensor
from islands.runtime.elastic.recovery import Manifest, RecoveryError, StateImage, StateServer, fetch_state

SECRET = b"job-token"


def mixed_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(300, 41, generator=g),
            "h": torch.randn(64, generator=g).bfloat16(),
            "half": torch.randn(9, 3, generator=g).half(),
            "idx": torch.arange(-5, 1000, 7),
            "mask": torch.rand(33, generator=g) > 0.5,
            "empty": torch.empty(0, 4),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "nan": torch.tensor([float("nan"), -0.0]),
            "strided": torch.randn(20, 30, generator=g).t(),
        },  # non-contiguous
        "strategy": {"rounds": 7, "outer": {"momentum": [torch.randn(11, generator=g)]}, "name": "diloco"},
        "step": 123,
    }


def assert_bitwise(a, b, where="state"):
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)  # noqa: E731
        assert torch.equal(raw(a), raw(b)), f"{where}: bytes differ"
    else:
        assert a == b, where


@pytest.fixture
def servers():
    made = []

    def make(image, cls=StateServer, **kw):
        s = cls(image, secret=SECRET, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("codec", [None, TensorCodec()], ids=["raw", "codec"])
def test_round_trip_is_bitwise_for_mixed_dtypes_from_three_peers(servers, codec):
    state = mixed_state()
    image = StateImage.build(state, chunk_bytes=512, codec=codec)
    peers = [servers(image).address for _ in range(3)]
    if codec is not None:
        with pytest.raises(RecoveryError, match=re.escape("pass decode=islands.checkpoint.codec.decode_tensor")):
            fetch_state(peers, secret=SECRET)
    got, report = fetch_state(peers, secret=SECRET, decode=decode_tensor)
    assert_bitwise(state, got)
    assert report.chunks == image.manifest.chunks > 20 and report.refetched == 0
    assert sum(p["chunks"] for p in report.per_peer.values()) == report.chunks
    assert len(report.per_peer) == 3 and report.digest == image.manifest.digest


def test_the_same_state_gives_the_same_digest_and_another_state_another():
    a, b = StateImage.build(mixed_state(0)), StateImage.build(mixed_state(0))
    assert a.manifest.digest == b.manifest.digest and bytes(a.payload) == bytes(b.payload)
    assert StateImage.build(mixed_state(1)).manifest.digest != a.manifest.digest


class Flipper(StateServer):
    """A peer whose memory (or link) damages one chunk: one byte flipped, the length right."""

    bad_index = 3

    def chunk(self, index):
        data = super().chunk(index)
        if index != self.bad_index:
            return data
        out = bytearray(data)
        out[len(out) // 2] ^= 0x40
        return memoryview(out)


class FlipsFirst(StateServer):
    """A peer that damages the first chunk it serves, whichever index the fetcher asks it for first (which
    chunks go to which peer depends on who connects first: under load the healthy peer may take chunk 3)."""

    def __init__(self, *args, **kwargs):
        self._first = threading.Lock()
        self.damaged_index = None
        super().__init__(*args, **kwargs)

    def chunk(self, index):
        data = super().chunk(index)
        if not self._first.acquire(blocking=False):
            return data
        self.damaged_index = index
        out = bytearray(data)
        out[len(out) // 2] ^= 0x40
        return memoryview(out)


class Gated(StateServer):
    """A healthy peer that serves nothing until `gate` is set (so the flipper is asked for chunk 3 first)."""

    gate: threading.Event

    def chunk(self, index):
        self.gate.wait(60)  # generous: on a loaded machine 10 s expired before the flipper reached chunk 3
        return super().chunk(index)


def test_a_damaged_chunk_is_detected_and_fetched_again_from_another_peer(servers):
    state = mixed_state()
    image = StateImage.build(state, chunk_bytes=512)
    bad = servers(image, FlipsFirst)
    good = servers(image, Gated)
    good.gate = threading.Event()
    # the healthy peer serves nothing until the other has served a chunk, and that first one went out damaged
    threading.Thread(target=lambda: (_wait_for(lambda: bad.served >= 1), good.gate.set()), daemon=True).start()
    got, report = fetch_state([bad.address, good.address], secret=SECRET, depth=1)
    assert_bitwise(state, got)
    bad_stats = report.per_peer[f"{bad.address[0]}:{bad.address[1]}"]
    good_stats = report.per_peer[f"{good.address[0]}:{good.address[1]}"]
    assert report.refetched == 1 and bad_stats["damaged"] == 1
    assert bad_stats["chunks"] + good_stats["chunks"] == report.chunks and good_stats["chunks"] >= 1


def _wait_for(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_a_chunk_damaged_at_every_peer_is_a_clear_error_after_bounded_attempts(servers):
    image = StateImage.build(mixed_state(), chunk_bytes=512)
    peers = [servers(image, Flipper).address for _ in range(2)]
    with pytest.raises(RecoveryError, match=r"chunk 3 arrived damaged 3 times .*giving up after 3 attempts"):
        fetch_state(peers, secret=SECRET, attempts=3)


class DiesMidway(StateServer):
    """A peer that crashes after serving a few chunks: every connection is reset (RST, no goodbye)."""

    serve_before_death = 5

    def chunk(self, index):
        if self.served >= self.serve_before_death:
            with self._lock:
                conns = list(self._conns)
            for c in conns:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close()
            raise OSError("peer died")
        time.sleep(0.002)  # slower than the others, so it is mid-transfer when it dies
        return super().chunk(index)


class Slow(StateServer):
    def chunk(self, index):
        time.sleep(0.002)
        return super().chunk(index)


def test_a_peer_that_dies_mid_transfer_leaves_the_rest_to_the_others(servers):
    state = mixed_state()
    image = StateImage.build(state, chunk_bytes=512)
    dying = servers(image, DiesMidway)
    peers = [dying.address, servers(image, Slow).address, servers(image, Slow).address]
    got, report = fetch_state(peers, secret=SECRET)
    assert_bitwise(state, got)
    dead = report.per_peer[f"{dying.address[0]}:{dying.address[1]}"]
    assert dead["error"] is not None and dead["chunks"] <= DiesMidway.serve_before_death
    assert sum(p["chunks"] for p in report.per_peer.values()) == report.chunks


def test_every_peer_dying_is_a_clear_error(servers):
    image = StateImage.build(mixed_state(), chunk_bytes=512)
    peers = [servers(image, DiesMidway).address for _ in range(2)]
    with pytest.raises(RecoveryError, match="every peer failed before the state was whole"):
        fetch_state(peers, secret=SECRET)


def test_manifest_mismatch_is_a_clear_error_and_other_states_are_skipped(servers):
    mine, other = StateImage.build(mixed_state(0), chunk_bytes=512), StateImage.build(mixed_state(1), chunk_bytes=512)
    a, b = servers(mine), servers(other)
    with pytest.raises(RecoveryError, match="manifest mismatch: the peers serve state"):
        fetch_state([a.address], secret=SECRET, expect_digest=other.manifest.digest[::-1])
    # with the announced digest, the peer holding another state is not used
    got, report = fetch_state([b.address, a.address], secret=SECRET, expect_digest=mine.manifest.digest)
    assert_bitwise(mixed_state(0), got)
    assert "serves another state" in report.skipped[f"{b.address[0]}:{b.address[1]}"]
    assert b.served == 0


def test_a_damaged_manifest_is_refused():
    data = bytearray(StateImage.build(mixed_state(), chunk_bytes=512).manifest.to_bytes())
    data[20] ^= 1
    with pytest.raises(RecoveryError):
        Manifest.from_bytes(bytes(data))


def test_wrong_secret_is_refused_and_names_the_token(servers):
    image = StateImage.build(mixed_state(), chunk_bytes=512)
    s = servers(image)
    with pytest.raises(RecoveryError, match="secret \\(the job's token\\) does not match"):
        fetch_state([s.address], secret=b"not-the-token")
    assert s.refused == 1 and s.served == 0


def test_bad_arguments_name_what_is_right():
    with pytest.raises(ValueError, match="chunk_bytes must be a positive integer"):
        StateImage.build({}, chunk_bytes=0)
    with pytest.raises(ValueError, match="HOST:PORT"):
        fetch_state(["nohost"])
    with pytest.raises(ValueError, match="at least one peer"):
        fetch_state([])


def test_empty_and_tensorless_states_round_trip(servers):
    for state in ({}, {"step": 5, "name": "x"}, {"e": torch.empty(0)}):
        got, _ = fetch_state([servers(StateImage.build(state)).address], secret=SECRET)
        assert_bitwise(state, got)


def test_training_resumes_bitwise_from_a_recovered_state(servers):
    """Bitwise resume: a joiner that loads the recovered model + optimizer state and takes the same steps
    ends with exactly the source's parameters."""
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    data = [(torch.randn(12, 8), torch.randint(0, 3, (12,))) for _ in range(6)]

    def step(model, o, x, y):
        o.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        o.step()

    for x, y in data[:3]:
        step(src, opt, x, y)
    image = StateImage.build({"model": src.state_dict(), "opt": opt.state_dict(), "step": 3}, chunk_bytes=256)
    got, _ = fetch_state([servers(image).address, servers(image).address], secret=SECRET)

    torch.manual_seed(1)  # the joiner starts from other weights
    joiner = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    jopt = torch.optim.AdamW(joiner.parameters(), lr=1e-2)
    joiner.load_state_dict(got["model"])
    jopt.load_state_dict(got["opt"])
    assert got["step"] == 3
    for x, y in data[3:]:
        step(src, opt, x, y)
        step(joiner, jopt, x, y)
    assert_bitwise(src.state_dict(), joiner.state_dict())


class _Strategy:
    """What share_state needs of the strategy the loop drives: its global model and a state of its own."""

    def __init__(self, rounds: int, momentum: torch.Tensor):
        self.rounds, self.momentum = rounds, momentum

    def eval_model(self, model):
        return model

    def state_dict(self):
        return {"rounds": self.rounds, "momentum": self.momentum}

    def load_state_dict(self, state):
        self.rounds, self.momentum = state["rounds"], state["momentum"].clone()

    def settle(self):  # and the membership's participant (runtime.contracts.ElasticParticipant)
        pass

    def joined(self):
        pass


@pytest.mark.parametrize("transfer", ["chunks", "broadcast"])
def test_elastic_join_receives_the_lowest_holders_state_from_every_holder(transfer):
    """Two members of epoch 1 serve their (identical) state; a joiner entering with them gets it bit for bit, with
    the members' step, through StateTransfer.share_state (the join path of islands.runtime.elastic)."""
    from islands.runtime.comm import CommLedger
    from islands.runtime.elastic import elastic_member
    from islands.runtime.elastic.membership import connect, host_store

    server, store = host_store(0)
    store.set("e/1/members", '[[0, "h0", 0], [1, "h1", 1], [2, "j", 2]]')
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    momentum = torch.randn(4)
    out, errors = {}, []

    def member(name):
        try:
            torch.manual_seed(hash(name) % 1000)
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
            strategy = _Strategy(0, torch.zeros(4))
            if name != "j":
                model.load_state_dict(reference.state_dict())
                strategy = _Strategy(5, momentum.clone())
            member = elastic_member(
                connect("127.0.0.1", server.port), name, CommLedger(), heartbeat_timeout=10.0, collective_timeout=30.0
            )
            member.transfer.mode = transfer
            member.participate(strategy)
            member.epochs.form(1, None)
            step = member.transfer.share_state(strategy, model, 0 if name == "j" else 40, {"h0", "h1"})
            out[name] = (step, model, strategy, member.comm, member.transfer)
            member.leave()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((name, e))

    threads = [threading.Thread(target=member, args=(n,)) for n in ("h0", "h1", "j")]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not errors, errors
    step, model, strategy, comm, joiner = out["j"]
    assert step == 40 and strategy.rounds == 5
    assert_bitwise(reference.state_dict(), model.state_dict())
    assert_bitwise(momentum, strategy.momentum)
    received = comm.ledger.received["elastic_state"]
    assert received >= sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    if transfer == "chunks":
        [t] = joiner.transfers
        assert t["peers"] == 2 and t["refetched"] == 0 and t["skipped"] == {}
        # what the holders served is what the joiner received (no chunk twice)
        sent = out["h0"][3].ledger.sent["elastic_state"] + out["h1"][3].ledger.sent["elastic_state"]
        assert sent == t["bytes"]
