"""Compressed pulls of the parameter server (issue #36 item 1; ps_pulls.py): the server answers with C(global -
the copy the island holds), both ends add its decode to their copy. The two copies stay equal bit for bit, the gap C
leaves goes out with later answers (the copy is the feedback), a first pull, an answer the island never took, a
rebuilt server and the final answer are whole, and a refused compressor is named with what works. Thread mode under
islands.simulate here, and the process mode's shard servers as threads (harness.ps.ThreadService)."""

from __future__ import annotations

import pytest
import torch
from test_ps_codecs_service import island_world
from test_ps_strategy import Island

import islands
from harness.cli import islands_cli
from harness.outer import tiny_model
from harness.ps import ThreadService, done_together
from islands.compress import COMPRESSORS, TopK
from islands.outer import InProcessServer, ParameterServer, VirtualClock
from islands.runtime.comm import CommLedger
from islands.sync.outer import make_outer
from islands.sync.outer.flat import FlatView
from islands.sync.outer.ps import ServerProcesses, outer_rule
from islands.sync.outer.ps_link import ANSWER_BYTES, DONE, Message
from islands.sync.outer.ps_pulls import WHOLE, HeldCopies, HeldModel, PullCodec, Pulled, pull_codec
from islands.sync.outer.ps_remote import REPLY_BYTES
from islands.sync.outer.ps_service import ServiceConfig
from islands.sync.outer.ps_wire import PULL, Request

PULLS = ["topkq:ratio=0.05,bits=4", "int8", "topk:ratio=0.1", "fp16"]


