"""Model parallelism inside an island: layers split over the ranks of one well-connected group."""

from islands.parallel.contrastive import sigmoid_pair_loss, softmax_pair_loss
from islands.parallel.overlap import matmul_all_reduce
from islands.parallel.ring_attention import ring_attention
from islands.parallel.row_linear import RowParallelLinear
from islands.parallel.sequence import TensorParallelMLP, sequence_shard
from islands.parallel.shuffle_bn import encode_in_groups, shuffled_encode, shuffled_encode_bytes, shuffled_group_encode

# Each of these modules is a practice's registered implementation (practices/registry.toml); their entry
# points are public so that a user's model, or a benchmark, calls them directly.
__all__ = [
    "matmul_all_reduce",
    "RowParallelLinear",
    "sigmoid_pair_loss",
    "softmax_pair_loss",  # contrastive losses over pairs held by every rank
    "ring_attention",  # attention over a sequence split across ranks, K/V passed round a ring
    "TensorParallelMLP",
    "sequence_shard",  # sequence parallelism around a tensor-parallel MLP
    "encode_in_groups",
    "shuffled_encode",
    "shuffled_encode_bytes",
    "shuffled_group_encode",
]  # shuffle-BN
