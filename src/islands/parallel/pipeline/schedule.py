"""Pipeline schedules as explicit per-stage action lists, and a timeline simulator to check them.

An action is ("F", i) or ("B", i): the forward or backward of micro-batch i on this stage.

    gpipe   every forward, then every backward (LIT-016): a stage holds all M micro-batches' activations
    1f1b    after K-1-s warm-up forwards, stage s alternates one forward and one backward, so it holds at
            most K-s micro-batches at once; same idle share as gpipe when every stage costs the same

Both run backwards in micro-batch order 0..M-1, so the messages between two stages arrive in the order
they are awaited. With uniform stage times the idle share of either schedule is (K-1)/(M+K-1)
(SOTA-017); `simulate` computes it for any per-stage times.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")

Action = tuple[str, int]


def check_schedule_args(stages: int, microbatches: int) -> None:
    for name, v in (("stages", stages), ("microbatches", microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def gpipe(stage: int, stages: int, microbatches: int) -> list[Action]:
    check_schedule_args(stages, microbatches)
    return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Action]:
    check_schedule_args(stages, microbatches)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in 0..{stages - 1}")
    warmup = min(stages - 1 - stage, microbatches)
    acts: list[Action] = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        acts += [("F", warmup + i), ("B", i)]
    return acts + [("B", i) for i in range(microbatches - warmup, microbatches)]


def schedule_for(name: str):
    if name == "gpipe":
        return gpipe
    if name == "1f1b":
        return one_f_one_b
    raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran and whose backward has not: activations held at once."""
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a K-stage pipeline over M micro-batches of uniform cost (SOTA-017)."""
    check_schedule_args(stages, microbatches)
    return (stages - 1) / (microbatches + stages - 1)


@dataclass(frozen=True)
class Timeline:
    makespan: float
    busy: list[float]  # per stage

    @property
    def bubble(self) -> float:
        """Share of stage-time spent idle: 1 - busy / (stages x makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan > 0 else 0.0


def simulate(name: str, forward: list[float], backward: list[float], microbatches: int, link: float = 0.0) -> Timeline:
    """Run a schedule on paper: stage s spends forward[s] / backward[s] per micro-batch, a message takes
    `link` seconds. A stage waits for the message its next action needs (as the real runner does)."""
    stages = len(forward)
    if len(backward) != stages:
        raise ValueError("forward and backward need one time per stage each")
    plans = [schedule_for(name)(s, stages, microbatches) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * stages, [0.0] * stages
    busy = [0.0] * stages
    while any(pos[s] < len(plans[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            if pos[s] >= len(plans[s]):
                continue
            kind, i = plans[s][pos[s]]
            if kind == "F":
                need = [("F", s - 1, i)] if s > 0 else []
            else:
                need = [("B", s + 1, i)] if s < stages - 1 else [("F", s, i)]
            if any(n not in done for n in need):
                continue
            ready = max([done[n] + (link if n[1] != s else 0.0) for n in need], default=0.0)
            cost = forward[s] if kind == "F" else backward[s]
            start = max(free[s], ready)
            free[s] = done[(kind, s, i)] = start + cost
            busy[s] += cost
            pos[s] += 1
            moved = True
        if not moved:
            raise RuntimeError(f"schedule {name!r} deadlocks: every stage waits for a message never sent")
    return Timeline(max(free), busy)
