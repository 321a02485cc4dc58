"""Micro-batches and checkpointing under 2-rank DDP: the same parameters as one process on the whole batch,
and gradients exchanged once per step (no_sync on all but the last micro-batch)."""

import os

import torch

from harness.lm_reference import lm_batches, train_reference
from harness.world import spawn_ranks
from islands.memory import ForwardBackward
from islands.models import ByteTransformer, count_parameters, sequence_loss

STEPS, WORKERS, BATCH, CONTEXT = 3, 2, 4, 16


def tiny_model():
    torch.manual_seed(0)
    return ByteTransformer(d_model=32, n_layers=2, n_heads=2, context=CONTEXT)


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # see test_ddp: the claim is the gradient


def global_batches():
    return lm_batches(WORKERS * BATCH, CONTEXT, STEPS, seed=7)


def reference_params():
    model = tiny_model()
    train_reference(model, make_optimizer(model), global_batches())
    return [p.detach().clone() for p in model.parameters()]


CASES = [(2, 0), (3, 2)]  # (micro_batch, checkpoint segments): even pieces; uneven pieces with checkpointing


def _worker(rank, env, queue):
    os.environ.update(env, RANK=str(rank))
    torch.set_num_threads(1)
    from islands.runtime.world import close_world, init_world
    from islands.sync.ddp import DDP

    world = init_world(islands=1, timeout_s=30)
    out = []
    for micro, segments in CASES:  # one process group for both cases: spawning is the slow part
        model = tiny_model()
        model.set_activation_checkpointing(segments)
        opt = make_optimizer(model)
        ddp = DDP().wrap(model, opt, world)
        step = ForwardBackward(micro_batch=micro)
        before = world.ledger.snapshot()["sent"].get("grad_all_reduce", 0)
        for b in global_batches():
            mine = b[rank * BATCH : (rank + 1) * BATCH]
            step(ddp, (mine[:, :-1], mine[:, 1:]), sequence_loss)
            opt.step()
            opt.zero_grad()
        sent = world.ledger.snapshot()["sent"]["grad_all_reduce"] - before
        out.append(([p.detach().numpy().copy() for p in model.parameters()], sent))
    queue.put((rank, out))
    close_world(world)


def test_accumulation_under_ddp_matches_one_process_and_exchanges_once_per_step():
    results = spawn_ranks(_worker, WORKERS, timeout=120)
    ref = reference_params()
    payload = 4 * count_parameters(tiny_model())
    for rank, out in results:
        for (micro, segments), (params, sent) in zip(CASES, out):
            for a, b in zip(params, ref):
                diff = (torch.from_numpy(a) - b).abs().max().item()
                assert diff <= 1e-5, f"rank {rank} micro={micro} segments={segments}: off one process by {diff}"
            # one full gradient exchange per step however many micro-batches: hooks see one gradient per step
            assert sent == STEPS * payload, f"micro={micro}: {sent} bytes sent, want {STEPS * payload}"
