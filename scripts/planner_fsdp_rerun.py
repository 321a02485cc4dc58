"""planner-accuracy's full tier, its FSDP rows only (every setting as the tier runs it): how the 6 FSDP rows of
results/planner-accuracy/full-fsdp were measured after FSDP's reduce-scatter was timed as gloo runs it (docs/plan.md,
"The full tier"). A one-off measurement on tc-shaped testbed links (needs root), not a registered benchmark:

    PYTHONPATH=src:bench python scripts/planner_fsdp_rerun.py OUT_DIR      # writes OUT_DIR/fsdp_rows.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from islands_bench.experiments import planner_accuracy as pa
from islands_bench.harness import BenchContext


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ctx = BenchContext(name="planner-accuracy", quick=False, out_dir=out)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ[pa.CACHE_ENV] = cache  # this invocation's own profiles, as the experiment keeps them
        for model in ("lm", "llama"):
            for rate in pa.RATES:
                rows += pa._setting(ctx, model, rate, ("fsdp",), None, memory=False)
    (out / "fsdp_rows.json").write_text(json.dumps({"rows": rows, "end": time.strftime("%H:%M:%S")}, indent=1))
    for r in rows:
        print(
            f"{r['model']} {r['link']}: predicted {r['pred_step_ms']:.2f} ms, measured {r['meas_step_ms']:.2f} ms "
            f"({100 * r['step_err']:.1f}%); bytes exact {r['pred_bytes'] == r['meas_bytes']}; {r['interconnect']}"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
