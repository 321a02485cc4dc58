"""The fit loop reads a step's loss on the host only where someone reads it: a log entry, or a callback that
does not say `reads_loss = False`. On a GPU each read waits for the device, so a read per step would keep the
CPU from queueing the next step's kernels (gpu-throughput measures what it costs)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import islands
from islands.loop.callbacks import Checkpointing, Evaluate, Progress, RunRecord


class CountedLoss(torch.Tensor):
    """A loss tensor that counts how often it is turned into a host float (every tensor made from it is one too)."""

    reads = 0

    def __float__(self):
        CountedLoss.reads += 1
        return super().__float__()


class CountedStep(islands.memory.ForwardBackward):
    def __call__(self, model, batch, loss_fn, explain=False):
        return super().__call__(model, batch, loss_fn, explain).as_subclass(CountedLoss)


def _data(n=12):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _trainer(callbacks, step_fn=None, log_every=5):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    return islands.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        F.cross_entropy,
        _data(),
        val_data=_data(2),
        callbacks=callbacks,
        log_every=log_every,
        step_fn=step_fn or CountedStep(),
    )


class Quiet:
    reads_loss = False

    def __init__(self):
        self.seen = []

    def on_step_end(self, trainer, loss):
        self.seen.append(loss)


class Reads:
    def __init__(self):
        self.seen = []

    def on_step_end(self, trainer, loss):
        self.seen.append(loss)


def test_the_loop_reads_the_loss_only_at_log_entries_when_no_callback_asks():
    quiet = Quiet()
    trainer = _trainer([quiet, Evaluate(every=5), Progress(enabled=False), RunRecord(probe=False)])
    CountedLoss.reads = 0
    trainer.fit(10)
    assert CountedLoss.reads == 2  # steps 5 and 10: one read per log entry
    assert quiet.seen == [None] * 10
    assert [e["step"] for e in trainer.series["train"]] == [5, 10]


def test_a_callback_that_reads_the_loss_gets_each_steps_float():
    reads, quiet = Reads(), Quiet()
    trainer = _trainer([reads, quiet])
    CountedLoss.reads = 0
    trainer.fit(10)
    assert all(type(v) is float for v in reads.seen) and len(reads.seen) == 10
    assert CountedLoss.reads == 10 + 2  # one per step for the callback (cached after), one per log entry
    assert trainer.loss == reads.seen[-1]  # the cache: read once, the same value after
    assert quiet.seen == [None] * 10


def test_the_series_means_equal_the_host_floats_of_each_step():
    reads = Reads()
    trainer = _trainer([reads], step_fn=islands.memory.ForwardBackward(), log_every=4)
    trainer.fit(10)
    # Python's own mean of the per-step floats, in step order: the loop's device-side float64 sum gives the same
    expected = [sum(reads.seen[0:4]) / 4, sum(reads.seen[4:8]) / 4, sum(reads.seen[8:10]) / 2]
    assert [e["loss"] for e in trainer.series["train"]] == expected


def test_train_step_returns_the_steps_loss_as_a_float():
    trainer = _trainer([])
    trainer.total_steps = 3
    first = trainer.train_step()
    assert type(first) is float and first == trainer.loss
    assert trainer.step == 1


def test_the_builtin_callbacks_do_not_ask_for_the_loss():
    from islands.observe.callback import Logging
    from islands.runtime.launch.stop import StopAt

    for cls in (Evaluate, Checkpointing, Progress, RunRecord, Logging, StopAt):
        assert cls.reads_loss is False, cls.__name__


def test_a_subclass_that_overrides_train_step_still_has_it_called_by_fit():
    class Counting(islands.Trainer):
        calls = 0

        def train_step(self):
            Counting.calls += 1
            return super().train_step()

    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    trainer = Counting(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, _data(), log_every=5)
    reads = Reads()
    trainer.add_callback(reads)
    trainer.fit(10)
    assert Counting.calls == 10 and len(trainer.series["train"]) == 2
    assert reads.seen[-1] == trainer.loss and type(reads.seen[-1]) is float
