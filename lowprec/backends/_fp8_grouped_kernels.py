"""@triton.jit kernel of the grouped per-tensor-scaled FP8 GEMM (launcher:
:mod:`lowprec.backends.fp8_grouped`).

``out = (A @ B.T) * (da[g] * db[g])``: both operands fp8 (``FP8``) or both bf16, contiguous
along the contraction, one factor per group and operand. FP8: the contraction is loaded in
chunks of ``BK`` (a multiple of 128); each 128 of it is summed on the tensor cores apart
and then added to the fp32 accumulator (``max_num_imprecise_acc=128``), the promotion
cuBLAS's FP8 GEMMs without fast accumulation make, so that a group's result is the bits of
its own ``torch._scaled_mm``. bf16: the tensor cores accumulate in fp32 throughout, as
cuBLAS's bf16 GEMMs do.

Two ways the groups split the problem (``GROUP_K``):

* rows (``GROUP_K=False``, forward and dgrad): group ``g`` owns rows ``[offs[g-1], offs[g])``
  of A and the output; B is expert ``g``'s matrix. Row tiles start at each group's first
  row, so a tile never mixes two groups and the groups need no padding.
* contraction (``GROUP_K=True``, wgrad): ``out[g] = A[:, cols of g] @ B[:, cols of g].T``;
  an empty group writes zeros. Group starts are multiples of 16 (16-byte loads).

Imported only when a launcher runs on CUDA with Triton available.
"""

import triton
import triton.language as tl


@triton.jit
def _row_tile_table(offs_ptr, G, BM: tl.constexpr, GP: tl.constexpr):
    """(first row, end row, row tiles, tiles ending at or before each group) of every group,
    each group's tiles counted from its own first row; groups past ``G`` are empty."""
    gidx = tl.arange(0, GP)
    live = gidx < G
    ends = tl.load(offs_ptr + gidx, mask=live, other=0)
    starts = tl.load(offs_ptr + gidx - 1, mask=live & (gidx > 0), other=0)
    tiles = tl.cdiv(ends - starts, BM)
    return starts, ends, tiles, tl.cumsum(tiles, 0)


