"""The Logging callback: a run's numbers to any loggers (islands.observe.logger), as the run goes.

It logs at the points the run record keeps (every entry of the Trainer's "train" and "val" series), so what a
logger shows equals run.json: loss and learning rate, throughput, bytes per collective kind (cumulative and
per step), time blocked in the strategy's synchronisation and the compute utilisation it leaves, the rate the
collectives achieved, membership changes and checkpoint saves. Once per run: the configuration, the
interconnect and the baseline as parameters. Every rank logs its own numbers (bytes and blocked time differ
between ranks: a gossip node, a pipeline stage), each to its own logger objects.

Metric names (one namespace for every backend):
    train/loss train/lr train/tokens_per_s         at each train-series entry (log_every steps)
    val/loss val/accuracy val/<metric> val/sent_mb  at each evaluation (the global model)
    comm/sent_bytes/<kind>  comm/bytes_per_step/<kind>  comm/sent_mb   this rank's ledger (payload bytes)
    time/elapsed_s time/blocked_s time/comm_s time/utilisation         utilisation = 1 - blocked / elapsed
    link/achieved_gbit_s    bytes sent / time with a collective in flight, since the previous entry
    ckpt/saves/<level> ckpt/stall_s                                    when a save happened
    summary/<name>          the run record's summary, at the end
"""

from __future__ import annotations

from typing import Any

from islands.measure.probe import describe
from islands.observe.logger import Logger, finite, flatten


