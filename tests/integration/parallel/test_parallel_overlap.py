"""Chunked matmul + all-reduce (SOTA-059) and the row-parallel Linear built on it, on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.outer import run_world
from islands.parallel import RowParallelLinear, matmul_all_reduce
from islands.parallel.overlap import check_chunks


def _reference():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 3, 8, generator=g, dtype=torch.float64)
    full = nn.Linear(8, 6).double()
    with torch.no_grad():
        full.weight.copy_(torch.randn(6, 8, generator=g, dtype=torch.float64))
        full.bias.copy_(torch.randn(6, generator=g, dtype=torch.float64))
    return x, full


def _row_parallel(world):
    x, full = _reference()
    comm = world.comm("global")
    out = {}
    for chunks in (1, 3, 64):  # 64 > 15 rows: capped at one row per chunk
        layer = RowParallelLinear.from_linear(full, comm, chunks=chunks)
        xs = x[..., layer.input_slice()].clone().requires_grad_(True)
        before = dict(world.ledger.sent)
        y = layer(xs)
        y.pow(2).sum().backward()
        sent = world.ledger.sent.get("tp_all_reduce", 0) - before.get("tp_all_reduce", 0)
        calls = world.ledger.calls["tp_all_reduce"]
        out[chunks] = {
            "y": y.detach().numpy(),
            "gx": xs.grad.numpy(),
            "gw": layer.weight.grad.numpy(),
            "gb": layer.bias.grad.numpy(),
            "sent": sent,
            "calls": calls,
            "slice": (layer.input_slice().start, layer.input_slice().stop),
        }
    return out


def test_row_parallel_linear_matches_the_whole_layer_for_any_chunk_count():
    results = run_world(_row_parallel, size=2, islands=1)
    x, full = _reference()
    xr = x.clone().requires_grad_(True)
    y = full(xr)
    y.pow(2).sum().backward()
    for rank_out in results:
        calls_before = 0
        for chunks, got in rank_out.items():
            lo, hi = got["slice"]
            torch.testing.assert_close(torch.from_numpy(got["y"]), y.detach())
            torch.testing.assert_close(torch.from_numpy(got["gx"]), xr.grad[..., lo:hi])
            torch.testing.assert_close(torch.from_numpy(got["gw"]), full.weight.grad[:, lo:hi])
            torch.testing.assert_close(torch.from_numpy(got["gb"]), full.bias.grad)
            # bytes do not depend on the chunk count: the whole (15 x 6) fp64 output, once
            assert got["sent"] == 15 * 6 * 8
            assert got["calls"] - calls_before == min(chunks, 15)
            calls_before = got["calls"]


def _empty_and_errors(world):
    comm = world.comm("global")
    w = torch.ones(4, 3)
    empty = matmul_all_reduce(torch.zeros(0, 3), w, comm, chunks=2)
    errors = []
    for bad in (
        lambda: matmul_all_reduce(torch.ones(2, 5), w, comm),
        lambda: matmul_all_reduce(torch.ones(2, 3, dtype=torch.float64), w, comm),
    ):
        try:
            bad()
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    return {"empty_shape": tuple(empty.shape), "sent": world.ledger.total_sent, "errors": errors}


def test_empty_input_sends_nothing_and_bad_shapes_or_dtypes_are_named():
    for out in run_world(_empty_and_errors, size=2, islands=1):
        assert out["empty_shape"] == (0, 4)
        assert out["sent"] == 0
        assert "do not multiply" in out["errors"][0]
        assert "float64" in out["errors"][1] and "float32" in out["errors"][1]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_chunk_count_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="positive int"):
        check_chunks(bad)
