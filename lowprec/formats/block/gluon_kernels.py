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

``block1_both_kernel`` (both usages, one read): a 128 x 128 tile is copied to shared memory
in pieces of 4 * WARPS rows (``cp.async``, one commit group each, all in flight at once). Pass 1
takes each piece as it lands, in a row layout: the rowwise blocks are whole rows of the
piece, so their codes and scales are written at once, and the column maxima accumulate
elementwise. Pass 2 reads the pieces back in a column layout (each thread 8 consecutive
rows of 2 columns) and writes the columnwise codes. Registers stay small (16 elements a
thread), so several programs share an SM and their copies overlap.

Numerics are the shared jit helpers of ``float8/triton_kernels.py`` (bit for bit the
reference, ``block/reference.py``). The launcher guarantees M % 128 == 0 (K % 128 == 0
for both usages), a unit inner stride and no prologue. Only ``launch.py`` imports this
module, and only when Gluon imports.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

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


@gluon.jit
def block1_both_kernel(x_ptr, rq_ptr, rs_ptr, rd_ptr, cq_ptr, cs_ptr, cd_ptr, M, K,
                       stride_xm, eps, FP8_MAX: gl.constexpr, POW2: gl.constexpr,
                       MBITS: gl.constexpr, BIAS: gl.constexpr, MAX_BITS: gl.constexpr,
                       WARPS: gl.constexpr, K_FAST: gl.constexpr = False):
    """Both usages of one 128 x 128 tile from one read (K % 128 == 0: no masks), in pieces
    of CHUNK = 4 * WARPS rows: 2 rows of 8 columns a thread in the row layout, 8 rows of 2
    columns in the column layout, each covering a piece exactly."""
    CHUNK: gl.constexpr = 4 * WARPS
    NCH: gl.constexpr = 128 // CHUNK
    row_l: gl.constexpr = gl.BlockedLayout([2, 8], [2, 16], [WARPS, 1], [1, 0])
    col_l: gl.constexpr = gl.BlockedLayout([8, 2], [1, 32], [WARPS // 2, 2], [0, 1])
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    tile = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NCH, CHUNK, 128],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    pid_m, pid_k = _tile_ids(K_FAST)
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, row_l))
    cols = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, row_l))
    for c in gl.static_range(NCH):
        m64 = (pid_m * 128 + c * CHUNK + rows).to(gl.int64)
        async_copy.async_copy_global_to_shared(tile.index(c),
                                               x_ptr + m64[:, None] * stride_xm + cols[None, :])
        async_copy.commit_group()

    # pass 1, row layout: rowwise codes and scales, column maxima
    acc = gl.zeros([CHUNK, 128], gl.int32, row_l)
    for c in gl.static_range(NCH):
        async_copy.wait_group(NCH - 1 - c)  # this thread's copies of piece c have landed
        x = tile.index(c).load(row_l).to(gl.float32)
        a = abs_bits(x)
        acc = gl.maximum(acc, a)
        s_r = current_scale(gl.max(a, axis=1), eps, FP8_MAX, POW2)
        m = pid_m * 128 + c * CHUNK + rows
        gl.store(rs_ptr + m.to(gl.int64) * (K // 128) + pid_k, s_r)
        gl.store(rd_ptr + pid_k.to(gl.int64) * M + m, decode_scale(s_r))
        q = fp8_codes(x * s_r[:, None], MBITS, BIAS, MAX_BITS, True, True)
        gl.store(rq_ptr + m.to(gl.int64)[:, None] * K + cols[None, :], q)

    # pass 2, column layout: columnwise scales and codes
    s_c, d_c = _scales(gl.max(acc, axis=0), eps, one_l, FP8_MAX, POW2)
    sk = pid_k * 128 + gl.arange(0, 128, layout=one_l)
    gl.store(cs_ptr + sk.to(gl.int64) * (M // 128) + pid_m, s_c)
    gl.store(cd_ptr + pid_m.to(gl.int64) * K + sk, d_c)
    s_c = gl.convert_layout(s_c, gl.SliceLayout(0, col_l))
    gl.thread_barrier()  # every thread's pieces are in shared memory
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, col_l))
    cols64 = (pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, col_l))).to(gl.int64)
    for c in gl.static_range(NCH):
        x = tile.index(c).load(col_l).to(gl.float32)
        q = fp8_codes(x * s_c[None, :], MBITS, BIAS, MAX_BITS, True)
        gl.store(cq_ptr + cols64[None, :] * M + (pid_m * 128 + c * CHUNK + rows)[:, None], q)
