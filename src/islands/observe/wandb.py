"""Weights & Biases, offline: a run per process written to local files, no network, no login.

    logger = Wandb("runs/mine", project="islands", group="mine", name="rank0")
    wandb sync runs/mine/wandb/offline-run-*           later, from a machine with an account

`dir` is what wandb.init calls dir: the run's files go to `<dir>/wandb/offline-run-<time>-<id>/`, the
history in its `run-<id>.wandb` file (wandb's own record log; `wandb sync` uploads it). `group` is the job,
so every rank's run sits in one group; `name` is the stream (rank0, or an elastic member's name).

What lands where:
    history   every metric by its name, each row with "step" (the training step); every metric is charted
              against "step" (define_metric), so rows logged out of order still plot at their step.
    config    the run's parameters.
    history   events: "event/<type>" = 1 at the event's step, and the event itself in the summary under
              "events" (the list so far).

Quiet and quick: no console capture, no system-metrics sampling, no code, git, requirements or machine
metadata, no job artifact. Each process starts wandb's service (`wandb-core`) once, about a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from islands.observe.logger import needs

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run


class Wandb:
    def __init__(
        self,
        dir: str | Path,
        project: str = "islands",
        group: str | None = None,
        name: str | None = None,
        config: dict | None = None,
        mode: str = "offline",
    ):
        try:
            import wandb  # heavy, optional: imported on first use
        except ImportError as e:
            raise needs("wandb", "W&B") from e
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # `mode` is checked by wandb itself (online, offline, disabled, ...)
        settings = wandb.Settings(
            mode=cast(Any, mode),
            console="off",
            silent=True,
            x_disable_stats=True,
            x_disable_meta=True,
            x_disable_machine_info=True,
            disable_code=True,
            save_code=False,
            disable_git=True,
            x_save_requirements=False,
            disable_job_creation=True,
        )
        self.run: Run | None = wandb.init(
            dir=str(self.dir),
            project=project,
            group=group,
            name=name,
            config=dict(config or {}),
            settings=settings,
            reinit="create_new",
        )  # its own run, beside any other in the process
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.run_dir = Path(self.run.dir).parent  # <dir>/wandb/offline-run-...: what `wandb sync` takes
        self._events: list[dict] = []

    def log_params(self, params: dict) -> None:
        if self.run is not None and params:
            self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None and metrics:
            self.run.log({**metrics, "step": int(step)})

    def log_event(self, event: dict, step: int) -> None:
        if self.run is None:
            return
        self._events.append({"step": int(step), **event})
        self.run.log({f"event/{event.get('type', 'event')}": 1, "step": int(step)})
        self.run.summary["events"] = list(self._events)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
