"""Pipeline parallelism inside an island: a model cut into stages, one per rank, fed micro-batches.

pieces_of(model) -> pieces;  equal_cuts / graph_cuts / balanced_cuts -> stage starts
build_stages(pieces, starts) -> stages;  PipelineRunner(pieces, stage, comm, "gpipe"|"1f1b", loss_fn)
choose_microbatches(...)  (SOTA-019);  simulate(...) / bubble_fraction(K, M)  (SOTA-017)
PipelineStages: the inner strategy `islands train --inner pipeline` builds (docs/pipeline.md); its public
home is islands.inner.Pipeline (one home per name), so it is not in __all__ here
"""

from islands.parallel.pipeline.chooser import (
    MicrobatchChoice,
    MicrobatchOption,
    choose_microbatches,
    held_bytes,
    profile_microbatches,
)
from islands.parallel.pipeline.cuts import (
    CUT_KINDS,
    PieceCost,
    balanced_cuts,
    choose_cuts,
    equal_cuts,
    graph_cuts,
    output_bytes,
    param_bytes,
    piece_costs,
    stage_sums,
)
from islands.parallel.pipeline.memory import SavedTensorMeter, saved_bytes_of_forward
from islands.parallel.pipeline.pieces import Stage, build_stages, parameter_owner, pieces_of
from islands.parallel.pipeline.runner import ACTIVATION, GRADIENT, PipelineRunner, split_batch
from islands.parallel.pipeline.schedule import (
    SCHEDULES,
    Timeline,
    bubble_fraction,
    gpipe,
    one_f_one_b,
    peak_in_flight,
    schedule_for,
    simulate,
)
from islands.parallel.pipeline.strategy import PipelineStages as PipelineStages

__all__ = [
    "ACTIVATION",
    "CUT_KINDS",
    "GRADIENT",
    "SCHEDULES",
    "MicrobatchChoice",
    "MicrobatchOption",
    "PieceCost",
    "PipelineRunner",
    "SavedTensorMeter",
    "Stage",
    "Timeline",
    "balanced_cuts",
    "bubble_fraction",
    "build_stages",
    "choose_cuts",
    "choose_microbatches",
    "equal_cuts",
    "gpipe",
    "graph_cuts",
    "held_bytes",
    "one_f_one_b",
    "output_bytes",
    "param_bytes",
    "parameter_owner",
    "peak_in_flight",
    "piece_costs",
    "pieces_of",
    "profile_microbatches",
    "saved_bytes_of_forward",
    "schedule_for",
    "simulate",
    "split_batch",
    "stage_sums",
]
