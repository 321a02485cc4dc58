"""Ring attention (SOTA-181) on 1-3 gloo ranks equals whole-sequence attention, outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.outer import run_world
from islands.parallel.ring_attention import ring_attention, ring_kv_bytes

SEQ, HEADS, DIM = 12, 2, 4


def _full_inputs():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2, HEADS, SEQ, DIM, generator=g, dtype=torch.float64) for _ in range(3)]


def _ring(world):
    comm = world.comm("global")
    n, r = comm.size, comm.rank
    block = SEQ // n
    out = {}
    for causal in (True, False):
        q, k, v = (t[:, :, r * block : (r + 1) * block].clone().requires_grad_(True) for t in _full_inputs())
        before = world.ledger.total_sent
        y = ring_attention(q, k, v, comm, causal=causal)
        weights = torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape) / y.numel()
        (y * weights).sum().backward()  # a loss that differs per position
        out[causal] = {
            "y": y.detach().numpy(),
            "dq": q.grad.numpy(),
            "dk": k.grad.numpy(),
            "dv": v.grad.numpy(),
            "sent": world.ledger.total_sent - before,
            "block": tuple(q.shape),
        }
    return out


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_ring_attention_equals_whole_sequence_attention(ranks):
    results = run_world(_ring, size=ranks, islands=1)
    block = SEQ // ranks
    for causal in (True, False):
        q, k, v = (t.clone().requires_grad_(True) for t in _full_inputs())
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        weights = torch.arange(y.numel() // ranks, dtype=y.dtype) / (y.numel() // ranks)
        # the same per-rank loss weights, laid out block by block
        w = torch.cat([weights.reshape(2, HEADS, block, DIM)] * ranks, dim=2)
        (y * w).sum().backward()
        for r, got in enumerate(results):
            part = slice(r * block, (r + 1) * block)
            g = got[causal]
            torch.testing.assert_close(torch.from_numpy(g["y"]), y.detach()[:, :, part])
            torch.testing.assert_close(torch.from_numpy(g["dq"]), q.grad[:, :, part])
            torch.testing.assert_close(torch.from_numpy(g["dk"]), k.grad[:, :, part])
            torch.testing.assert_close(torch.from_numpy(g["dv"]), v.grad[:, :, part])
            expect = ring_kv_bytes(g["block"], 8, ranks)
            assert g["sent"] == expect["forward"] + expect["backward"]


def test_bad_shapes_and_dtypes_are_named():
    q = torch.zeros(1, 4, 2)
    with pytest.raises(ValueError, match="one shape"):
        ring_attention(q, torch.zeros(1, 3, 2), q, comm=None)
    with pytest.raises(ValueError, match="at least one position"):
        ring_attention(torch.zeros(1, 0, 2), torch.zeros(1, 0, 2), torch.zeros(1, 0, 2), comm=None)
    with pytest.raises(TypeError, match="floating dtype"):
        ring_attention(q, q.double(), q, comm=None)
