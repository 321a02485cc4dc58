"""Hybrid sharding (SOTA-119) and explicit prefetch (SOTA-117) on 4 gloo ranks in 2 islands: every sharding
group size (1, 2 = the island, 4 = across islands) and prefetch depth trains exactly like one process on the
concatenated batch; the ledger's analytic bytes equal what FSDP hands to torch.distributed (prefetch changes
no byte); each rank holds 1/g of the state. The sizer and the cross-island byte model are checked alone."""

import os

import pytest
import torch

from harness.lm_reference import lm_batches, train_reference
from harness.world import spawn_ranks
from islands.models import ByteTransformer, sequence_loss

STEPS, WORKERS, ISLANDS, BATCH, CONTEXT = 3, 4, 2, 2, 16
# (shard_group, prefetch)
CASES = [(2, 0), (1, 0), (4, 0), (2, 2), (4, 1)]


def tiny_model():
    torch.manual_seed(0)
    return ByteTransformer(d_model=32, n_layers=3, n_heads=2, context=CONTEXT)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def global_batches():
    return lm_batches(WORKERS * BATCH, CONTEXT, STEPS, seed=42)


def reference_state():
    model = tiny_model()
    train_reference(model, make_optimizer(model.parameters()), global_batches())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class WireCounter:
    """Bytes FSDP hands to torch.distributed: gathers, reduce-scatters, and HSDP's all-reduces."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.sent = dist, {}
        self.orig = dist.all_gather_single, dist.reduce_scatter_single, dist.all_reduce

        def gather(output_tensor, input_tensor, *a, **k):
            self._add("fsdp_all_gather", input_tensor.nbytes)
            return self.orig[0](output_tensor, input_tensor, *a, **k)

        def scatter(output, input, *a, **k):
            self._add("fsdp_reduce_scatter", input.nbytes)
            return self.orig[1](output, input, *a, **k)

        def reduce(tensor, *a, **k):
            self._add("fsdp_replicate_all_reduce", tensor.nbytes)
            return self.orig[2](tensor, *a, **k)

        dist.all_gather_single, dist.reduce_scatter_single, dist.all_reduce = gather, scatter, reduce

    def _add(self, kind, s):
        self.sent[kind] = self.sent.get(kind, 0) + s

    def close(self):
        self.dist.all_gather_single, self.dist.reduce_scatter_single, self.dist.all_reduce = self.orig


def _worker(rank, env, queue):
    os.environ.update(env, RANK=str(rank))
    torch.set_num_threads(1)
    from islands.runtime.world import close_world, init_world
    from islands.sync.sharded import FSDP, measured_state_bytes, state_bytes_per_rank

    world = init_world(islands=ISLANDS, timeout_s=30)
    out = []
    for group, prefetch in CASES:
        world.ledger.reset()
        model = tiny_model()
        opt = make_optimizer(model.parameters())
        strategy = FSDP(shard_group=group, prefetch=prefetch)
        model = strategy.wrap(model, opt, world)
        wire = WireCounter()
        for b in global_batches():
            mine = b[rank * BATCH : (rank + 1) * BATCH]
            sequence_loss(model(mine[:, :-1]), mine[:, 1:]).backward()
            strategy.after_backward(model, 0)
            opt.step()
            memory = measured_state_bytes(model, opt)
            opt.zero_grad()
        wire.close()
        sent = {k: v for k, v in world.ledger.snapshot()["sent"].items() if k != "fsdp_eval_gather"}
        full = strategy.eval_model(model)
        out.append(
            {
                "case": (group, prefetch),
                "group_size": strategy.group_size,
                "ledger": sent,
                "wire": wire.sent,
                "state": {k: v.detach().numpy().copy() for k, v in full.state_dict().items()},
                "memory": memory["total"],
                "analytic_memory": state_bytes_per_rank(strategy.units, group, rank % group, optimizer_slots=1)[
                    "total"
                ],
            }
        )
    queue.put((rank, out))
    close_world(world)


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(_worker, WORKERS, timeout=300)


@pytest.mark.slow
def test_every_group_size_and_prefetch_matches_one_process(results):
    ref = reference_state()
    for rank, out in results:
        for r in out:
            assert r["group_size"] == r["case"][0]
            for k in ref:
                diff = (torch.from_numpy(r["state"][k]) - ref[k]).abs().max().item()
                assert diff <= 1e-5, f"{r['case']} rank {rank}: {k} differs from one process by {diff}"


@pytest.mark.slow
def test_ledger_equals_what_fsdp_hands_to_torch_and_prefetch_sends_no_more(results):
    for _rank, out in results:
        by_case = {r["case"]: r for r in out}
        for r in out:
            assert r["ledger"] == r["wire"], r["case"]
            assert ("fsdp_replicate_all_reduce" in r["wire"]) == (r["case"][0] < WORKERS)
        assert by_case[(2, 2)]["wire"] == by_case[(2, 0)]["wire"]
        assert by_case[(4, 1)]["wire"] == by_case[(4, 0)]["wire"]


@pytest.mark.slow
def test_each_rank_holds_one_gth_of_the_state(results):
    for _rank, out in results:
        for r in out:
            assert r["memory"] == r["analytic_memory"], r["case"]
        one = next(r for r in out if r["case"] == (1, 0))["memory"]
        four = next(r for r in out if r["case"] == (4, 0))["memory"]
        assert 0.24 < four / one < 0.30


def _units():
    from islands.sync.sharded import plan_units
    from islands.sync.wrap_policy import parse_wrap

    return plan_units(tiny_model(), parse_wrap("block"))[1]


def test_sizer_picks_the_smallest_group_that_fits():
    from islands.sync.shard_group import candidate_groups, choose_group
    from islands.sync.sharded import state_bytes_per_rank

    units = _units()
    need = {g: state_bytes_per_rank(units, g)["total"] for g in (1, 2, 4, 8)}
    assert candidate_groups(8, 4) == [1, 2, 4, 8]
    assert candidate_groups(12, 4) == [1, 2, 4, 8, 12][:3] + [12]  # 8 does not divide 12
    assert choose_group(units, 8, 4, need[1]) == 1
    assert choose_group(units, 8, 4, need[1] - 1) == 2
    assert choose_group(units, 8, 4, need[4]) == 4
    assert choose_group(units, 8, 4, need[4] - 1) == 8  # only a group across islands fits
    with pytest.raises(ValueError, match="no sharding group fits"):
        choose_group(units, 8, 4, need[8] - 1)
    with pytest.raises(ValueError, match="budget must be > 0"):
        choose_group(units, 8, 4, 0)


def test_cross_island_bytes_vanish_inside_islands():
    from islands.sync.shard_group import cross_island_wire_bytes

    units = _units()
    full = cross_island_wire_bytes(units, 4, 2, 4, True)
    hsdp = cross_island_wire_bytes(units, 4, 2, 2, True)
    assert full > 0 and 0 < hsdp < full
    assert cross_island_wire_bytes(units, 4, 1, 4, True) == 0  # one island: nothing crosses
    # HSDP at g = island: only the all-reduce of 1/g shards crosses, two links per replica ring of 2
    padded = sum(u.padded_numel(2) for u in units)
    assert hsdp == pytest.approx(2 * 2 * 2 * (1 / 2) * padded / 2 * 4)


def test_bad_specs_name_the_choices():
    from islands.sync.shard_group import check_group, parse_shard_group
    from islands.sync.sharded import FSDP

    assert parse_shard_group("auto") == "auto" and parse_shard_group("") == "" and parse_shard_group("4") == 4
    with pytest.raises(ValueError, match="positive number of ranks"):
        parse_shard_group("half")
    with pytest.raises(ValueError, match=r"choose one of \[1, 2, 3, 6\]"):
        check_group(4, 6)
    with pytest.raises(ValueError, match="prefetch"):
        FSDP(prefetch=-1)


def test_config_accepts_hybrid_and_rejects_misplaced_knobs():
    from islands.app.validate import validate
    from islands.config import ConfigError, from_mapping

    def job(**values):
        return from_mapping(values)

    validate(job(workers=4, islands=2, global_batch=8, inner="fsdp", shard_group="auto", shard_budget_mb=64))
    validate(job(workers=4, global_batch=8, inner="fsdp", shard_group="2", prefetch=2))
    for bad, match in (
        (dict(inner="ddp", shard_group="2"), "inner.strategy=fsdp only"),
        (dict(inner="fsdp", shard_group="3"), "must divide"),
        (dict(inner="fsdp", shard_budget_mb=8), "shard_group='auto'"),
        (dict(inner="fsdp", prefetch=-1), "prefetch"),
        (dict(inner="ddp", islands=2), "needs an outer strategy"),
    ):
        with pytest.raises(ConfigError, match=match):
            validate(job(workers=4, global_batch=8, **bad))
