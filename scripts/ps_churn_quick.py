"""The parameter-server experiment's (c) churn setting alone at its quick tier (issue #36; docs/parameter-server.md,
"Elastic jobs"): DDP's run for the target loss, then every arm islands runs elastically (diloco, ps, ps-nesterov;
deadline rounds are refused under elastic membership), island 2 SIGKILLed every 3 of its rounds and restarted by
the launcher. The experiment runs all its settings at once; this runs (c) only, with the experiment's own code
(parameter_server.run_churn). A one-off measurement on gloo loopback, not a registered benchmark:

    PYTHONPATH=src:bench python scripts/ps_churn_quick.py OUT_DIR      # writes OUT_DIR/churn.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from islands_bench.experiments import parameter_server as ps
from islands_bench.harness import BenchContext


def main(out: Path) -> None:
    ctx = BenchContext(name="parameter-server", quick=True, out_dir=out)
    t = ps.tier(ctx)
    load = [os.getloadavg()]
    steps = t["ddp_steps"]
    ddp = ctx.train(
        "ddp",
        task=t["task"],
        workers=2,
        islands=1,
        steps=steps,
        global_batch=ps.BATCH,
        warmup=max(steps // 10, 1),
        eval_every=t["h"],
        log_every=t["log_every"],
        slowdown=f"floor={t['floor']}",
        **t["model"],
    )
    target = ddp["summary"]["final_val_loss"]
    rows, not_run = ps.run_churn(ctx, t, target, ps._numel(t))
    load.append(os.getloadavg())
    series = {r["run"]: r.pop("_series") for r in rows}
    equal = min(s[-1]["elapsed"] for s in series.values())  # the earliest end among the arms
    for r in rows:
        r["loss_at_equal_wall"] = ps.loss_at(series[r["run"]], equal)
        r["equal_wall_s"] = equal
        r["val"] = [(p["step"], p["elapsed"], p["val_loss"]) for p in series[r["run"]]]
    result = {"target": target, "rows": rows, "not_run": not_run, "load": load, "end": time.strftime("%H:%M:%S")}
    (out / "churn.json").write_text(json.dumps(result, indent=1))
    for r in rows:
        reached = r["time_to_target_s"]
        ttt = f"{reached:.1f} s at step {r['steps_to_target']}" if reached else "not reached"
        print(
            f"{r['run']}: time to target {ttt}; final loss {r['final_val_loss']:.4f}; loss at {equal:.1f} s "
            f"{r['loss_at_equal_wall']:.4f}; goodput {100 * r['goodput']:.1f}%; kills {r['kills']}; "
            f"refused {r['refused']}; {r['mb_per_worker']:.2f} MB/worker; {r['interconnect']}"
        )
    print(f"target (DDP's loss) {target:.4f}; not run: {not_run}; load average {load}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
