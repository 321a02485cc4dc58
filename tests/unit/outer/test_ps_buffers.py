"""Buffers through the parameter server (issue #36): BatchNorm's running statistics and step counter ride on each
push, the server keeps each island's latest and answers with their mean (the counter: the largest), and the island
adopts it, in thread mode (islands.simulate, the server a thread of this process) and in process mode (shard
servers as threads here, harness.ps.ThreadService; shard 0 holds the buffers). A late island starts from the others'
statistics, not its model's initial ones; a model without buffers sends the bytes it sent before. Shard 0's table
through a rebuild and a resume: test_ps_buffers_durable.py."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import islands
from harness.ps import ThreadService
from islands.outer import InProcessServer, ParameterServer, VirtualClock
from islands.runtime.comm import CommLedger
from islands.runtime.world import LoneComm, World
from islands.sync.outer import ps_link
from islands.sync.outer.flat import FlatView
from islands.sync.outer.ps import ServerProcesses, outer_rule
from islands.sync.outer.ps_buffers import BufferTable, IslandBuffers
from islands.sync.outer.ps_link import ANSWER_BYTES, HEADER_BYTES, Message
from islands.sync.outer.ps_remote import REPLY_BYTES, REQUEST_BYTES
from islands.sync.outer.ps_service import ServiceConfig
from islands.sync.outer.ps_wire import PUSH

LAYOUT = (8, 1)  # BatchNorm2d(4): running_mean and running_var, then num_batches_tracked


def bn_model(batchnorm: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm2d(4) if batchnorm else torch.nn.Identity()
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), norm, torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 36, 3)
    )


def batch(island: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Island i's data has its own mean and spread, so its running statistics are its own."""
    g = torch.Generator().manual_seed(1000 * island + step)
    return torch.randn(8, 1, 6, 6, generator=g) * (1 + island) + island, torch.randint(0, 3, (8,), generator=g)


