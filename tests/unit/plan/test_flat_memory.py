"""Per-rank memory of the flat strategies against what one rank measurably holds, in one process:

- DDP: torch's DDP over a one-process gloo group (an in-process HashStore), whose reducer's buckets are seen
  through a comm hook (they live in C++, out of reach of held_bytes); the model and optimizer through held_bytes.
- ZeRO-1: rank 0 of 2, its optimizer partitioned by islands' own OptimizerPartition over a Comm that plays the
  other rank (its all-gather hands back rank 0's flat vector as rank 1's), so the optimizer keeps state for the
  parameters rank 0 owns only.
FSDP's shards need a process per rank; it is not measured here."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.futures import Future
from torch.testing._internal.distributed.fake_pg import FakeStore

from islands.memory import ForwardBackward, SavedTensorMeter
from islands.plan import Candidate, Topology, parse_link, predict
from islands.plan.api import job_config, profile_job
from islands.plan.held import held_bytes
from islands.sync.ddp import start_ddp
from islands.sync.zero1 import OptimizerPartition

JOB = {"task": "digits", "workers": 2, "steps": 8, "progress": False, "eval_every": 0}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ISLANDS_PLAN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def planned():
    torch.set_num_threads(1)
    cfg = job_config(JOB)
    prof, model = profile_job(cfg, steps=4)
    link = parse_link("1gbit")
    return (
        prof,
        model,
        {
            inner: predict(Candidate(inner, inner), prof, Topology(2, 1), link, link).memory
            for inner in ("ddp", "zero1")
        },
    )


def _batches(prof, n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(prof.batch_size, 64, generator=g), torch.randint(0, 10, (prof.batch_size,), generator=g))] * n


def _peak_step(model, batch) -> int:
    with SavedTensorMeter(exclude=list(model.parameters())) as meter:
        ForwardBackward()(model, batch, torch.nn.functional.cross_entropy)
    return meter.peak


class TwoRanks:
    """Rank 0 of a 2-rank Comm in one process: the other rank's all-gather contribution is a copy of this one's."""

    size, rank = 2, 0

    def all_gather(self, tensor, kind="all_gather"):
        return [tensor, tensor.clone()]


def test_zero1_memory_is_the_held_peak_of_rank_0(planned):
    prof, model, pred = planned
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    part = OptimizerPartition(opt, TwoRanks())
    assert 0 < len(part.owned) < len(part.params)  # rank 0 owns some parameters, not all
    batches = _batches(prof)
    for b in batches:
        ForwardBackward()(model, b, torch.nn.functional.cross_entropy)
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = _peak_step(model, batches[0])
    # ZeRO-1 exchanges gradients through torch DDP, whose buckets (a copy of the gradients) held_bytes cannot see:
    # measured for DDP in the test below
    measured = held_bytes(model, opt, part) + prof.grad_bytes + peak
    assert pred["zero1"].optimizer < prof.optimizer_bytes  # a partition's share of the state
    assert pred["zero1"].total == pytest.approx(measured, rel=0.10), (pred["zero1"], measured)


def test_ddp_memory_is_the_held_peak_with_the_reducers_buckets(planned):
    prof, model, pred = planned
    model = copy.deepcopy(model)
    # torch's fake backend: no gloo threads. A gloo group freed with the DDP wrapper at the test's end deadlocked once
    # (make test, session 33): its destructor joined a worker thread that waited for the GIL the destructor held
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        ddp = start_ddp(model, None, 25.0)
        buckets: dict[int, int] = {}

        def hook(state, bucket):
            buf = bucket.buffer()
            buckets[bucket.index()] = buf.numel() * buf.element_size()
            fut: Future = Future()
            fut.set_result(buf)
            return fut

        ddp.register_comm_hook(None, hook)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        batches = _batches(prof)
        for b in batches:
            ForwardBackward()(ddp, b, torch.nn.functional.cross_entropy)
            opt.step()
            opt.zero_grad(set_to_none=True)
        peak = _peak_step(ddp, batches[0])
        measured = held_bytes(ddp, opt) + sum(buckets.values()) + peak
    finally:
        dist.destroy_process_group()
    assert sum(buckets.values()) == prof.grad_bytes  # the buckets are one more copy of the gradients
    assert pred["ddp"].strategy == prof.grad_bytes
    assert pred["ddp"].total == pytest.approx(measured, rel=0.10), (pred["ddp"], measured)
