"""Gluon kernels of the 1x128 block FP8 quantize: the columnwise usage alone, and both
usages in one launch.

Why Gluon: the Triton kernel (``kernels/block_scaled.py``) leaves layouts to the compiler, which
transposes the columnwise fp8 codes byte by byte through shared memory and repeats each
column's scale math in every thread that holds part of the column (docs/performance.md,
"Inside the quantize kernels"). Here the layouts are explicit.

``block1_col_kernel`` (columnwise only, ``_col_tile``):

* each thread loads R consecutive rows of 8 consecutive columns (``load_l``);
* the column amaxes move to one block per thread (``one_l``) for the scale math, and the
  scales are broadcast back;
* the codes are stored from ``store_l``, which differs from ``load_l`` only in register
  order: no data crosses threads, each thread writes R consecutive bytes of a (K, M) row.

``block1_both_kernel`` (both usages of a 128 x 128 tile): the rowwise usage in chunks of
RB rows (16 lanes span a row's 128 columns, so a row amax is 4 shuffles), then the
columnwise usage as ``_col_tile`` over the same tile. The second read finds the tile in
L2, where the first one has just put it, so the input crosses DRAM once while no thread
holds more than a chunk. (Holding the whole tile in registers needs 255 registers at 4
warps and runs slower than two launches.)

Numerics are the shared jit helpers of ``kernels/fp8_cast.py`` (bit for bit the
reference, ``block/reference.py``). The launcher guarantees M % 128 == 0 (K % 128 == 0
for both usages), a unit inner stride and no prologue. Only ``launch.py`` imports this
module, and only when Gluon imports.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...kernels.fp8_cast import abs_bits, current_scale, decode_scale, fp8_codes
from ...kernels.gluon_tiles import tile_ids


@gluon.constexpr_function
def _col_layouts(R, T, WARPS):
    """(load_l, store_l, one_l) of a (128, 8 * T) columnwise tile."""
    assert R * (32 // T) * WARPS == 128, "one 128-row block per program"
    return (gl.BlockedLayout([R, 8], [32 // T, T], [WARPS, 1], [1, 0]),
            gl.BlockedLayout([R, 8], [32 // T, T], [WARPS, 1], [0, 1]),
            gl.BlockedLayout([1], [32], [WARPS], [0]))


@gluon.jit
def _col_load(x_ptr, K, stride_xm, pid_m, pid_k, R: gl.constexpr, T: gl.constexpr,
              WARPS: gl.constexpr, POLICY: gl.constexpr):
    """The (128, 8 * T) tile (pid_m, pid_k) of x, columns past K zero, loaded with L2
    eviction policy ``POLICY``."""
    load_l: gl.constexpr = _col_layouts(R, T, WARPS)[0]
    offs_m = pid_m * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, load_l))
    offs_k = pid_k * (8 * T) + gl.arange(0, 8 * T, layout=gl.SliceLayout(0, load_l))
    return gl.load(x_ptr + offs_m.to(gl.int64)[:, None] * stride_xm + offs_k[None, :],
                   mask=(offs_k < K)[None, :], other=0.0, eviction_policy=POLICY)


@gluon.jit
def _col_store(x, cq_ptr, cs_ptr, cd_ptr, M, K, eps, pid_m, pid_k, FP8_MAX: gl.constexpr,
               POW2: gl.constexpr, MBITS: gl.constexpr, BIAS: gl.constexpr,
               MAX_BITS: gl.constexpr, R: gl.constexpr, T: gl.constexpr,
               WARPS: gl.constexpr):
    """Columnwise codes, scales and decode scales of the tile ``_col_load`` read."""
    BN: gl.constexpr = 8 * T
    load_l: gl.constexpr = _col_layouts(R, T, WARPS)[0]
    store_l: gl.constexpr = _col_layouts(R, T, WARPS)[1]
    one_l: gl.constexpr = _col_layouts(R, T, WARPS)[2]
    x = x.to(gl.float32)
    s_c = current_scale(gl.convert_layout(gl.max(abs_bits(x), axis=0), one_l), eps, FP8_MAX,
                        POW2)
    sk = pid_k * BN + gl.arange(0, BN, layout=one_l)
    gl.store(cs_ptr + sk.to(gl.int64) * (M // 128) + pid_m, s_c, mask=sk < K)
    gl.store(cd_ptr + pid_m.to(gl.int64) * K + sk, decode_scale(s_c), mask=sk < K)
    q = fp8_codes(x * gl.convert_layout(s_c, gl.SliceLayout(0, load_l))[None, :], MBITS, BIAS,
                  MAX_BITS, True)
    q = gl.convert_layout(q, store_l)  # register order only
    offs_m = pid_m * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, store_l))
    offs_k = pid_k * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, store_l))
    gl.store(cq_ptr + offs_k.to(gl.int64)[None, :] * M + offs_m[:, None], q,
             mask=(offs_k < K)[None, :])


@gluon.jit
def block1_col_kernel(x_ptr, cq_ptr, cs_ptr, cd_ptr, M, K, stride_xm, eps,
                      FP8_MAX: gl.constexpr, POW2: gl.constexpr, MBITS: gl.constexpr,
                      BIAS: gl.constexpr, MAX_BITS: gl.constexpr, R: gl.constexpr,
                      T: gl.constexpr, WARPS: gl.constexpr, K_FAST: gl.constexpr = False):
    """Columnwise usage of one (128, 8 * T) tile; columns past K are masked. ``K_FAST``:
    grid axis 0 runs along K."""
    pid_m, pid_k = tile_ids(K_FAST)
    x = _col_load(x_ptr, K, stride_xm, pid_m, pid_k, R, T, WARPS, "")
    _col_store(x, cq_ptr, cs_ptr, cd_ptr, M, K, eps, pid_m, pid_k, FP8_MAX, POW2, MBITS, BIAS,
               MAX_BITS, R, T, WARPS)


@gluon.constexpr_function
def _row_layout(WARPS):
    """Layout of a rowwise chunk: each thread holds 8 consecutive columns (16 bytes of
    bf16), 16 lanes span a 1x128 block."""
    return gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])


@gluon.jit
def _row_load(x_ptr, stride_xm, row0, pid_k, RB: gl.constexpr, WARPS: gl.constexpr,
              POLICY: gl.constexpr):
    """Rows row0 .. row0 + RB of 1x128 block column pid_k, loaded with L2 eviction policy
    ``POLICY``."""
    row_l: gl.constexpr = _row_layout(WARPS)
    rows = row0 + gl.arange(0, RB, layout=gl.SliceLayout(1, row_l))
    cols = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, row_l))
    return gl.load(x_ptr + gl.expand_dims(rows, 1).to(gl.int64) * stride_xm
                   + gl.expand_dims(cols, 0), eviction_policy=POLICY)


@gluon.jit
def _row_store(x, rq_ptr, rs_ptr, rd_ptr, M, K, eps, row0, pid_k, FP8_MAX: gl.constexpr,
               POW2: gl.constexpr, MBITS: gl.constexpr, BIAS: gl.constexpr,
               MAX_BITS: gl.constexpr, RB: gl.constexpr, WARPS: gl.constexpr):
    """Rowwise codes, scales and decode scales of the rows ``_row_load`` read."""
    row_l: gl.constexpr = _row_layout(WARPS)
    rows = row0 + gl.arange(0, RB, layout=gl.SliceLayout(1, row_l))
    cols = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, row_l))
    x = x.to(gl.float32)
    s_r = current_scale(gl.max(abs_bits(x), axis=1), eps, FP8_MAX, POW2)
    gl.store(rs_ptr + rows.to(gl.int64) * (K // 128) + pid_k, s_r)
    gl.store(rd_ptr + pid_k.to(gl.int64) * M + rows, decode_scale(s_r))
    q = fp8_codes(x * gl.expand_dims(s_r, 1), MBITS, BIAS, MAX_BITS, True)
    gl.store(rq_ptr + gl.expand_dims(rows, 1).to(gl.int64) * K + gl.expand_dims(cols, 0), q)


@gluon.jit
def block1_both_kernel(x_ptr, rq_ptr, rs_ptr, rd_ptr, cq_ptr, cs_ptr, cd_ptr, M, K,
                       stride_xm, eps, FP8_MAX: gl.constexpr, POW2: gl.constexpr,
                       MBITS: gl.constexpr, BIAS: gl.constexpr, MAX_BITS: gl.constexpr,
                       RB: gl.constexpr, R: gl.constexpr, T: gl.constexpr,
                       WARPS: gl.constexpr, K_FAST: gl.constexpr = False,
                       EVICT: gl.constexpr = True):
    """Both usages of one 128 x 128 tile (K % 128 == 0: no masks): the rowwise usage in
    chunks of RB rows, then the columnwise usage in (128, 8 * T) pieces read again, from
    L2. ``EVICT``: hint L2 to keep the tile after the first read and drop it after the
    second.

    The compiler keeps a load behind earlier stores (they might alias it), so each row
    chunk's load, and the first columnwise piece's, is issued by hand before the previous
    chunk is converted and stored. The columnwise pieces are not overlapped so: holding two
    of them took 162 registers (three programs an SM) and ran 7% slower (H200)."""
    NR: gl.constexpr = 128 // RB
    NC: gl.constexpr = 128 // (8 * T)
    FIRST: gl.constexpr = "evict_last" if EVICT else ""
    SECOND: gl.constexpr = "evict_first" if EVICT else ""
    pid_m, pid_k = tile_ids(K_FAST)
    x = _row_load(x_ptr, stride_xm, pid_m * 128, pid_k, RB, WARPS, FIRST)
    for c in gl.static_range(NR):
        if c + 1 < NR:
            nxt = _row_load(x_ptr, stride_xm, pid_m * 128 + (c + 1) * RB, pid_k, RB, WARPS,
                            FIRST)
        else:
            y = _col_load(x_ptr, K, stride_xm, pid_m, pid_k * NC, R, T, WARPS, SECOND)
        _row_store(x, rq_ptr, rs_ptr, rd_ptr, M, K, eps, pid_m * 128 + c * RB, pid_k, FP8_MAX,
                   POW2, MBITS, BIAS, MAX_BITS, RB, WARPS)
        if c + 1 < NR:
            x = nxt
    for j in gl.static_range(NC):
        _col_store(y, cq_ptr, cs_ptr, cd_ptr, M, K, eps, pid_m, pid_k * NC + j, FP8_MAX, POW2,
                   MBITS, BIAS, MAX_BITS, R, T, WARPS)
        if j + 1 < NC:
            y = _col_load(x_ptr, K, stride_xm, pid_m, pid_k * NC + j + 1, R, T, WARPS, SECOND)
