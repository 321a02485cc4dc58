"""islands.compress compressors for the pushes of the parameter server's processes (issue #36 item 1), shard servers
as threads here (harness.ps.ThreadService): each island encodes each server's range with a compressor of its own, its
own residual per range, and each server decodes its range. Two islands through two servers with topkq: every shard
applied what the hand-done error feedback on that range says, the ranges' residuals are the island's, the ledger
counts the compressed payloads, and both islands end on one global model."""

from __future__ import annotations

import threading

import torch
from test_ps_buffers import OneIsland
from test_ps_codecs import by_hand, recorded, watch_encoder
from test_ps_strategy import Island

from harness.outer import tiny_model
from harness.ps import ThreadService
from islands.compress import COMPRESSORS
from islands.outer import ParameterServer
from islands.runtime.comm import CommLedger
from islands.runtime.world import LoneComm, World
from islands.sync.outer.flat import FlatView
from islands.sync.outer.ps import ServerProcesses, outer_rule
from islands.sync.outer.ps_codecs import CompressedPushes
from islands.sync.outer.ps_remote import REQUEST_BYTES
from islands.sync.outer.ps_service import ServiceConfig

SPEC = "topkq:ratio=0.05,bits=2"


def island_world(island: int, ledger: CommLedger) -> World:
    comms = {"cross": OneIsland(island, ledger), "local": LoneComm()}
    return World(rank=island, size=2, islands=2, device=torch.device("cpu"), backend="none", comms=comms)


def test_two_islands_through_two_shard_servers_compress_each_range_with_its_own_residual(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    applied = recorded(monkeypatch)
    initial = FlatView(tiny_model().parameters()).read()
    codec = CompressedPushes(COMPRESSORS.build(SPEC))  # the servers' decoder, as island 0 would configure it
    config = ServiceConfig(initial, outer_rule(), islands=2, servers=2, lease_s=30.0, max_staleness=100, codec=codec)
    ledgers = [CommLedger(), CommLedger()]
    with ThreadService(tmp_path, config) as svc:
        isl, calls = [], []
        for k in range(2):
            ps = ParameterServer(
                2, compressor=COMPRESSORS.build(SPEC), service=ServerProcesses(2, 30.0, 120.0, address=svc.address)
            )
            isl.append(Island(island_world(k, ledgers[k]), ps))
            assert isinstance(ps.codec, CompressedPushes)
            calls.append(watch_encoder(ps.codec))
        for i in range(8):  # in turn: 4 pushes each
            for x in isl:
                x.step(i)
        pushed = [ledger.snapshot()["sent"]["ps_push"] for ledger in ledgers]  # before DONE (resent until final)
        finals = [threading.Thread(target=x.strategy.final) for x in isl]  # DONE: answered once both are done
        for t in finals:
            t.start()
        for t in finals:
            t.join(60)
        bounds = config.bounds
        assert len(bounds) == 2 and all(hi > lo for lo, hi in bounds)
        for k, x in enumerate(isl):
            assert x.strategy.link.final
            # each push encoded shard 0's range, then shard 1's: calls alternate between the ranges
            assert len(calls[k]) == 2 * 4
            for r, (lo, hi) in enumerate(bounds):
                deltas = [delta for delta, _ in calls[k][r::2]]
                assert all(d.numel() == hi - lo for d in deltas)
                shard = svc.servers[r].durable.state
                mine = [d for i, d, state in applied if i == k and state is shard]
                sent, residual = by_hand(SPEC, deltas, ef=True)  # this range's residual only
                assert len(mine) == len(sent) == 4
                for got, expected in zip(mine, sent):
                    torch.testing.assert_close(got, expected, rtol=0, atol=0)
                state = x.strategy.state_dict()["ps_codec"]["encoder"]["states"][f"range{r}"]
                torch.testing.assert_close(state["residual"], residual, rtol=0, atol=0)
                assert residual.abs().sum() > 0
            # the first pull's header to each server, then per push and server the header and the range's payload:
            # its 3 counts and topkq's own bytes
            nbytes = sum(codec.compressor.payload_nbytes((hi - lo,), torch.float32) + 3 * 8 for lo, hi in bounds)
            assert pushed[k] == 2 * REQUEST_BYTES + 4 * (2 * REQUEST_BYTES + nbytes)
            assert nbytes < initial.numel() * 4 // 3
        assert torch.equal(isl[0].strategy.global_flat, isl[1].strategy.global_flat)  # one global model
        served = torch.cat([s.durable.state.pull()[1] for s in svc.servers])
        assert torch.equal(isl[0].strategy.global_flat, served)
        assert not torch.equal(served, initial)  # it trained
