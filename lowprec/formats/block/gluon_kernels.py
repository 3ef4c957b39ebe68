"""Gluon kernel of the 1x128 block FP8 quantize with the columnwise usage (and optionally the
rowwise one from the same read).

Why Gluon: the Triton kernel (``triton_kernels.py``) leaves layouts to the compiler, which
transposes the columnwise fp8 codes byte by byte through shared memory and repeats each
column's scale math in every thread that holds part of the column (docs/performance.md,
"Block scaling on the first shape"). Here the layouts are explicit:

* each thread loads R consecutive rows of 8 consecutive columns (``load_l``);
* the row and column amaxes move to one block per thread (``one_l``) for the scale math,
  and the scales are broadcast back;
* the columnwise codes are stored from ``store_l``, which differs from ``load_l`` only in
  register order: no data crosses threads, each thread writes R consecutive bytes of a
  (K, M) row.

Numerics are the shared jit helpers of ``float8/triton_kernels.py`` (bit for bit the
reference, ``block/reference.py``). One program covers BM = 128 rows (one block along M)
and BN = 8 * T columns; the launcher guarantees M % 128 == 0, a unit inner stride, no
prologue, and BN == 128 with K % 128 == 0 when the rowwise usage is made too. Only
``launch.py`` imports this module, and only when Gluon imports.
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
def block1_quant_kernel(x_ptr, rq_ptr, rs_ptr, rd_ptr, cq_ptr, cs_ptr, cd_ptr, M, K,
                        stride_xm, eps, FP8_MAX: gl.constexpr, POW2: gl.constexpr,
                        MBITS: gl.constexpr, BIAS: gl.constexpr, MAX_BITS: gl.constexpr,
                        ROWWISE: gl.constexpr, R: gl.constexpr, T: gl.constexpr,
                        WARPS: gl.constexpr):
    BM: gl.constexpr = R * (32 // T) * WARPS
    BN: gl.constexpr = 8 * T
    gl.static_assert(BM == 128, "one 128-row block per program")
    gl.static_assert(not ROWWISE or BN == 128, "the rowwise usage needs 128-column tiles")
    load_l: gl.constexpr = gl.BlockedLayout([R, 8], [32 // T, T], [WARPS, 1], [1, 0])
    store_l: gl.constexpr = gl.BlockedLayout([R, 8], [32 // T, T], [WARPS, 1], [0, 1])
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    rows_l: gl.constexpr = gl.SliceLayout(1, load_l)
    cols_l: gl.constexpr = gl.SliceLayout(0, load_l)

    pid_m = gl.program_id(0)
    pid_k = gl.program_id(1)
    offs_m = pid_m * BM + gl.arange(0, BM, layout=rows_l)
    offs_k = pid_k * BN + gl.arange(0, BN, layout=cols_l)
    mask = (offs_k < K)[None, :]  # M % 128 == 0: only columns can fall outside
    x = gl.load(x_ptr + offs_m.to(gl.int64)[:, None] * stride_xm + offs_k[None, :],
                mask=mask, other=0.0)
    a = abs_bits(x.to(gl.float32))

    # columnwise: one 128 x 1 block per column of the tile
    s_c, d_c = _scales(gl.max(a, axis=0), eps, one_l, FP8_MAX, POW2)
    sk = pid_k * BN + gl.arange(0, BN, layout=one_l)
    skmask = sk < K
    gl.store(cs_ptr + sk.to(gl.int64) * (M // 128) + pid_m, s_c, mask=skmask)
    gl.store(cd_ptr + pid_m.to(gl.int64) * K + sk, d_c, mask=skmask)
    if ROWWISE:
        # one 1 x 128 block per row of the tile (K % 128 == 0, so no column is masked)
        s_r, d_r = _scales(gl.max(a, axis=1), eps, one_l, FP8_MAX, POW2)
        sm = pid_m * BM + gl.arange(0, BM, layout=one_l)
        gl.store(rs_ptr + sm.to(gl.int64) * (K // 128) + pid_k, s_r)
        gl.store(rd_ptr + pid_k.to(gl.int64) * M + sm, d_r)
        q_r = fp8_codes(x.to(gl.float32) * gl.convert_layout(s_r, rows_l)[:, None], MBITS,
                        BIAS, MAX_BITS, True, True)
        gl.store(rq_ptr + offs_m.to(gl.int64)[:, None] * K + offs_k[None, :], q_r)
    q_c = fp8_codes(x.to(gl.float32) * gl.convert_layout(s_c, cols_l)[None, :], MBITS, BIAS,
                    MAX_BITS, True)
    q_c = gl.convert_layout(q_c, store_l)  # register order only
    offs_m_st = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, store_l))
    offs_k_st = pid_k * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, store_l))
    gl.store(cq_ptr + offs_k_st.to(gl.int64)[None, :] * M + offs_m_st[:, None], q_c,
             mask=(offs_k_st < K)[None, :])
