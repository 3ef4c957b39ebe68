"""Gluon kernel of the 1x32 MXFP8 quantize with both usages: each 128x128 tile is read
from DRAM once, for the rowwise usage, and again from L2 for the columnwise usage.

It is the structure of the 1x128 block kernel (``block/gluon_kernels.py``): a program
makes the rowwise usage of its tile in chunks of RB rows, each chunk's load issued before
the previous chunk is converted, then the columnwise usage in pieces of 128 rows x 64
columns, loaded again (``evict_last`` on the first read, ``evict_first`` on the second).
No thread holds more than a chunk or a piece.

* rowwise chunk, a (RB, 4, 32) view (rows, 1x32 block, column in the block): each thread
  loads 8 consecutive columns (16 bytes of bf16), 4 lanes span a block, so a block amax is
  8 registers and 2 shuffles;
* columnwise piece, a (4, 32, 64) view (32-row block, row in the block, column): each
  thread holds 8 consecutive rows of 8 consecutive columns, 4 lanes span a 32-row block and
  a warp holds the block, so a block amax is 8 registers and 2 shuffles; the codes and
  exact values are stored from ``col_l``, the same registers numbered rows first, so each
  thread writes 8 consecutive bytes (16 for exact bf16) of a (K, M) row and no data moves.

Numerics are the shared jit helpers the Triton kernel uses (``kernels/fp8_cast.py``,
``kernels/e8m0.py``), bit for bit the reference (``mxfp8/reference.py``). The
launcher guarantees M and K multiples of 32, a unit inner stride and no prologue; rows and
columns past the tensor are masked a whole block at a time. Only ``launch.py`` imports
this module, and only when Gluon imports.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...kernels.e8m0 import e8m0_factor, e8m0_scale
from ...kernels.fp8_cast import abs_bits, fp8_codes, fp8_value
from ...kernels.gluon_tiles import tile_ids


@gluon.constexpr_function
def _row_layout(WARPS):
    """(RB, 4, 32) rowwise chunk: 8 columns a thread, lanes 4 along a block's columns, 4
    along the blocks, 2 along the rows; warps along the rows."""
    return gl.BlockedLayout([1, 1, 8], [2, 4, 4], [WARPS, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _col_layouts(WARPS):
    """(load_l, col_l) of the (WARPS, 32, 64) columnwise piece: registers hold 8 columns
    then 8 rows (``load_l``) or 8 rows then 8 columns (``col_l``); lanes 8 along the
    columns, 4 along the rows; one warp per 32-row block."""
    def basis(dim, value):
        return [value if d == dim else 0 for d in range(3)]
    cols = [basis(2, v) for v in (1, 2, 4)]
    rows = [basis(1, v) for v in (1, 2, 4)]
    lanes = [basis(2, 8), basis(2, 16), basis(2, 32), basis(1, 8), basis(1, 16)]
    warps = [basis(0, 1 << i) for i in range(WARPS.bit_length() - 1)]

    def layout(regs):
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps,
                                          block_bases=[], shape=[WARPS, 32, 64])
    return layout(cols + rows), layout(rows + cols)


@gluon.jit
def _index(n: gl.constexpr, axis: gl.constexpr, L: gl.constexpr):
    """``arange(n)`` along ``axis`` of a 3-D tensor in layout L, expanded back to 3-D."""
    if axis == 0:
        i = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        return gl.expand_dims(gl.expand_dims(i, 1), 2)
    elif axis == 1:
        i = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
        return gl.expand_dims(gl.expand_dims(i, 0), 2)
    else:
        i = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
        return gl.expand_dims(gl.expand_dims(i, 0), 1)


@gluon.jit
def _row_offsets(row0, pid_k, M, K, RB: gl.constexpr, WARPS: gl.constexpr):
    """Rows (RB, 1, 1), columns (1, 4, 32) and the mask of a rowwise chunk."""
    L: gl.constexpr = _row_layout(WARPS)
    rows = row0 + _index(RB, 0, L)
    cols = (pid_k * 4 + _index(4, 1, L)) * 32 + _index(32, 2, L)
    return rows, cols, (rows < M) & (cols < K)


@gluon.jit
def _row_load(x_ptr, stride_xm, M, K, row0, pid_k, RB: gl.constexpr, WARPS: gl.constexpr,
              POLICY: gl.constexpr):
    rows, cols, live = _row_offsets(row0, pid_k, M, K, RB, WARPS)
    return gl.load(x_ptr + rows.to(gl.int64) * stride_xm + cols, mask=live, other=0.0,
                   eviction_policy=POLICY)


@gluon.jit
def _row_store(x, rq_ptr, rs_ptr, re_ptr, M, K, row0, pid_k, FP8_MAX: gl.constexpr,
               MBITS: gl.constexpr, BIAS: gl.constexpr, MAX_BITS: gl.constexpr,
               RB: gl.constexpr, WARPS: gl.constexpr, EXACT: gl.constexpr,
               CODES: gl.constexpr):
    """Rowwise codes (M, K), E8M0 codes (M, K / 32) and, with ``EXACT``, the exact bf16
    values (M, K) of the chunk ``_row_load`` read."""
    rows, cols, live = _row_offsets(row0, pid_k, M, K, RB, WARPS)
    x = x.to(gl.float32)
    code, mult = e8m0_scale(gl.max(abs_bits(x), axis=2), FP8_MAX)          # (RB, 4)
    q = fp8_codes(x * gl.expand_dims(mult, 2), MBITS, BIAS, MAX_BITS, True)
    at = rows.to(gl.int64) * K + cols
    if CODES:
        gl.store(rq_ptr + at, q, mask=live)
        s_l: gl.constexpr = gl.SliceLayout(2, _row_layout(WARPS))
        rows_s = row0 + gl.expand_dims(gl.arange(0, RB, layout=gl.SliceLayout(1, s_l)), 1)
        blk_s = pid_k * 4 + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, s_l)), 0)
        gl.store(rs_ptr + rows_s.to(gl.int64) * (K // 32) + blk_s, code,
                 mask=(rows_s < M) & (blk_s < K // 32))
    if EXACT:
        v = fp8_value(q, MBITS, BIAS, True) * gl.expand_dims(e8m0_factor(code), 2)
        gl.store(re_ptr + at, v.to(gl.bfloat16), mask=live)


@gluon.jit
def _col_offsets(pid_m, pid_c, M, K, WARPS: gl.constexpr):
    """Rows (WARPS, 32, 1), columns (1, 1, 64) and the mask of columnwise piece pid_c."""
    L: gl.constexpr = _col_layouts(WARPS)[0]
    rows = (pid_m * WARPS + _index(WARPS, 0, L)) * 32 + _index(32, 1, L)
    cols = pid_c * 64 + _index(64, 2, L)
    return rows, cols, (rows < M) & (cols < K)


@gluon.jit
def _col_load(x_ptr, stride_xm, M, K, pid_m, pid_c, WARPS: gl.constexpr,
              POLICY: gl.constexpr):
    rows, cols, live = _col_offsets(pid_m, pid_c, M, K, WARPS)
    return gl.load(x_ptr + rows.to(gl.int64) * stride_xm + cols, mask=live, other=0.0,
                   eviction_policy=POLICY)


@gluon.jit
def _col_store(x, cq_ptr, cs_ptr, ce_ptr, M, K, pid_m, pid_c, FP8_MAX: gl.constexpr,
               MBITS: gl.constexpr, BIAS: gl.constexpr, MAX_BITS: gl.constexpr,
               WARPS: gl.constexpr, EXACT: gl.constexpr, CODES: gl.constexpr):
    """Columnwise codes (K, M), E8M0 codes (K, M / 32) and, with ``EXACT``, the exact bf16
    values (K, M) of the piece ``_col_load`` read."""
    load_l: gl.constexpr = _col_layouts(WARPS)[0]
    col_l: gl.constexpr = _col_layouts(WARPS)[1]
    rows, cols, live = _col_offsets(pid_m, pid_c, M, K, WARPS)
    x = x.to(gl.float32)
    code, mult = e8m0_scale(gl.max(abs_bits(x), axis=1), FP8_MAX)          # (WARPS, 64)
    q = fp8_codes(x * gl.expand_dims(mult, 1), MBITS, BIAS, MAX_BITS, True)
    at = gl.convert_layout(cols.to(gl.int64) * M + rows, col_l, assert_trivial=True)
    live_c = gl.convert_layout(live, col_l, assert_trivial=True)
    if CODES:
        gl.store(cq_ptr + at, gl.convert_layout(q, col_l, assert_trivial=True), mask=live_c)
        s_l: gl.constexpr = gl.SliceLayout(1, load_l)
        blk_s = pid_m * WARPS + gl.expand_dims(
            gl.arange(0, WARPS, layout=gl.SliceLayout(1, s_l)), 1)
        cols_s = pid_c * 64 + gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, s_l)), 0)
        gl.store(cs_ptr + cols_s.to(gl.int64) * (M // 32) + blk_s, code,
                 mask=(blk_s < M // 32) & (cols_s < K))
    if EXACT:
        v = fp8_value(q, MBITS, BIAS, True) * gl.expand_dims(e8m0_factor(code), 1)
        gl.store(ce_ptr + at, gl.convert_layout(v.to(gl.bfloat16), col_l, assert_trivial=True),
                 mask=live_c)


@gluon.jit
def mx1_both_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, re_ptr, ce_ptr, M, K, stride_xm,
                    FP8_MAX: gl.constexpr, MBITS: gl.constexpr, BIAS: gl.constexpr,
                    MAX_BITS: gl.constexpr, RB: gl.constexpr, WARPS: gl.constexpr,
                    EXACT_ROW: gl.constexpr, EXACT_COL: gl.constexpr, ROW_CODES: gl.constexpr,
                    COL_CODES: gl.constexpr, K_FAST: gl.constexpr = True,
                    EVICT: gl.constexpr = True):
    """Both usages of the tile of 32 * WARPS rows and 128 columns (pid_m, pid_k): rowwise
    codes (M, K) and E8M0 codes (M, K / 32) where ``ROW_CODES``, columnwise codes (K, M)
    and E8M0 codes (K, M / 32) where ``COL_CODES``; with ``EXACT_ROW`` / ``EXACT_COL``
    that direction's exact bf16 values in its data's layout. ``K_FAST``: grid axis 0 runs
    along K. ``EVICT``: hint L2 to keep the tile after the first read and drop it after
    the second."""
    pid_m, pid_k = tile_ids(K_FAST)
    BM: gl.constexpr = 32 * WARPS
    NR: gl.constexpr = BM // RB
    FIRST: gl.constexpr = "evict_last" if EVICT else ""
    SECOND: gl.constexpr = "evict_first" if EVICT else ""
    x = _row_load(x_ptr, stride_xm, M, K, pid_m * BM, pid_k, RB, WARPS, FIRST)
    for c in gl.static_range(NR):
        if c + 1 < NR:
            nxt = _row_load(x_ptr, stride_xm, M, K, pid_m * BM + (c + 1) * RB, pid_k, RB,
                            WARPS, FIRST)
        else:
            y = _col_load(x_ptr, stride_xm, M, K, pid_m, pid_k * 2, WARPS, SECOND)
        _row_store(x, rq_ptr, rs_ptr, re_ptr, M, K, pid_m * BM + c * RB, pid_k, FP8_MAX, MBITS,
                   BIAS, MAX_BITS, RB, WARPS, EXACT_ROW, ROW_CODES)
        if c + 1 < NR:
            x = nxt
    _col_store(y, cq_ptr, cs_ptr, ce_ptr, M, K, pid_m, pid_k * 2, FP8_MAX, MBITS, BIAS,
               MAX_BITS, WARPS, EXACT_COL, COL_CODES)
    y = _col_load(x_ptr, stride_xm, M, K, pid_m, pid_k * 2 + 1, WARPS, SECOND)
    _col_store(y, cq_ptr, cs_ptr, ce_ptr, M, K, pid_m, pid_k * 2 + 1, FP8_MAX, MBITS, BIAS,
               MAX_BITS, WARPS, EXACT_COL, COL_CODES)
