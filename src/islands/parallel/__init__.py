"""Model parallelism inside an island: layers split over the ranks of one well-connected group."""

from islands.parallel.overlap import matmul_all_reduce
from islands.parallel.row_linear import RowParallelLinear

__all__ = ["matmul_all_reduce", "RowParallelLinear"]
