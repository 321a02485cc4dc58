"""The parameter-server experiment's settings (a) equal (2 islands, 100 Mbit/s testbed link: needs root) and (b)
slow (3 islands on loopback, 2x and 4x slower) at its quick tier, chosen arms only, repeated interleaved, with the
experiment's own code (parameter_server.run_settings): a one-off check that a change to the ps arm's numerics leaves
those settings no worse (issue #36), not a registered benchmark:

    PYTHONPATH=src:bench python scripts/ps_settings_quick.py OUT_DIR --settings slow --arms diloco,ps \\
        --repeat 2 --target 0.0906 [--spec NAME=SPEC ...]                         # writes OUT_DIR/settings.json

`--task lm --ddp-steps N --h H --floor SECONDS` runs the byte LM at a size of its own instead of the quick tier's
digits MLP (ps_tier.py); `--target ddp` trains the experiment's DDP reference (2 workers, one island, N steps) first
and takes its final loss.
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


def main(out: Path, where, arms, repeat: int, target: str, extra, tier: dict) -> None:
    ctx = BenchContext(name="parameter-server", quick=True, out_dir=out)
    t = dict(ps.tier(ctx), **tier)
    target_loss = ps.ddp_target(ctx, t) if target == "ddp" else float(target)
    print(f"target {target_loss:.4f} ({t})", flush=True)
    rows: list[dict] = []
    for i in range(repeat):
        for setting in where:
            for arm in arms:
                load0 = os.getloadavg()
                got = ps.run_settings(
                    ctx, t, target_loss, ps._numel(t), only=(arm,), extra=extra, where=(setting,), tag=f"#{i}"
                )
                for r in got:
                    r.update(repeat=i, load_before=load0, load_after=os.getloadavg())
                    r["val"] = [(p["step"], p["elapsed"], p["val_loss"]) for p in r.pop("_series")]
                rows += got
    (out / "settings.json").write_text(
        json.dumps({"target": target_loss, "tier": t, "rows": rows, "end": time.strftime("%T")}, indent=1)
    )
    for r in rows:
        reached = r["time_to_target_s"]
        ttt = f"{reached:.1f} s at step {r['steps_to_target']}" if reached else "not reached"
        print(
            f"{r['setting']} {r['run']}#{r['repeat']}: time to target {ttt}; final loss {r['final_val_loss']:.4f}; "
            f"load {r['load_before'][0]:.1f}-{r['load_after'][0]:.1f}; {r['interconnect']}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--settings", default="equal,slow", help="comma-separated: equal, slow, link20, link5")
    parser.add_argument("--arms", default="diloco,ps", help="comma-separated arms (the experiment's or --spec's)")
    parser.add_argument("--spec", action="append", default=[], help="NAME=SPEC: an arm of its own (repeatable)")
    parser.add_argument("--repeat", type=int, default=1, help="run the arms interleaved this many times")
    parser.add_argument("--target", required=True, help="the target loss (DDP's: 0.0906 at quick), or ddp: train it")
    add_tier_options(parser)
    a = parser.parse_args()
    extra = tuple(tuple(x.split("=", 1)) for x in a.spec)
    main(a.out, tuple(a.settings.split(",")), tuple(a.arms.split(",")), a.repeat, a.target, extra, tier_overrides(a))
