"""FSDP's predicted per-rank state (parameters, gradients, optimizer state: shard_plan.state_bytes_per_rank) against
what each rank of a real 2-process gloo FSDP run holds (plan.held.held_bytes, which counts a DTensor as its local
shard), measured at the moment all three exist: just before the second optimizer step; and FSDP's predicted bytes
(its per-step collectives, the clip norm, the final evaluation's gather) against the rank's ledger after two steps
and an evaluation. It needs processes: FSDP's shards exist only in a process group of several ranks."""

import os

import torch

from harness.world import spawn_ranks
from islands.plan.api import candidate, job_config

JOB = {"task": "digits", "workers": 2, "steps": 4, "progress": False, "eval_every": 0}


def _rank(rank, env, queue):
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from islands.app.build import build_trainer
    from islands.plan.held import held_bytes
    from islands.runtime.world import close_world, init_world

    world = init_world()
    trainer = build_trainer(job_config({**JOB, "inner": "fsdp"}), world)
    held: list[int] = []

    def measure(optimizer, args, kwargs):
        if optimizer.state:  # the second step: gradients and the first step's optimizer state both exist
            held.append(held_bytes(trainer.model, optimizer))

    trainer.optimizer.register_step_pre_hook(measure)
    for _ in range(2):
        trainer.train_step()
    full = trainer.eval_model  # the full model gathered, as a run's final evaluation gathers it
    assert full is not trainer.model
    queue.put((rank, (held, world.ledger.total_sent)))
    close_world(world)


def test_fsdp_state_per_rank_is_what_each_rank_holds():
    cfg = job_config({**JOB, "inner": "fsdp"})
    from islands.app.build import build_task

    cand = candidate("fsdp", cfg, build_task(cfg).model)
    predicted = cand.fsdp_state
    state = predicted["params"] + predicted["grads"] + predicted["optimizer"]
    tensors = len(list(build_task(cfg).model.parameters()))
    # bytes: two steps' collectives (grad_clip is on by default: the norm's all-reduce among them) and one gathering
    per_step = sum(sent for _, sent, _ in cand.fsdp_traffic)
    assert any(kind == "fsdp_grad_norm" for kind, _, _ in cand.fsdp_traffic) and cand.end_bytes > 0
    for rank, (held, sent) in spawn_ranks(_rank, 2):
        assert sent == 2 * per_step + cand.end_bytes, (rank, sent, per_step, cand.end_bytes)
        assert len(held) == 1, held  # measured once, at the second step
        # the goal is 10% (issue #37); what is not predicted is AdamW's 0-d step counter per parameter tensor
        # (measured: 209,008 held against 208,976 predicted on both ranks, 8 tensors x 4 bytes)
        assert 0 <= held[0] - state <= 8 * tensors, (rank, held[0], predicted)
