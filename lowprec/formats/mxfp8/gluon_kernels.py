"""Gluon kernel of the 1x32 MXFP8 quantize with the columnwise (32x1) usage: the columnwise
direction alone or both directions from one read of the input.

Why Gluon: the Triton kernel (``block/triton_kernels.py``) leaves the layout to the
compiler, which stores the columnwise codes (a transpose) through shared memory byte by
byte; with both directions the fused launch reached 0.54 of a copy's bandwidth (H200,
session 11). Here the layout is chosen so that nothing crosses threads but the two block
reductions, which stay inside a warp (shuffles):

* a program covers one 32-row block of rows and ``NB`` 32-column blocks, held as a
  (32, NB, 32) tensor (row, column block, column within the block);
* each thread loads 8 rows of 8 consecutive columns (16-byte vectors for bf16); 4 lanes
  span a 1x32 block's columns and 4 lanes a 32x1 block's rows, so each block's amax is 8
  registers and 2 shuffles;
* ``col_l`` is ``row_l`` with its registers renumbered rows first, so the columnwise
  codes and exact values (a (K, M) matrix) are written as 8 consecutive bytes (16 for
  bf16) per column per thread without moving data: ``convert_layout`` is a no-op
  (asserted trivial).

Numerics are the shared jit helpers of the Triton kernel (``e8m0_scale``, ``fp8_codes``,
``fp8_value``, ``e8m0_factor``), so the outputs are bit for bit the reference's
(``mxfp8/reference.py``). The launcher guarantees M % 32 == 0, K % 32 == 0, a unit inner
stride and no prologue; column blocks past K are masked. Only ``launch.py`` imports this
module, and only when Gluon imports.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..float8.triton_kernels import abs_bits, fp8_codes, fp8_value
from .triton_kernels import e8m0_factor, e8m0_scale


def layouts(warps: int, rows: int):
    """(row_l, col_l, NB) of a (32, NB, 32) tile: each thread holds ``rows`` (4 or 8) rows
    of 8 consecutive columns, 4 lanes span a block's columns and 32 / rows lanes its rows,
    the other lanes and the warps run over column blocks. The same thread holds every
    element in both layouts; registers run along the columns first in ``row_l`` (a
    blocked layout), along the rows first in ``col_l`` (a linear one, used only for
    whole tiles, never for a slice)."""
    assert rows in (4, 8) and warps & (warps - 1) == 0, (rows, warps)
    row_lanes, blk_lanes = 32 // rows, rows // 4
    nb = warps * blk_lanes
    row_l = gl.BlockedLayout([rows, 1, 8], [row_lanes, blk_lanes, 4], [1, warps, 1],
                             [2, 1, 0])

    def bases(dim, start, count):
        return [[start << i if d == dim else 0 for d in range(3)] for i in range(count)]
    col_l = gl.DistributedLinearLayout(
        reg_bases=bases(0, 1, rows.bit_length() - 1) + bases(2, 1, 3),
        lane_bases=bases(2, 8, 2) + bases(1, 1, blk_lanes.bit_length() - 1)
        + bases(0, rows, row_lanes.bit_length() - 1),
        warp_bases=bases(1, blk_lanes, warps.bit_length() - 1), block_bases=[],
        shape=[32, nb, 32])
    return row_l, col_l, nb


@gluon.jit
def _tile_offsets(pid_m, pid_k, M, K, row_l: gl.constexpr, NB: gl.constexpr,
                  ROW_MASK: gl.constexpr):
    """(rows (32, 1, 1) int64, columns (1, NB, 32), live mask) of tile (pid_m, pid_k);
    ``live`` is False past K and, with ``ROW_MASK``, past M (where a program converts
    several tiles, its last ones may lie beyond M)."""
    L2: gl.constexpr = gl.SliceLayout(2, row_l)
    rows = pid_m * 32 + gl.arange(0, 32, layout=gl.SliceLayout(1, L2))
    blks = pid_k * NB + gl.arange(0, NB, layout=gl.SliceLayout(0, L2))
    rows3 = gl.expand_dims(gl.expand_dims(rows, 1), 2).to(gl.int64)      # (32, 1, 1)
    blks3 = gl.expand_dims(gl.expand_dims(blks, 0), 2)                   # (1, NB, 1)
    inner = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, row_l)))
    cols3 = blks3 * 32 + gl.expand_dims(gl.expand_dims(inner, 0), 1)     # (1, NB, 32)
    live = blks3 < K // 32
    if ROW_MASK:
        live = live & (rows3 < M)
    return rows3, cols3, live


@gluon.jit
def _load(x_ptr, pid_m, pid_k, M, K, stride_xm, row_l: gl.constexpr, NB: gl.constexpr,
          ROW_MASK: gl.constexpr):
    rows3, cols3, live = _tile_offsets(pid_m, pid_k, M, K, row_l, NB, ROW_MASK)
    return gl.load(x_ptr + rows3 * stride_xm + cols3, mask=live, other=0.0)


@gluon.jit
def _quant_tile(x, pid_m, pid_k, rq_ptr, rs_ptr, cq_ptr, cs_ptr, re_ptr, ce_ptr, M, K,
                FP8_MAX: gl.constexpr, MBITS: gl.constexpr, BIAS: gl.constexpr,
                MAX_BITS: gl.constexpr, ROWWISE: gl.constexpr, CODES: gl.constexpr,
                EXACT_ROW: gl.constexpr, EXACT_COL: gl.constexpr, NB: gl.constexpr,
                row_l: gl.constexpr, col_l: gl.constexpr, ROW_MASK: gl.constexpr):
    L2: gl.constexpr = gl.SliceLayout(2, row_l)   # (32, NB): one per row block
    L0: gl.constexpr = gl.SliceLayout(0, row_l)   # (NB, 32): one per column block
    rows3, cols3, live = _tile_offsets(pid_m, pid_k, M, K, row_l, NB, ROW_MASK)
    a = abs_bits(x)

    if ROWWISE:
        sc_r, mult_r = e8m0_scale(gl.max(a, axis=2), FP8_MAX)  # (32, NB)
        q = fp8_codes(x * gl.expand_dims(mult_r, 2), MBITS, BIAS, MAX_BITS, True)
        if CODES:
            gl.store(rq_ptr + rows3 * K + cols3, q, mask=live)
            rows = pid_m * 32 + gl.arange(0, 32, layout=gl.SliceLayout(1, L2))
            blks = pid_k * NB + gl.arange(0, NB, layout=gl.SliceLayout(0, L2))
            rb = gl.expand_dims(rows, 1).to(gl.int64) * (K // 32) + gl.expand_dims(blks, 0)
            rb_live = gl.expand_dims(blks, 0) < K // 32
            if ROW_MASK:
                rb_live = rb_live & (gl.expand_dims(rows, 1) < M)
            gl.store(rs_ptr + rb, sc_r, mask=rb_live)
        if EXACT_ROW:
            v = fp8_value(q, MBITS, BIAS, True) * gl.expand_dims(e8m0_factor(sc_r), 2)
            gl.store(re_ptr + rows3 * K + cols3, v.to(gl.bfloat16), mask=live)

    sc_c, mult_c = e8m0_scale(gl.max(a, axis=0), FP8_MAX)  # (NB, 32)
    q_c = fp8_codes(x * gl.expand_dims(mult_c, 0), MBITS, BIAS, MAX_BITS, True)
    # element (r, c) of x goes to (c, r) of the columnwise outputs; in col_l each thread
    # holds the same elements as in row_l, its registers ordered rows first (no data moves)
    at_c = gl.convert_layout(cols3.to(gl.int64) * M + rows3, col_l, assert_trivial=True)
    live_c = gl.convert_layout(live, col_l, assert_trivial=True)
    if CODES:
        gl.store(cq_ptr + at_c, gl.convert_layout(q_c, col_l, assert_trivial=True),
                 mask=live_c)
        cblk = gl.expand_dims(pid_k * NB + gl.arange(0, NB, layout=gl.SliceLayout(1, L0)), 1)
        ccol = cblk * 32 + gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, L0)), 0)
        gl.store(cs_ptr + ccol.to(gl.int64) * (M // 32) + pid_m, sc_c,
                 mask=(cblk < K // 32) & (pid_m < M // 32))
    if EXACT_COL:
        v_c = fp8_value(q_c, MBITS, BIAS, True) * gl.expand_dims(e8m0_factor(sc_c), 0)
        gl.store(ce_ptr + at_c, gl.convert_layout(v_c.to(gl.bfloat16), col_l,
                                                  assert_trivial=True), mask=live_c)


@gluon.jit
def mx1_quant_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, re_ptr, ce_ptr, M, K, stride_xm,
                     FP8_MAX: gl.constexpr, MBITS: gl.constexpr, BIAS: gl.constexpr,
                     MAX_BITS: gl.constexpr, ROWWISE: gl.constexpr, CODES: gl.constexpr,
                     EXACT_ROW: gl.constexpr, EXACT_COL: gl.constexpr, NB: gl.constexpr,
                     row_l: gl.constexpr, col_l: gl.constexpr, ITERS: gl.constexpr,
                     K_FAST: gl.constexpr):
    """Columnwise data (K, M), E8M0 scales (K, M / 32) and, with ``ROWWISE``, rowwise data
    (M, K) and scales (M, K / 32) of ITERS (32, 32 * NB) tiles down a column of tiles;
    ``EXACT_*`` also write that direction's exact bf16 values in its data's layout,
    ``CODES=False`` only those. Each tile's load is issued before the previous tile is
    converted, so a program keeps memory busy while it computes. ``K_FAST``: grid axis 0
    runs along K (neighbouring programs read neighbouring columns), else along M."""
    if K_FAST:
        pid_k = gl.program_id(0)
        first = gl.program_id(1) * ITERS
    else:
        pid_k = gl.program_id(1)
        first = gl.program_id(0) * ITERS
    ROW_MASK: gl.constexpr = ITERS > 1
    x_next = _load(x_ptr, first, pid_k, M, K, stride_xm, row_l, NB, ROW_MASK)
    for t in gl.static_range(ITERS):
        x = x_next
        if t + 1 < ITERS:
            x_next = _load(x_ptr, first + t + 1, pid_k, M, K, stride_xm, row_l, NB, ROW_MASK)
        _quant_tile(x.to(gl.float32), first + t, pid_k, rq_ptr, rs_ptr, cq_ptr, cs_ptr,
                    re_ptr, ce_ptr, M, K, FP8_MAX, MBITS, BIAS, MAX_BITS, ROWWISE, CODES,
                    EXACT_ROW, EXACT_COL, NB, row_l, col_l, ROW_MASK)
