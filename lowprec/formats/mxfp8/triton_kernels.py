"""Triton kernel for MXFP8 (E8M0 scales; 1x32 / 32x1 blocks, or 32x32), one pass per tile.

Each program loads one (BM, BN) tile of x once (BM, BN multiples of 32 where that direction
is blocked), computes the 1x32 row-block and/or 32x1 column-block exponents (or the 32x32
ones) from int32 amaxes of the bit patterns, and writes the rowwise data (M, K) and the
columnwise data (K, M) with their uint8 E8M0 codes. Numerics are those of
``mxfp8/reference.py``: ``e`` = exponent of the smallest power of two >= fp32(amax / fp8_max)
(correctly rounded division), clamped to [-127, 127], zero -> -127, non-finite -> code 255
with data cast at scale 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...fused.triton_prologue import load_tile
from ..float8.triton_kernels import abs_bits, fp8_codes, store_t


@triton.jit
def e8m0_scale(amax_bits, FP8_MAX: tl.constexpr, ALT: tl.constexpr = False):
    """(uint8 E8M0 code, fp32 multiplier 2**-e) for int32 amax bit patterns (any shape).

    ``ALT`` computes the code with other (equivalent) ops, so that a second copy stays a
    chain of its own (see ``float8.triton_kernels.cast_kernel``)."""
    finite = amax_bits < 0x7F800000
    amax = amax_bits.to(tl.float32, bitcast=True)
    v = tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX)
    vb = v.to(tl.int32, bitcast=True)
    ex = vb >> 23
    mant = vb & 0x7FFFFF
    # Smallest power of two >= v: normal v rounds its exponent up unless v is a power of two;
    # a subnormal v (< 2**-126) needs 2**-126 when above 2**-127, else 2**-127 (and zero).
    e = tl.where(ex == 0, tl.where(mant > 0x400000, -126, -127),
                 ex - 127 + (mant != 0).to(tl.int32))
    e = tl.minimum(tl.maximum(e, -127), 127)
    e = tl.where(finite, e, 0)
    if ALT:
        code = (tl.where(finite, e, 128) + 127).to(tl.uint8)
    else:
        code = tl.where(finite, e + 127, 255).to(tl.uint8)
    neg = -e
    mult = tl.where(neg >= -126, (neg + 127) << 23, 0x400000).to(tl.float32, bitcast=True)
    return code, mult


@triton.jit
def _mxfp8_tile(pid_m, pid_k, x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, stride_xm, stride_xk,
                p0, p1, p2, p3, PRO: tl.constexpr,
                FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                MAX_BITS: tl.constexpr, HW_CVT: tl.constexpr, TWO_D: tl.constexpr,
                ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, COL_MODE: tl.constexpr):
    BLK: tl.constexpr = 32
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BN + tl.arange(0, BN)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    offs_m64 = offs_m.to(tl.int64)
    x = load_tile(x_ptr, offs_m, offs_k, M, K, stride_xm, stride_xk, p0, p1, p2, p3, PRO)
    a = abs_bits(x)
    if TWO_D:
        amax = tl.max(tl.max(tl.reshape(a, (BM // BLK, BLK, BN // BLK, BLK)), 3), 1)
        code, mult = e8m0_scale(amax, FP8_MAX)  # (BM/32, BN/32)
        x4 = tl.reshape(x, (BM // BLK, BLK, BN // BLK, BLK))
        y = tl.reshape(x4 * mult[:, None, :, None], (BM, BN))
        sm = pid_m * (BM // BLK) + tl.arange(0, BM // BLK)
        sk = pid_k * (BN // BLK) + tl.arange(0, BN // BLK)
        smask = (sm < M // BLK)[:, None] & (sk < K // BLK)[None, :]
        if ROWWISE:
            tl.store(rq_ptr + offs_m64[:, None] * K + offs_k[None, :],
                     fp8_codes(y, MBITS, BIAS, MAX_BITS, HW_CVT), mask=mask)
            tl.store(rs_ptr + sm[:, None] * (K // BLK) + sk[None, :], code, mask=smask)
        if COLWISE:
            # a chain of its own when the rowwise codes exist too (see float8 cast_kernel)
            store_t(cq_ptr, offs_m, offs_k, M, K, M,
                    fp8_codes(y, MBITS, BIAS, MAX_BITS, HW_CVT, ROWWISE), COL_MODE)
            code_c, _ = e8m0_scale(amax, FP8_MAX, ROWWISE)
            store_t(cs_ptr, sm, sk, M // BLK, K // BLK, M // BLK, code_c, COL_MODE)
    else:
        if ROWWISE:
            amax_r = tl.max(tl.reshape(a, (BM, BN // BLK, BLK)), 2)
            code_r, mult_r = e8m0_scale(amax_r, FP8_MAX)  # (BM, BN/32)
            x3 = tl.reshape(x, (BM, BN // BLK, BLK))
            q = fp8_codes(tl.reshape(x3 * mult_r[:, :, None], (BM, BN)), MBITS, BIAS, MAX_BITS,
                          HW_CVT)
            tl.store(rq_ptr + offs_m64[:, None] * K + offs_k[None, :], q, mask=mask)
            sk = pid_k * (BN // BLK) + tl.arange(0, BN // BLK)
            tl.store(rs_ptr + offs_m64[:, None] * (K // BLK) + sk[None, :], code_r,
                     mask=(offs_m < M)[:, None] & (sk < K // BLK)[None, :])
        if COLWISE:
            amax_c = tl.max(tl.reshape(a, (BM // BLK, BLK, BN)), 1)
            code_c, mult_c = e8m0_scale(amax_c, FP8_MAX)  # (BM/32, BN)
            x3 = tl.reshape(x, (BM // BLK, BLK, BN))
            y = tl.reshape(x3 * mult_c[:, None, :], (BM, BN))
            store_t(cq_ptr, offs_m, offs_k, M, K, M, fp8_codes(y, MBITS, BIAS, MAX_BITS, HW_CVT),
                    COL_MODE)
            sm = pid_m * (BM // BLK) + tl.arange(0, BM // BLK)
            store_t(cs_ptr, sm, offs_k, M // BLK, K, M // BLK, code_c, COL_MODE)


@triton.jit
def mxfp8_quant_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, stride_xm, stride_xk,
                       p0, p1, p2, p3, PRO: tl.constexpr,
                       FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                       MAX_BITS: tl.constexpr, HW_CVT: tl.constexpr, TWO_D: tl.constexpr,
                       ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, COL_MODE: tl.constexpr,
                       ITERS: tl.constexpr = 1, STAGES: tl.constexpr = 1):
    """One program quantizes ITERS (BM, BN) tiles down a column of tiles; with STAGES > 1
    the loads of the next tiles are issued (asynchronously) while one is converted."""
    pid_k = tl.program_id(1)
    for t in tl.range(0, ITERS, num_stages=STAGES):
        _mxfp8_tile(tl.program_id(0) * ITERS + t, pid_k, x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr,
                    M, K, stride_xm, stride_xk, p0, p1, p2, p3, PRO, FP8_MAX, MBITS, BIAS, MAX_BITS,
                    HW_CVT, TWO_D, ROWWISE, COLWISE, BM, BN, COL_MODE)
