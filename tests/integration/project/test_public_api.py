"""The public face: one import, objects inside, and the defects a user's own model used to meet.

Each multi-process case spawns gloo ranks (tests/harness/world.py) running a model islands did not write.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import islands
from harness.world import spawn_ranks
from islands.runtime.world import LoneComm


class BNNet(nn.Module):
    """A BatchNorm CNN: its running statistics are buffers, not parameters."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.head(F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1))


class TupleNet(nn.Module):
    """Returns (prediction, features), as many research models do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        h = self.lin(x)
        return h, h.detach()


def plain(t: torch.Tensor):
    """A tensor as a numpy array, which crosses a multiprocessing queue by value (torch shares storage)."""
    return t.detach().numpy().copy()


def own_loop(strategy, model, opt, world, data):
    """The user's loop with the strategy's hooks (docs/own-model.md); returns the wrapped model after finish()."""
    model = strategy.wrap(model, opt, world)
    for step, (x, y) in enumerate(data):
        F.cross_entropy(model(x), y).backward()
        strategy.after_backward(model, step)
        opt.step()
        opt.zero_grad()
        strategy.after_step(model, opt, step)
    strategy.finish(model)
    return model


def batches(seed: int, n: int = 64, shape=(1, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, *shape, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


# ---- one import ------------------------------------------------------------------------------------
def test_public_names_resolve_and_compose_from_objects():
    for name in islands.__all__:
        assert getattr(islands, name) is not None, name
    for ns in (islands.inner, islands.outer, islands.robust, islands.observe, islands.optim):
        for name in ns.__all__:
            assert callable(getattr(ns, name)), f"{ns.__name__}.{name}"
    # the program of the issue, built from objects (this raised TypeError: compressor spec must be a str)
    strategy = islands.Stack(
        inner=islands.inner.DDP(compressor=islands.compress.PowerSGD(rank=4)),
        outer=islands.outer.DiLoCo(50, exchange=islands.outer.Exchange(aggregator=islands.robust.CoordinateMedian())),
    )
    assert strategy.name == "ddp+diloco"
    outer = islands.outer.DiLoCo(exchange=islands.outer.Exchange(compressor=islands.compress.PowerSGD(rank=2)))
    assert type(outer.exchange.compressor).__name__ == "ErrorFeedback"  # PowerSGD asks for error feedback
    with pytest.raises(TypeError, match="takes a strategy"):
        islands.Stack(inner="ddp")
    with pytest.raises(TypeError, match="takes a compressor"):
        islands.inner.DDP(compressor="powersgd:rank=4")


def test_outer_strategies_need_no_step_count_and_finish_is_idempotent():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    world = islands.World.single()
    for outer in (
        islands.outer.DiLoCo(inner_steps=4),
        islands.outer.LocalSGD(every=3),
        islands.outer.StreamingDiLoCo(4, schedule=islands.outer.Fragments(2, tau=1)),
        islands.outer.EASGD(every=2),
        islands.outer.OverlapLocalSGD(tau=2),
        islands.outer.Gossip(every=2),
        islands.outer.SlowMo(every=2),
    ):
        m = outer.wrap(model, opt, world)
        for step in range(5):
            m(torch.randn(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
            outer.after_step(m, opt, step)
        outer.finish(m)
        rounds = outer.rounds
        outer.finish(m)  # nothing new since the final sync: nothing happens
        assert outer.rounds == rounds, type(outer).__name__
        if isinstance(outer, islands.outer.EASGD):
            continue  # its islands are pulled toward the centre, never set to it (LIT-370)
        # one island: the global model is the live model after the final sync
        for a, b in zip(outer.eval_model(m).parameters(), m.parameters()):
            torch.testing.assert_close(a, b, msg=type(outer).__name__)


# ---- the Trainer takes any output and batch --------------------------------------------------------
def test_trainer_takes_a_tuple_output_and_reports_accuracy():
    torch.manual_seed(0)
    model = TupleNet()
    data = batches(1, 40, shape=(6,))
    trainer = islands.Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        F.cross_entropy,
        data,
        val_data=data[:4],
        callbacks=[islands.Evaluate(every=10)],
    )
    trainer.fit(20)
    val = trainer.series["val"]
    assert [v["step"] for v in val] == [0, 10, 20]
    assert 0.0 <= val[-1]["val_accuracy"] <= 1.0
    assert val[-1]["val_loss"] < val[0]["val_loss"]


def test_evaluate_reads_logits_and_loss_from_a_model_output():
    class Output(dict):  # what transformers' ModelOutput is: a mapping with attributes
        __getattr__ = dict.__getitem__

    class WithOutput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x, labels=None):
            logits = self.lin(x)
            out = Output(logits=logits)
            if labels is not None:
                out["loss"] = F.cross_entropy(logits, labels)
            return out

    model = WithOutput()
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    # a (inputs, targets) batch with a loss function: the loss sees the logits
    got = islands.evaluate(model, [(x, y)], F.cross_entropy, torch.device("cpu"))
    assert got["val_loss"] == pytest.approx(F.cross_entropy(model.lin(x), y).item())
    assert got["val_accuracy"] == pytest.approx((model.lin(x).argmax(-1) == y).float().mean().item())
    # a dict batch and no loss function: the model's own loss
    got = islands.evaluate(model, [{"x": x, "labels": y}], None, torch.device("cpu"))
    assert got["val_loss"] == pytest.approx(F.cross_entropy(model.lin(x), y).item())


def test_evaluate_a_transformers_model_built_from_a_config():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
        )
    )
    ids = torch.randint(0, 50, (4, 16))
    got = islands.evaluate(model, [{"input_ids": ids, "labels": ids}], None, torch.device("cpu"))
    assert model.training  # evaluate() puts the model back as it found it
    with torch.no_grad():
        expected = model.eval()(input_ids=ids, labels=ids).loss.item()  # dropout off, as evaluate runs it
    model.train()
    assert got["val_loss"] == pytest.approx(expected, rel=1e-6)
    trainer = islands.Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        None,
        [{"input_ids": ids, "labels": ids}] * 10,
        val_data=[{"input_ids": ids, "labels": ids}],
    )
    trainer.fit(10)
    assert trainer.series["val"][-1]["val_loss"] < got["val_loss"]


# ---- bad input: messages, not tracebacks -----------------------------------------------------------
def test_a_model_with_nothing_to_train_is_refused():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        islands.Trainer(frozen, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), F.mse_loss, [])


def test_a_loss_that_is_not_a_scalar_is_named():
    model = nn.Linear(6, 3)
    per_sample = lambda pred, y: F.cross_entropy(pred, y, reduction="none")  # noqa: E731
    trainer = islands.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), per_sample, batches(0, 4, shape=(6,)))
    with pytest.raises(islands.BatchError, match="scalar"):
        trainer.fit(1)


def test_a_batch_the_model_cannot_take_names_its_shape():
    model = nn.Linear(6, 3)
    trainer = islands.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, batches(0, 4, shape=(5,))
    )
    with pytest.raises(islands.BatchError, match=r"could not take the batch tuple\(Tensor\[8, 5\] float32"):
        trainer.fit(1)


# ---- several processes ------------------------------------------------------------------------------
def _bn_rank(rank, env):
    """(world of 2 islands, the same BNNet on every rank, its AdamW) in a spawned rank."""
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    world = islands.init_world(islands=2)
    torch.manual_seed(0)
    model = BNNet()
    return world, model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _bn_diloco_worker(rank, env, queue, streaming=False):
    world, model, opt = _bn_rank(rank, env)
    outer = (
        islands.outer.StreamingDiLoCo(4, schedule=islands.outer.Fragments(2, tau=1))
        if streaming
        else islands.outer.DiLoCo(inner_steps=5)
    )
    strategy = islands.Stack(outer=outer)
    model = own_loop(strategy, model, opt, world, batches(10 + rank, 12))  # each island its own data
    g = strategy.eval_model(model)
    queue.put(
        (
            rank,
            plain(model.bn.running_mean),
            plain(g.bn.running_mean),
            int(g.bn.num_batches_tracked),
            [plain(p) for p in g.parameters()],
        )
    )
    islands.close_world(world)


def test_outer_strategies_carry_batchnorm_statistics_to_the_global_model():
    (_, live0, glob0, tracked0, params0), (_, live1, glob1, tracked1, params1) = spawn_ranks(_bn_diloco_worker, 2)
    assert tracked0 == tracked1 == 12  # was 0: the global model kept its initial buffers
    assert (glob0 == glob1).all()  # every island reports the same global model
    assert (live0 == glob0).all()  # islands adopt the average at the final sync
    assert (glob0 != 0).any()  # statistics of the data, not the initial zeros
    for a, b in zip(params0, params1):
        assert (a == b).all()


def test_buffers_follow_an_overlapped_exchange_without_deadlock():
    """Streaming DiLoCo: a fragment's exchange is in flight on a background thread when a cycle's buffers are
    averaged; both go through the exchange's one thread, so every rank issues them in the same order (two
    threads on one gloo group deadlocked here)."""
    (_, live0, glob0, tracked0, _), (_, _, glob1, _, _) = spawn_ranks(_bn_diloco_worker, 2, True, timeout=120)
    assert tracked0 == 12
    assert (glob0 == glob1).all() and (live0 == glob0).all()


def _bn_islands_of_two_worker(rank, env, queue, gossip=False):
    """4 ranks: 2 islands of 2 workers, DDP inside, DiLoCo (or gossip) across, every rank its own batches."""
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    world = islands.init_world(islands=2)
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = (
        islands.outer.Gossip(every=4, topology=islands.outer.Ring()) if gossip else islands.outer.DiLoCo(inner_steps=4)
    )
    strategy = islands.Stack(inner=islands.inner.DDP(), outer=outer)
    model = own_loop(strategy, model, opt, world, batches(20 + rank, 10))
    g = strategy.eval_model(model)
    queue.put(
        (
            rank,
            {k: plain(v) for k, v in g.state_dict().items()},
            plain(model.module.bn.running_mean),
            dict(world.ledger.sent),
        )
    )
    islands.close_world(world)


def test_every_worker_of_every_island_holds_the_same_global_batchnorm_statistics():
    """DDP re-sends only rank 0's buffers, at the next forward: after a round each worker of an island holds
    statistics of its own batch. The cross exchange pairs worker i of every island, so without averaging over
    the island first, worker 0 and worker 1 reported different global models (silently)."""
    got = sorted(spawn_ranks(_bn_islands_of_two_worker, 4, timeout=120), key=lambda r: r[0])
    first = got[0][1]
    assert int(first["bn.num_batches_tracked"]) == 10
    for rank, state, live_mean, _sent in got:
        for key, value in state.items():
            assert (value == first[key]).all(), (rank, key)
        assert (live_mean == first["bn.running_mean"]).all(), rank  # the live model adopted the same average
    assert all(sent["island_buffers"] > 0 and sent["outer_buffers"] > 0 for *_, sent in got)


def test_gossip_keeps_each_islands_own_batchnorm_statistics_the_same_on_all_its_workers():
    """Gossip has no global average of buffers (buffer_policy "own"), but the workers of one island are one
    replica: without averaging over the island, worker 0 and 1 of an island reported different models."""
    got = sorted(spawn_ranks(_bn_islands_of_two_worker, 4, True, timeout=120), key=lambda r: r[0])
    for island in (0, 1):
        (_, a, live_a, _), (_, b, live_b, _) = got[2 * island : 2 * island + 2]
        for key in a:
            assert (a[key] == b[key]).all(), (island, key)
        assert (live_a == live_b).all()
    assert not (got[0][1]["bn.running_mean"] == got[2][1]["bn.running_mean"]).all()  # islands keep their own
    assert all(sent["island_buffers"] > 0 and "outer_buffers" not in sent for *_, sent in got)


class _TwinComm(LoneComm):
    """A cross-island Comm of two identical islands, recording which thread issued each collective (the rest of
    the Comm contract, runtime.contracts.Collectives, as a lone Comm has it)."""

    size, rank = 2, 0

    def __init__(self):
        import threading

        self.calls, self._thread = [], threading.current_thread

    def all_reduce(self, tensor, op=None, kind="all_reduce"):
        self.calls.append((kind, self._thread().name))
        return tensor.mul_(2)

    def all_gather(self, tensor, kind="all_gather"):
        self.calls.append((kind, self._thread().name))
        return [tensor.clone(), tensor.clone()]


def test_buffer_averages_queue_behind_the_exchange_in_flight():
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = islands.outer.StreamingDiLoCo(4, schedule=islands.outer.Fragments(2, tau=1))
    outer.wrap(model, opt, islands.World.single())
    outer.comm = comm = _TwinComm()
    for step, (x, y) in enumerate(batches(0, 9)):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        outer.after_step(model, opt, step)
    outer.finish(model)
    buffers = {t for k, t in comm.calls if k == "outer_buffers"}
    overlapped = {t for k, t in comm.calls if k == "outer_delta"} - {"MainThread"}  # the final sync blocks
    assert len(buffers) == 1 and buffers == overlapped  # the same one thread: one order on every rank


def _existing_group_worker(rank, env, queue):
    import torch.distributed as dist

    from islands.compress.ddp_hook import ddp_comm_hook

    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the script's own group, as most scripts make it
    world = islands.init_world(islands=2)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    state, hook = ddp_comm_hook(islands.compress.PowerSGD(rank=2), dist.group.WORLD, net.named_parameters())
    ddp.register_comm_hook(state, hook)  # a plain process group, as torch's own hooks take
    x, y = batches(rank, 1, shape=(6,))[0]
    F.cross_entropy(ddp(x), y).backward()
    grads = [plain(p.grad) for p in net.parameters()]
    queue.put((rank, world.size, world.islands, world.owns_group, grads, state.comm.ledger.total_sent))
    islands.close_world(world)  # leaves the script's group alone
    queue_alive = dist.is_initialized()
    dist.destroy_process_group()
    assert queue_alive


def test_init_world_reuses_the_scripts_group_and_the_hook_takes_a_plain_group():
    reports = spawn_ranks(_existing_group_worker, 2)
    for _, size, isl, owns, _, sent in reports:
        assert (size, isl, owns) == (2, 2, False)
        assert sent > 0
    for a, b in zip(reports[0][4], reports[1][4]):
        assert (a == b).all()  # averaged: the same gradient on both ranks


def _attach_worker(rank, env, queue, zero_touch):
    world, model, opt = _bn_rank(rank, env)
    strategy = islands.outer.DiLoCo(inner_steps=4)
    data = batches(20 + rank, 10)
    if zero_touch:
        with strategy.attach(model, opt, world):
            for x, y in data:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    else:
        model = own_loop(strategy, model, opt, world, data)
    queue.put((rank, strategy.rounds, {k: plain(v) for k, v in strategy.eval_model(model).state_dict().items()}))
    islands.close_world(world)


def test_zero_touch_attach_equals_the_explicit_hooks_bitwise():
    explicit = spawn_ranks(_attach_worker, 2, False)
    attached = spawn_ranks(_attach_worker, 2, True)
    assert explicit[0][1] == attached[0][1] == 3  # rounds at steps 4, 8 and the final one at 10
    for k, v in explicit[0][2].items():
        assert (attached[0][2][k] == v).all(), k
