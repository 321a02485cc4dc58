"""plan.gathered: an exchange's local work for M islands, timed on MirrorComm (M ranks holding this rank's
tensors, no process group). What it times must be the M-island work: M payloads decoded, one mean that equals the
one-island mean (M identical deltas average to themselves)."""

import copy

import pytest
import torch

from islands.aggregate import CoordinateMedian
from islands.compress import TopK
from islands.plan.gathered import MirrorComm, gathered_seconds
from islands.sync.outer.exchange import Exchange
from islands.sync.outer.quant4 import Quant4

NUMEL = 4096


def test_a_mirror_of_m_ranks_gathers_m_copies_and_sums_m_times():
    comm = MirrorComm(3)
    x = torch.arange(4.0)
    got = comm.all_gather(x)
    assert len(got) == 3 and all(torch.equal(g, x) for g in got)
    assert got[1].data_ptr() != x.data_ptr()  # received buffers of their own, as a real gather's
    assert torch.equal(comm.all_reduce(torch.ones(2)), torch.full((2,), 3.0))
    assert torch.equal(comm.all_reduce(torch.ones(2), op=torch.distributed.ReduceOp.MAX), torch.ones(2))
    with pytest.raises(ValueError, match="SUM, MAX or MIN"):
        comm.all_reduce(torch.ones(2), op=torch.distributed.ReduceOp.PRODUCT)
    with pytest.raises(ValueError, match="size >= 1"):
        MirrorComm(0)


@pytest.mark.parametrize(
    "exchange",
    [Exchange(compressor=Quant4(256)), Exchange(compressor=TopK(0.1)), Exchange(aggregator=CoordinateMedian())],
    ids=["quant4 codec", "top-k compressor", "robust median"],
)
def test_m_mirrored_islands_average_to_the_one_islands_mean(exchange):
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    a, b = copy.deepcopy(exchange), copy.deepcopy(exchange)
    torch.testing.assert_close(a.mean(MirrorComm(4), x.clone()), b.mean(MirrorComm(1), x.clone()))


def test_what_is_timed_decodes_every_islands_payload(monkeypatch):
    calls = []
    decode = Quant4.decode

    def counting(self, payload, numel):
        calls.append(numel)
        return decode(self, payload, numel)

    monkeypatch.setattr(Quant4, "decode", counting)
    extra = gathered_seconds(Exchange(compressor=Quant4(256)), NUMEL, islands=5, repeats=3)
    assert extra >= 0.0
    assert len(calls) == (1 + 3) * 5 + (1 + 3) * 1  # warm-up and repeats: 5 payloads for M = 5, 1 for one island
    assert set(calls) == {NUMEL}
    assert gathered_seconds(Exchange(compressor=Quant4(256)), NUMEL, islands=1) == 0.0
