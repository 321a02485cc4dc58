"""chaos-torchft: chaos's seeded campaign against torchft, where its model applies (issue #20).

The same event list as `islands bench chaos` (chaos.campaign, same seed and tier) drives torchft 0.2.0 replicas
training the same task (churn_torchft_worker: digits, AdamW inner steps, torchft's DiLoCo with H = chaos.H, outer
Nesterov SGD), one replica group of one process per chaos island, coordinated by torchft's Lighthouse. This
harness plays the part our launcher plays for islands: it starts the replicas, restarts one that died or exited
non-zero (a new replica id, the same data shard; torchft heals it from a peer), and it is also the watchdog that a
torchft deployment needs for a frozen process, acting once the lighthouse's own heartbeat timeout has passed
(torchft detects the silence but nothing stops or replaces the stopped process).

Events, mapped to torchft's model:
  kill-worker       SIGKILL one replica; restarted at once
  freeze-worker     SIGSTOP one replica; after the lighthouse's heartbeat timeout it is SIGKILLed and restarted
  kill-coordinator  SIGKILL the Lighthouse (torchft's coordinator: one process by its own design); a supervisor
                    starts it again at once on the same port
  kill-etcd-member, heal-etcd-member, cut-link, heal-link, kill-launcher: not applicable (below, NOT_APPLICABLE)
A fault that needs a victim waits (up to chaos.WAIT_S) until two replicas train, as in chaos.

Measured as in chaos: events applied, hangs, lost jobs (no replica finished), events survived, stall per event
(per replica that trained across it, the gap between its committed rounds across the event minus its median gap:
torchft logs once per round, ours once per step, so its stall is measured at round granularity), whether the
finishing replicas hold one model bit for bit, and the final validation loss against a fault-free torchft run
of the same steps in the same invocation.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from islands_bench.experiments.chaos import (
    FULL,
    ISLANDS,
    QUICK,
    RESTART_S,
    SMOKE,
    TIMEOUT_S,
    WAIT_S,
    H,
    campaign,
    stall_per_event,
)
from islands_bench.experiments.churn_torchft import Lighthouse, TorchftSettings, load_torchft, read_round_log
from islands_bench.harness import BenchContext, experiment

NOT_APPLICABLE = {
    "kill-etcd-member": "torchft keeps no replicated store: the lighthouse holds the quorum state in its memory",
    "heal-etcd-member": "no etcd member was killed (see kill-etcd-member)",
    "cut-link": "the replicas run on loopback here, not on the testbed (torchft has no namespace placement of ours)",
    "heal-link": "no link was cut (see cut-link)",
    "kill-launcher": "torchft has no launcher of its own; this harness starts and restarts the replicas",
}


@dataclass
class Replica:
    name: str
    shard: int
    proc: subprocess.Popen
    started: float = field(default_factory=time.time)
    frozen_at: float | None = None


@dataclass
class Event:
    kind: str
    at: float = 0.0
    target: str = ""
    waited_s: float = 0.0
    applied: bool = False
    note: str = ""


class Job:
    """The replicas of one torchft run and the harness's launcher duties (start, restart, watchdog)."""

    def __init__(
        self,
        cfg,
        run_dir: Path,
        replicas: int,
        rounds: int,
        lighthouse: Lighthouse,
        settings: TorchftSettings,
        max_restarts: int,
    ):
        from islands.config import dump_json

        self.run_dir, self.n, self.rounds, self.lighthouse, self.settings = (
            run_dir,
            replicas,
            rounds,
            lighthouse,
            settings,
        )
        self.max_restarts, self.restarts = max_restarts, 0
        dump_json(cfg, run_dir / "config.json")
        self.live: dict[str, Replica] = {}
        self.ended: dict[str, int] = {}  # name -> exit code
        self.incarnation = [0] * replicas
        self.barrier = run_dir / "go-all"
        self.stop_at = run_dir / "stop-at"  # the round the replicas end at, once the harness writes it

    def start(self, shard: int, first: bool) -> Replica:
        n = self.incarnation[shard]
        name = f"r{shard}" if n == 0 else f"r{shard}.{n}"
        spec = {
            "config": str(self.run_dir / "config.json"),
            "lighthouse": self.lighthouse.address,
            "name": name,
            "shard": shard,
            "shards": self.n,
            "inner_steps": H,
            "rounds": self.rounds,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "log": str(self.run_dir / f"{name}.jsonl"),
            "go": None,
            "barrier": str(self.barrier) if first else None,
            "start_limit_s": 600.0,
            "timeout_s": self.settings.timeout_s,
            "quorum_timeout_s": self.settings.quorum_timeout_s,
            "heartbeat_interval_ms": self.settings.heartbeat_interval_ms,
            "stop_at": str(self.stop_at),
        }
        (self.run_dir / f"{name}.spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "islands_bench.experiments.churn_torchft_worker",
                str(self.run_dir / f"{name}.spec.json"),
            ],
            env=env,
            stdout=open(self.run_dir / "logs" / f"{name}.log", "w"),  # noqa: SIM115 - the child process writes its log after this returns
            stderr=subprocess.STDOUT,
        )
        self.live[name] = Replica(name, shard, proc)
        return self.live[name]

    def training(self) -> list[Replica]:
        """Replicas running (not stopped) that committed a round since they started."""
        out = []
        for r in self.live.values():
            if r.frozen_at is not None or r.proc.poll() is not None:
                continue
            rows = read_round_log(self.run_dir / f"{r.name}.jsonl")
            if any(row.get("committed") for row in rows):
                out.append(r)
        return out

    def finished(self) -> bool:
        return not self.live and any(code == 0 for code in self.ended.values())

    def tick(self, log) -> None:
        """The launcher's duties: reap exits (restart a failed replica), kill a frozen one past the lighthouse's
        heartbeat timeout and restart it."""
        for r in list(self.live.values()):
            if r.frozen_at is not None and time.time() - r.frozen_at > self.settings.heartbeat_timeout_ms / 1000:
                r.proc.kill()
            code = r.proc.poll()
            if code is None:
                continue
            del self.live[r.name]
            self.ended[r.name] = code
            if code != 0 and self.restarts < self.max_restarts and not self._done():
                self.restarts += 1
                self.incarnation[r.shard] += 1
                new = self.start(r.shard, first=False)
                log(f"{r.name} exited {code}; restarted as {new.name}")

    def _done(self) -> bool:
        """A replica finished: the job's rounds are committed, so a failed one is not restarted."""
        return any(code == 0 for code in self.ended.values())

    def stop(self) -> None:
        for r in self.live.values():
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    r.proc.send_signal(sig)
                except ProcessLookupError:
                    pass
            r.proc.wait(timeout=30)


