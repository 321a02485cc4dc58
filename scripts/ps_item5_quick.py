"""Item 5 of the parameter-server experiment alone, at its quick tier (issue #36; docs/outer-strategies.md, Q-6): the
utilisation setting (byte LM, 2 islands of one worker, 60 steps at H=20) run to fp32 DiLoCo's loopback loss, every
target arm on loopback and on 20 and 5 Mbit/s testbed links, with the experiment's own code
(parameter_server.run_targets). A one-off measurement, not a registered benchmark:

    PYTHONPATH=src:bench python scripts/ps_item5_quick.py OUT_DIR [--arms diloco,ps-int8]   # writes OUT_DIR/item5.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from islands_bench.experiments import parameter_server as ps
from islands_bench.harness import BenchContext


def main(out: Path, only: tuple[str, ...] | None) -> None:
    ctx = BenchContext(name="parameter-server", quick=True, out_dir=out)
    load = [os.getloadavg()]
    rows, target = ps.run_targets(ctx, only)
    load.append(os.getloadavg())
    lines = [ps.item5_text(rows, link, goal, target) for link, goal in ps.GOALS.items()]
    result = {"target": target, "rows": rows, "lines": lines, "load": load, "end": time.strftime("%H:%M:%S")}
    (out / "item5.json").write_text(json.dumps(result, indent=1, default=str))
    for r in rows:
        reached = r["time_to_target_s"]
        ttt = f"{reached:.1f} s at step {r['steps_to_target']}" if reached else "not reached"
        print(
            f"{r['run']}@{r['link']}: {ttt}; final {r['final_val_loss']:.4f}; "
            f"x{r['vs_diloco_loopback'] or float('nan'):.2f} fp32 DiLoCo's loopback; {r['mb_per_worker']:.2f} MB/worker"
        )
    print("\n".join(lines))
    print(f"target {target:.4f}; load average {load}")


if __name__ == "__main__":
    arms = tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 and sys.argv[2] == "--arms" else None
    main(Path(sys.argv[1]), arms)
