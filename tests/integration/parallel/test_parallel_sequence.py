"""Tensor-parallel MLP with and without sequence parallelism (SOTA-058) on 2 gloo ranks vs one device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.outer import run_world
from islands.parallel.sequence import TensorParallelMLP, sequence_shard

S, D, H = 8, 6, 10


def _full():
    torch.manual_seed(11)
    norm, up, down = nn.LayerNorm(D).double(), nn.Linear(D, H).double(), nn.Linear(H, D).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.2, 0.2)
    x = torch.randn(S, D, dtype=torch.float64)
    weights = torch.linspace(-1, 1, S * D, dtype=torch.float64).reshape(S, D)
    return norm, up, down, x, weights


def _run(world):
    comm = world.comm("global")
    out = {}
    for sp in (False, True):
        norm, up, down, x, weights = _full()
        block = TensorParallelMLP.from_full(norm, up, down, comm, sequence_parallel=sp)
        before = world.ledger.snapshot()["sent"]
        xin = sequence_shard(x, comm) if sp else x
        y = block(xin)
        w = sequence_shard(weights, comm) if sp else weights
        (y * w).sum().backward()
        after = world.ledger.snapshot()["sent"]
        moved = sum(
            v - before.get(k, 0)
            for k, v in after.items()
            if k in ("tp_all_reduce", "sp_all_gather", "sp_reduce_scatter")
        )
        block.reduce_replicated_grads()
        out[sp] = {
            "y": y.detach().numpy(),
            "moved": moved,
            "grads": {k: p.grad.numpy() for k, p in block.named_parameters()},
        }
    return out


def test_sequence_parallel_and_plain_tensor_parallel_equal_the_unsplit_block_and_move_the_same_bytes():
    results = run_world(_run, size=2, islands=1)
    norm, up, down, x, weights = _full()
    y = x + down(torch.nn.functional.gelu(up(norm(x))))
    (y * weights).sum().backward()
    for r, got in enumerate(results):
        rows = slice(r * H // 2, (r + 1) * H // 2)
        for sp in (False, True):
            g = got[sp]
            expect_y = y.detach()[r * S // 2 : (r + 1) * S // 2] if sp else y.detach()
            torch.testing.assert_close(torch.from_numpy(g["y"]), expect_y)
            gr = {k: torch.from_numpy(v) for k, v in g["grads"].items()}
            torch.testing.assert_close(gr["up.weight"], up.weight.grad[rows])
            torch.testing.assert_close(gr["up.bias"], up.bias.grad[rows])
            torch.testing.assert_close(gr["down.weight"], down.weight.grad[:, rows])
            torch.testing.assert_close(gr["down_bias"], down.bias.grad)
            torch.testing.assert_close(gr["norm.weight"], norm.weight.grad)
            torch.testing.assert_close(gr["norm.bias"], norm.bias.grad)
        # forward all-reduce + backward all-reduce of (S x D) fp64 == all-gather + reduce-scatter, both ways
        assert got[False]["moved"] == got[True]["moved"] == 2 * S * D * 8


def test_bad_sizes_are_named():
    class _Two:
        size, rank = 2, 0

    with pytest.raises(ValueError, match="divide evenly over 2"):
        TensorParallelMLP(4, 5, _Two())
    with pytest.raises(ValueError, match="dropout"):
        TensorParallelMLP(4, 6, _Two(), dropout=1.0)
    with pytest.raises(ValueError, match="sequence length 3"):
        sequence_shard(torch.zeros(3, 4), _Two())
