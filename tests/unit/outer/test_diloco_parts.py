"""DiLoCo from parts (issue #33 item 3): a torch.optim outer optimizer, schedule objects, the old spec keys at the edge.

The torch.optim outer step (the pseudo-gradient form: global .grad = mean delta, optimizer.step()) must give the
built-in Nesterov step's global model to fp32 rounding, and both must match the DiLoCo paper's algorithm written
out here by hand over 2 simulated islands (islands.simulate, in process)."""

from __future__ import annotations

import warnings

import pytest
import torch

H, ROUNDS, LR_IN = 3, 3, 1e-2
OUTER_LR, MOMENTUM = 0.7, 0.9


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(island: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * island + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _loss(model, island: int, step: int) -> torch.Tensor:
    x, y = _batch(island, step)
    return torch.nn.functional.mse_loss(model(x), y)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _run_islands(make_strategy) -> list[torch.Tensor]:
    """The global model after ROUNDS rounds of H inner AdamW steps on 2 simulated islands, as each island sees it."""
    from islands import simulate

    def main(world):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR_IN)
        strategy = make_strategy()
        strategy.wrap(model, opt, world)
        for step in range(ROUNDS * H):
            _loss(model, world.rank, step).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            strategy.after_step(model, opt, step)
        strategy.finish(model)
        return strategy.global_flat.clone()

    return simulate.run(main, islands=2)


def _paper() -> torch.Tensor:
    """DiLoCo (Douillard et al. 2023, Algorithm 1), by hand: each island starts every round from the global model
    and takes H AdamW steps (its Adam state kept across rounds); delta = global - local, averaged over the islands;
    Nesterov momentum outer step: buf = m buf + delta; global -= lr (delta + m buf)."""
    models = [_model(), _model()]
    opts = [torch.optim.AdamW(m.parameters(), lr=LR_IN) for m in models]
    glob = _flat(models[0])
    buf = torch.zeros_like(glob)
    for r in range(ROUNDS):
        deltas = []
        for i, (model, opt) in enumerate(zip(models, opts)):
            torch.nn.utils.vector_to_parameters(glob.clone(), model.parameters())
            for step in range(r * H, (r + 1) * H):
                _loss(model, i, step).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            deltas.append(glob - _flat(model))
        mean = (deltas[0] + deltas[1]) / 2
        buf = MOMENTUM * buf + mean
        glob = glob - OUTER_LR * (mean + MOMENTUM * buf)
    return glob


def test_torch_optim_outer_optimizer_matches_the_builtin_nesterov_and_the_paper():
    from islands.outer import DiLoCo, OuterSGD

    torch_outer = _run_islands(
        lambda: DiLoCo(
            H, outer_optimizer=lambda params: torch.optim.SGD(params, lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)
        )
    )
    builtin = _run_islands(lambda: DiLoCo(H, outer_optimizer=OuterSGD(OUTER_LR, MOMENTUM, nesterov=True)))
    paper = _paper()
    assert torch.equal(torch_outer[0], torch_outer[1]) and torch.equal(builtin[0], builtin[1])  # every island alike
    assert not torch.equal(paper, _flat(_model()))  # the rounds moved the model
    torch.testing.assert_close(torch_outer[0], builtin[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(builtin[0], paper, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch_outer[0], paper, rtol=1e-5, atol=1e-6)


def test_torch_optim_outer_optimizer_steps_fragments_and_scales_its_lr():
    """A slice steps only its fragment's parameter (the others' state untouched); lr_scale multiplies the lr for
    that step only; the state round-trips through state_dict without aliasing the live state."""
    from islands.sync.outer.outer_opt import OuterSGD, TorchOuter

    t = TorchOuter(lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9))
    ref = OuterSGD(0.5, 0.9)
    t.bind([(0, 3), (3, 5)])
    a, b = torch.arange(5.0), torch.arange(5.0)
    for lo, hi, scale in ((0, 3, 1.0), (3, 5, 2.0), (0, 3, 1.0)):
        d = torch.linspace(0.1, 0.5, hi - lo)
        t.step(a, d, lo, hi, lr_scale=scale)
        ref.step(b, d, lo, hi, lr_scale=scale)
    torch.testing.assert_close(a, b)
    assert [g["lr"] for g in t.optimizer.param_groups] == [0.5]
    saved = t.state_dict()
    t.step(a, torch.ones(3), 0, 3)
    other = TorchOuter(lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9))
    other.bind([(0, 3), (3, 5)])
    other.load_state_dict(saved)
    c = b.clone()
    other.step(c, torch.ones(3), 0, 3)
    torch.testing.assert_close(a, c)
    with pytest.raises(TypeError, match="factory"):
        TorchOuter(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))