def target(n: int = 400, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# ---- the two ends -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", PULLS)
def test_both_ends_step_their_copies_to_the_same_bits_and_the_gap_shrinks_answer_by_answer(spec):
    codec = pull_codec(COMPRESSORS.build(spec))
    assert isinstance(codec, PullCodec)
    server, island = HeldCopies(codec), HeldModel(codec)
    first = server.answer(3, island.token, target(seed=0))
    assert not first.coded and first.token != WHOLE  # nothing held yet: the whole model, under a token
    assert torch.equal(island.take(first), target(seed=0))
    goal = target(seed=1)  # the global model moved
    gaps = []
    for _ in range(60):  # top-k at 5% needs 20 answers to have sent every coordinate once
        answer = server.answer(3, island.token, goal)
        assert answer.coded and answer.body.dtype == torch.uint8
        assert answer.body.numel() < goal.numel() * 4  # fewer bytes than the fp32 model
        held = island.take(answer)
        assert torch.equal(held, server.copies[3][1])  # the same bits on both ends
        assert island.token == server.copies[3][0] == answer.token
        gaps.append(float((goal - held).norm()))
    start = float((goal - target(seed=0)).norm())
    # what one answer left out went out with the next ones: the gap falls well below one compressed answer's error
    assert gaps[0] < start and gaps[-1] < 0.05 * gaps[0], gaps
    assert server.report() == {"whole": 1, "coded": 60, "copies": 1, "peak_bytes": 400 * 4}


def test_top_k_pulls_of_a_still_model_reach_it_exactly_in_one_over_ratio_answers():
    """Top-k sends its k values exactly: each answer closes k more coordinates of the gap, none twice."""
    codec = PullCodec(TopK(ratio=0.1))
    server, island = HeldCopies(codec), HeldModel(codec)
    island.take(server.answer(0, island.token, torch.zeros(100)))
    goal = target(100)
    for i in range(10):
        held = island.take(server.answer(0, island.token, goal))
        assert int((held != goal).sum()) == 100 - 10 * (i + 1)
    assert torch.equal(held, goal)


def test_an_answer_the_island_never_took_or_a_copy_the_server_dropped_makes_the_next_answer_whole():
    codec = PullCodec(COMPRESSORS.build("int8"))
    server, island = HeldCopies(codec), HeldModel(codec)
    island.take(server.answer(1, island.token, target(seed=0)))
    lost = server.answer(1, island.token, target(seed=1))  # lost on the way: the island still holds the first copy
    assert lost.coded
    again = server.answer(1, island.token, target(seed=2))
    assert not again.coded and torch.equal(island.take(again), target(seed=2))  # whole, and both ends agree again
    server.forget(1)  # done, left or lapsed
    back = server.answer(1, island.token, target(seed=3))
    assert not back.coded and torch.equal(island.take(back), target(seed=3))
    island.take(server.answer(1, island.token, target(seed=5)))  # coded: both ends hold the same copy again
    server.forget_all()  # the global model put back (a checkpoint's restore): nobody holds a copy of it
    restored = server.answer(1, island.token, target(seed=6))
    assert not restored.coded and server.report()["whole"] == 4  # its counts go on (first, again, back, this)
    rebuilt = HeldCopies(codec)  # a server rebuilt from its journal holds no copies
    assert not rebuilt.answer(1, island.token, target(seed=4)).coded
    assert not server.answer(2, WHOLE, target()).coded  # an island that says it holds nothing


def test_without_pulls_every_answer_is_the_model_and_nothing_is_held():
    server, island = HeldCopies(None), HeldModel(None)
    answer = server.answer(0, 12345, target())
    assert answer == Pulled(answer.body) and answer.body is not None and not server.copies
    assert torch.equal(island.take(answer), target()) and island.model is None and island.token == WHOLE


def test_a_coded_answer_to_an_island_without_a_copy_is_refused_by_name():
    codec = PullCodec(COMPRESSORS.build("int8"))
    with pytest.raises(ValueError, match="cannot apply: it holds no copy"):
        HeldModel(codec).take(Pulled(torch.zeros(8, dtype=torch.uint8), 7, coded=True))


# ---- thread mode under islands.simulate ---------------------------------------------------------------------
def simulated(pulls: str | None, steps: int = 12, h: int = 2):
    torch.set_num_threads(1)
    server = InProcessServer()

    def main(world):
        ps = ParameterServer(
            h,
            arrivals=VirtualClock([1.0, 2.0, 3.0]),
            host=server,
            max_staleness=8,
            pulls=None if pulls is None else COMPRESSORS.build(pulls),
        )
        isl = Island(world, ps)
        held = []  # the model the island trains from after each answer
        for i in range(steps):
            isl.step(i)
            if (i + 1) % h == 0:
                held.append(ps.global_flat.clone())
        ps.finish(isl.model)
        return held, ps.global_flat.clone(), world.ledger.snapshot(), ps.run_report()

    return islands.simulate.run(main, islands=3)


@pytest.mark.parametrize("spec", ["topkq:ratio=0.05,bits=4", "int8"])
def test_simulated_islands_train_from_the_copy_the_server_holds_for_them_and_end_on_the_exact_model(monkeypatch, spec):
    answers: list[tuple[int, Pulled, torch.Tensor]] = []  # (island, the answer, the server's copy after it)
    answer = HeldCopies.answer

    def watched(self, island, token, flat):
        got = answer(self, island, token, flat)
        if self.codec is not None:  # not the exact run's
            answers.append((island, got, self.copies[island][1].clone()))
        return got

    monkeypatch.setattr(HeldCopies, "answer", watched)
    results = simulated(spec)
    numel = results[0][1].numel()
    final = results[0][1]
    exact = simulated(None)[0][1]
    for island, (held, last, ledger, _) in enumerate(results):
        mine = [(p, copy) for i, p, copy in answers if i == island]
        assert len(mine) == len(held) == 6
        assert not mine[0][0].coded and all(p.coded for p, _ in mine[1:])  # its first answer whole, then steps
        for (_, copy), model in zip(mine, held):
            assert torch.equal(copy, model)  # it trained from exactly the copy the server kept for it
        assert torch.equal(last, final)  # the DONE's answer is whole: one exact model for every island
        # the ledger: a whole answer is the fp32 model, a coded one its payload; DONE's the whole model
        coded = sum(p.body.numel() for p, _ in mine[1:])
        assert ledger["received"]["ps_pull"] == 7 * ANSWER_BYTES + 2 * numel * 4 + coded
        assert coded < 5 * numel * 4 / 3  # under a third of fp32 answers
    assert not torch.equal(final, exact)  # the islands trained from their copies, not the exact model
    assert simulated(spec)[0][1].equal(final)  # deterministic: the same schedule, the same bits
    server = next(r[3]["parameter_server"] for r in results if r[3])["servers"][0]
    # every island's copy dropped at its DONE; three held at once, counted in the server's memory
    assert server["pulls"] == {"whole": 3, "coded": 15, "copies": 0, "peak_bytes": 3 * 4 * numel}
    assert server["peak_memory_bytes"] == server["state_bytes"]["total"] + 3 * 4 * numel


# ---- process mode: shard servers -----------------------------------------------------------------------------
def test_shard_servers_answer_each_range_from_the_islands_copy_and_a_rebuilt_one_answers_whole(tmp_path):
    torch.set_num_threads(1)
    initial = FlatView(tiny_model().parameters()).read()
    pulls = COMPRESSORS.build("topkq:ratio=0.05,bits=4")
    config = ServiceConfig(
        initial, outer_rule(), islands=2, servers=2, lease_s=30.0, max_staleness=100, pulls=pull_codec(pulls)
    )
    ledgers = [CommLedger(), CommLedger()]
    with ThreadService(tmp_path, config) as svc:
        isl = []
        for k in range(2):
            ps = ParameterServer(2, pulls=pulls, service=ServerProcesses(2, 30.0, 120.0, address=svc.address))
            isl.append(Island(island_world(k, ledgers[k]), ps))
        for i in range(6):  # in turn: 3 pushes each
            for x in isl:
                x.step(i)
        for k, x in enumerate(isl):
            link = x.strategy.link
            for r, server in enumerate(svc.servers):
                token, copy = server.copies.copies[k]
                assert link.held[r].token == token  # each range's copy, under the same token on both ends
                lo, hi = config.bounds[r]
                assert torch.equal(x.strategy.global_flat[lo:hi], copy)
            assert [s.copies.report()["coded"] for s in svc.servers] == [6, 6]  # 3 pushes each of 2 islands
        # bytes: island 0's first pull whole (the fp32 model), its pushes' answers coded
        snap = ledgers[0].snapshot()["received"]["ps_pull"]
        assert REPLY_BYTES * 8 + initial.numel() * 4 < snap < REPLY_BYTES * 8 + initial.numel() * 4 * 4 / 3

        # an answer island 0 never took (lost on the way): shard 0 steps its copy, the island does not
        link = isl[0].strategy.link
        lost = link.request(0, Request(PULL, 0, held=link.held[0].token))
        assert lost.coded and lost.token != link.held[0].token
        # shard 1's server dies and its successor rebuilds from the journal, without copies
        svc.restart(1, [x.strategy.link for x in isl])
        for i in range(6, 8):
            for x in isl:
                x.step(i)
        lo, hi = config.bounds[1]
        assert svc.servers[1].copies.report() == {"whole": 2, "coded": 0, "copies": 2, "peak_bytes": 2 * 4 * (hi - lo)}
        assert svc.servers[0].copies.report()["whole"] == 2 + 1  # the two first pulls, and island 0's after the loss
        for k, x in enumerate(isl):
            for r, server in enumerate(svc.servers):
                lo, hi = config.bounds[r]
                assert torch.equal(x.strategy.global_flat[lo:hi], server.copies.copies[k][1])
        done_together([x.strategy.link for x in isl])
        served = torch.cat([s.durable.state.pull()[1] for s in svc.servers])
        for x in isl:
            x.strategy.adopt(x.strategy.link.send(Message(DONE, x.strategy.island)))
            assert torch.equal(x.strategy.global_flat, served)  # the final answers: whole, the exact model


# ---- specs and refusals --------------------------------------------------------------------------------------
def test_the_spec_builds_a_pull_compressor_beside_a_push_compressor():
    ps = make_outer("ps:inner_steps=4,compressor=(topkq:ratio=0.05,bits=2),pulls=(int8)")
    assert isinstance(ps.pulls, PullCodec) and ps.pulls.compressor.name == "int8"
    assert make_outer("ps:inner_steps=4").pulls is None  # whole fp32 pulls by default


# the refused pull compressors: test_ps_codecs.py, beside the refused push compressors
def test_the_cli_refuses_a_pull_compressor_with_exit_2(capsys):
    argv = ["train", "--workers", "2", "--islands", "2", "--outer"]
    assert islands_cli(*argv, "ps:inner_steps=4,pulls=(randomk:ratio=0.1)") == 2
    err = capsys.readouterr().err
    assert "pulls=randomk rescales its values" in err and "Traceback" not in err
