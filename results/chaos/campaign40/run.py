from pathlib import Path
from islands_bench import harness
from islands_bench.experiments import chaos
chaos.FULL = dict(events=40, gap=(3.0, 6.0))  # a mid-size campaign: the full tier (100) does not fit this session
harness.run("chaos", quick=False, out_root=Path("/tmp/chaos40"), rate="", device="cpu", reuse=False)