class Trained:
    """One island: a model, SGD and its ParameterServer, stepped in the trainer's hook order. `pushed`: the buffer
    vector it held at each push (what the push carried); `adopted`: (the answer's buffers, its own right after)."""

    def __init__(self, island: int, world, strategy: ParameterServer, batchnorm: bool = True):
        self.island, self.strategy, self.model = island, strategy, bn_model(batchnorm)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.pushed: list[torch.Tensor] = []
        self.adopted: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        adopt = strategy.adopt

        def watched(reply):  # the strategy's own adopt, then what the island holds
            adopt(reply)
            self.adopted.append((reply.buffers, self.buffers()))

        strategy.adopt = watched  # type: ignore[method-assign]
        strategy.wrap(self.model, self.opt, world)

    def buffers(self) -> torch.Tensor:
        mine = IslandBuffers.of(self.model.buffers())
        return mine.read() if mine is not None else torch.zeros(0, dtype=torch.float64)

    def step(self, i: int) -> None:
        x, y = batch(self.island, i)
        torch.nn.functional.cross_entropy(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        ps = self.strategy
        if i + 1 - ps.synced_at >= ps.inner_steps:  # after_step pushes now
            self.pushed.append(self.buffers())
        ps.after_step(self.model, self.opt, i)


def mean_of(rows: list[torch.Tensor], floating: int = LAYOUT[0]) -> torch.Tensor:
    """What the server should answer, computed here: the floating values' mean, the counts' largest."""
    stacked = torch.stack(rows)
    return torch.cat([stacked[:, :floating].mean(0), stacked[:, floating:].amax(0)])


def as_held(vector: torch.Tensor) -> torch.Tensor:
    """A float64 buffer vector as a BatchNorm model holds it (fp32 statistics, an int64 count)."""
    return torch.cat([vector[: LAYOUT[0]].to(torch.float32).to(torch.float64), vector[LAYOUT[0] :]])


# ---- thread mode (islands.simulate) ------------------------------------------------------------------------
class Recorded(BufferTable):
    """The server loop's table, recording what it was given and what it answered, in the loop's order."""

    log: ClassVar[list] = []

    def put(self, island: int, vector: torch.Tensor) -> None:
        super().put(island, vector)
        self.log.append(("put", island, vector.clone()))

    def mean(self) -> torch.Tensor | None:
        m = super().mean()
        self.log.append(("mean", None, None if m is None else m.clone()))
        return m


def test_simulated_islands_adopt_the_servers_mean_after_every_push_and_the_counter_takes_the_largest(monkeypatch):
    """3 islands of different data and round lengths (H = 2, 3, 2): each answer carries the mean of every island's
    latest statistics and the largest step count, and the island holds exactly that after each of its pulls."""
    torch.set_num_threads(1)
    monkeypatch.setattr(ps_link, "BufferTable", Recorded)
    Recorded.log = []
    server, h = InProcessServer(), (2, 3, 2)

    def main(world):
        ps = ParameterServer(h[world.rank], arrivals=VirtualClock([1.0, 1.0, 1.0]), host=server, max_staleness=8)
        island = Trained(world.rank, world, ps)
        for i in range(12):
            island.step(i)
        ps.finish(island.model)  # DONE: thread mode's loop serves until every island is done
        return island.pushed, island.adopted[:-1]  # the answers to its pushes (the last is the final answer's)

    results = islands.simulate.run(main, islands=3)
    latest: dict[int, torch.Tensor] = {}
    answered, larger = [], 0
    for (what, island, vector), nxt in zip(Recorded.log, [*Recorded.log[1:], None]):
        if what == "put":
            latest[island] = vector
            assert nxt is not None and nxt[0] == "mean"  # quorum 1: its answer comes next, with the mean
            count = nxt[2][LAYOUT[0] :]
            larger += int(count.item() > vector[LAYOUT[0] :].item())  # another island had counted more
        else:
            assert vector is not None and len(latest) >= 1
            torch.testing.assert_close(vector, mean_of(list(latest.values())), rtol=0, atol=1e-12)
            answered.append(vector)
    assert len(latest) == 3 and larger > 0
    for island, (pushed, adopted) in enumerate(results):
        assert len(pushed) == len(adopted) == 12 // h[island]
        for k, ((shared, holds), mine) in enumerate(zip(adopted, pushed)):
            assert shared is not None and any(torch.equal(shared, a) for a in answered)
            assert torch.equal(holds, as_held(shared))  # the island's buffers are the server's mean, as fp32
            # ... and not what it pushed (the others' are in the mean), but for the very first push of the run
            assert torch.equal(holds, mine) == (island == 0 and k == 0)
    first = results[0][1][0][1]  # island 0's first answer: only its own statistics were on the server then
    assert torch.equal(first, results[0][0][0])


def test_a_simulated_model_without_buffers_sends_what_it_sent_before_and_one_with_sends_its_buffers_more():
    """The byte ledger of a push and its answer (LocalLink counts what the wire would carry): a model without
    buffers, header and fp32 delta out, header and fp32 model back, as before; a BatchNorm model adds its float64
    buffer vector to the push, and [held, mean] to every answer."""
    torch.set_num_threads(1)

    def run(batchnorm: bool) -> tuple[dict, int]:
        server, ledgers = InProcessServer(), []

        def train(world):
            island = Trained(
                world.rank, world, ParameterServer(2, arrivals=VirtualClock([1.0, 1.0]), host=server), batchnorm
            )
            for i in range(4):
                island.step(i)
            island.strategy.finish(island.model)
            ledgers.append(world.ledger)
            return FlatView(island.model.parameters()).numel

        numel = islands.simulate.run(train, islands=2)[0]
        snap = ledgers[0].snapshot()
        kinds = ("ps_push", "ps_pull")
        return {k: (snap["sent"].get(k, 0), snap["received"].get(k, 0), snap["calls"].get(k, 0)) for k in kinds}, numel

    plain, numel = run(False)
    pushes, done = 2, 1  # in one island's ledger: its 2 pushes, then its DONE (a header, answered with the model)
    assert plain["ps_push"] == (pushes * (HEADER_BYTES + 4 * numel) + done * HEADER_BYTES, 0, pushes + done)
    assert plain["ps_pull"] == (0, (pushes + done) * (ANSWER_BYTES + 4 * numel), pushes + done)
    with_bn, numel_bn = run(True)
    n = sum(LAYOUT)
    assert with_bn["ps_push"] == (
        pushes * (HEADER_BYTES + 4 * numel_bn + 8 * n) + done * HEADER_BYTES,
        0,
        pushes + done,
    )
    assert with_bn["ps_pull"] == (0, (pushes + done) * (ANSWER_BYTES + 4 * numel_bn + 8 * (n + 1)), pushes + done)


def test_with_statistics_own_each_island_keeps_its_own_buffers_and_the_pushes_carry_none():
    """ps:statistics=own: a BatchNorm model's pushes and answers are the bytes of a model without buffers, and every
    island holds the statistics of its own data all run long and at the end (they differ: island i's data has its
    own mean), on the same parameters."""
    torch.set_num_threads(1)
    server, ledgers = InProcessServer(), {}

    def main(world):
        ps = ParameterServer(2, arrivals=VirtualClock([1.0, 1.0]), host=server, statistics="own")
        island = Trained(world.rank, world, ps)
        for i in range(4):
            island.step(i)
        before_end = island.buffers()
        ps.finish(island.model)
        ledgers[world.rank] = world.ledger.snapshot()
        evaluated = ps.eval_model(island.model)
        kept = IslandBuffers.of(evaluated.buffers())
        assert kept is not None
        params = torch.cat([p.detach().reshape(-1) for p in evaluated.parameters()])
        return island.pushed, [held for shared, held in island.adopted[:-1]], before_end, kept.read(), params

    results = islands.simulate.run(main, islands=2)
    for pushed, held, before_end, at_end, _ in results:
        assert len(held) == 2 and all(torch.equal(h, p) for h, p in zip(held, pushed))  # nothing adopted
        assert torch.equal(at_end, before_end)  # no average at the end: the evaluated model has the island's own
    assert not torch.equal(results[0][3], results[1][3])  # their own data, their own statistics
    assert torch.equal(results[0][4], results[1][4])  # on the server's parameters, the same for both
    numel = FlatView(bn_model().parameters()).numel
    assert (
        ledgers[0]["sent"]["ps_push"] == 2 * (HEADER_BYTES + 4 * numel) + HEADER_BYTES
    )  # no buffer vector on the wire
    with pytest.raises(ValueError, match="statistics must be one of mean, own"):
        ParameterServer(2, statistics="island")


# ---- process mode (shard servers as threads) ---------------------------------------------------------------
class OneIsland(LoneComm):
    """Island `rank`'s cross-island Comm when the islands share nothing but the servers (no collective: each
    trains alone between its pushes), counting its pushes and pulls in `ledger`."""

    def __init__(self, rank: int, ledger: CommLedger):
        self.rank, self.ledger = rank, ledger


def island_world(island: int, ledger: CommLedger | None = None) -> World:
    comms = {"cross": OneIsland(island, ledger or CommLedger()), "local": LoneComm()}
    return World(rank=0, size=2, islands=2, device=torch.device("cpu"), backend="none", comms=comms)


def service(tmp_path, batchnorm: bool = True, **kw) -> ThreadService:
    initial = FlatView(bn_model(batchnorm).parameters()).read()
    layout = LAYOUT if batchnorm else (0, 0)
    config = ServiceConfig(initial, outer_rule(), islands=2, servers=2, lease_s=30.0, buffers=layout, **kw)
    return ThreadService(tmp_path, config)


def remote(svc: ThreadService, island: int, h: int = 2, batchnorm: bool = True, ledger=None) -> Trained:
    ps = ParameterServer(h, max_staleness=100, service=ServerProcesses(2, 30.0, 120.0, address=svc.address))
    return Trained(island, island_world(island, ledger), ps, batchnorm)


def test_a_late_island_starts_from_the_others_mean_statistics_not_its_models_initial_ones(tmp_path):
    """Islands 0 and 1 train on different data; island 2 joins afterwards. Its first pull brings the global model
    and the mean of the others' latest running statistics (the largest step count), which its BatchNorm layer then
    holds. Before, it started from mean 0, variance 1 and a count of 0 until its own batches warmed them."""
    torch.set_num_threads(1)
    with service(tmp_path) as svc:
        a, b = remote(svc, 0), remote(svc, 1, h=3)
        for i in range(6):
            a.step(i)
            b.step(i)
        assert [s.buffers is not None for s in svc.servers] == [True, False]  # shard 0 holds them
        late = remote(svc, 2)
        ((shared, holds),) = late.adopted  # its first pull
        expected = mean_of([a.pushed[-1], b.pushed[-1]])
        assert shared is not None and torch.equal(shared, expected)  # two islands: summed in one order everywhere
        assert torch.equal(holds, as_held(expected))
        bn = late.model[1]
        assert not torch.equal(bn.running_mean, torch.zeros(4)) and not torch.equal(bn.running_var, torch.ones(4))
        assert bn.num_batches_tracked.item() == 6  # the largest count: island 1's 2 rounds of 3
        assert torch.equal(late.strategy.global_model[1].running_var, bn.running_var)  # the global model's too
        model = torch.cat([s.durable.state.pull()[1] for s in svc.servers])
        assert torch.equal(FlatView(late.model.parameters()).read(), model)  # and the global parameters


def test_islands_through_shard_servers_hold_the_servers_mean_after_every_push(tmp_path):
    """Two islands in turn through two shard servers: after each push the island holds the mean of both islands'
    latest statistics (computed here from what each pushed) and the larger count; the islands' buffers meet
    during the run, not only at its end."""
    torch.set_num_threads(1)
    with service(tmp_path) as svc:
        a, b = remote(svc, 0, h=2), remote(svc, 1, h=3)
        latest: dict[int, torch.Tensor] = {}
        for i in range(12):
            for island in (a, b):
                before = len(island.pushed)
                island.step(i)
                if len(island.pushed) > before:  # it pushed: its answer is the mean over the latest pushes
                    latest[island.island] = island.pushed[-1]
                    shared, holds = island.adopted[-1]
                    expected = mean_of([latest[k] for k in sorted(latest)])
                    assert shared is not None and torch.equal(shared, expected)
                    assert torch.equal(holds, as_held(expected))
        assert len(a.pushed) == 6 and len(b.pushed) == 4
        # after b's last push (step 11) both islands' statistics are the same mean: they met during the run
        assert torch.equal(b.buffers(), as_held(mean_of([a.pushed[-1], b.pushed[-1]])))
        assert b.buffers()[-1].item() == 12 and b.pushed[-1][-1].item() == 12 and a.pushed[-1][-1].item() == 12
        # the layout is the job's: a push without its buffers is refused by the island before anything is sent (the
        # server would read the delta's tail as statistics)
        link = svc.link(3, buffers=sum(LAYOUT))
        with pytest.raises(ValueError, match="without its 9 buffer values"):
            link.send(Message(PUSH, 3, 0, 1.0, torch.zeros(svc.config.bounds[-1][1])))


def test_a_model_without_buffers_sends_the_same_bytes_to_shard_servers_and_buffers_cost_their_vector(tmp_path):
    """Per push: to each of the 2 shards a 7-value header and its fp32 range; back, a header and the range.
    A BatchNorm model adds its float64 buffer vector to shard 0's push and the mean to shard 0's answer, nothing
    to shard 1's, and no message of its own."""
    torch.set_num_threads(1)
    counts = {}
    for batchnorm in (False, True):
        with service(tmp_path / str(batchnorm), batchnorm=batchnorm) as svc:
            ledger = CommLedger()
            island = remote(svc, 0, batchnorm=batchnorm, ledger=ledger)
            for i in range(4):
                island.step(i)
            snap = ledger.snapshot()
            counts[batchnorm] = [snap[k]["ps_push" if k == "sent" else "ps_pull"] for k in ("sent", "received")]
            numel = FlatView(island.model.parameters()).numel
            calls = snap["calls"]["ps_push"]
            assert calls == 3 * 2  # the first pull and 2 pushes, to each of 2 shards: no extra message
    plain_numel = FlatView(bn_model(False).parameters()).numel
    pushes, out, back = 2, 2 * REQUEST_BYTES, 2 * REPLY_BYTES  # one header to and from each of 2 shards
    # the first pull (a header out, the model back), then 2 pushes (header and delta out, header and model back)
    assert counts[False] == [3 * out + pushes * 4 * plain_numel, 3 * back + 3 * 4 * plain_numel]
    n = sum(LAYOUT)
    # the first pull finds no buffers on the servers yet; each push carries the vector and each answer the mean
    assert counts[True] == [3 * out + pushes * (4 * numel + 8 * n), 3 * back + 3 * 4 * numel + pushes * 8 * n]


def test_thread_modes_checkpoint_holds_the_servers_buffers_and_a_resume_answers_with_them():
    """The hosting island's checkpoint carries the loop's table beside the server state (`ps_buffers`): a resumed
    server answers its first push with the mean of what it held and the new push, as the run that never stopped."""
    torch.set_num_threads(1)
    first = Trained(0, World.single(), ParameterServer(2))
    for i in range(4):
        first.step(i)
    saved = first.strategy.state_dict()
    assert torch.equal(saved["ps_buffers"]["latest"][0], first.pushed[-1])
    saved["ps_buffers"]["latest"][7] = torch.zeros(sum(LAYOUT), dtype=torch.float64)  # as if an island 7 had pushed
    second = Trained(0, World.single(), ParameterServer(2))
    second.strategy.load_state_dict(saved)
    assert second.strategy.loop is not None and sorted(second.strategy.loop.buffers.latest) == [0, 7]
    second.step(4)
    second.step(5)
    expected = mean_of([second.pushed[-1], torch.zeros(sum(LAYOUT), dtype=torch.float64)])
    assert torch.equal(second.adopted[-1][0], expected)
    first.strategy.finish(first.model)
    second.strategy.finish(second.model)