@triton.jit
def fp8_grouped_gemm_kernel(
        a_ptr, b_ptr, da_ptr, db_ptr, out_ptr, offs_ptr,
        M, N, K, G,
        s_am, s_ak, s_bg, s_bn, s_bk,
        s_og, s_om, s_on,
        GROUP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GP: tl.constexpr, GROUP_M: tl.constexpr, MASK_K: tl.constexpr, FP8: tl.constexpr):
    """One (BM, BN) output tile (grid: row tiles x column tiles, then groups for
    ``GROUP_K``). ``GP``: ``G`` rounded up to a power of two. ``MASK_K``: the contraction
    may end inside a chunk (always so for ``GROUP_K``)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    if GROUP_K:
        tiles_m = tl.cdiv(M, BM)
    else:
        starts, ends, tiles, tile_end = _row_tile_table(offs_ptr, G, BM, GP)
        tiles_m = tl.sum(tiles)
    # tiles in bands of GROUP_M row tiles, so that a band's A rows stay in L2 while every
    # column tile reads them
    band = GROUP_M * tiles_n
    first_m = (pid // band) * GROUP_M
    if first_m >= tiles_m:
        return  # the grid's bound on the row tiles, past the last group's
    band_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % band_m
    pid_n = (pid % band) // band_m
    if pid_n >= tiles_n:
        return  # a short last band
    cols = pid_n * BN + tl.arange(0, BN)
    if GROUP_K:
        g = tl.program_id(1)
        k_hi = tl.multiple_of(tl.load(offs_ptr + g), 16)
        k_lo = tl.multiple_of(tl.load(offs_ptr + g - 1, mask=g > 0, other=0), 16)
        rows = pid_m * BM + tl.arange(0, BM)
        row_end = M
        b_base = b_ptr
        out_base = out_ptr + g.to(tl.int64) * s_og
    else:
        # the group of this row tile: the number of groups whose tiles end at or before it
        g = tl.sum((tile_end <= pid_m).to(tl.int32))
        pick = tl.arange(0, GP) == g
        first = tl.sum(tl.where(pick, starts + (pid_m - (tile_end - tiles)) * BM, 0))
        row_end = tl.sum(tl.where(pick, ends, 0))
        rows = first + tl.arange(0, BM)
        k_lo = 0
        k_hi = K
        b_base = b_ptr + g.to(tl.int64) * s_bg
        out_base = out_ptr
    rmask = rows < row_end
    cmask = cols < N
    ks = tl.arange(0, BK)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * s_am + (k_lo + ks)[None, :] * s_ak
    b_ptrs = b_base + cols.to(tl.int64)[None, :] * s_bn + (k_lo + ks)[:, None] * s_bk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(k_lo, k_hi, BK):
        if MASK_K:
            kmask = (k + ks) < k_hi
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=cmask[None, :] & kmask[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=cmask[None, :], other=0.0)
        if FP8:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=128)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    # the two decode scales' product first, as cuBLAS applies them (the other order
    # differs in the last bit)
    acc = acc * (tl.load(da_ptr + g) * tl.load(db_ptr + g))
    optr = out_base + rows.to(tl.int64)[:, None] * s_om + cols[None, :] * s_on
    tl.store(optr, acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _band_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of linear tile ``tile``: tiles in bands of GROUP_M row tiles,
    column tiles slowest inside a band, so a band's A rows stay in L2."""
    band = GROUP_M * tiles_n
    first_m = (tile // band) * GROUP_M
    band_m = min(tiles_m - first_m, GROUP_M)
    return first_m + (tile % band) % band_m, (tile % band) // band_m


@triton.jit
def fp8_grouped_gemm_persistent_kernel(
        a_ptr, b_ptr, da_ptr, db_ptr, out_ptr, offs_ptr,
        M, N, K, G,
        s_am, s_ak, s_bg, s_bn, s_bk,
        s_og, s_om, s_on,
        GROUP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GP: tl.constexpr, GROUP_M: tl.constexpr, MASK_K: tl.constexpr, FP8: tl.constexpr,
        PROGRAMS: tl.constexpr):
    """:func:`fp8_grouped_gemm_kernel`'s tiles and sums from ``PROGRAMS`` programs (one an
    SM), each taking every PROGRAMS-th tile: the group table is read once a program, not
    once a tile, and no program waits to be scheduled. (Flattening the tile loop into the
    chunk loop, so that the next tile's loads overlap this one's epilogue, ran slower.)"""
    tiles_n = tl.cdiv(N, BN)
    if GROUP_K:
        tiles_m = tl.cdiv(M, BM)
        per_group = tiles_m * tiles_n
        num_tiles = per_group * G
    else:
        starts, ends, tiles, tile_end = _row_tile_table(offs_ptr, G, BM, GP)
        tiles_m = tl.sum(tiles)
        per_group = tiles_m * tiles_n
        num_tiles = per_group
    ks = tl.arange(0, BK)
    for tile in tl.range(tl.program_id(0), num_tiles, PROGRAMS):
        if GROUP_K:
            g = tile // per_group
            pid_m, pid_n = _band_tile(tile % per_group, tiles_m, tiles_n, GROUP_M)
            k_hi = tl.multiple_of(tl.load(offs_ptr + g), 16)
            k_lo = tl.multiple_of(tl.load(offs_ptr + g - 1, mask=g > 0, other=0), 16)
            rows = pid_m * BM + tl.arange(0, BM)
            row_end = M
            b_base = b_ptr
            out_base = out_ptr + g.to(tl.int64) * s_og
        else:
            pid_m, pid_n = _band_tile(tile, tiles_m, tiles_n, GROUP_M)
            g = tl.sum((tile_end <= pid_m).to(tl.int32))
            pick = tl.arange(0, GP) == g
            first = tl.sum(tl.where(pick, starts + (pid_m - (tile_end - tiles)) * BM, 0))
            row_end = tl.sum(tl.where(pick, ends, 0))
            rows = first + tl.arange(0, BM)
            k_lo = 0
            k_hi = K
            b_base = b_ptr + g.to(tl.int64) * s_bg
            out_base = out_ptr
        cols = pid_n * BN + tl.arange(0, BN)
        rmask = rows < row_end
        cmask = cols < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(k_lo, k_hi, BK):
            kk = k + ks
            a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * s_am + kk[None, :] * s_ak
            b_ptrs = b_base + cols.to(tl.int64)[None, :] * s_bn + kk[:, None] * s_bk
            if MASK_K:
                kmask = kk < k_hi
                a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=cmask[None, :] & kmask[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=cmask[None, :], other=0.0)
            if FP8:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=128)
            else:
                acc = tl.dot(a, b, acc)
        acc = acc * (tl.load(da_ptr + g) * tl.load(db_ptr + g))
        optr = out_base + rows.to(tl.int64)[:, None] * s_om + cols[None, :] * s_on
        tl.store(optr, acc.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])
