"""Import, once, the modules the test suite's processes import, so that their .pyc files exist before it starts.

`make`'s setup runs this beside the codec's numba warm-up (the other core). A fresh clone's `make test` took 790 s of
tests where the same clone's second run took 699 s (session 35, results/test-suite/s35): the first run's processes
compiled every module they imported, several at once (three xdist workers collecting, then every rank and launcher
of the first jobs). One process compiling them here costs ~20 s of CPU once. An import that fails (an extra not
installed) is skipped: this only warms what is there.
"""

from __future__ import annotations

import importlib
import sys

# What the suite's processes import besides torch and islands' own modules (imported by the numba warm-up):
# the compile path (dynamo, inductor), FSDP, the frameworks and their model code, the data and plotting libraries.
MODULES = (
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.run",
    "islands.cli",
    "islands.app.elastic_worker",
    "islands.runtime.launch.job_host",
    "islands.sync.outer.ps_process",
    "islands_bench.harness",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.trainer",
    "lightning.pytorch",
    "accelerate",
    "sklearn.datasets",
    "matplotlib.pyplot",
    "hypothesis",
    "pytest",
    "xdist",
    "safetensors.torch",
    "zstandard",
)


def main() -> int:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:  # an optional extra this install lacks: nothing to warm
            print(f"warm_imports: skipped {name} ({e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
