"""DDP across N gloo workers equals one process on the concatenated batch; bytes equal the payload."""

import os

import pytest
import torch

from harness.lm_reference import lm_batches, train_reference
from harness.world import spawn_ranks
from islands.models import ByteTransformer, count_parameters, sequence_loss

STEPS, WORKERS, BATCH, CONTEXT = 5, 2, 4, 16


def tiny_model():
    torch.manual_seed(0)
    return ByteTransformer(d_model=32, n_layers=2, n_heads=2, context=CONTEXT)


def make_optimizer(model):
    # SGD with momentum: Adam's first steps divide by sqrt(v), which turns float-summation-order noise in
    # near-zero gradients into lr-sized differences; the claim under test is DDP's gradient mean.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def global_batches():
    return lm_batches(WORKERS * BATCH, CONTEXT, STEPS, seed=42)


def reference_params():
    model = tiny_model()
    train_reference(model, make_optimizer(model), global_batches())
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank, env, queue, bucket_mb):
    os.environ.update(env, RANK=str(rank))
    torch.set_num_threads(1)
    from islands.runtime.world import close_world, init_world
    from islands.sync.ddp import DDP

    world = init_world(islands=1, timeout_s=30)
    model = tiny_model()
    opt = make_optimizer(model)
    ddp = DDP(bucket_mb=bucket_mb).wrap(model, opt, world)
    for b in global_batches():
        mine = b[rank * BATCH : (rank + 1) * BATCH]
        sequence_loss(ddp(mine[:, :-1]), mine[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    # plain numpy: torch tensors in a queue are shared through the sender, which is about to exit
    queue.put((rank, [p.detach().numpy().copy() for p in model.parameters()], world.ledger.snapshot()))
    close_world(world)


@pytest.mark.parametrize("bucket_mb", [25.0, 0.01])  # one bucket, and many small buckets
def test_ddp_matches_single_process_and_counts_exact_bytes(bucket_mb):
    results = spawn_ranks(_worker, WORKERS, bucket_mb, timeout=120)
    ref = reference_params()
    payload = 4 * count_parameters(tiny_model())
    for rank, params, ledger in results:
        for a, b in zip(params, ref):
            diff = (torch.from_numpy(a) - b).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} diverged from single process by {diff}"
        assert ledger["sent"] == {"grad_all_reduce": STEPS * payload}
        assert ledger["received"] == {"grad_all_reduce": STEPS * payload}
        if bucket_mb < 1:
            assert ledger["calls"]["grad_all_reduce"] > STEPS  # several buckets per step
