"""M equal-speed islands of one worker on gloo loopback, no faults, the parameter-server experiment's quick tier
otherwise (digits MLP, 400 steps per island at H=20, global batch 48, steps padded to 30 ms, evaluated every round
on rank 0): does the server's default step (lr 1/sqrt(M) per push) hold with more equal islands, whose pushes are
M - 1 versions stale (docs/parameter-server.md, "Where the time goes under churn"; scripts/ps_delay_stability.py)?
A one-off check, not a registered benchmark; arms run interleaved:

    PYTHONPATH=src:bench python scripts/ps_equal_quick.py OUT_DIR --islands 4 --repeat 2 --target 0.0906 \\
        [--spec NAME=SPEC ...]                                                      # writes OUT_DIR/equal.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from islands_bench.experiments import parameter_server as ps
from islands_bench.harness import BenchContext


def main(out: Path, islands: int, repeat: int, target: float, arms: list[tuple[str, str]]) -> None:
    ctx = BenchContext(name="parameter-server", quick=True, out_dir=out)
    t = ps.tier(ctx)
    h, steps = t["h"], ps.LONGER * t["ddp_steps"]
    rows = []
    for i in range(repeat):
        for arm, spec in arms:
            load0 = os.getloadavg()
            rec = ctx.train(
                f"{arm}@equal{islands}#{i}",
                task=t["task"],
                workers=islands,
                islands=islands,
                outer=spec,
                steps=steps,
                global_batch=ps.BATCH,
                warmup=max(steps // 10, 1),
                eval_every=h,
                log_every=t["log_every"],
                slowdown=f"floor={t['floor']}",
            )
            val = rec["series"]["val"]
            rows.append(
                {
                    "run": arm,
                    "spec": spec,
                    "repeat": i,
                    "islands": islands,
                    "time_to_target_s": ps.time_to(val, target),
                    "steps_to_target": ps.steps_to(val, target),
                    "final_val_loss": rec["summary"]["final_val_loss"],
                    "load_before": load0,
                    "load_after": os.getloadavg(),
                    "interconnect": rec["interconnect_line"],
                    "val": [(p["step"], p["elapsed"], p["val_loss"]) for p in val],
                }
            )
    (out / "equal.json").write_text(json.dumps({"target": target, "rows": rows, "end": time.strftime("%T")}, indent=1))
    for r in rows:
        reached = r["time_to_target_s"]
        ttt = f"{reached:.1f} s at step {r['steps_to_target']}" if reached else "not reached"
        print(
            f"{r['islands']} islands {r['run']}#{r['repeat']}: time to target {ttt}; final loss "
            f"{r['final_val_loss']:.4f}; load {r['load_before'][0]:.1f}-{r['load_after'][0]:.1f}; {r['interconnect']}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--islands", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1, help="run the arms interleaved this many times")
    parser.add_argument("--target", type=float, required=True, help="the target loss (DDP's, 0.0906 at quick)")
    parser.add_argument("--spec", action="append", default=[], help="NAME=SPEC: an arm beside diloco and ps")
    a = parser.parse_args()
    h = 20  # the quick tier's H
    arms = [("diloco", f"diloco:inner_steps={h}"), ("ps", f"ps:inner_steps={h},max_staleness={ps.STALENESS}")]
    arms += [tuple(x.split("=", 1)) for x in a.spec]
    main(a.out, a.islands, a.repeat, a.target, arms)
