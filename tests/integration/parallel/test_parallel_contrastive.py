"""Sigmoid pair loss on a ring (SOTA-376) and gathered softmax loss, 2-3 gloo ranks vs one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.outer import run_world
from islands.parallel.contrastive import sigmoid_pair_loss, softmax_pair_loss

PER_RANK, DIM = 3, 5


def _inputs(ranks):
    g = torch.Generator().manual_seed(5)
    x = F.normalize(torch.randn(ranks * PER_RANK, DIM, generator=g, dtype=torch.float64), dim=1)
    y = F.normalize(x + 0.5 * torch.randn(ranks * PER_RANK, DIM, generator=g, dtype=torch.float64), dim=1)
    return x, y, torch.tensor(1.2, dtype=torch.float64), torch.tensor(-2.0, dtype=torch.float64)


def _run(world):
    comm = world.comm("global")
    n, r = comm.size, comm.rank
    out = {}
    for name in ("sigmoid", "softmax"):
        x, y, t, b = _inputs(n)
        part = slice(r * PER_RANK, (r + 1) * PER_RANK)
        xs, ys = x[part].clone().requires_grad_(True), y[part].clone().requires_grad_(True)
        t, b = t.clone().requires_grad_(True), b.clone().requires_grad_(True)
        loss = sigmoid_pair_loss(xs, ys, t, b, comm) if name == "sigmoid" else softmax_pair_loss(xs, ys, t, comm)
        loss.backward()
        out[name] = {
            "loss": loss.item(),
            "dx": xs.grad.numpy(),
            "dy": ys.grad.numpy(),
            "dt": t.grad.item(),
            "db": 0.0 if b.grad is None else b.grad.item(),
        }
    return out


def _reference(n, name):
    """Sum over ranks of each rank's loss, computed in one process from the whole batch."""
    x, y, t, b = (v.clone().requires_grad_(True) for v in _inputs(n))
    total, losses = 0, []
    for r in range(n):
        part = slice(r * PER_RANK, (r + 1) * PER_RANK)
        if name == "sigmoid":
            z = t.exp() * x[part] @ y.T + b
            labels = -torch.ones_like(z)
            labels[:, part] = labels[:, part] + 2 * torch.eye(PER_RANK, dtype=z.dtype)
            loss = -F.logsigmoid(labels * z).sum() / PER_RANK
        else:
            target = torch.arange(r * PER_RANK, (r + 1) * PER_RANK)
            loss = (
                F.cross_entropy(t.exp() * x[part] @ y.T, target, reduction="sum")
                + F.cross_entropy(t.exp() * y[part] @ x.T, target, reduction="sum")
            ) / (2 * PER_RANK)
        losses.append(loss.item())
        total = total + loss
    total.backward()
    return losses, x.grad, y.grad, t.grad.item(), b.grad.item() if b.grad is not None else 0.0


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_distributed_pair_losses_match_the_whole_batch_in_one_process(ranks):
    results = run_world(_run, size=ranks, islands=1)
    for name in ("sigmoid", "softmax"):
        losses, dx, dy, dt, db = _reference(ranks, name)
        for r, got in enumerate(results):
            part = slice(r * PER_RANK, (r + 1) * PER_RANK)
            g = got[name]
            assert g["loss"] == pytest.approx(losses[r], rel=1e-12)
            torch.testing.assert_close(torch.from_numpy(g["dx"]), dx[part])
            torch.testing.assert_close(torch.from_numpy(g["dy"]), dy[part])
        # the temperature and bias are replicated: the ranks' shares add up to the whole gradient
        assert sum(got[name]["dt"] for got in results) == pytest.approx(dt, rel=1e-9)
        assert sum(got[name]["db"] for got in results) == pytest.approx(db, rel=1e-9, abs=1e-12)


def test_bad_embeddings_are_named():
    t = torch.tensor(0.0)
    with pytest.raises(ValueError, match="matching"):
        sigmoid_pair_loss(torch.zeros(2, 3), torch.zeros(3, 3), t, t)
    with pytest.raises(ValueError, match="at least one pair"):
        softmax_pair_loss(torch.zeros(0, 3), torch.zeros(0, 3), t)
    with pytest.raises(TypeError, match="floating dtype"):
        sigmoid_pair_loss(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64), t, t)
