"""Inner strategies: how the ranks of one island cooperate every step (public names).

    DDP(compressor=None, aggregator=None, attack=None, bucket_mb=25.0, overlap=True)   data parallel (LIT-219)
    ZeRO1(bucket_mb=25.0)                  DDP's exchange, optimizer state partitioned (SOTA-028)
    FSDP(wrap=BlockWrap(), ...)            FSDP2 sharding inside the island (SOTA-030), HSDP with shard_group
    Single()                               one worker per island: no exchange
    Pipeline(stages, microbatches, cuts, schedule, batch, loss_fn)   the island's ranks as pipeline stages
Wrap policies for FSDP: ModelWrap, BlockWrap, ParamThreshold(n), SplitByParams(k), GraphWrap(k).
"""

from islands.parallel.pipeline.strategy import PipelineStages as Pipeline
from islands.sync.ddp import DDP
from islands.sync.sharded import FSDP
from islands.sync.single import Single
from islands.sync.wrap_policy import BlockWrap, GraphWrap, ModelWrap, ParamThreshold, SplitByParams
from islands.sync.zero1 import ZeRO1

__all__ = [
    "DDP",
    "FSDP",
    "BlockWrap",
    "GraphWrap",
    "ModelWrap",
    "ParamThreshold",
    "Pipeline",
    "Single",
    "SplitByParams",
    "ZeRO1",
]
