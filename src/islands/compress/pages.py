"""Zeroed dense vectors on 2 MB pages: the decoded side of a sparse payload (issue #34 item 5).

A sparse payload's decode writes into a dense vector of the model's size that did not exist before. On a Linux CPU
each 4 KB page of a fresh allocation faults in on its first touch, and for a large vector that costs more than the
decode itself: a fresh 10M-value fp32 `torch.zeros` took 14.2 ms, one on 2 MB pages 2.75 ms (100M values: 147 against
37 ms; one thread, this 2-core machine). Linux backs a region with 2 MB pages once told to (madvise MADV_HUGEPAGE,
before its first touch) when transparent huge pages are in `madvise` mode, the common default, or `always`. torch
does that for all its CPU allocations only under THP_MEM_ALLOC_ENABLE=1, read once per process; `zeros` does it for
the one vector it allocates, so a compressor's decode gets it whatever the environment. Where madvise is refused
(THP `never`, another OS) the vector is the same, on 4 KB pages.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch
from torch import Tensor

HUGE_PAGE = 1 << 21  # 2 MB: x86-64's and arm64's (4 KB base pages) transparent huge page
MIN_BYTES = 4 * HUGE_PAGE  # smaller vectors fault in few pages, and their aligned interior is a small part of them
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def zeros(numel: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
    """torch.zeros(numel, dtype=dtype, device=device), on 2 MB pages where it is a large vector on a Linux CPU."""
    return empty(numel, dtype, device).zero_()


def empty(numel: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
    """torch.empty(numel, dtype=dtype, device=device), on 2 MB pages where it is a large vector on a Linux CPU:
    for a caller that writes every value itself (a decode that zero-fills chunk by chunk as it goes)."""
    where = torch.device("cpu") if device is None else torch.device(device)
    nbytes = numel * dtype.itemsize
    madvise = _madvise() if where.type == "cpu" and nbytes >= MIN_BYTES else None
    out = torch.empty(numel, dtype=dtype, device=where)
    if madvise is None:
        return out
    start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the 2 MB-aligned interior, before the first touch
    end = (out.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)  # refused (THP never): 4 KB pages, the same vector
    return out
