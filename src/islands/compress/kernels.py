"""Compiled CPU loops (numba) for the outer compressors' hot paths, each giving bit for bit what the torch ops
it stands in for give on the CPU.

Chunked top-k. `torch.topk(rows, k, dim=1, sorted=False)` on the CPU runs, per row, libstdc++'s
`std::partial_sort` when 64 k <= row length and `std::nth_element` (introselect) otherwise, on (value, index)
pairs ordered NaN first, then by larger value. The unsorted order it returns is that algorithm's, and TopKQ's
fixed-width payload under order=torch packs positions in exactly that order (and its least-squares scale sums the
values in it), so a faster selection must reproduce the order, ties included, not just the set (the default,
order=ascending, sends each chunk's positions ascending: a threshold selection gives that directly). `topk_rows`
runs the same algorithm on the same comparator, with one change that keeps every swap: introselect's Hoare partition
finds its out-of-place elements a block at a time without branches (a compare stored as an offset, as
BlockQuicksort does) and swaps the same pairs in the same order Hoare's scan would; the ends of each
partition, where the scans cross, run Hoare's loop itself. Mispredicted branches were most of the cost.
It sorts one uint64 key per entry (the magnitude's order in the high half, the position in the low half), so a
compare is one integer compare. The test suite checks the result against torch.topk row by row (ties, zeros,
NaN, every size class).

Error feedback's round (`add_select_rows`): r + g formed a chunk at a time, that chunk's top k selected, quantised
(topkq's codes and least-squares scale, the same bits as its torch ops) and taken from r + g while it is in cache,
so the residual's update no longer scatters into a cold vector afterwards. The threshold selection's own loops
(the guess's histogram, quickselect, candidate appends) are branch-free.

Decode (`decode_topkq`) and packing (`pack_fields`): topkq's payload read and written field by field in one pass.

Shared-scale stochastic rounding (int8/int4): one pass for what was seven elementwise torch passes, with
the same fp32 operations in the same order (division, multiplication, clamp, floor, compare, add).

All kernels release the GIL and compile once per machine (on-disk cache).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_kernel = njit(nogil=True, cache=True, boundscheck=False)

# offsets gathered per block of the partition (BlockQuicksort's block; 64 fits two buffers in L1 many times over)
_BLOCK = 64
_MAGNITUDE = np.uint32(0x7FFFFFFF)  # an fp32's bits without the sign
_INF = np.uint32(0x7F800000)  # the magnitude bits of Inf; a NaN's are larger


@njit(inline="always")
def _before(a, b):
    """torch.topk's largest-first order on values: NaN before any number, then the larger first."""
    return (a != a and b == b) or a > b


@njit(inline="always")
def _swap(v, p, i, j):
    t = v[i]
    v[i] = v[j]
    v[j] = t
    u = p[i]
    p[i] = p[j]
    p[j] = u


