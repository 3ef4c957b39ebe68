"""Gluon kernels of the 1x128 block FP8 quantize: the columnwise usage alone, and both
usages from one read of the input.

Why Gluon: the Triton kernel (``triton_kernels.py``) leaves layouts to the compiler, which
transposes the columnwise fp8 codes byte by byte through shared memory and repeats each
column's scale math in every thread that holds part of the column (docs/performance.md,
"Block scaling on the first shape"). Here the layouts are explicit.

``block1_col_kernel`` (columnwise only):

* each thread loads R consecutive rows of 8 consecutive columns (``load_l``);
* the column amaxes move to one block per thread (``one_l``) for the scale math, and the
  scales are broadcast back;
* the codes are stored from ``store_l``, which differs from ``load_l`` only in register
  order: no data crosses threads, each thread writes R consecutive bytes of a (K, M) row.

``block1_both_kernel`` (both usages, one read): the 128 x 128 tile stays in registers.
Each thread holds R rows of 8 consecutive columns; 16 lanes span a row's 128 columns, so
the rowwise amaxes are shuffles, and the columnwise amaxes cross the warps. The
columnwise codes are stored from a layout that renumbers the same registers rows first
(``both_layouts``), so each thread writes R consecutive bytes of a (K, M) row.

Numerics are the shared jit helpers of ``float8/triton_kernels.py`` (bit for bit the
reference, ``block/reference.py``). The launcher guarantees M % 128 == 0 (K % 128 == 0
for both usages), a unit inner stride and no prologue. Only ``launch.py`` imports this
module, and only when Gluon imports.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..float8.triton_kernels import abs_bits, current_scale, decode_scale, fp8_codes


@gluon.jit
def _scales(amax, eps, one_l: gl.constexpr, FP8_MAX: gl.constexpr, POW2: gl.constexpr):
    """(encode scale, decode scale) of int32 amax bits, computed in ``one_l``."""
    s = current_scale(gl.convert_layout(amax, one_l), eps, FP8_MAX, POW2)
    return s, decode_scale(s)


@gluon.jit
def _tile_ids(K_FAST: gl.constexpr):
    """(pid_m, pid_k) of this program; ``K_FAST``: grid axis 0 runs along K, so programs
    launched together read neighbouring columns of the same rows."""
    if K_FAST:
        return gl.program_id(1), gl.program_id(0)
    else:
        return gl.program_id(0), gl.program_id(1)


@gluon.jit
def block1_col_kernel(x_ptr, cq_ptr, cs_ptr, cd_ptr, M, K, stride_xm, eps,
                      FP8_MAX: gl.constexpr, POW2: gl.constexpr, MBITS: gl.constexpr,
                      BIAS: gl.constexpr, MAX_BITS: gl.constexpr, R: gl.constexpr,
                      T: gl.constexpr, WARPS: gl.constexpr, K_FAST: gl.constexpr = False):
    """Columnwise usage of one (128, 8 * T) tile; columns past K are masked. ``K_FAST``:
    grid axis 0 runs along K."""
    BM: gl.constexpr = R * (32 // T) * WARPS
    BN: gl.constexpr = 8 * T
    gl.static_assert(BM == 128, "one 128-row block per program")
    load_l: gl.constexpr = gl.BlockedLayout([R, 8], [32 // T, T], [WARPS, 1], [1, 0])
    store_l: gl.constexpr = gl.BlockedLayout([R, 8], [32 // T, T], [WARPS, 1], [0, 1])
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])

    pid_m, pid_k = _tile_ids(K_FAST)
    offs_m = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, load_l))
    offs_k = pid_k * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, load_l))
    x = gl.load(x_ptr + offs_m.to(gl.int64)[:, None] * stride_xm + offs_k[None, :],
                mask=(offs_k < K)[None, :], other=0.0).to(gl.float32)

    s_c, d_c = _scales(gl.max(abs_bits(x), axis=0), eps, one_l, FP8_MAX, POW2)
    sk = pid_k * BN + gl.arange(0, BN, layout=one_l)
    gl.store(cs_ptr + sk.to(gl.int64) * (M // 128) + pid_m, s_c, mask=sk < K)
    gl.store(cd_ptr + pid_m.to(gl.int64) * K + sk, d_c, mask=sk < K)
    q = fp8_codes(x * gl.convert_layout(s_c, gl.SliceLayout(0, load_l))[None, :], MBITS, BIAS,
                  MAX_BITS, True)
    q = gl.convert_layout(q, store_l)  # register order only
    offs_m = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, store_l))
    offs_k = pid_k * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, store_l))
    gl.store(cq_ptr + offs_k.to(gl.int64)[None, :] * M + offs_m[:, None], q,
             mask=(offs_k < K)[None, :])


def both_layouts(warps: int):
    """(row_l, col_l) of the (128, 128) tile of ``block1_both_kernel``: each thread holds
    R = 64 / warps rows of 8 consecutive columns, 16 lanes span a 1x128 block's columns
    (its amax: 8 registers and 4 shuffles), 2 lanes and the warps its 128 rows. The same
    thread holds every element in both layouts; registers run along the columns first in
    ``row_l`` (16-byte loads, 8-byte rowwise stores), along the rows first in ``col_l``
    (R consecutive bytes of a (K, M) row per column, no data moved)."""
    assert warps in (4, 8, 16), warps
    rows = 64 // warps
    row_l = gl.BlockedLayout([rows, 8], [2, 16], [warps, 1], [1, 0])

    def bases(dim, start, count):
        return [[start << i if d == dim else 0 for d in range(2)] for i in range(count)]
    col_l = gl.DistributedLinearLayout(
        reg_bases=bases(0, 1, rows.bit_length() - 1) + bases(1, 1, 3),
        lane_bases=bases(1, 8, 4) + bases(0, rows, 1),
        warp_bases=bases(0, 2 * rows, warps.bit_length() - 1), block_bases=[],
        shape=[128, 128])
    return row_l, col_l


@gluon.jit
def block1_both_kernel(x_ptr, rq_ptr, rs_ptr, rd_ptr, cq_ptr, cs_ptr, cd_ptr, M, K,
                       stride_xm, eps, FP8_MAX: gl.constexpr, POW2: gl.constexpr,
                       MBITS: gl.constexpr, BIAS: gl.constexpr, MAX_BITS: gl.constexpr,
                       WARPS: gl.constexpr, row_l: gl.constexpr, col_l: gl.constexpr,
                       K_FAST: gl.constexpr = False):
    """Both usages of one 128 x 128 tile from one read, held in registers (K % 128 == 0:
    no masks; layouts from ``both_layouts``). The row amaxes are warp shuffles, the column
    amaxes cross the warps (a small shared-memory reduction), and the columnwise codes are
    stored from ``col_l``, the same registers renumbered."""
    pid_m, pid_k = _tile_ids(K_FAST)
    rows = pid_m * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, row_l))
    cols = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, row_l))
    rows2 = gl.expand_dims(rows, 1).to(gl.int64)
    cols2 = gl.expand_dims(cols, 0)
    x = gl.load(x_ptr + rows2 * stride_xm + cols2).to(gl.float32)
    a = abs_bits(x)

    # rowwise: 1x128 blocks are whole rows of the tile
    s_r = current_scale(gl.max(a, axis=1), eps, FP8_MAX, POW2)
    gl.store(rs_ptr + rows.to(gl.int64) * (K // 128) + pid_k, s_r)
    gl.store(rd_ptr + pid_k.to(gl.int64) * M + rows, decode_scale(s_r))
    q = fp8_codes(x * gl.expand_dims(s_r, 1), MBITS, BIAS, MAX_BITS, True, True)
    gl.store(rq_ptr + rows2 * K + cols2, q)

    # columnwise: 128x1 blocks are whole columns of the tile
    s_c = current_scale(gl.max(a, axis=0), eps, FP8_MAX, POW2)
    gl.store(cs_ptr + cols.to(gl.int64) * (M // 128) + pid_m, s_c)
    gl.store(cd_ptr + pid_m.to(gl.int64) * K + cols, decode_scale(s_c))
    q_c = fp8_codes(x * gl.expand_dims(s_c, 0), MBITS, BIAS, MAX_BITS, True)
    at_c = gl.convert_layout(gl.expand_dims(cols.to(gl.int64), 0) * M + rows2, col_l,
                             assert_trivial=True)
    gl.store(cq_ptr + at_c, gl.convert_layout(q_c, col_l, assert_trivial=True))
