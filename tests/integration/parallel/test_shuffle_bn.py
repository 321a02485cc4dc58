"""Shuffled / per-group batch norm for the key branch (SOTA-364): 2 gloo ranks vs one process."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from harness.outer import run_world
from islands.parallel.shuffle_bn import (
    dealt_permutation,
    encode_in_groups,
    shuffled_encode,
    shuffled_encode_bytes,
    shuffled_group_encode,
)

ROWS, IN, OUT, SEED = 6, 5, 3, 11


def _encoder() -> nn.Module:
    torch.manual_seed(0)  # same weights in every process
    return nn.Sequential(nn.Linear(IN, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, OUT)).double()


def _global_batch(ranks: int) -> torch.Tensor:
    return torch.randn(ranks * ROWS, IN, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _loss_weights(ranks: int) -> torch.Tensor:
    return torch.randn(ranks * ROWS, OUT, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


def _rank(world):
    comm = world.comm("global")
    n, r = comm.size, comm.rank
    enc = _encoder()
    mine = slice(r * ROWS, (r + 1) * ROWS)
    x = _global_batch(n)[mine].clone().requires_grad_(True)
    gen = torch.Generator().manual_seed(SEED)
    perm_seen = dealt_permutation(n * ROWS, n, torch.Generator().manual_seed(SEED))
    rng_before = torch.random.get_rng_state()
    world.ledger.reset()
    out = shuffled_encode(enc, x, comm, gen)
    (out * _loss_weights(n)[mine]).sum().backward()
    with_grad = world.ledger.snapshot()
    rng_untouched = torch.equal(rng_before, torch.random.get_rng_state())
    world.ledger.reset()
    with torch.no_grad():
        shuffled_encode(enc, x, comm, gen)
    return {
        "out": out.detach().numpy(),
        "dx": x.grad.numpy(),
        "perm": perm_seen.numpy(),
        "rng_untouched": rng_untouched,
        "grads": {k: p.grad.numpy() for k, p in enc.named_parameters()},
        "bytes": (with_grad["total_sent"], with_grad["total_received"]),
        "kinds": sorted(with_grad["sent"]),
        "bytes_no_grad": (world.ledger.total_sent, world.ledger.total_received),
    }


def test_shuffled_encode_on_two_ranks_matches_the_dealt_batch_in_one_process():
    ranks = 2
    results = run_world(_rank, size=ranks, islands=1)

    # the permutation is the same on every rank, and the global RNG is never drawn from
    assert (results[0]["perm"] == results[1]["perm"]).all()
    assert all(res["rng_untouched"] for res in results)

    # reference: the whole batch in one process, each dealt group normalised on its own
    enc = _encoder()
    x = _global_batch(ranks).requires_grad_(True)
    perm = dealt_permutation(ranks * ROWS, ranks, torch.Generator().manual_seed(SEED))
    assert torch.equal(perm, torch.from_numpy(results[0]["perm"]))
    shuffled = x[perm]
    groups_out = torch.cat([enc(shuffled[g * ROWS : (g + 1) * ROWS]) for g in range(ranks)])
    ref = torch.empty_like(groups_out)
    ref[perm] = groups_out  # row perm[i] of the batch came out as row i of the dealt encoding
    (ref * _loss_weights(ranks)).sum().backward()

    for r, res in enumerate(results):
        mine = slice(r * ROWS, (r + 1) * ROWS)
        torch.testing.assert_close(torch.from_numpy(res["out"]), ref[mine].detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.from_numpy(res["dx"]), x.grad[mine], rtol=1e-12, atol=1e-12)
    # each rank's weight gradient is its shard's share; the shares add up to the whole gradient
    for name, p in enc.named_parameters():
        total = sum(torch.from_numpy(res["grads"][name]) for res in results)
        torch.testing.assert_close(total, p.grad, rtol=1e-10, atol=1e-12)

    # the same forward through the single-process form (it draws the same permutation)
    enc2 = _encoder()
    same = shuffled_group_encode(enc2, _global_batch(ranks), ranks, torch.Generator().manual_seed(SEED))
    torch.testing.assert_close(same, ref.detach(), rtol=1e-12, atol=1e-12)

    # ledger: forward gathers inputs and outputs; backward reduce-scatters both back
    want = shuffled_encode_bytes(ROWS, (IN,), (OUT,), ranks, itemsize=8, grad_outputs=True, grad_inputs=True)
    want_fwd = shuffled_encode_bytes(ROWS, (IN,), (OUT,), ranks, itemsize=8)
    assert want == {"sent": ROWS * (IN + OUT) * 8 * 2, "received": ROWS * (IN + OUT) * 8 * 2}
    for res in results:
        assert res["bytes"] == (want["sent"], want["received"])
        assert res["kinds"] == ["shuffle_bn_all_gather", "shuffle_bn_reduce_scatter"]
        assert res["bytes_no_grad"] == (want_fwd["sent"], want_fwd["received"])


def test_dealt_permutation_spreads_every_source_group_evenly():
    for rows, groups in [(12, 2), (24, 4), (30, 3), (10, 5), (21, 7)]:
        m = rows // groups
        perm = dealt_permutation(rows, groups, torch.Generator().manual_seed(rows))
        assert sorted(perm.tolist()) == list(range(rows))
        for j in range(groups):
            counts = torch.bincount(perm[j * m : (j + 1) * m] // m, minlength=groups)
            assert counts.max() - counts.min() <= 1, (rows, groups, counts)
        # seeded: the same generator state gives the same permutation, a different one another
        assert torch.equal(perm, dealt_permutation(rows, groups, torch.Generator().manual_seed(rows)))
        # no key group is the same set of rows as a query (source) group
        assert all(
            set((perm[j * m : (j + 1) * m] // m).tolist()) != {j2} for j in range(groups) for j2 in range(groups)
        )
    a = dealt_permutation(64, 4, torch.Generator().manual_seed(1))
    assert not torch.equal(a, dealt_permutation(64, 4, torch.Generator().manual_seed(2)))


def test_group_encoding_restores_row_order_and_uses_each_groups_statistics():
    x = torch.randn(8, IN, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    # a row-wise encoder (no batch norm) is unchanged by grouping: only the order is shuffled and restored
    linear = nn.Linear(IN, OUT).double()
    torch.testing.assert_close(shuffled_group_encode(linear, x, 4, torch.Generator().manual_seed(0)), linear(x))
    # batch norm in training mode: each output row is normalised with its own group's mean
    bn = nn.BatchNorm1d(IN, affine=False).double()
    perm = dealt_permutation(8, 2, torch.Generator().manual_seed(5))
    out = encode_in_groups(bn, x, 2, perm)
    for g in range(2):
        idx = perm[g * 4 : (g + 1) * 4]
        block = x[idx]
        want = (block - block.mean(0)) / torch.sqrt(block.var(0, unbiased=False) + bn.eps)
        torch.testing.assert_close(out[idx], want)
    # perm=None: contiguous blocks, as G workers with ordinary batch norm would compute
    plain = encode_in_groups(bn, x, 2)
    torch.testing.assert_close(plain[:4], (x[:4] - x[:4].mean(0)) / torch.sqrt(x[:4].var(0, unbiased=False) + bn.eps))
    # a positive pair's key never shares its statistics with the query's block: with the deal, each
    # key group holds rows of both source blocks
    for g in range(2):
        assert set((perm[g * 4 : (g + 1) * 4] // 4).tolist()) == {0, 1}


def test_bad_input_is_named():
    enc, gen = nn.Linear(IN, OUT), torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=">= 2"):
        shuffled_group_encode(enc, torch.zeros(4, IN), 1, gen)
    with pytest.raises(ValueError, match="multiple of 4"):
        shuffled_group_encode(enc, torch.zeros(6, IN), 4, gen)
    with pytest.raises(ValueError, match="at least 2 rows"):
        shuffled_group_encode(enc, torch.zeros(3, IN), 3, gen)
    with pytest.raises(ValueError, match="rows, features"):
        shuffled_group_encode(enc, torch.zeros(6), 2, gen)
    with pytest.raises(TypeError, match=re.escape("torch.Generator")):
        shuffled_group_encode(enc, torch.zeros(4, IN), 2, 1234)
    with pytest.raises(ValueError, match="2 or more ranks"):
        shuffled_encode(enc, torch.zeros(4, IN), None, gen)
    with pytest.raises(ValueError, match="permutation of range"):
        encode_in_groups(enc, torch.zeros(4, IN), 2, torch.arange(3))
    with pytest.raises(ValueError, match="positive int"):
        encode_in_groups(enc, torch.zeros(4, IN), 0)