def _sleep(job: Job, seconds: float, log) -> None:
    end = time.time() + seconds
    while time.time() < end:
        job.tick(log)
        time.sleep(0.05)


def _apply(ev: Event, job: Job, rng: random.Random, log) -> None:
    if ev.kind in NOT_APPLICABLE:
        ev.note = f"not applicable: {NOT_APPLICABLE[ev.kind]}"
        return
    start = time.time()
    if ev.kind in ("kill-worker", "freeze-worker"):
        while len(job.training()) < 2 and time.time() - start < WAIT_S and not job.finished():
            _sleep(job, 0.2, log)
        ev.waited_s = time.time() - start
        whole = job.training()
        if len(whole) < 2:
            ev.note = f"skipped: {len(whole)} training replica(s) after {ev.waited_s:.0f} s"
            return
        victim = rng.choice(sorted(whole, key=lambda r: r.name))
        ev.target = victim.name
        if ev.kind == "kill-worker":
            victim.proc.kill()
        else:
            victim.proc.send_signal(signal.SIGSTOP)
            victim.frozen_at = time.time()
    elif ev.kind == "kill-coordinator":
        ev.target = f"lighthouse pid {job.lighthouse.proc.pid}"
        job.lighthouse.kill()
        job.lighthouse.start()  # a supervisor restarts it on the same port
    ev.at, ev.applied = time.time(), True


def _latest_round(run_dir: Path) -> int:
    """The highest round any replica logged as committed."""
    rows = [row for p in run_dir.glob("*.jsonl") for row in read_round_log(p)]
    return max((row["step"] for row in rows if row.get("committed")), default=0)


