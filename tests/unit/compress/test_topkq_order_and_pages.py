"""topkq's `order` (issue #34 item 5): under index=fixed a chunk's positions travel ascending (the default: the faster
selection on the CPU) or in torch.topk's order (order=torch); both send the same entries and scales, so they decode
to the same vector. And compress.pages.zeros: a zeroed vector whose large CPU allocations are advised onto 2 MB
pages, over exactly their 2 MB-aligned interior."""

import pytest
import torch

from islands.compress import DCTTopK, TopKQ, pages, parse_compressor
from islands.compress.bits import unpack_uint


def _positions(c: TopKQ, payload, n: int) -> torch.Tensor:
    g, full, k, _, _ = c.layout(n)
    return unpack_uint(payload.tensors[0], c.index_bits(n), full * k)[: full * k].view(full, k)


def test_ascending_sends_the_same_entries_sorted_and_decodes_to_the_same_vector():
    n = 4096 * 6 + 100
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    plain, asc = TopKQ(ratio=0.0215, order="torch"), TopKQ(ratio=0.0215, order="ascending")
    p, q = plain.compress(x, {}), asc.compress(x, {})
    assert plain.payload_nbytes(x.shape, x.dtype) == asc.payload_nbytes(x.shape, x.dtype)
    mine, theirs = _positions(asc, q, n), _positions(plain, p, n)
    assert torch.equal(mine, mine.sort(dim=1).values)  # ascending within each chunk
    assert not torch.equal(theirs, theirs.sort(dim=1).values)  # torch's order is not
    assert torch.equal(mine, theirs.sort(dim=1).values)  # the same positions
    torch.testing.assert_close(asc.decompress(q), plain.decompress(p), rtol=1e-6, atol=0)
    # the default is ascending: the same payload, bit for bit, as order=ascending spelt out
    default = TopKQ(ratio=0.0215).compress(x, {})
    assert all(torch.equal(a, b) for a, b in zip(default.tensors, q.tensors, strict=True))


def test_default_order_decodes_to_torch_orders_vector_bit_for_bit():
    """The default (ascending) sends, chunk by chunk, the set of entries order=torch sends, tail chunk included,
    with the same scales: the scale's float64 sum is exact for these values, whatever order they are added in. So
    the two decode to the same vector, bit for bit."""
    n = 4096 * 3 + 777
    x = torch.randn(n, generator=torch.Generator().manual_seed(8))
    for bits in (2, 4, 8, 32):
        default, torch_order = TopKQ(ratio=0.0215, bits=bits), TopKQ(ratio=0.0215, bits=bits, order="torch")
        p, q = default.compress(x, {}), torch_order.compress(x, {})
        assert not torch.equal(p.tensors[0], q.tensors[0])  # the positions travel in other orders
        if bits != 32:
            assert torch.equal(p.tensors[2].view(torch.int32), q.tensors[2].view(torch.int32)), bits  # scales
        a, b = default.decompress(p), torch_order.decompress(q)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), bits


def test_order_in_the_spec_and_a_bad_one_named():
    assert TopKQ().order == "ascending" and DCTTopK().order == "ascending"
    assert parse_compressor("topkq").inner.order == "ascending"  # inside error feedback
    assert parse_compressor("dct-topk").inner.order == "ascending"
    assert parse_compressor("topkq:ratio=0.02,order=torch").inner.order == "torch"
    assert parse_compressor("dct-topk:order=torch").inner.order == "torch"
    assert parse_compressor("topkq:ratio=0.02,order=ascending").inner.order == "ascending"
    with pytest.raises(ValueError, match=r"order \(of a chunk's positions\) must be one of ascending, torch"):
        TopKQ(order="sorted")


@pytest.mark.parametrize("numel", [10, pages.MIN_BYTES // 4 - 1, 3 * pages.MIN_BYTES // 4 + 5])
def test_pages_zeros_is_torch_zeros(numel):
    z = pages.zeros(numel)
    assert z.dtype == torch.float32 and z.shape == (numel,) and not z.any()
    assert pages.zeros(numel, dtype=torch.float64).dtype == torch.float64


def test_pages_zeros_advises_the_aligned_interior_of_a_large_vector_only(monkeypatch):
    calls = []
    monkeypatch.setattr(pages, "_madvise", lambda: lambda start, size, advice: calls.append((start, size, advice)))
    small = pages.zeros(pages.MIN_BYTES // 4 - 1)
    assert calls == [] and not small.any()
    big = pages.zeros(3 * pages.MIN_BYTES // 4 + 5)
    assert not big.any() and len(calls) == 1
    start, size, advice = calls[0]
    lo, hi = big.data_ptr(), big.data_ptr() + big.numel() * 4
    assert start % pages.HUGE_PAGE == 0 and size % pages.HUGE_PAGE == 0 and size > 0
    assert lo <= start < lo + pages.HUGE_PAGE and hi - pages.HUGE_PAGE < start + size <= hi