def _lone_run(strategy, steps: int):
    from islands.runtime.world import World

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR_IN)
    strategy.wrap(model, opt, World.single())
    for step in range(steps):
        strategy.on_batch(_batch(0, step), step)
        _loss(model, 0, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        strategy.after_step(model, opt, step)
    return strategy, model, opt


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b or (a != a and b != b), (a, b)  # NaN rates of a round nobody measured


def _schedules():
    from islands.sync.outer.adaptive import Adaptive
    from islands.sync.outer.eager import Overlapped
    from islands.sync.outer.rounds import Fragments, Rounds

    return {
        "rounds": Rounds,
        "fragments": lambda: Fragments(2, tau=1, landing="replay"),
        "overlapped": lambda: Overlapped("eager", fragments=2),
        "adaptive": lambda: Adaptive("speed"),
        "adaptive-overlapped": lambda: Adaptive("deadline", deadline=5.0, overlap="delayed"),
    }


@pytest.mark.parametrize("kind", list(_schedules()))
def test_each_schedule_part_round_trips_its_state(kind):
    """Mid-round (exchanges in flight where the schedule has them), a schedule's state_dict loads into a fresh one
    and gives the same state back; the strategy's checkpoint keys are those of before the parts."""
    from islands.outer import DiLoCo, OuterSGD

    make = _schedules()[kind]
    s, _, _ = _lone_run(DiLoCo(4, outer_optimizer=OuterSGD(0.7, 0.9, nesterov=True), schedule=make()), 7)
    state = s.schedule.state_dict()
    fresh, _, _ = _lone_run(DiLoCo(4, outer_optimizer=OuterSGD(0.7, 0.9, nesterov=True), schedule=make()), 0)
    fresh.schedule.load_state_dict(state)
    _same(fresh.schedule.state_dict(), state)
    full = s.state_dict()
    assert {"outer_opt", "inflight", "sends", "exchange", "at_send", "start_at"} <= set(full)
    assert ("adapt" in full) == kind.startswith("adaptive")
    other, _, _ = _lone_run(DiLoCo(4, outer_optimizer=OuterSGD(0.7, 0.9, nesterov=True), schedule=make()), 0)
    other.load_state_dict(full)
    _same(other.state_dict(), s.state_dict())


def test_a_checkpoint_of_the_old_keyword_form_resumes_bitwise_in_the_new_form():
    """Half a run built from the old keyword options, saved; the rest in the parts form from that state: the same
    bits as the whole run in the old form (the checkpoint layout did not change)."""
    from islands.outer import DiLoCo, OuterSGD
    from islands.sync.outer.eager import Overlapped

    def whole(steps):
        return _lone_run(
            DiLoCo.from_options(
                inner_steps=3, outer="nesterov", outer_lr=0.7, momentum=0.9, overlap="eager", fragments=1
            ),
            steps,
        )

    full, _, _ = whole(10)
    half, model, opt = whole(5)
    snap = {"s": half.state_dict(), "m": model.state_dict(), "o": opt.state_dict()}
    new = DiLoCo(3, outer_optimizer=OuterSGD(0.7, 0.9, nesterov=True), schedule=Overlapped("eager"))
    resumed, m2, o2 = _lone_run(new, 0)
    m2.load_state_dict(snap["m"])
    o2.load_state_dict(snap["o"])
    resumed.load_state_dict(snap["s"])
    for step in range(5, 10):
        _loss(m2, 0, step).backward()
        o2.step()
        o2.zero_grad(set_to_none=True)
        resumed.after_step(m2, o2, step)
    assert torch.equal(resumed.global_flat, full.global_flat) and torch.equal(resumed.local.read(), full.local.read())


@pytest.mark.parametrize(
    "spec, want",
    [
        (
            "diloco:inner_steps=50,outer=nesterov,outer_lr=0.7,momentum=0.9",
            dict(schedule="Rounds", opt=("OuterSGD", 0.7, 0.9, True)),
        ),
        (
            "diloco:inner_steps=50,outer=nesterov,outer_lr=0.7,momentum=0.9,overlap=eager,lr_scale=sqrt-islands",
            dict(schedule="Overlapped", overlap="eager", sqrt=True, opt=("OuterSGD", 0.7, 0.9, True)),
        ),
        (
            "diloco:inner_steps=50,adapt=speed,overlap=delayed",
            dict(schedule="Adaptive", adapt="speed", overlap="delayed"),
        ),
        (
            "diloco:inner_steps=50,adapt=deadline,deadline=2.5",
            dict(schedule="Adaptive", adapt="deadline", deadline=2.5),
        ),
        (
            "diloco:inner_steps=8,fragments=2,tau=1,landing=replay,outer_schedule=inner",
            dict(schedule="Fragments", fragments=2, tau=1, landing="replay", follow=True),
        ),
        ("streaming-diloco:inner_steps=8,fragments=2,entropy=zstd", dict(schedule="Fragments", codec="Quant4Zstd")),
        (
            "streaming-diloco:inner_steps=8,bits=32,compressor=(topk:ratio=0.1)",
            dict(schedule="Fragments", codec=None, compressor=True),
        ),
        ("diloco:outer=primal,weight=0.3", dict(schedule="Rounds", opt=("PrimalAveraging", 2**0.5))),
    ],
)
def test_old_spec_strings_build_the_equivalent_parts(spec, want):
    from islands.sync.outer import make_outer

    s = make_outer(spec)
    sched, opt = s.schedule, s.outer.opt
    assert type(sched).__name__ == want["schedule"]
    o = sched.options()
    for key in ("overlap", "adapt", "fragments", "tau"):
        if key in want:
            assert o[key] == want[key]
    if "deadline" in want:
        assert sched.deadline == want["deadline"]
    if "landing" in want:
        assert sched.landing == want["landing"]
    assert s.outer.sqrt_islands == want.get("sqrt", False) and s.outer.follow_inner_lr == want.get("follow", False)
    if "opt" in want:
        name, lr, *rest = want["opt"]
        assert type(opt).__name__ == name and opt.lr == lr
        if rest:
            assert (opt.momentum, opt.nesterov) == tuple(rest)
    if "codec" in want:
        assert type(s.exchange.codec).__name__ == str(want["codec"]) if want["codec"] else s.exchange.codec is None
    assert (s.exchange.compressor is not None) == want.get("compressor", False)


def test_the_old_keyword_form_warns_and_builds_the_same_as_from_options():
    from islands.outer import DiLoCo, StreamingDiLoCo

    with pytest.warns(DeprecationWarning, match="from_options"):
        old = DiLoCo(inner_steps=6, outer="nesterov", outer_lr=0.7, momentum=0.9, fragments=2, tau=1)
    new = DiLoCo.from_options(inner_steps=6, outer="nesterov", outer_lr=0.7, momentum=0.9, fragments=2, tau=1)
    assert (
        old.schedule.options()
        == new.schedule.options()
        == {"fragments": 2, "tau": 1, "overlap": "none", "adapt": "none"}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the parts form and from_options do not warn
        s = StreamingDiLoCo(8)
        assert s.name == "streaming-diloco" and s.schedule.options()["fragments"] == 4
        assert type(s.exchange.codec).__name__ == "Quant4"
    with pytest.raises(TypeError, match="not both"):
        DiLoCo(4, schedule=new.schedule, outer="sgd")
    with pytest.raises(ValueError, match="sync_inner_state needs plain rounds"):
        from islands.sync.outer.rounds import Fragments

        DiLoCo(4, schedule=Fragments(2, tau=1), sync_inner_state=True)


def test_no_part_is_a_god_object():
    """Issue #33: no class over 25 attributes or 25 methods in the DiLoCo parts."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[3] / "src/islands/sync/outer"
    for name in (
        "diloco.py",
        "adaptive.py",
        "eager.py",
        "rounds.py",
        "exchange.py",
        "streaming_diloco.py",
        "outer_opt.py",
        "options.py",
    ):
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, ast.FunctionDef)]
                attrs = {
                    t.attr
                    for n in ast.walk(node)
                    if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                    for t in ast.walk(t)
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                }
                assert len(methods) <= 25 and len(attrs) <= 25, (name, node.name, len(methods), len(attrs))
