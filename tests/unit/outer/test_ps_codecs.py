"""islands.compress compressors for the parameter server's pushes (issue #36 item 1; ps_codecs.CompressedPushes), in
thread mode: islands under islands.simulate on a virtual clock, the server a thread of this process. The server
applies exactly what each payload decodes to; the ledger counts the compressor's payload plus its 8-byte counts and
the link's header; error feedback carries an island's unsent residual into its next push (against the error-feedback
arithmetic done here by hand); the residual is in the island's checkpoint. The spec builds, and compressors that need
the other islands' payloads of a round are refused, at the CLI with exit 2. Process mode: test_ps_codecs_service.py."""

from __future__ import annotations

import copy

import pytest
import torch
from test_ps_strategy import Island

import islands
from harness.cli import islands_cli
from islands.aggregate.coordinate import CoordinateMedian
from islands.compress import COMPRESSORS, Agreed, TopKQ
from islands.outer import InProcessServer, ParameterServer, Quant4, VirtualClock
from islands.runtime.world import World
from islands.sync.outer import make_outer
from islands.sync.outer.ps_codecs import CompressedPushes, push_codec
from islands.sync.outer.ps_link import HEADER_BYTES
from islands.sync.outer.ps_server import ServerState


def recorded(monkeypatch) -> list[tuple[int, torch.Tensor, ServerState]]:
    """Every contribution a server state is given (island, decoded delta, the state), in the order it applies them."""
    applied: list[tuple[int, torch.Tensor, ServerState]] = []
    push = ServerState.push

    def watched(self, c, active):
        applied.append((c.island, c.delta.clone(), self))
        return push(self, c, active)

    monkeypatch.setattr(ServerState, "push", watched)
    return applied


