"""What happens around the steps, as callbacks: evaluation, the progress bar, checkpoints, the kept model, run.json.

A callback is any object with some of these methods; the Trainer calls those it has, in `order`
(lower first; a callback without `order` counts as 50; on_fit_end follows `end_order` where one is given):
    on_fit_start(trainer)            before the first step of this fit
    on_step_end(trainer, loss)       after each step (trainer.step counts the steps done); `loss` is the step's
                                     loss as a float, or None for a callback whose `reads_loss` is False (reading
                                     it waits for the device; trainer.loss reads it on demand)
    on_fit_end(trainer)              after the last step and the strategy's final synchronisation
    state_dict() / load_state_dict()  kept in checkpoints under "callbacks" when present
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

# rich at import time, not when a bar first draws: importing it draws from Python's global RNG (rich.style's
# id counter), which must not happen after a resume has restored that RNG
from rich.console import Console

from islands.checkpoint.policy.driver import CheckpointDriver
from islands.checkpoint.store.model_dir import MODEL_DIR, ModelWriter, SafetensorsWriter, write_model_dir
from islands.measure.probe import describe, probe_interconnect
from islands.measure.progress import TrainProgress, print_finished
from islands.measure.record import BASELINE_PER_WORKER, finish_record, versions
from islands.runtime.comm import crosses_islands
from islands.testbed import Testbed


@runtime_checkable
class Callback(Protocol):
    def on_step_end(self, trainer, loss: float) -> None: ...


class Evaluate:
    """Validation of `strategy.eval_model(model)` every `every` steps (0: only at the end), at step 0 when
    `every` > 0 (where the curve starts), and after the final synchronisation. Results go to
    trainer.series["val"]."""

    reads_loss = False
    order = 10

    def __init__(self, every: int = 0, max_batches: int | None = None):
        if every < 0:
            raise ValueError(f"Evaluate(every=...) must be >= 0 steps (0 = only at the end); got {every}")
        self.every, self.max_batches = int(every), max_batches

    def run(self, trainer) -> dict:
        metrics = trainer.evaluate(self.max_batches)
        trainer.series["val"].append(
            {
                "step": trainer.step,
                "elapsed": trainer.elapsed,
                "mb_sent": trainer.world.ledger.total_sent / 1e6,
                **metrics,
            }
        )
        trainer.log(
            f"step {trainer.step:>5}  val loss {metrics['val_loss']:.4f}"
            + (f"  acc {100 * metrics['val_accuracy']:.1f}%" if metrics.get("val_accuracy") is not None else "")
            + f"  sent {trainer.world.ledger.total_sent / 1e6:.2f} MB"
        )
        return metrics

    def on_fit_start(self, trainer) -> None:
        if trainer.val_data is not None and trainer.step == 0 and self.every:
            self.run(trainer)

    def on_step_end(self, trainer, loss) -> None:
        if (
            trainer.val_data is not None
            and self.every
            and trainer.step % self.every == 0
            and trainer.step != trainer.total_steps
        ):  # the last one comes after the final sync
            self.run(trainer)

    def on_fit_end(self, trainer) -> None:
        if trainer.val_data is not None:
            last = trainer.series["val"][-1]["step"] if trainer.series["val"] else None
            if last != trainer.step:  # not already evaluated at this step (a fit resumed at its end)
                self.run(trainer)


class Checkpointing:
    """Saves through a CheckpointDriver (levels, intervals, asynchronous persist; islands.checkpoint.policy.driver)
    after each step; the final checkpoint after the strategy's final synchronisation, durable before the
    run record is written."""

    reads_loss = False
    order = 20
    record_key = "checkpoint"

    def __init__(self, driver: CheckpointDriver):
        self.driver = driver

    def record(self) -> dict:
        return self.driver.record()

    def on_step_end(self, trainer, loss) -> None:
        if trainer.step != trainer.total_steps:  # the last step is saved after the final synchronisation
            self.driver.after_step(trainer)

    def on_fit_end(self, trainer) -> None:
        self.driver.finish(trainer)


class SaveModel:
    """At the end of the fit, rank 0 writes the global model to RUN_DIR/model (islands.checkpoint.store.model_dir):
    `strategy.eval_model(model)` after the strategy's final synchronisation, what the final evaluation scored (under
    DiLoCo and the other outer strategies the outer model; under fsdp the gathered full model; under gossip island
    0's own). Every rank asks for it, since under fsdp and the pipeline gathering it is a collective; only rank 0
    writes (in an elastic job the rank 0 of the last epoch, island 0's leader), so a job keeps exactly one model.
    `writer`: how (default SafetensorsWriter: model.safetensors; a transformers task passes its own). A fit that
    raises never reaches on_fit_end, and the write itself is atomic: no half-written model directory."""

    reads_loss = False
    order = 30  # after the final evaluation and checkpoint, before the run record (which records where it went)
    record_key = "model"

    def __init__(self, run_dir: str | Path, writer: ModelWriter | None = None):
        self.dir = Path(run_dir) / MODEL_DIR
        self.writer = writer if writer is not None else SafetensorsWriter()
        self.saved: dict | None = None

    def on_fit_end(self, trainer) -> None:
        model = trainer.eval_model  # collective under fsdp and the pipeline: every rank takes part
        if trainer.world.rank != 0:
            return
        t = time.perf_counter()
        info = {"step": trainer.step, "strategy": trainer.strategy.name, "class": type(model).__name__}
        files = write_model_dir(self.dir, self.writer, model, info)
        self.saved = {
            "dir": str(self.dir),
            **info,
            "format": self.writer.format,
            "files": files,
            "bytes": sum((self.dir / f).stat().st_size for f in files),
            "seconds": time.perf_counter() - t,
            "definition": "strategy.eval_model(model) after the final synchronisation (the global model)",
        }

    def record(self) -> dict | None:
        return self.saved


class Progress:
    """Rank 0's live bar (on a terminal, when `bar`), its log lines, and at the end the summary table and where the
    run's files are (run.json, the plot, the model, the logs) (islands.measure.progress). `bar=False` (`islands train
    --no-progress`) drops only the bar: a job under nohup or in CI still says how it went and where its record is.
    `enabled=False` prints nothing at all."""

    reads_loss = False
    order, end_order = 1, 99  # the bar exists before anything logs; the table needs the record

    def __init__(self, enabled: bool = True, tokens_per_sample: int = 1, bar: bool = True):
        self.enabled, self.tokens_per_sample, self.show_bar = enabled, tokens_per_sample, bar
        self.bar: TrainProgress | None = None  # made at the start of each fit

    def on_fit_start(self, trainer) -> None:
        self.bar = TrainProgress(
            trainer.total_steps, enabled=self.enabled and trainer.world.rank == 0, start=trainer.step, bar=self.show_bar
        )
        trainer.log = self.bar.log

    def on_step_end(self, trainer, loss) -> None:
        assert self.bar is not None  # on_fit_start came first
        if not self.bar.live:
            return
        # the latest logged mean: a fresh float each step would make a GPU wait for every step
        train = trainer.series["train"]
        loss = train[-1]["loss"] if train else trainer.loss
        tps = self.tokens_per_sample * trainer.samples_per_step * trainer.step / max(trainer.elapsed, 1e-9)
        self.bar.update(trainer.step, loss, tps, trainer.world.ledger.total_sent / 1e6)

    def on_fit_end(self, trainer) -> None:
        assert self.bar is not None  # on_fit_start came first
        self.bar.close()
        record = getattr(trainer, "record", None)
        if self.enabled and trainer.world.rank == 0 and record is not None:
            print_finished(record, Console())
            sys.stdout.flush()


class RunRecord:
    """The run record: every number with the interconnect it was measured on and the baseline it is relative to.

    At the start it probes the interconnect (when distributed and `probe`); at the end it gathers every rank's
    ledger and writes run.json and (with `plot`) loss.png to `run_dir` on rank 0 (islands.measure.record).
    `config`: what to record as the job's configuration (a plain dict); `task`, `data_source`, `tokens_per_sample`:
    labels and the tokens/s definition; `testbed`: a testbed whose shaped links the run used (its record is kept);
    `plot`: False where the process that launched this one draws loss.png (islands' launchers do)."""

    reads_loss = False
    order = 90

    def __init__(
        self,
        run_dir: str | Path | None = None,
        config: dict | None = None,
        probe: bool = True,
        task: str = "task",
        data_source: str = "",
        tokens_per_sample: int = 1,
        testbed: str = "",
        threads: int = 1,
        plot: bool = True,
    ):
        self.run_dir = Path(run_dir) if run_dir else None
        self.plot = plot
        self.config, self.probe, self.task, self.data_source = config or {}, probe, task, data_source
        self.tokens_per_sample, self.testbed, self.threads = tokens_per_sample, testbed, threads
        self.interconnect: dict = {"measured": False}

    def on_fit_start(self, trainer) -> None:
        world = trainer.world
        if self.probe and world.distributed and world.comms is None:
            self.interconnect = probe_interconnect(world)
        elif world.distributed:  # several processes, but the link was not measured: say so, not "none"
            self.interconnect = {"measured": False, "reason": f"{world.backend}, link not probed"}
        if self.testbed:
            self.interconnect["testbed"] = Testbed.load(self.testbed).record()
        trainer.log(
            f"[bold]islands[/] {trainer.strategy.name} · {world.size} workers / {world.islands} island(s) · "
            f"data: {self.data_source or self.task} · interconnect: {describe(self.interconnect)}"
        )

    def on_step_end(self, trainer, loss) -> None:
        pass

    def on_fit_end(self, trainer) -> None:
        trainer.record = self.build(trainer)
        if trainer.world.rank == 0 and self.run_dir is not None:
            finish_record(self.run_dir, trainer.record, plot=self.plot)

    def baseline_text(self, world) -> str:
        """What every per-worker figure of this run is relative to."""
        return BASELINE_PER_WORKER.format(threads=self.threads, device=world.device.type)

    def build(self, trainer) -> dict:
        world = trainer.world
        ledgers = [world.ledger.snapshot()]
        if world.distributed:
            ledgers = world.all_gather_object(world.ledger.snapshot())  # bookkeeping, not training traffic
        final = trainer.series["val"][-1] if trainer.series["val"] else {"val_loss": None, "val_accuracy": None}
        total_sent = sum(led["total_sent"] for led in ledgers)
        steps_run = max(trainer.steps_this_fit, 1)
        tokens_per_step = self.tokens_per_sample * trainer.samples_per_step
        baseline = self.baseline_text(world)
        summary = {
            "task": self.task,
            "strategy": trainer.strategy.name,
            "workers": world.size,
            "islands": world.islands,
            "steps": trainer.step,
            "wall_seconds": trainer.elapsed,
            "seconds_per_step": trainer.elapsed / steps_run,
            "median_seconds_per_step": trainer.median_step_seconds(),
            "tokens_per_second": tokens_per_step * trainer.step / max(trainer.elapsed, 1e-9),
            "final_val_loss": final["val_loss"],
            "final_val_accuracy": final.get("val_accuracy"),
            "final_train_loss": trainer.series["train"][-1]["loss"] if trainer.series["train"] else None,
            "mb_sent_per_worker": total_sent / world.size / 1e6,
            # the baseline of every communication saving: plain DDP all-reduces every gradient every step
            # (payload definition of islands.runtime.comm: one fp32 gradient per step per worker)
            "ddp_mb_per_worker": trainer.gradient_bytes() * trainer.step / 1e6 if world.size > 1 else 0.0,
            # what crossed between islands: the outer strategy's traffic, a parameter server's pushes included
            "cross_island_mb_per_worker": sum(
                v for led in ledgers for k, v in led["sent"].items() if crosses_islands(k)
            )
            / world.size
            / 1e6,
            "bytes_sent_per_worker_per_step": total_sent / world.size / steps_run,
            "compute_seconds": trainer.compute_seconds,
            "comm_seconds": trainer.comm_seconds,
            "comm_fraction": trainer.comm_seconds / max(trainer.compute_seconds + trainer.comm_seconds, 1e-9),
            "sync_blocked_seconds": trainer.sync_seconds,
            "baseline": baseline,
        }
        record = {
            "versions": versions(),
            "config": self.config,
            "world": {
                "size": world.size,
                "islands": world.islands,
                "workers_per_island": world.workers_per_island,
                "backend": world.backend,
                "local_backend": world.local_backend or world.backend,  # nccl over a gloo world: islands share GPUs
                "device": str(world.device),
                "threads_per_worker": self.threads,
            },
            "interconnect": self.interconnect,
            "interconnect_line": describe(self.interconnect),
            "baseline": {"definition": baseline, "unit": "worker"},
            "comm": {
                "per_rank": ledgers,
                "definition": "payload bytes handed to collectives (see islands.runtime.comm)",
            },
            "series": trainer.series,
            "summary": summary,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(trainer.started)),
        }
        if self.run_dir is not None:
            record["run_dir"] = str(self.run_dir)
        record.update(trainer.record_parts())
        summary["compile_seconds"] = record["compile"]["seconds"] if "compile" in record else None
        summary["compile_graphs"] = record["compile"]["graphs"] if "compile" in record else None
        return record