def run_campaign(
    ctx: BenchContext,
    label: str,
    base: dict,
    kinds: list[str],
    seed: int,
    gap: tuple[float, float],
    settings: TorchftSettings,
    deadline_s: float,
    stop_round: int | None = None,
) -> dict:
    """One torchft job under `kinds` of events. A campaign ends its job END_ROUNDS rounds after its last event
    (as islands' chaos arm ends with `islands stop`); `stop_round` ends a job at that round from the start (the
    fault-free arm, at the campaign's length)."""
    run_dir = ctx.out_dir / "runs" / label
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "logs").mkdir(parents=True)
    rounds = base["steps"] // H
    lighthouse = Lighthouse(run_dir, settings).start()
    job = Job(
        ctx.config(run_dir=str(run_dir), **base),
        run_dir,
        ISLANDS,
        rounds,
        lighthouse,
        settings,
        max_restarts=len(kinds),
    )
    events = [Event(k) for k in kinds]
    rng = random.Random(seed + 1)
    t0, hung = time.time(), False
    if stop_round is not None:
        job.stop_at.write_text(str(stop_round))
    with ctx.arm(label):
        try:
            for shard in range(ISLANDS):
                job.start(shard, first=True)
            while not all((run_dir / f"r{i}.jsonl.ready").exists() for i in range(ISLANDS)):
                if time.time() - t0 > 600 or any(r.proc.poll() is not None for r in job.live.values()):
                    raise RuntimeError(f"torchft replicas did not start (see {run_dir / 'logs'})")
                time.sleep(0.05)
            job.barrier.write_text(str(time.time()))
            while len(job.training()) < ISLANDS and time.time() - t0 < 600:
                _sleep(job, 0.2, ctx.log)
            for ev in events:
                _sleep(job, rng.uniform(*gap), ctx.log)
                if job.finished():
                    ev.note = "not applied: the job had ended"
                    continue
                _apply(ev, job, rng, ctx.log)
                ctx.log(f"{label}: {ev.kind} {ev.target} {ev.note}".rstrip())
            if kinds and stop_round is None:
                stop_round = _latest_round(run_dir) + END_ROUNDS
                job.stop_at.write_text(str(stop_round))
                ctx.log(f"{label}: the campaign is over; the replicas end at round {stop_round}")
            while job.live:
                if time.time() - t0 > deadline_s:
                    hung = True
                    break
                _sleep(job, 0.5, ctx.log)
        finally:
            job.stop()
            lighthouse.kill()
    logs = {p.name[: -len(".jsonl")]: read_round_log(p) for p in run_dir.glob("*.jsonl")}
    finals = {n: rows[-1] for n, rows in logs.items() if rows and rows[-1].get("final")}
    progress = {
        n: sorted(r["t"] for r in rows if not r.get("final") and r.get("committed")) for n, rows in logs.items()
    }
    return {
        "events": events,
        "hung": hung,
        "finals": finals,
        "progress": progress,
        "wall_s": time.time() - t0,
        "restarts": job.restarts,
        "lighthouse_starts": lighthouse.starts,
        "rounds": rounds,
        "stop_round": stop_round,
    }


def _rate(run: dict) -> float:
    """Inner steps per second of the fastest replica (rounds x H over its committed span)."""
    best = 0.0
    for times in run["progress"].values():
        if len(times) >= 2:
            best = max(best, (len(times) - 1) * H / max(times[-1] - times[0], 1e-3))
    return best


END_ROUNDS = 40  # rounds the replicas train after the last event: every stall is over, the survivors meet again


