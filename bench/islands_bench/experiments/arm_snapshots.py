"""Snapshots of a simulated arm's training state, so that an arm longer than one session survives it (issue #18:
`scale-sweep` with `--reuse`).

Every `every` steps (a multiple of the arm's round length, so no round is cut) each simulated island writes its
Trainer's state (model, optimizer, strategy with anything in flight, data position, generators, schedule,
series), its ledger's counts so far and the arm's wall seconds so far to ROOT/step<N>/island<i>.pt, atomically
(a temporary file, then a rename). A set is complete when every island's file of a step is there. An island
deletes its own files two intervals back only after writing a newer one: by then every island has written the
step between (each reached the round's exchange that lies between the two snapshots, and wrote its snapshot
before it), so a complete set exists at every moment, whenever the process is killed.

Resuming (`--reuse`, spec unchanged: ROOT/spec.json) loads the newest complete set into each island's Trainer
before its fit and continues its ledger from the stored counts, so the arm's bytes, calls, losses and
parameters are those of a run that was never interrupted (tested bit for bit in bench/tests). Without --reuse, or
with a different spec, the snapshots are deleted and the arm starts over. No collective is used: the ledger
counts only what the arm itself sends.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import torch

_STEP = re.compile(r"^step(\d+)$")


class ArmSnapshots:
    """One arm's snapshot directory: `prepare` once before the simulation, `restore` and `callback` per island."""

    def __init__(self, root: Path, every: int, islands: int, spec: dict):
        if every <= 0:
            raise ValueError(f"snapshot interval must be > 0 steps; got {every}")
        self.root, self.every, self.islands, self.spec = Path(root), int(every), int(islands), spec
        self.resume_step: int | None = None
        self.wall_before = 0.0  # the arm's wall seconds in earlier sessions (island 0's restore reads it)
        self.started = time.perf_counter()

    # ---- the main thread, before the islands start ------------------------------------------------------------
    def prepare(self, reuse: bool) -> int | None:
        """Find the newest complete set when resuming the same spec; otherwise start the directory afresh. Returns
        the step the arm resumes at, or None."""
        spec_file = self.root / "spec.json"
        same = spec_file.is_file() and json.loads(spec_file.read_text()) == self.spec
        if not (reuse and same):
            shutil.rmtree(self.root, ignore_errors=True)
            self.root.mkdir(parents=True)
            spec_file.write_text(json.dumps(self.spec, indent=1))
            self.resume_step = None
            return None
        steps = sorted((int(m.group(1)) for p in self.root.iterdir() if (m := _STEP.match(p.name))), reverse=True)
        self.resume_step = next((s for s in steps if self.complete(s)), None)
        return self.resume_step

    def complete(self, step: int) -> bool:
        return all(self._file(step, i).is_file() for i in range(self.islands))

    def wall_s(self) -> float:
        """The arm's wall seconds, earlier sessions included."""
        return self.wall_before + time.perf_counter() - self.started

    # ---- each island's thread ------------------------------------------------------------------------------------
    def restore(self, trainer, island: int) -> None:
        """Load this island's part of the resumed set (nothing when starting afresh)."""
        if self.resume_step is None:
            return
        state = torch.load(self._file(self.resume_step, island), weights_only=False)
        trainer.load_state_dict(state["trainer"])
        if island == 0:  # every island stored the same arm clock; read once, with the state it came with
            self.wall_before = float(state["wall_s"])
        ledger = trainer.world.ledger  # continues from the stored counts: the arm's traffic, as if never cut (this
        for name in ("sent", "received", "calls"):  # session's start-up check, 8 bytes, was the wrap's, not the arm's)
            counts = getattr(ledger, name)
            counts.clear()
            counts.update(state["ledger"][name])
        ledger.busy_seconds = state["ledger"]["busy_seconds"]

    def callback(self, island: int) -> _Save:
        return _Save(self, island)

    def save(self, trainer, island: int) -> None:
        step = trainer.step
        path = self._file(step, island)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(
            {"trainer": trainer.state_dict(), "ledger": trainer.world.ledger.snapshot(), "wall_s": self.wall_s()}, tmp
        )
        os.replace(tmp, path)
        for old in self.root.glob(f"step*/island{island}.pt"):  # this island's files two intervals back
            m = _STEP.match(old.parent.name)
            if m and int(m.group(1)) <= step - 2 * self.every:
                old.unlink(missing_ok=True)
                try:
                    old.parent.rmdir()  # the last island out removes the step's directory
                except OSError:
                    pass

    def _file(self, step: int, island: int) -> Path:
        return self.root / f"step{step}" / f"island{island}.pt"


class _Save:
    """A Trainer callback: this island's snapshot at every multiple of the interval before the arm's last step."""

    reads_loss = False

    def __init__(self, snapshots: ArmSnapshots, island: int):
        self.snapshots, self.island = snapshots, island

    def on_step_end(self, trainer, loss) -> None:
        if trainer.step % self.snapshots.every == 0 and trainer.step < trainer.total_steps:
            self.snapshots.save(trainer, self.island)