class Logging:
    reads_loss = False  # its numbers come from the series and the ledger
    order = 95  # after Evaluate (10) and the run record's probe (90): their numbers exist when this logs
    end_order = 95  # after the run record is built (90), before the progress table (99)

    def __init__(
        self, loggers: list[Logger], tokens_per_sample: int = 1, params: dict | None = None, close: bool = True
    ):
        """`loggers`: this process's logger objects. `tokens_per_sample`: what train/tokens_per_s counts
        (1: samples/s). `params`: extra run parameters to log. `close`: close the loggers at the fit's end."""
        for lg in loggers:
            if not isinstance(lg, Logger):
                raise TypeError(f"a logger needs log_params, log_metrics, log_event and close; got {type(lg).__name__}")
        self.loggers = list(loggers)
        self.tokens_per_sample, self.extra, self.close_at_end = int(tokens_per_sample), dict(params or {}), close
        self._train_seen = self._val_seen = self._events_seen = 0
        self._saves: dict = {}
        self._last: dict[str, Any] = {"step": 0, "elapsed": 0.0, "sent": {}, "busy": 0.0, "total": 0}

    # ---- what is logged ----------------------------------------------------------------------------
    def params(self, trainer) -> dict:
        world = trainer.world
        params = {
            "strategy": trainer.strategy.name,
            "world.size": world.size,
            "world.islands": world.islands,
            "world.rank": world.rank,
            "world.island": world.island,
            "world.backend": world.backend,
            "world.device": str(world.device),
        }
        record = next((cb for cb in trainer.callbacks if hasattr(cb, "interconnect") and hasattr(cb, "config")), None)
        if record is not None:  # the run record's callback: the job's config, interconnect and baseline
            params.update(flatten(record.config, "config"))
            params["task"] = record.task
            params["interconnect"] = describe(record.interconnect)
            params.update(flatten(record.interconnect, "interconnect"))
            params["baseline"] = record.baseline_text(world)
        params.update(self.extra)
        return params

    def _state_metrics(self, trainer, snap: dict | None = None) -> dict:
        snap = snap or trainer.world.ledger.snapshot()
        last = self._last
        steps = trainer.step - last["step"]  # 0 at the end: the final synchronisation is no step of its own
        out = {f"comm/sent_bytes/{k}": v for k, v in snap["sent"].items()}
        if steps > 0:
            out.update(
                {f"comm/bytes_per_step/{k}": (v - last["sent"].get(k, 0)) / steps for k, v in snap["sent"].items()}
            )
        out["comm/sent_mb"] = snap["total_sent"] / 1e6
        out["time/elapsed_s"] = trainer.elapsed
        out["time/blocked_s"] = trainer.sync_seconds
        out["time/comm_s"] = trainer.comm_seconds
        if trainer.elapsed > 0:
            out["time/utilisation"] = 1.0 - trainer.sync_seconds / trainer.elapsed
        busy = snap["busy_seconds"] - last["busy"]
        if busy > 1e-6:
            out["link/achieved_gbit_s"] = (snap["total_sent"] - last["total"]) * 8 / busy / 1e9
        dt = trainer.elapsed - last["elapsed"]
        if dt > 0 and steps > 0 and trainer.samples_per_step:
            out["train/tokens_per_s"] = (
                self.tokens_per_sample * trainer.samples_per_step * (trainer.step - last["step"]) / dt
            )
        self._last = {
            "step": trainer.step,
            "elapsed": trainer.elapsed,
            "sent": dict(snap["sent"]),
            "busy": snap["busy_seconds"],
            "total": snap["total_sent"],
        }
        return out

    def _emit(self, metrics: dict, step: int) -> None:
        metrics = finite(metrics)
        if metrics:
            for lg in self.loggers:
                lg.log_metrics(metrics, step)

    def _event(self, event: dict, step: int) -> None:
        for lg in self.loggers:
            lg.log_event(event, step)

    def _flush(self, trainer) -> None:
        train, val = trainer.series["train"], trainer.series["val"]
        for entry in train[self._train_seen :]:
            metrics = {"train/loss": entry["loss"], "train/lr": entry.get("lr")}
            if entry["step"] == trainer.step:  # the ledger and clocks are as of this entry
                metrics.update(self._state_metrics(trainer))
            self._emit(metrics, entry["step"])
        self._train_seen = len(train)
        for entry in val[self._val_seen :]:
            metrics = {
                f"val/{k[4:] if k.startswith('val_') else k}": v
                for k, v in entry.items()
                if k not in ("step", "elapsed", "mb_sent")
            }
            metrics["val/sent_mb"] = entry.get("mb_sent")
            metrics["val/elapsed_s"] = entry.get("elapsed")
            self._emit(metrics, entry["step"])
        self._val_seen = len(val)
        membership = trainer.world.membership
        if membership is not None:
            for ev in membership.events[self._events_seen :]:
                self._event({"type": "membership", **flatten({"change": ev}, "")}, trainer.step)
            self._events_seen = len(membership.events)
        driver = trainer.checkpoints
        if driver is not None and dict(driver.saves) != self._saves:
            self._saves = dict(driver.saves)
            saves = {f"ckpt/saves/{level}": n for level, n in self._saves.items()}
            self._emit({**saves, "ckpt/stall_s": driver.stall_s}, trainer.step)
            self._event(
                {
                    "type": "checkpoint",
                    "last_saved_step": driver.last_saved_step,
                    "stall_s": driver.stall_s,
                    **{f"saves.{k}": v for k, v in self._saves.items()},
                },
                trainer.step,
            )

    # ---- callback hooks ----------------------------------------------------------------------------
    def on_fit_start(self, trainer) -> None:
        # a resumed trainer's series already holds what the earlier run logged
        self._train_seen, self._val_seen = len(trainer.series["train"]), 0
        self._val_seen = sum(1 for v in trainer.series["val"] if v["step"] < trainer.step)
        membership = trainer.world.membership
        self._events_seen = 0 if membership is None else len(membership.events)
        driver = trainer.checkpoints
        self._saves = {} if driver is None else dict(driver.saves)
        snap = trainer.world.ledger.snapshot()
        self._last = {
            "step": trainer.step,
            "elapsed": trainer.elapsed,
            "sent": dict(snap["sent"]),
            "busy": snap["busy_seconds"],
            "total": snap["total_sent"],
        }
        params = self.params(trainer)
        for lg in self.loggers:
            lg.log_params(params)
        self._flush(trainer)  # an evaluation at step 0

    def on_step_end(self, trainer, loss) -> None:
        self._flush(trainer)

    def on_fit_end(self, trainer) -> None:
        self._flush(trainer)
        record = getattr(trainer, "record", None)
        # after the final synchronisation's bytes; the ledger as the run record took it (its own gather of
        # the ledgers is bookkeeping that run.json does not count)
        mine = record["comm"]["per_rank"][trainer.world.rank] if record is not None else None
        final = self._state_metrics(trainer, mine)
        if record is not None:
            final.update({f"summary/{k}": v for k, v in record["summary"].items()})
        self._emit(final, trainer.step)
        if self.close_at_end:
            self.close()

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()
