"""Key-branch batch norm whose statistics a positive pair never shares (SOTA-364).

In contrastive training with batch norm, each worker normalises its rows with statistics of its
own sub-batch. When a query and its positive key are encoded from the same sub-batch, both carry
that sub-batch's statistics as a fingerprint, and the loss can be lowered by matching fingerprints
instead of content. The fix is to compute the key branch's statistics over a different mix of
samples than the query's, then put the keys back in order.

Two forms, the same arithmetic:
- `shuffled_encode(encoder, x, comm, generator)`: across ranks (MoCo's shuffled BN). The key batch
  is gathered over `comm`, one agreed permutation deals it into one shard per rank, each rank
  encodes its shard (batch norm over that shard), and the outputs are gathered and unshuffled.
- `shuffled_group_encode(encoder, x, groups, generator)`: one process, G groups of rows each
  normalised on its own; what G ranks would compute, with no communication.

The permutation is a deal, not a plain shuffle: each source group (a rank's rows, or a contiguous
block of rows) is shuffled and its rows handed round the G destination groups in turn, so every
destination group holds (to within one row) the same number of rows from every source group. No
key group then resembles its query group more than any other group does; a uniformly random
permutation leaves the positive's group an overlap of one extra row on average.
The permutation comes from a caller-held torch.Generator (never the global RNG): seeded alike on
every rank and called in the same order, it agrees without a collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from islands.parallel.collectives import gather_rows
from islands.runtime.comm import Comm

Encoder = Callable[[torch.Tensor], torch.Tensor]


def _check_generator(generator) -> None:
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator seeded alike on every rank (the global RNG is never "
            f"used), got {type(generator).__name__}"
        )


def _check_rows(x: torch.Tensor, groups: int, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(
            f"{what}: x must be a (rows, features...) tensor, got "
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
        )
    if x.shape[0] == 0 or x.shape[0] % groups:
        raise ValueError(
            f"{what}: {x.shape[0]} rows cannot be split into {groups} equal groups; "
            f"use a batch that is a positive multiple of {groups}"
        )


def dealt_permutation(rows: int, groups: int, generator: torch.Generator) -> torch.Tensor:
    """A permutation p of range(rows): destination group j is x[p][j*m:(j+1)*m], m = rows // groups.

    Source group g is rows g*m..(g+1)*m-1. Each source group's rows are shuffled and dealt round
    the destination groups (continuing where the previous group stopped, from a random start), so
    every destination group gets m rows and floor or ceil of m/G rows from each source group.
    With m >= 2 a source group's consecutive rows land in different destinations, so no key group
    is the same set of samples as any query group.
    """
    _check_generator(generator)
    if not isinstance(groups, int) or groups < 2:
        raise ValueError(f"groups must be an int >= 2 (with one group the statistics are shared); got {groups!r}")
    if rows <= 0 or rows % groups or rows // groups < 2:
        raise ValueError(
            f"{rows} rows cannot be split into {groups} equal groups of at least 2 rows (one row "
            f"would keep its own statistics); use a multiple of {groups} of at least {2 * groups}"
        )
    m = rows // groups
    order = torch.cat([g * m + torch.randperm(m, generator=generator) for g in range(groups)])
    start = int(torch.randint(groups, (1,), generator=generator))
    dest = (torch.arange(rows) + start) % groups
    # stable sort by destination keeps the dealt order inside each destination group; a final
    # in-group shuffle hides which source group a row came from by its position
    dealt = order[torch.sort(dest, stable=True).indices]
    inner = torch.cat([j * m + torch.randperm(m, generator=generator) for j in range(groups)])
    return dealt[inner]


def encode_in_groups(encoder: Encoder, x: torch.Tensor, groups: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """encoder applied to G groups of rows separately (so batch norm sees one group at a time), the
    output in x's row order. Groups are x[perm] cut into G equal blocks (perm=None: x's own blocks,
    which is what G workers with ordinary batch norm compute). Batch-norm running statistics are
    updated once per group."""
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    _check_rows(x, groups, "encode_in_groups")
    if perm is not None and (perm.dim() != 1 or perm.numel() != x.shape[0]):
        raise ValueError(f"perm must be a permutation of range({x.shape[0]}), got shape {tuple(perm.shape)}")
    src = x if perm is None else x[perm.to(x.device)]
    out = torch.cat([encoder(block) for block in src.chunk(groups)])
    if perm is None:
        return out
    unshuffled = torch.empty_like(out)
    unshuffled[perm.to(out.device)] = out
    return unshuffled


def shuffled_group_encode(encoder: Encoder, x: torch.Tensor, groups: int, generator: torch.Generator) -> torch.Tensor:
    """Form (b), one process: the key rows x dealt into `groups` groups (x's contiguous blocks are
    the source groups: lay the batch out so block g holds the pairs whose queries share statistics),
    each encoded with its own batch-norm statistics, returned in x's order."""
    _check_rows(x, 1, "shuffled_group_encode")
    perm = dealt_permutation(x.shape[0], groups, generator)
    return encode_in_groups(encoder, x, groups, perm)


def shuffled_encode(
    encoder: Encoder, x: torch.Tensor, comm: Comm, generator: torch.Generator, prefix: str = "shuffle_bn"
) -> torch.Tensor:
    """Form (a), across ranks: this rank's key rows encoded inside a shard of the dealt global batch.

    Every rank must call it with the same number of rows, the same encoder weights and a generator
    in the same state. Bytes (ledger kinds `<prefix>_all_gather`, `<prefix>_reduce_scatter`): forward
    gathers the inputs and the outputs; backward, when anything needs a gradient, reduce-scatters
    them back (see `shuffled_encode_bytes`). Differentiable end to end.
    """
    _check_generator(generator)
    if comm is None or comm.size < 2:
        raise ValueError(
            "shuffled_encode needs a Comm over 2 or more ranks; in one process use "
            "shuffled_group_encode(encoder, x, groups, generator)"
        )
    n, r = comm.size, comm.rank
    _check_rows(x, 1, "shuffled_encode")
    rows = x.shape[0]
    perm = dealt_permutation(n * rows, n, generator).to(x.device)
    everyone = gather_rows(x.contiguous(), comm, prefix)
    mine = encoder(everyone[perm[r * rows : (r + 1) * rows]])
    shuffled_out = gather_rows(mine.contiguous(), comm, prefix)
    unshuffled = torch.empty_like(shuffled_out)
    unshuffled[perm] = shuffled_out
    return unshuffled[r * rows : (r + 1) * rows]


def shuffled_encode_bytes(
    rows: int,
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    ranks: int,
    itemsize: int = 4,
    grad_outputs: bool = False,
    grad_inputs: bool = False,
) -> dict[str, int]:
    """Bytes one rank sends and receives in one shuffled_encode of `rows` rows per rank, as the ledger
    counts them (all_gather: own chunk sent, n-1 received; reduce_scatter: n-1 slices each way).
    `in_shape`/`out_shape` exclude the row dimension. grad_outputs: the outputs need a gradient (the
    encoder's weights or x do), so backward reduce-scatters them; grad_inputs: x itself needs one."""

    def chunk(shape):
        k = rows * itemsize
        for d in shape:
            k *= d
        return k

    sent = chunk(in_shape) + chunk(out_shape)
    received = (ranks - 1) * sent
    for needed, shape in ((grad_outputs, out_shape), (grad_inputs, in_shape)):
        if needed:
            sent += (ranks - 1) * chunk(shape)
            received += (ranks - 1) * chunk(shape)
    return {"sent": sent, "received": received}
