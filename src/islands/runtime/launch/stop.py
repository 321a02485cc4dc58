"""Ending a running elastic job early and cleanly: every worker stops at one requested step.

An operator, or an experiment, that wants a job to end before its configured steps writes the step to end at
under STOP_KEY in the job's store, signed with the token like every value there (`request_stop`, or
`islands stop ADDRESS --at-step N`). Each worker's Trainer looks at the key every POLL_S seconds (`StopAt`, a
callback the elastic worker installs) and lowers its step target to that step; the workers then end as they
would at their configured last step: the strategy's final synchronisation, the records, exit 0. Joiners still
waiting for admission end as they do at any end of a job.

Every worker must see the request before it reaches the step, so the step has to lie ahead of the job's
furthest worker by more than POLL_S of training plus a round (islands of one job are at most a round apart). A
worker already past it ignores the request and says so (ending there would leave its final synchronisation
without partners); a step beyond the configured end changes nothing. The learning-rate schedule keeps its
configured length (an early end stops partway along it).
"""

from __future__ import annotations

import sys
import time

STOP_KEY = "stop/at"
POLL_S = 0.5  # seconds between a worker's looks at the key: one store read (an etcd read is a few ms)


def request_stop(store, step: int) -> None:
    """Ask every worker of the job whose store (an AuthStore for a token holder: `islands.runtime.observe`) this
    is to end at `step`. A later request replaces an earlier one that no worker has acted on."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"the step to end at must be a whole number >= 1; got {step!r}")
    store.set(STOP_KEY, str(step))


def requested_stop(store) -> int | None:
    """The step a stop request names, or None when there is none (or its value is not a step)."""
    if not store.check([STOP_KEY]):
        return None
    try:
        return int(store.get(STOP_KEY))
    except ValueError:
        return None


class StopAt:
    """Trainer callback: lowers trainer.total_steps to a requested stop step (module docstring)."""

    reads_loss = False
    order = 5  # before the callbacks that act on the last step (evaluation, checkpoints) see this one

    def __init__(self, store, name: str = "", poll_s: float = POLL_S, out=None):
        self.store, self.name, self.poll_s = store, name, poll_s
        self.out = sys.stderr if out is None else out
        self._next = 0.0
        self._answered: int | None = None  # the request this worker acted on or refused (said once)

    def on_step_end(self, trainer, loss) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.poll_s
        step = requested_stop(self.store)
        if step is None or step == self._answered or step >= trainer.total_steps:
            return
        self._answered = step
        if step < trainer.step:
            print(
                f"islands: {self.name}: a stop at step {step} was requested, but this worker is at step "
                f"{trainer.step} already; it goes on to step {trainer.total_steps} (request a later step)",
                file=self.out,
                flush=True,
            )
            return
        trainer.total_steps = step
        print(f"islands: {self.name}: ending at step {step} (a stop was requested)", file=self.out, flush=True)