@experiment(
    "chaos-torchft",
    practices=("SOTA-932",),
    help="chaos's seeded campaign against torchft 0.2.0 (kill/freeze replicas, kill its lighthouse), "
    "its own launcher and watchdog played by the harness",
)
def chaos_torchft(ctx: BenchContext) -> dict:
    version, why = load_torchft(ctx.log)
    if version is None:
        raise RuntimeError(f"torchft is not available here: {why}")
    tier = SMOKE if ctx.smoke else QUICK if ctx.quick else FULL
    seed = 0
    kinds = campaign(tier["events"], seed)
    settings = TorchftSettings(timeout_s=TIMEOUT_S, quorum_timeout_s=TIMEOUT_S)  # our job's collective timeout
    ctx.plan(2 if ctx.smoke else 3)
    base = dict(
        task="digits",
        workers=ISLANDS,
        islands=ISLANDS,
        outer=f"diloco:inner_steps={H}",
        steps=400,
        global_batch=8 * ISLANDS,
        eval_every=0,
        probe=False,
        timeout=TIMEOUT_S,
    )
    probe = run_campaign(ctx, "probe", base, [], seed, (0.0, 0.0), settings, deadline_s=600)
    if not probe["finals"] or probe["hung"]:
        raise RuntimeError(f"the torchft probe run did not finish (see {ctx.out_dir / 'runs' / 'probe'})")
    applies = [k for k in kinds if k not in NOT_APPLICABLE]
    # The replicas train between events, not through torchft's stalls (one heartbeat or Manager timeout per
    # event): size the job by the training time the gaps leave, x2 margin. Sizing it by the whole campaign's
    # wall time at the probe's quiet rate (session 18's full run) left 17k rounds after the last event.
    train_s = len(applies) * sum(tier["gap"]) / 2
    base["steps"] = int(max(400, 2 * _rate(probe) * train_s) // H * H)
    deadline = max(900, 2 * len(applies) * (sum(tier["gap"]) / 2 + TIMEOUT_S + RESTART_S))
    run = run_campaign(ctx, "chaos", base, kinds, seed, tier["gap"], settings, deadline)
    # smoke: the probe, a fault-free run of the same job, stands in for the fault-free reference
    calm = (
        probe
        if ctx.smoke
        else run_campaign(
            ctx, "fault-free", base, [], seed, (0.0, 0.0), settings, deadline, stop_round=run["stop_round"]
        )
    )
    applied = [e for e in run["events"] if e.applied]
    stalls = stall_per_event(run["progress"], [e.at for e in applied])
    lost = not run["finals"]
    survived = len(applied) if not lost and not run["hung"] else 0
    digests = {n: f.get("sha256") for n, f in run["finals"].items()}
    rows = [
        {
            "kind": e.kind,
            "target": e.target,
            "t_s": round(e.at - applied[0].at, 1),
            "waited_s": round(e.waited_s, 1),
            "stall_s": None if s is None else round(s, 2),
        }
        for e, s in zip(applied, stalls)
    ]
    rows += [
        {"kind": e.kind, "target": "-", "t_s": None, "waited_s": round(e.waited_s, 1), "stall_s": None, "note": e.note}
        for e in run["events"]
        if not e.applied
    ]
    by_kind: dict[str, list[float]] = {}
    for e, s in zip(applied, stalls):
        if s is not None:
            by_kind.setdefault(e.kind, []).append(s)
    measured = [s for s in stalls if s is not None]
    loss = statistics.mean(f["val_loss"] for f in run["finals"].values()) if run["finals"] else float("nan")
    calm_loss = statistics.mean(f["val_loss"] for f in calm["finals"].values()) if calm["finals"] else float("nan")
    where = (
        f"loopback on one 2-core machine; {ISLANDS} torchft {version} replicas of one process each "
        f"(ProcessGroupGloo), its Lighthouse in a process of its own; {settings.describe()}"
    )
    headline = [
        f"{'quick tier: ' if ctx.quick else ''}torchft {version}: {len(applied)} of {len(kinds)} events applied "
        f"({', '.join(f'{k} {sum(1 for e in applied if e.kind == k)}' for k in dict.fromkeys(applies))}; "
        f"{len(kinds) - len(applies)} not applicable to its model), {run['rounds'] * H} steps: hangs "
        f"{int(run['hung'])}, "
        f"lost jobs {int(lost)}, events survived {survived} of {len(applied)}, replica restarts by the harness "
        f"{run['restarts']}, lighthouse starts {run['lighthouse_starts']}",
        f"stall per event (max over replicas training across it, round granularity): median "
        f"{statistics.median(measured) if measured else float('nan'):.2f} s, max "
        f"{max(measured) if measured else float('nan'):.2f} s; "
        + "; ".join(f"{k} max {max(v):.2f} s" for k, v in by_kind.items()),
        f"replicas finishing: {len(digests)}, models bitwise equal: "
        f"{len(set(digests.values())) == 1 and None not in digests.values()}",
        f"final val loss (mean over finishing replicas) {loss:.4f} vs {calm_loss:.4f} fault-free",
        f"where: {where}",
    ]
    return {
        "rows": rows,
        "headline": headline,
        "interconnect": [where],
        "baseline": [
            "the same torchft job without faults, same invocation; islands' own campaign: `islands bench chaos`"
        ],
        "hangs": int(run["hung"]),
        "lost_jobs": int(lost),
        "events_applied": len(applied),
        "digests": digests,
        "restarts": run["restarts"],
    }
