"""Parameter server vs synchronous DiLoCo vs DDP on the digits MLP, islands of uneven speed on a virtual clock
(issue #36; an exploratory measurement, not yet the registered `parameter-server` experiment).

    PYTHONPATH=src python scripts/ps_virtual_clock.py [--budget 40] [--h 10] [--slow 2]

Two islands; island 0's round of H steps takes 1 virtual second, island 1's `slow` seconds. Communication costs
nothing (no link: compute only). Every arm gets the same virtual time budget T:
  DDP          one model on both islands' batches each step (gradients averaged); a step waits for the slower island
  DiLoCo       synchronous rounds (islands.outer.DiLoCo defaults): a round waits for the slower island
  ps           islands.outer.ParameterServer (delayed Nesterov 0.7/0.9, N = 2) in islands.simulate, arrivals by the
               virtual clock: island i's k-th push lands at k * t_i; each island runs floor(T / t_i) rounds
Prints the validation loss each arm reaches by T, and the virtual time each arm first reaches DDP's loss at T.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import islands
from islands.outer import DiLoCo, InProcessServer, ParameterServer, VirtualClock
from islands.sync.outer.flat import FlatView
from islands.sync.outer.ps import RULES, outer_rule
from islands.sync.outer.ps_server import ServerState
from islands.tasks.builtin import digits_task

LR = 3e-3


def val_loss(model, val) -> float:
    with torch.no_grad():
        return sum(float(F.cross_entropy(model(x), y)) for x, y in val) / len(val)


def loss_of(task, flat) -> float:
    model = copy.deepcopy(task.model)
    FlatView(model.parameters()).write(flat)
    return val_loss(model, task.val_data)


def ddp(budget: float, h: int, times: list[float]) -> list[tuple[float, float]]:
    task = digits_task()
    model, step_time = task.model, max(times) / h
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loaders = [task.train_data(i, 2) for i in range(2)]
    curve = []
    for s in range(round(budget / step_time)):
        loss = torch.stack([F.cross_entropy(model(x), y) for x, y in (ld.next() for ld in loaders)]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (s + 1) % h == 0:
            curve.append(((s + 1) * step_time, val_loss(model, task.val_data)))
    return curve


def diloco(budget: float, h: int, times: list[float]) -> list[tuple[float, float]]:
    rounds = int(budget // max(times))
    task = digits_task()
    curve: list[tuple[float, float]] = []

    def main(world):
        t = digits_task()
        model, loader = t.model, t.train_data(world.rank, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        strategy = DiLoCo(inner_steps=h)
        strategy.wrap(model, opt, world)
        for s in range(rounds * h):
            x, y = loader.next()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            strategy.after_step(model, opt, s)
            if world.rank == 0 and (s + 1) % h == 0:
                curve.append(((s + 1) // h * max(times), loss_of(task, strategy.global_flat)))
        strategy.finish(model)

    islands.simulate.run(main, islands=2)
    return curve


def ps(budget: float, h: int, times: list[float], rule) -> tuple[list[tuple[float, float]], float]:
    task = digits_task()
    pushes: list[tuple[int, torch.Tensor]] = []
    taken: list[tuple[int, float]] = []

    class Clock(VirtualClock):
        def took(self, island: int) -> None:
            taken.append((island, self.at(island)))
            super().took(island)

    class Recording(ServerState):
        def push(self, c, active=None):
            ack = super().push(c, active)
            pushes.append((c.island, self.pull()[1]))
            return ack

    server = InProcessServer()

    def main(world):
        t = digits_task()
        model, loader = t.model, t.train_data(world.rank, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        strategy = ParameterServer(inner_steps=h, rule=rule, arrivals=Clock(times), host=server)
        strategy.server_state = lambda islands: Recording(  # records each push
            strategy.global_flat, lambda: strategy.rule(islands), max_staleness=strategy.max_staleness
        )
        strategy.wrap(model, opt, world)
        for s in range(int(budget // times[world.rank]) * h):
            x, y = loader.next()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            strategy.after_step(model, opt, s)
        strategy.finish(model)

    islands.simulate.run(main, islands=2)
    assert server.loop is not None
    # the k-th push of island i landed at its k-th virtual time (its DONE comes after its pushes)
    at: dict[int, list[float]] = {}
    for island, when in taken:
        at.setdefault(island, []).append(when)
    seen = {0: 0, 1: 0}
    curve = []
    for island, flat in pushes:
        curve.append((at[island][seen[island]], loss_of(task, flat)))
        seen[island] += 1
    curve.sort(key=lambda p: p[0])
    return curve, server.loop.state.goodput()


def first_at(curve, target: float) -> float | None:
    return next((t for t, loss in curve if loss <= target), None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=float, default=40.0)
    p.add_argument("--h", type=int, default=10)
    p.add_argument("--slow", type=float, default=2.0)
    p.add_argument("--ps-outer", default="delayed-nesterov", choices=RULES)
    p.add_argument("--ps-lr", type=float, default=0.7)
    p.add_argument("--ps-momentum", type=float, default=0.9)
    a = p.parse_args()
    torch.set_num_threads(1)
    times = [1.0, a.slow]
    ref = ddp(a.budget, a.h, times)
    target = ref[-1][1]
    dl = diloco(a.budget, a.h, times)
    pc, goodput = ps(a.budget, a.h, times, outer_rule(a.ps_outer, a.ps_lr, a.ps_momentum))
    print(f"islands: round times {times} virtual s (H={a.h}), budget {a.budget} virtual s; no link (compute only)")
    print(f"ps: outer={a.ps_outer} lr={a.ps_lr} momentum={a.ps_momentum}")
    targets = {"DDP's loss at T": target, "DiLoCo's loss at T": dl[-1][1]}
    for name, curve in (("ddp", ref), ("diloco", dl), ("ps", pc)):
        times_to = "; ".join(
            f"to {what} ({value:.4f}): " + ("not reached" if (t := first_at(curve, value)) is None else f"{t:.1f} s")
            for what, value in targets.items()
        )
        print(f"{name:7s} loss at T {curve[-1][1]:.4f}; {times_to}")
    print(f"ps goodput (accepted samples / pushed): {goodput:.3f}")


if __name__ == "__main__":
    main()