def watch_encoder(codec: CompressedPushes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The island's encode calls: (the delta it was given, the payload bytes it made)."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    encode_part = codec.encode_part

    def watched(x, part):
        payload = encode_part(x, part)
        calls.append((x.detach().clone(), payload.clone()))
        return payload

    codec.encode_part = watched  # type: ignore[method-assign]
    return calls


def by_hand(spec: str, deltas: list[torch.Tensor], ef: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """What each push should decode to, error feedback done here: x = residual + delta, send compress(x), residual =
    x - decompress(sent); the compressor alone (no ErrorFeedback), agreeing within a group of one. Returns the sent
    vectors and the last residual."""
    c = COMPRESSORS.build(spec)
    residual = torch.zeros_like(deltas[0])
    sent = []
    for d in deltas:
        x = residual + d if ef else d.clone()
        state = c.state("by-hand", x)
        s = c.decompress(c.compress(x, state, Agreed(c.agree(x, state), 1))).to(torch.float32)
        if ef:
            residual = x - s
        sent.append(s)
    return sent, residual


SPECS = [  # (spec, error feedback on, payload tensors: topkq's index/codes/scales, int8's codes/scale, values/indices)
    ("topkq:ratio=0.05,bits=2", True, 3),
    ("int8:ef=1", True, 2),
    ("randomk:ratio=0.1", False, 2),
]


@pytest.mark.parametrize("spec, ef, tensors", SPECS)
def test_simulated_islands_push_compressed_deltas_and_the_server_applies_their_decode(monkeypatch, spec, ef, tensors):
    torch.set_num_threads(1)
    applied = recorded(monkeypatch)
    server, steps, h = InProcessServer(), 8, 2

    def main(world):
        ps = ParameterServer(
            h,
            arrivals=VirtualClock([1.0, 2.0, 3.0]),
            host=server,
            max_staleness=8,
            compressor=COMPRESSORS.build(spec),
        )
        isl = Island(world, ps)
        assert isinstance(ps.codec, CompressedPushes)
        calls = watch_encoder(ps.codec)
        for i in range(steps):
            isl.step(i)
        ps.finish(isl.model)
        return calls, ps.global_flat.clone(), world.ledger.snapshot(), ps.codec.state_dict()

    results = islands.simulate.run(main, islands=3)
    numel = results[0][1].numel()
    pushes = steps // h
    assert len(applied) == 3 * pushes
    for island, (calls, final, ledger, state) in enumerate(results):
        assert torch.equal(final, results[0][1])  # one global model at the end
        mine = [delta for i, delta, _ in applied if i == island]
        assert len(mine) == len(calls) == pushes
        fresh = CompressedPushes(COMPRESSORS.build(spec))  # a decoder that never saw an encode
        for (_, payload), delta in zip(calls, mine):
            assert torch.equal(delta, fresh.decode(payload, numel))  # the server applied the payload's decode
            assert delta.count_nonzero() > 0
        # the ledger: per push the header, one int64 count per payload tensor and the compressor's own payload; then
        # the DONE's header
        nbytes = fresh.compressor.payload_nbytes((numel,), torch.float32)
        assert all(payload.numel() == 8 * tensors + nbytes for _, payload in calls)
        assert ledger["sent"]["ps_push"] == pushes * (HEADER_BYTES + 8 * tensors + nbytes) + HEADER_BYTES
        assert nbytes < numel * 4 // 3  # compressed: under a third of the fp32 delta
        # every push against the error-feedback arithmetic done by hand on the deltas this island pushed
        sent, residual = by_hand(spec, [x for x, _ in calls], ef)
        for expected, delta in zip(sent, mine):
            torch.testing.assert_close(delta, expected, rtol=0, atol=0)
        if ef:  # the residual carried: it is in the island's state, and it moved its second push
            torch.testing.assert_close(state["encoder"]["states"]["range0"]["residual"], residual, rtol=0, atol=0)
            assert residual.abs().sum() > 0
            alone, _ = by_hand(spec, [calls[1][0]], ef)  # the second delta without the first's residual
            assert not torch.equal(alone[0], mine[1])
        else:  # no error feedback: nothing carried, only the compressor's own state (random-k's generator)
            assert "residual" not in state["encoder"]["states"]["range0"] and "rng" in state["encoder"]


def test_int8_agrees_its_scale_within_one_island_127_levels_of_its_own_largest_value():
    """int8's shared scale is the island's own max |x| (a group of one): every decoded value is a multiple of
    max |x| / 127, within one level of the value sent (stochastic rounding)."""
    codec = push_codec(COMPRESSORS.build("int8"))
    assert isinstance(codec, CompressedPushes)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    got = codec.decode(codec.encode(x), x.numel())
    step = x.abs().max() / 127
    levels = got / step
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-3)
    assert float(levels.abs().max()) == pytest.approx(127, abs=1e-3)
    assert bool(((got - x).abs() <= step * 1.0001).all())


def test_the_residual_is_in_the_islands_checkpoint_and_a_resume_continues_exactly():
    """One island, topkq with error feedback: stopped mid-run, its state_dict holds the residual; a new island that
    loads it ends on the model of the run that never stopped. Without the residual it does not."""
    torch.set_num_threads(1)

    def make():
        return Island(World.single(), ParameterServer(inner_steps=2, compressor=TopKQ(ratio=0.05, bits=2)))

    whole = make()
    for i in range(9):
        whole.step(i)
    whole.strategy.finish(whole.model)

    first = make()
    for i in range(5):  # two pushes, then mid-round
        first.step(i)
    saved = copy.deepcopy(
        {"model": first.model.state_dict(), "opt": first.opt.state_dict(), "ps": first.strategy.state_dict()}
    )
    residual = saved["ps"]["ps_codec"]["encoder"]["states"]["range0"]["residual"]
    assert residual.abs().sum() > 0

    def resumed(state: dict) -> torch.Tensor:
        second = make()
        second.model.load_state_dict(saved["model"])
        second.opt.load_state_dict(saved["opt"])
        second.strategy.load_state_dict(state)
        for i in range(5, 9):
            second.step(i)
        second.strategy.finish(second.model)
        return second.strategy.global_flat

    torch.testing.assert_close(resumed(saved["ps"]), whole.strategy.global_flat, rtol=0, atol=0)
    without = {k: v for k, v in saved["ps"].items() if k != "ps_codec"}
    assert not torch.equal(resumed(without), whole.strategy.global_flat)  # the residual mattered


def test_the_spec_builds_a_compressor_for_the_pushes_and_bits_4_stays_the_4_bit_codec():
    ps = make_outer("ps:inner_steps=4,compressor=(topkq:ratio=0.05,bits=2)")
    assert isinstance(ps.codec, CompressedPushes) and isinstance(ps.codec.compressor, TopKQ)
    assert (ps.codec.compressor.ratio, ps.codec.compressor.bits) == (0.05, 2)
    four = make_outer("ps:inner_steps=4,bits=4")
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    assert type(four.codec) is Quant4 and torch.equal(four.codec.encode(x), Quant4(1024).encode(x))  # same bytes
    assert make_outer("ps:inner_steps=4").codec is None  # fp32 pushes by default


WORKS = {  # what each refusal names as working: pushes take any that stands alone, pulls only contractive ones
    "compressor": "use topkq, dct-topk, topk, randomk, qsgd, int8, int4, fp16 or bf16",
    "pulls": "use topkq, dct-topk, topk, int8, int4, fp16 or bf16",
}


@pytest.mark.parametrize(
    "key, spec, why",
    [
        ("compressor", "sign", "majority vote"),
        ("compressor", "powersgd:rank=4", "projections the islands share"),
        ("compressor", "randomk-shared:ratio=0.1", "same positions in the same round"),
        ("compressor", "torch-powersgd", "DDP gradient hook"),
        # compressed pulls (ps_pulls): unbiased rescaling could overshoot the gap and swing the copies
        ("pulls", "randomk:ratio=0.1", "rescales its values to stay unbiased"),
        ("pulls", "qsgd", "rescales its values to stay unbiased"),
        ("pulls", "sign", "majority vote"),
        ("pulls", "powersgd:rank=4", "projections the islands share"),
    ],
)
def test_compressors_that_need_the_other_islands_payloads_are_refused_naming_what_works(key, spec, why):
    with pytest.raises(ValueError, match=why) as refused:
        make_outer(f"ps:inner_steps=4,{key}=({spec})")
    assert WORKS[key] in str(refused.value)
    with pytest.raises(ValueError, match=why):  # the Python way too, error feedback around it or not
        ParameterServer(4, **{key: COMPRESSORS.build(spec)})


def test_the_cli_refuses_a_compressor_that_cannot_stand_alone_and_one_beside_bits_4(capsys):
    argv = ["train", "--workers", "2", "--islands", "2", "--outer"]
    assert islands_cli(*argv, "ps:inner_steps=4,compressor=(sign)") == 2
    err = capsys.readouterr().err
    assert "sign decides each coordinate by a majority vote" in err and "Traceback" not in err
    assert islands_cli(*argv, "ps:inner_steps=4,bits=4,compressor=(int8)") == 2
    assert "bits=4 is the built-in 4-bit quantiser and compressor= another" in capsys.readouterr().err


def test_other_refusals_robust_aggregators_rank_exact_deltas_and_a_compressor_must_be_one():
    with pytest.raises(ValueError, match="robust aggregator ranks exact deltas"):
        ParameterServer(4, compressor=TopKQ(), aggregator=CoordinateMedian())
    with pytest.raises(TypeError, match=r"islands\.compress compressor or a PayloadCodec"):
        ParameterServer(4, compressor="topkq")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="error feedback needs a contractive compressor"):
        make_outer("ps:inner_steps=4,compressor=(randomk:ef=1)")  # refused as DiLoCo refuses it, when it is built


def test_the_servers_configuration_carries_the_compressor_not_the_islands_residuals():
    """The server processes' configuration pickles the codec (ServiceConfig.save): after pushes it holds the
    compressor only, and decodes what the island's codec decodes."""
    import pickle

    codec = push_codec(COMPRESSORS.build("randomk:ratio=0.1"))  # a generator in its state once it has encoded
    assert isinstance(codec, CompressedPushes)
    x = torch.randn(500, generator=torch.Generator().manual_seed(1))
    payload = codec.encode(x)
    assert codec.state_dict()["encoder"]["rng"]["generators"]
    server = pickle.loads(pickle.dumps(codec))
    assert server.encoder is None and server.state_dict() == {}
    assert torch.equal(server.decode(payload, 500), codec.decode(payload, 500))
    assert not torch.equal(codec.encode(x), payload)  # the island's generator moved on ...
    assert torch.equal(server.encode(x), payload)  # ... and did not travel: a new encoder starts at the seed
