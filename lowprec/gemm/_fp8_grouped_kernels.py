"""@triton.jit kernel of the grouped per-tensor-scaled FP8 GEMM (launcher:
:mod:`lowprec.gemm.fp8_grouped`).

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
def _band_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of linear tile ``tile``: tiles in bands of GROUP_M row tiles,
    column tiles slowest inside a band, so that a band's A rows stay in L2 while every
    column tile reads them."""
    band = GROUP_M * tiles_n
    first_m = (tile // band) * GROUP_M
    band_m = min(tiles_m - first_m, GROUP_M)
    return first_m + (tile % band) % band_m, (tile % band) // band_m


@triton.jit
def _rows_tile(pid_m, starts, ends, tiles, tile_end, b_ptr, s_bg, BM: tl.constexpr,
               GP: tl.constexpr):
    """(group, rows, end row, expert's B) of row tile ``pid_m`` (``GROUP_K=False``)."""
    # the group of this row tile: the number of groups whose tiles end at or before it
    g = tl.sum((tile_end <= pid_m).to(tl.int32))
    pick = tl.arange(0, GP) == g
    first = tl.sum(tl.where(pick, starts + (pid_m - (tile_end - tiles)) * BM, 0))
    row_end = tl.sum(tl.where(pick, ends, 0))
    return g, first + tl.arange(0, BM), row_end, b_ptr + g.to(tl.int64) * s_bg


@triton.jit
def _group_k_range(offs_ptr, g):
    """The contraction range ``[k_lo, k_hi)`` of group ``g`` (``GROUP_K=True``)."""
    k_hi = tl.multiple_of(tl.load(offs_ptr + g), 16)
    k_lo = tl.multiple_of(tl.load(offs_ptr + g - 1, mask=g > 0, other=0), 16)
    return k_lo, k_hi


@triton.jit
def _sum_and_store(a_ptr, b_base, da_ptr, db_ptr, out_base, g, rows, row_end, cols, N, k_lo,
                   k_hi, s_am, s_ak, s_bn, s_bk, s_om, s_on, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, MASK_K: tl.constexpr,
                   FP8: tl.constexpr):
    """One tile's sum over ``[k_lo, k_hi)`` in chunks of BK, scaled by group ``g``'s two
    decode factors, stored (rows below ``row_end``, columns below ``N``)."""
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
    tl.store(optr, acc.to(out_base.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


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
    if pid >= tiles_m * tiles_n:
        return  # the grid's bound on the row tiles, past the last group's
    pid_m, pid_n = _band_tile(pid, tiles_m, tiles_n, GROUP_M)
    if GROUP_K:
        g = tl.program_id(1)
        k_lo, k_hi = _group_k_range(offs_ptr, g)
        _sum_and_store(a_ptr, b_ptr, da_ptr, db_ptr, out_ptr + g.to(tl.int64) * s_og, g,
                       pid_m * BM + tl.arange(0, BM), M, pid_n * BN + tl.arange(0, BN), N,
                       k_lo, k_hi, s_am, s_ak, s_bn, s_bk, s_om, s_on, BM, BN, BK, MASK_K,
                       FP8)
    else:
        g, rows, row_end, b_base = _rows_tile(pid_m, starts, ends, tiles, tile_end, b_ptr,
                                              s_bg, BM, GP)
        _sum_and_store(a_ptr, b_base, da_ptr, db_ptr, out_ptr, g, rows, row_end,
                       pid_n * BN + tl.arange(0, BN), N, 0, K, s_am, s_ak, s_bn, s_bk, s_om,
                       s_on, BM, BN, BK, MASK_K, FP8)


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
        num_tiles = tiles_m * tiles_n * G
    else:
        starts, ends, tiles, tile_end = _row_tile_table(offs_ptr, G, BM, GP)
        tiles_m = tl.sum(tiles)
        num_tiles = tiles_m * tiles_n
    for tile in tl.range(tl.program_id(0), num_tiles, PROGRAMS):
        if GROUP_K:
            g = tile // (tiles_m * tiles_n)
            pid_m, pid_n = _band_tile(tile % (tiles_m * tiles_n), tiles_m, tiles_n, GROUP_M)
            k_lo, k_hi = _group_k_range(offs_ptr, g)
            _sum_and_store(a_ptr, b_ptr, da_ptr, db_ptr, out_ptr + g.to(tl.int64) * s_og, g,
                           pid_m * BM + tl.arange(0, BM), M, pid_n * BN + tl.arange(0, BN),
                           N, k_lo, k_hi, s_am, s_ak, s_bn, s_bk, s_om, s_on, BM, BN, BK,
                           MASK_K, FP8)
        else:
            pid_m, pid_n = _band_tile(tile, tiles_m, tiles_n, GROUP_M)
            g, rows, row_end, b_base = _rows_tile(pid_m, starts, ends, tiles, tile_end,
                                                  b_ptr, s_bg, BM, GP)
            _sum_and_store(a_ptr, b_base, da_ptr, db_ptr, out_ptr, g, rows, row_end,
                           pid_n * BN + tl.arange(0, BN), N, 0, K, s_am, s_ak, s_bn, s_bk,
                           s_om, s_on, BM, BN, BK, MASK_K, FP8)