@_kernel
def _adjust_heap(v, p, hole, length, val, idx):
    """libstdc++ __adjust_heap then __push_heap on v[0:length] (a heap whose top is the last in order)."""
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if _before(v[child], v[child - 1]):
            child -= 1
        v[hole] = v[child]
        p[hole] = p[child]
        hole = child
    if (length & 1) == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        v[hole] = v[child - 1]
        p[hole] = p[child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and _before(v[parent], val):
        v[hole] = v[parent]
        p[hole] = p[parent]
        hole = parent
        parent = (hole - 1) // 2
    v[hole] = val
    p[hole] = idx


@_kernel
def _make_heap(v, p, length):
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(v, p, parent, length, v[parent], p[parent])
        if parent == 0:
            return
        parent -= 1


@_kernel
def _partial_sort_row(row, k, v, p):
    """std::partial_sort of the row's (|value|, index) pairs into v[0:k], p[0:k]: heap-select, then sort_heap.
    The tail is only read (pop_heap's write into it never matters for the first k)."""
    for j in range(k):
        v[j] = abs(row[j])
        p[j] = j
    _make_heap(v, p, k)
    for j in range(k, row.size):
        a = abs(row[j])
        if _before(a, v[0]):
            _adjust_heap(v, p, 0, k, a, j)
    last = k
    while last > 1:
        last -= 1
        val = v[last]
        idx = p[last]
        v[last] = v[0]
        p[last] = p[0]
        _adjust_heap(v, p, 0, last, val, idx)


# introselect's working array: one uint64 per entry, the magnitude's ordering key in the high half (an fp32
# magnitude's bits order as its value does; every NaN maps to the top, so NaNs come first and tie among
# themselves, as torch's comparator has it) and the entry's position in the low half. A compare is one integer
# compare of the high halves and a swap moves one word: 1.6x faster than (fp32 value, int64 position) pairs
# compared with NaN checks, the same swaps in the same order.
_HI = np.uint64(32)
_LOW = np.uint64(0xFFFFFFFF)


@njit(inline="always")
def _swap_key(key, i, j):
    t = key[i]
    key[i] = key[j]
    key[j] = t


@_kernel
def _partition(key, first, last, off_lo, off_hi):
    """libstdc++ __unguarded_partition(first + 1, last, pivot = first): the same swaps, found a block at a time."""
    pivot = key[first] >> _HI
    lo = first + 1
    hi = last
    while hi - lo >= 2 * _BLOCK:
        n_lo = 0
        for i in range(_BLOCK):  # left stoppers: not before the pivot
            off_lo[n_lo] = i
            n_lo += (key[lo + i] >> _HI) <= pivot
        n_hi = 0
        for i in range(_BLOCK):  # right stoppers: the pivot not before them
            off_hi[n_hi] = i
            n_hi += (key[hi - 1 - i] >> _HI) >= pivot
        m = min(n_lo, n_hi)
        for t in range(m):  # Hoare pairs the t-th stopper from each end, in this order
            _swap_key(key, lo + off_lo[t], hi - 1 - off_hi[t])
        # resume where Hoare's scans would be: at the first unpaired stopper, or past the block
        lo = lo + off_lo[m] if n_lo > m else lo + _BLOCK
        hi = hi - off_hi[m] if n_hi > m else hi - _BLOCK
    while True:
        while (key[lo] >> _HI) > pivot:
            lo += 1
        hi -= 1
        while pivot > (key[hi] >> _HI):
            hi -= 1
        if not lo < hi:
            return lo
        _swap_key(key, lo, hi)
        lo += 1


@_kernel
def _insertion_sort(key, first, last):
    for i in range(first + 1, last):
        val = key[i]
        mag = val >> _HI
        if mag > (key[first] >> _HI):
            for j in range(i, first, -1):
                key[j] = key[j - 1]
            key[first] = val
        else:
            j = i
            while mag > (key[j - 1] >> _HI):
                key[j] = key[j - 1]
                j -= 1
            key[j] = val


@_kernel
def _nth_element_row(row, k, key, v, p, off_lo, off_hi, idx_out):
    """std::nth_element(pairs, pairs + k - 1, pairs + n): libstdc++'s introselect, step for step, on keys; its
    first k positions into idx_out. Past its depth limit (never seen on real data) the (value, position) pairs
    v, p take the heap selection libstdc++ falls back to."""
    bits = row.view(np.uint32)
    n = row.size
    for j in range(n):
        mag = bits[j] & _MAGNITUDE
        top = mag if mag <= _INF else np.uint32(0xFFFFFFFF)
        key[j] = (np.uint64(top) << _HI) | np.uint64(j)
    first, last, nth = 0, n, k - 1
    depth = 0
    m = n
    while m > 1:  # 2 floor(log2 n)
        m >>= 1
        depth += 1
    depth *= 2
    while last - first > 3:
        if depth == 0:  # heap_select(first, nth + 1, last), then the nth into place
            for j in range(n):
                p[j] = np.int64(key[j] & _LOW)
                v[j] = abs(row[p[j]])
            size = nth + 1 - first
            _make_heap(v[first:], p[first:], size)
            for i in range(nth + 1, last):
                if _before(v[i], v[first]):
                    val = v[i]
                    idx = p[i]
                    v[i] = v[first]
                    p[i] = p[first]
                    _adjust_heap(v[first:], p[first:], 0, size, val, idx)
            _swap(v, p, first, nth)
            for j in range(k):
                idx_out[j] = p[j]
            return
        depth -= 1
        a, b, c = first + 1, first + (last - first) // 2, last - 1  # median of three into `first`
        ka, kb, kc = key[a] >> _HI, key[b] >> _HI, key[c] >> _HI
        if ka > kb:
            if kb > kc:
                _swap_key(key, first, b)
            elif ka > kc:
                _swap_key(key, first, c)
            else:
                _swap_key(key, first, a)
        elif ka > kc:
            _swap_key(key, first, a)
        elif kb > kc:
            _swap_key(key, first, c)
        else:
            _swap_key(key, first, b)
        cut = _partition(key, first, last, off_lo, off_hi)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(key, first, last)
    for j in range(k):
        idx_out[j] = np.int64(key[j] & _LOW)


@_kernel
def _topk_row(row, k, key, v, p, off_lo, off_hi, idx_out, val_out):
    """One row of `topk_rows`: torch.topk's indices of its k largest magnitudes into idx_out (k,), values into
    val_out; key (uint64), v, p (row length) and off_lo, off_hi (_BLOCK) are scratch."""
    if k * 64 <= row.size:
        _partial_sort_row(row, k, v, p)
        for j in range(k):
            idx_out[j] = p[j]
    else:
        _nth_element_row(row, k, key, v, p, off_lo, off_hi, idx_out)
    for j in range(k):
        val_out[j] = row[idx_out[j]]


@_kernel
def topk_rows(rows, k, idx_out, val_out):
    """torch.topk(rows.abs(), k, dim=1, sorted=False).indices into idx_out (R, k) and the rows' signed values
    at them into val_out (R, k): the same indices in the same order, the CPU's algorithm replayed."""
    n = rows.shape[1]
    key = np.empty(n, np.uint64)
    v = np.empty(n, np.float32)
    p = np.empty(n, np.int64)
    off_lo = np.empty(_BLOCK, np.int64)
    off_hi = np.empty(_BLOCK, np.int64)
    for r in range(rows.shape[0]):
        _topk_row(rows[r], k, key, v, p, off_lo, off_hi, idx_out[r], val_out[r])


@njit(inline="always")
def _shared_scale_code(x, scale, s, u):
    """floor(y) + (u < y - floor(y)), y = clamp(x / scale * s, -s, s): torch's fp32 ops in torch's order."""
    y = min(max(np.float32(x / scale) * s, -s), s)
    low = np.floor(y)
    return low + (np.float32(1.0) if u < y - low else np.float32(0.0))


@_kernel
def shared_scale_wire(x, scale, levels, u, nibbles, wire):
    """quantize.SharedScaleQuant's wire bytes in one pass: int8 codes (wire int8, len n), or (nibbles) code + levels
    as nibbles, element 2i low (wire uint8, len ceil(n / 2)). False when some x / scale * levels is NaN (wire then
    partly written): the caller takes torch's ops, whose NaN handling this does not copy."""
    s = np.float32(levels)
    scale = np.float32(scale)
    n = x.size
    bad = False
    if not nibbles:
        for i in range(n):
            y = np.float32(x[i] / scale) * s
            bad |= y != y
            wire[i] = np.int8(_shared_scale_code(x[i], scale, s, u[i]))
        return not bad
    for i in range(n // 2):
        y0 = np.float32(x[2 * i] / scale) * s
        y1 = np.float32(x[2 * i + 1] / scale) * s
        bad |= (y0 != y0) | (y1 != y1)
        c0 = np.uint8(_shared_scale_code(x[2 * i], scale, s, u[2 * i]) + s)
        c1 = np.uint8(_shared_scale_code(x[2 * i + 1], scale, s, u[2 * i + 1]) + s)
        wire[i] = c0 | (c1 << np.uint8(4))
    if n % 2:
        y0 = np.float32(x[n - 1] / scale) * s
        bad |= y0 != y0
        wire[n // 2] = np.uint8(_shared_scale_code(x[n - 1], scale, s, u[n - 1]) + s)
    return not bad


@_kernel
def nibbles_decode(wire, offset, factor, out):
    """out[i] = fp32(nibble i - offset) * factor, nibble 2j the low half of wire[j]: unpack_nibbles, the
    subtraction in int16, the cast and the product of quantize.SharedScaleQuant.decompress in one pass."""
    f = np.float32(factor)
    for j in range(out.size // 2):
        b = np.int16(wire[j])
        out[2 * j] = np.float32((b & np.int16(15)) - offset) * f
        out[2 * j + 1] = np.float32((b >> np.int16(4)) - offset) * f
    if out.size % 2:
        out[out.size - 1] = np.float32((np.int16(wire[out.size // 2]) & np.int16(15)) - offset) * f
    return out


@_kernel
def _kth_largest(u, m, r):
    """The r-th largest (1-based) of u[0:m], u reordered in place: quickselect with a middle pivot whose partition
    has no data-dependent branch (Lomuto's scan, every element swapped, the boundary moved by the compare), since
    on random magnitudes Hoare's scans mispredict about every other step, which cost 1.7x the time. The values
    equal to a pivot that is the largest left are split off in a second such scan, so ties cannot make it
    quadratic."""
    lo, hi, want = 0, m, r - 1  # u[lo:hi] holds the answer, at `want` in descending order
    while hi - lo > 1:
        pivot = u[(lo + hi) >> 1]
        i = lo
        for j in range(lo, hi):  # u[lo:i] > pivot >= u[i:j]
            x = u[j]
            u[j] = u[i]
            u[i] = x
            i += x > pivot
        if want < i:
            hi = i
        elif i > lo:
            lo = i
        else:  # nothing above the pivot: the values equal to it first
            for j in range(i, hi):
                x = u[j]
                u[j] = u[i]
                u[i] = x
                i += x == pivot
            if want < i:
                return pivot
            lo = i
    return u[lo]


# threshold_rows' first guess: every 16th magnitude of a row, and a rank among them that leaves about 1.5 k (plus
# a margin) at or above the guess, so one pass collects all of the k with high probability. The guess is the lower
# edge of the histogram bin holding that rank's sample: a magnitude's bits >> 20 (its exponent and top 3 mantissa
# bits, bins 2**(1/8) wide, 2048 of them), counted and then uncounted, cheaper than a quickselect among the
# samples. Measured on 20,000 rows of 4096 (normal, Laplace, Student t with 2 degrees of freedom) at k = 41, 89 and
# 205: 2.0-4.5 k candidates on average, and fewer than k (a second pass) in at most 0.08% of rows.
_STRIDE = 16
_FINE_SHIFT = np.uint32(20)
_FINE_BINS = 2048


@_kernel
def _exponent_floor(row, k, hist):
    """The largest exponent floor f (bits << 23) with at least k magnitudes >= f: a histogram of the exponents."""
    hist[:] = 0
    for j in range(row.size):
        hist[(row[j] & np.uint32(0x7FFFFFFF)) >> np.uint32(23)] += 1
    above = 0
    b = 255
    while above + hist[b] < k:
        above += hist[b]
        b -= 1
    return np.uint32(b) << np.uint32(23)


@_kernel
def _threshold_row(rowf, row, k, by_value, idx_out, val_out, hist, fine, cand, work):
    """One row of `threshold_rows` (rowf the fp32 row, row its uint32 view; idx_out, val_out (k,)); True when the
    row must be replayed (a NaN, or ties that decide the result), its outputs then left unfinished. hist (256),
    fine (_FINE_BINS, all zero, and left so),
    cand (int64) and work (uint32) of the row's length are scratch. The loops over the row and over the candidates
    are branch-free (appends whose end moves by the compare)."""
    n = row.size
    samples = n // _STRIDE
    rank = min(samples, 3 * ((k * samples + n - 1) // n) // 2 + 5)
    if samples >= 64:
        top = 0
        for i in range(samples):
            b = np.int64((row[i * _STRIDE] & _MAGNITUDE) >> _FINE_SHIFT)
            fine[b] += 1
            top = max(top, b)
        above = 0
        b = top
        while True:  # down from the largest sample's bin to the one where `rank` samples are at or above
            above += fine[b]
            if above >= rank or b == 0:
                break
            b -= 1
        floor = np.uint32(b) << _FINE_SHIFT
        for i in range(samples):  # every count back to zero for the next row
            fine[(row[i * _STRIDE] & _MAGNITUDE) >> _FINE_SHIFT] = 0
    else:
        floor = _exponent_floor(row, k, hist)
    while True:
        m = 0
        for j in range(n):  # positions of every magnitude >= floor, ascending
            cand[m] = j
            m += (row[j] & _MAGNITUDE) >= floor
        # a NaN's magnitude bits exceed every number's, so a row's NaN is a candidate unless the floor is a NaN
        worst = floor
        for i in range(m):
            mag = row[cand[i]] & _MAGNITUDE
            work[i] = mag
            worst = max(worst, mag)
        if worst > _INF:
            return True
        if m >= k:
            break
        floor = _exponent_floor(row, k, hist)  # the guess was too high: the histogram's floor is safe
    t = _kth_largest(work, m, k)
    kept = 0
    for i in range(m):  # the candidates >= t, ascending, compacted in place (kept <= i)
        j = cand[i]
        cand[kept] = j
        kept += (row[j] & _MAGNITUDE) >= t
    if kept > k:  # more than k at or above t: a tie across the k-th place
        return True
    for i in range(k):
        idx_out[i] = cand[i]
    if by_value:  # insertion sort by magnitude, larger first (k is small here: 64 k <= n)
        for i in range(1, k):
            j = idx_out[i]
            mag = row[j] & _MAGNITUDE
            q = i
            while q > 0 and (row[idx_out[q - 1]] & _MAGNITUDE) < mag:
                idx_out[q] = idx_out[q - 1]
                q -= 1
            if q > 0 and (row[idx_out[q - 1]] & _MAGNITUDE) == mag:
                return True  # equal magnitudes among the k: their order is partial_sort's
            idx_out[q] = j
    for i in range(k):
        val_out[i] = rowf[idx_out[i]]
    return False


@_kernel
def threshold_rows(rows, bits, k, by_value, idx_out, val_out, replay):
    """The k largest magnitudes of each row by a threshold: a guess from a strided sample (or, when too few pass
    it, the exponent histogram's floor), one pass collecting every magnitude at or above it with its position
    (about 2 k), a quickselect among those for the k-th largest magnitude t, and the ones >= t are the k.
    Positions come out ascending, or (by_value) sorted by magnitude, larger first: torch.topk's order when it
    runs std::partial_sort.

    Exact only when the k are determined by magnitude alone: a row with a NaN, with ties across the k-th place,
    or (by_value) with ties among the k, has replay[r] set and its outputs left for the caller to take from
    `topk_rows` (torch's own tie order). `bits` is `rows` viewed as uint32 (the magnitude is bits & 0x7fffffff)."""
    n = rows.shape[1]
    hist = np.zeros(256, np.int64)
    fine = np.zeros(_FINE_BINS, np.int32)
    cand = np.empty(n, np.int64)
    work = np.empty(n, np.uint32)
    for r in range(rows.shape[0]):
        replay[r] = _threshold_row(rows[r], bits[r], k, by_value, idx_out[r], val_out[r], hist, fine, cand, work)


@_kernel
def _quantise_subtract_row(o, idx, val, bits, codes, scales, r):
    """One selected row's codes and scale as topkq._quantise_rows gives them (bits 2, 4, 8: the same fp32
    operations, and its float64 sums, exact here as there when the kept values span less than 2**14), then
    o[idx] -= what they decode to (index_add_'s alpha=-1 update), while o is in cache; bits 32 sends the values
    themselves. False, nothing written, when a kept value is not finite (an Inf from an overflowing add, a NaN the
    residual carries from one: the caller quantises and subtracts with torch ops, whose NaN handling is theirs)."""
    k = idx.size
    for i in range(k):
        if not np.isfinite(val[i]):
            return False
    minus = np.float32(-1.0)
    if bits == 32:
        for i in range(k):
            j = idx[i]
            o[j] = o[j] + val[i] * minus
        return True
    peak = np.float32(0.0)
    for i in range(k):
        peak = max(peak, abs(val[i]))
    top = np.float32(2**bits - 1)
    two = np.float32(2.0)
    unit_of = peak if peak > np.float32(0.0) else np.float32(1.0)
    num = 0.0
    den = 0.0
    for i in range(k):
        c = np.rint(np.float32(np.float32(np.float32(val[i] / unit_of) * top) + top) / two)
        c = min(max(c, np.float32(0.0)), top)
        codes[r, i] = np.uint8(c)
        g = two * c - top
        num += np.float64(val[i]) * np.float64(g)
        den += np.float64(g) * np.float64(g)
    scale = np.float32(num / den)
    scales[r] = scale
    for i in range(k):
        j = idx[i]
        o[j] = o[j] + np.float32((two * np.float32(codes[r, i]) - top) * scale) * minus
    return True


# add_select_rows' selection: torch.topk's introselect replayed (topk_rows), or a threshold selection (threshold_rows)
# with positions ascending or by magnitude
REPLAY, ASCENDING, BY_VALUE = 0, 1, 2
# add_select_rows' account of each row: left to select in torch's order, selected only, or finished
ROW_UNSELECTED, ROW_SELECTED, ROW_DONE = 0, 1, 2


@njit(nogil=True, cache=True, boundscheck=False, fastmath={"contract"})
def decayed_add(out, residual, delta, decay):
    """out = residual * decay + delta, the multiply and add allowed to fuse (and nothing else relaxed: the flag is
    LLVM's `contract` alone), which on a CPU with FMA gives torch.add(delta, residual, alpha=decay)'s bits, its
    vectorised kernel being a fused multiply-add. Not inlined: an inlined copy takes its caller's strict flags.
    Whether it matches torch on this machine is checked once before it is used (topkq.decay_fuses)."""
    for j in range(out.size):
        out[j] = residual[j] * decay + delta[j]


@_kernel
def add_select_rows(
    residual, delta, delta_bits, out, out_bits, decay, k, mode, bits, idx_out, val_out, codes, scales, done
):
    """Error feedback's add, the chunked top-k and the residual's update in one pass over memory. Row by row:
    out = residual + delta (fp32, the add torch.add does; at a float32 `decay` other than 1, `decayed_add`);
    that row's k selected from out as `topk_rows` (mode REPLAY) or `threshold_rows` (ASCENDING, BY_VALUE) would;
    then (`_quantise_subtract_row`) their codes (R, k) and scales (R,) made and what they decode to taken from
    out, while the row is still in cache. done[r] (uint8) is ROW_DONE for a finished row; the caller finishes the
    others, whose out is r + g and codes and scale unwritten: ROW_UNSELECTED, one a threshold selection must
    replay (a NaN, or ties that decide it), and ROW_SELECTED, one selected with a kept value not finite. Returns
    False as soon as a row of delta holds a NaN or Inf (out then partly written, residual untouched); True
    otherwise. out_bits and delta_bits are uint32 views of out and delta."""
    n = residual.shape[1]
    key = np.empty(n, np.uint64)
    v = np.empty(n, np.float32)
    p = np.empty(n, np.int64)
    off_lo = np.empty(_BLOCK, np.int64)
    off_hi = np.empty(_BLOCK, np.int64)
    hist = np.zeros(256, np.int64)
    fine = np.zeros(_FINE_BINS, np.int32)
    cand = np.empty(n, np.int64)
    work = np.empty(n, np.uint32)
    for r in range(residual.shape[0]):
        a = residual[r]
        d = delta[r]
        db = delta_bits[r]
        o = out[r]
        worst = np.uint32(0)
        if decay == np.float32(1.0):
            for j in range(n):
                o[j] = a[j] + d[j]
                worst = max(worst, db[j] & _MAGNITUDE)
        else:
            decayed_add(o, a, d, decay)
            for j in range(n):
                worst = max(worst, db[j] & _MAGNITUDE)
        if worst >= _INF:  # Inf or NaN in delta
            return False
        if mode == REPLAY:
            _topk_row(o, k, key, v, p, off_lo, off_hi, idx_out[r], val_out[r])
        elif _threshold_row(o, out_bits[r], k, mode == BY_VALUE, idx_out[r], val_out[r], hist, fine, cand, work):
            done[r] = ROW_UNSELECTED
            continue
        coded = _quantise_subtract_row(o, idx_out[r], val_out[r], bits, codes, scales, r)
        done[r] = ROW_DONE if coded else ROW_SELECTED
    return True


# bit i of a byte's lowest set bit: Elias-Fano's decode walks the high part's set bits a byte at a time
_LOWEST_BIT = np.array([0] + [(b & -b).bit_length() - 1 for b in range(1, 256)], dtype=np.int64)


@njit(inline="always")
def _or_field(out, offset, value, width):
    """ORs `value`'s low `width` bits (width <= 24) into the bit stream `out` at bit `offset`, least significant
    first (pack_bits' order: bit b is bit b & 7 of byte b >> 3)."""
    word = (np.uint64(value) & np.uint64((1 << width) - 1)) << np.uint64(offset & 7)
    first = offset >> 3
    for q in range(((offset & 7) + width + 7) >> 3):
        out[first + q] |= np.uint8((word >> np.uint64(8 * q)) & np.uint64(0xFF))


@_kernel
def ef_encode_rows(pos, n, lo, out, start):
    """elias_fano.encode_rows' bits for each row of pos (R, k), packed as pack_bits packs them, into the zeroed bit
    stream `out` from bit `start`, rows one after another: row r's k low fields of `lo` bits, then its high part,
    where position i sets bit (p_i >> lo) + i. False, at the first row that is not ascending inside [0, n) (the
    caller's torch path then gives whatever it gives)."""
    rows, k = pos.shape
    nb = k * lo + k + ((n - 1) >> lo) + 1
    for r in range(rows):
        prev = -1
        for i in range(k):
            p = pos[r, i]
            if p < prev or p >= n:
                return False
            prev = p
        base = start + r * nb
        high = base + k * lo
        for i in range(k):
            p = pos[r, i]
            if lo:
                _or_field(out, base + i * lo, p, lo)
            b = high + (p >> lo) + i
            out[b >> 3] |= np.uint8(1 << (b & 7))
    return True


@_kernel
def ef_decode_rows(packed, start, rows, n, k, lo, out):
    """elias_fano.decode_rows from the packed bit stream: rows (of nbits(n, k) bits each, from bit `start`) ->
    out (rows, k) int64 positions. The high part is read a byte at a time, its set bits by a table of the lowest
    bit. False when a row's high part does not hold exactly k set bits (a corrupt payload)."""
    width = k + ((n - 1) >> lo) + 1
    nb = k * lo + width
    for r in range(rows):
        base = start + r * nb
        high = base + k * lo
        i = 0
        first = high >> 3
        last = (high + width - 1) >> 3
        for byte in range(first, last + 1):
            bits = np.int64(packed[byte])
            if byte == first:
                bits &= 0xFF << (high & 7)
            if byte == last:
                bits &= (1 << (((high + width - 1) & 7) + 1)) - 1
            while bits:
                j = (byte << 3) + _LOWEST_BIT[bits] - high
                bits &= bits - 1
                if i == k:
                    return False
                p = (j - i) << lo
                if lo:
                    p |= np.int64(_field(packed, base + i * lo, lo))
                out[r, i] = p
                i += 1
        if i != k:
            return False
    return True


@njit(inline="always")
def _field(packed, offset, width):
    """The `width`-bit field at bit `offset` of a pack_uint stream (least significant bit first)."""
    first = offset >> 3
    shift = offset & 7
    word = np.uint64(0)
    for q in range((shift + width + 7) >> 3):
        word |= np.uint64(packed[first + q]) << np.uint64(8 * q)
    return (word >> np.uint64(shift)) & np.uint64((1 << width) - 1)


@_kernel
def decode_topkq(index, width, codes, bits, scales, values, kept, length, k, full, out, add):
    """Every payload (row p of each 2-D argument, index=fixed) of one topkq vector decoded into `out`, a chunk at a
    time: the chunk zeroed, then each payload's entries for it written while it is in cache, payloads in row
    order. A payload has `kept` entries: k for each of the `full` chunks of `length` values, then the tail's.
    Entry e sits at position field(index[p], e) of its chunk with value (2 code - (2**bits - 1)) * its chunk's
    scale (bits 2, 4, 8; the fp32 operations of _dequantise) or values[p, e] (bits 32). out[i] += v (`add`:
    index_add_'s sums, in payload order, a payload's positions being distinct) or out[i] = v (one payload:
    index_copy_). One write pass over out in place of a zero fill, the unpacking, dequantising and index
    arithmetic of `TopKQ.entries` and a scattered write. False, out partly written, at a position past its
    chunk (a damaged payload)."""
    n = out.size
    top = np.float32(2**bits - 1)
    chunks = full + (1 if n > full * length else 0)
    for r in range(chunks):
        lo = r * length
        hi = min(lo + length, n)
        out[lo:hi] = 0.0
        first = r * k
        last = first + k if r < full else kept  # the tail chunk's entries are the last ones
        for p in range(index.shape[0]):
            for e in range(first, last):
                i = lo + np.int64(_field(index[p], e * width, width))
                if i >= hi:
                    return False
                if bits == 32:
                    v = values[p, e]
                else:
                    code = np.float32(_field(codes[p], e * bits, bits))
                    v = np.float32(np.float32(2.0) * code - top) * scales[p, r]
                if add:
                    out[i] += v
                else:
                    out[i] = v
    return True


@_kernel
def pack_fields(values, width, out):
    """bits.pack_uint's bytes into out (ceil(n width / 8) bytes, each written): value i's low `width` bits at bit
    i * width, least significant first, one pass instead of a whole-buffer op per byte a field can touch."""
    mask = np.uint64((1 << width) - 1)
    acc = np.uint64(0)  # bits not yet stored, the oldest lowest
    have = 0
    o = 0
    for i in range(values.size):
        acc |= (np.uint64(values[i]) & mask) << np.uint64(have)
        have += width
        while have >= 8:
            out[o] = np.uint8(acc & np.uint64(0xFF))
            acc >>= np.uint64(8)
            have -= 8
            o += 1
    if have > 0:
        out[o] = np.uint8(acc & np.uint64(0xFF))
