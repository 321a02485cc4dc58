"""Which checkpoint levels save at a step (islands.checkpoint.policy.driver): each level's fixed interval, or for the
local disk under an AutoInterval policy the step the policy chose after the previous local save.

With an auto policy the local-disk interval comes from CombinedIntervalPolicy (SOTA-054 overhead bound,
SOTA-189 Young/Daly). Ranks must agree on every save step, so each decision is fed the maximum over ranks
of the measured iteration time, stall and persist time (one small gather per checkpoint): identical inputs
give identical decisions. The first auto checkpoint waits for its persist, so the policy starts from a
measured persist time (a one-off cost).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from islands.checkpoint.policy.settings import CheckpointSettings
from islands.checkpoint.store.async_writer import SaveHandle
from islands.runtime.world import World

MAX_DECISIONS_KEPT = 100  # run.json keeps the first and last decisions, not one per checkpoint forever


class SaveSteps:
    def __init__(self, settings: CheckpointSettings, world: World, levels: Iterable):
        """`levels`: the driver's levels, fastest first (each has `name` and `every`)."""
        self.world = world
        self.every = {lv.name: lv.every for lv in levels}
        self.auto = settings.policy  # the AutoInterval settings (first, bounds), or None: fixed intervals
        self.policy = settings.policy.build(world.size) if settings.policy is not None else None
        self.next_local: int | None = None  # auto: the step of the next local-disk save
        self.decisions: list[dict] = []
        self.last_elapsed: float | None = 0.0  # the loop's training seconds at the last step (None: resumed)
        self._iter_sum, self._iter_n = 0.0, 0
        self._uptime_mark = time.perf_counter()

    def resumed(self, step: int) -> None:
        """Intervals count from the resumed step; the first iteration after it is not measured."""
        self.last_elapsed = None
        if self.policy is not None:
            assert self.auto is not None  # the policy was built from it
            self.next_local = step + self.auto.first

    def due(self, step: int) -> list[str]:
        names = []
        for name, every in self.every.items():
            if name == "local" and self.policy is not None:
                if self.next_local is None:
                    assert self.auto is not None  # the policy was built from it
                    self.next_local = self.auto.first
                hit = step >= self.next_local
            else:
                hit = step % every == 0
            if hit:
                names.append(name)
        return names

    def stepped(self, elapsed: float) -> None:
        """After each step: the loop's training seconds so far (the policy's iteration time comes from them)."""
        if self.last_elapsed is not None:
            self._iter_sum += elapsed - self.last_elapsed
            self._iter_n += 1
        self.last_elapsed = elapsed

    def waits_for_persist(self, names: list[str]) -> bool:
        """The first auto checkpoint waits for its persist: the policy starts from a measured persist time."""
        return self.policy is not None and "local" in names and not self.decisions

    def saved(self, step: int, names: list[str], handle: SaveHandle, previous: SaveHandle | None) -> None:
        """After a save started: with an auto policy and the local level among `names`, the next local step."""
        if self.policy is not None and "local" in names:
            self._decide(step, handle, previous)

    def _decide(self, step: int, handle: SaveHandle, previous: SaveHandle | None) -> None:
        policy = self.policy
        assert policy is not None  # saved() asks only under a policy
        persist = handle.persist_s if handle.done() else (previous.persist_s if previous else 0.0)
        iter_s = self._iter_sum / max(self._iter_n, 1)
        now = time.perf_counter()
        local = [iter_s, handle.stall_s, persist, now - self._uptime_mark]
        if self.world.size > 1:  # identical inputs on every rank -> identical save steps
            local = [max(col) for col in zip(*self.world.all_gather_object(local))]
        self._iter_sum, self._iter_n, self._uptime_mark = 0.0, 0, now
        iter_s, stall, persist, uptime = local
        policy.observe_iteration(max(iter_s, 1e-9))
        policy.observe_checkpoint(stall, persist)
        policy.observe_uptime(uptime)
        decision = policy.decide()
        self.next_local = step + decision.steps
        entry = {
            "step": step,
            "interval_steps": decision.steps,
            "binding": decision.binding,
            "reason": decision.reason,
            "iter_s": iter_s,
            "stall_s": stall,
            "persist_s": persist,
        }
        self.decisions.append(entry)
        if len(self.decisions) > MAX_DECISIONS_KEPT:
            del self.decisions[MAX_DECISIONS_KEPT // 2]

    def intervals(self) -> dict:
        """Each level's interval for the record: its `every`, or "policy" for the local level under a policy."""
        return {name: ("policy" if name == "local" and self.policy else every) for name, every in self.every.items()}
