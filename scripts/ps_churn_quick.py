"""The parameter-server experiment's (c) churn setting alone at its quick tier (issue #36; docs/parameter-server.md,
"Elastic jobs"): DDP's run for the target loss, then every arm islands runs elastically (diloco, ps, ps-nesterov;
deadline rounds are refused under elastic membership), island 2 SIGKILLed every 3 of its rounds and restarted by
the launcher. The experiment runs all its settings at once; this runs (c) only, with the experiment's own code
(parameter_server.run_churn). A one-off measurement on gloo loopback, not a registered benchmark:

    PYTHONPATH=src:bench python scripts/ps_churn_quick.py OUT_DIR      # writes OUT_DIR/churn.json

Options (session 30): --arms diloco,ps (a subset), --repeat N (the arms run interleaved N times, diloco, ps,
diloco, ps, ..., so the host's load hits every arm alike; labels get #i), --target LOSS (skip DDP's run, e.g. its
known 0.0906), --every K (rounds between kills; 0: no kills, the same elastic job without churn, a control).
--spec NAME=SPEC (repeatable): an arm of one's own beside the experiment's (a NAME starting with ps runs as a ps
arm: servers=1 is added). Each row keeps its kills (kill_log) and run directory for scripts/ps_churn_timeline.py.
The tier options of ps_tier.py (--task lm --ddp-steps N --h H --floor S) run the byte LM instead of the digits MLP.
--fault freeze (session 38): SIGSTOP instead of SIGKILL, a host that vanishes without closing its connections (the
launcher finds it by its heartbeat and restarts it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ps_tier import add_tier_options, tier_overrides

from islands_bench.experiments import parameter_server as ps
from islands_bench.harness import BenchContext


def main(
    out: Path,
    arms: tuple[str, ...] | None,
    repeat: int,
    target: float | None,
    every: int,
    extra: tuple[tuple[str, str], ...] = (),
    tier: dict | None = None,
    fault: str = "kill",
) -> None:
    ctx = BenchContext(name="parameter-server", quick=True, out_dir=out)
    t = dict(ps.tier(ctx), **(tier or {}))
    load = [os.getloadavg()]
    if target is None:
        target = ps.ddp_target(ctx, t)
    rows: list[dict] = []
    not_run: dict[str, str] = {}
    for i in range(repeat):
        for arm in arms or [a for a, _ in ps.churn_arms(t["h"], 3, t["floor"]) + list(extra)]:
            tag = f"#{i}" if repeat > 1 else ""
            load0 = os.getloadavg()
            got, why = ps.run_churn(
                ctx, t, target, ps._numel(t), only=(arm,), tag=tag, every=every, extra=extra, fault=fault
            )
            not_run.update(why)
            for r in got:
                r.update(repeat=i, load_before=load0, load_after=os.getloadavg(), kill_log=r.pop("_kill_log"))
                r["run_dir"] = r.pop("_run_dir")
            rows += got
    load.append(os.getloadavg())
    series = {r["run_dir"]: r.pop("_series") for r in rows}
    equal = min(s[-1]["elapsed"] for s in series.values())  # the earliest end among the arms
    for r in rows:
        r["loss_at_equal_wall"] = ps.loss_at(series[r["run_dir"]], equal)
        r["equal_wall_s"] = equal
        r["val"] = [(p["step"], p["elapsed"], p["val_loss"]) for p in series[r["run_dir"]]]
    result = {
        "target": target,
        "every": every,
        "fault": fault,
        "rows": rows,
        "not_run": not_run,
        "load": load,
        "end": time.strftime("%H:%M:%S"),
    }
    (out / "churn.json").write_text(json.dumps(result, indent=1))
    for r in rows:
        reached = r["time_to_target_s"]
        ttt = f"{reached:.1f} s at step {r['steps_to_target']}" if reached else "not reached"
        print(
            f"{r['run']}#{r['repeat']}: time to target {ttt}; final loss {r['final_val_loss']:.4f}; loss at "
            f"{equal:.1f} s {r['loss_at_equal_wall']:.4f}; goodput {100 * r['goodput']:.1f}%; kills {r['kills']}; "
            f"refused {r['refused']}; {r['mb_per_worker']:.2f} MB/worker; load {r['load_before'][0]:.1f}-"
            f"{r['load_after'][0]:.1f}; {r['interconnect']}"
        )
    print(f"target (DDP's loss) {target:.4f}; not run: {not_run}; load average {load}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--arms", default="", help="comma-separated arms (default: every churn arm)")
    parser.add_argument("--repeat", type=int, default=1, help="run the arms interleaved this many times")
    parser.add_argument("--target", type=float, default=None, help="the target loss (default: DDP's run)")
    parser.add_argument("--every", type=int, default=ps.CHURN_EVERY, help="rounds between kills (0: none)")
    parser.add_argument("--fault", choices=ps.FAULTS, default="kill", help="kill: SIGKILL; freeze: SIGSTOP")
    parser.add_argument("--spec", action="append", default=[], help="NAME=SPEC: an arm of its own (ps... as ps)")
    add_tier_options(parser)
    a = parser.parse_args()
    extra = tuple(tuple(x.split("=", 1)) for x in a.spec)
    arms = tuple(a.arms.split(",")) if a.arms else None
    main(a.out, arms, a.repeat, a.target, a.every, extra, tier_overrides(a), a.fault)
