"""Triton kernel for block-scaled FP8 (1x128 / 128x1 and 128x128 blocks), one pass per tile.

Each program loads one (BM, BN) tile of x once (BM, BN multiples of 128 where that
direction is blocked), computes the row-block scales and/or the column-block scales from
int32 amaxes of the bit patterns, and writes the rowwise data (M, K) and the columnwise data
(K, M, the 128x1 quantization of the transposed matrix) with their fp32 encode scales.
Numerics are those of ``block/reference.py`` (see ``float8/triton_kernels.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...fused.triton_prologue import load_tile
from ..float8.triton_kernels import abs_bits, current_scale, fp8_codes, store_t


@triton.jit
def _block_tile(pid_m, pid_k, x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, stride_xm, stride_xk,
                p0, p1, p2, p3, eps, PRO: tl.constexpr,
                FP8_MAX: tl.constexpr, POW2: tl.constexpr, MBITS: tl.constexpr,
                BIAS: tl.constexpr, MAX_BITS: tl.constexpr, HW_CVT: tl.constexpr,
                TWO_D: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, COL_MODE: tl.constexpr):
    BLK: tl.constexpr = 128
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BN + tl.arange(0, BN)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    offs_m64 = offs_m.to(tl.int64)
    x = load_tile(x_ptr, offs_m, offs_k, M, K, stride_xm, stride_xk, p0, p1, p2, p3, PRO)
    a = abs_bits(x)
    if TWO_D:
        # 128x128 blocks shared by both directions (M, K both divisible by 128).
        amax = tl.max(tl.max(tl.reshape(a, (BM // BLK, BLK, BN // BLK, BLK)), 3), 1)
        s = current_scale(amax, eps, FP8_MAX, POW2)  # (BM/128, BN/128)
        x4 = tl.reshape(x, (BM // BLK, BLK, BN // BLK, BLK))
        y = tl.reshape(x4 * s[:, None, :, None], (BM, BN))
        sm = pid_m * (BM // BLK) + tl.arange(0, BM // BLK)
        sk = pid_k * (BN // BLK) + tl.arange(0, BN // BLK)
        smask = (sm < M // BLK)[:, None] & (sk < K // BLK)[None, :]
        if ROWWISE:
            tl.store(rq_ptr + offs_m64[:, None] * K + offs_k[None, :],
                     fp8_codes(y, MBITS, BIAS, MAX_BITS, HW_CVT), mask=mask)
            tl.store(rs_ptr + sm[:, None] * (K // BLK) + sk[None, :], s, mask=smask)
        if COLWISE:
            # a chain of its own when the rowwise codes exist too (see float8 cast_kernel)
            store_t(cq_ptr, offs_m, offs_k, M, K, M,
                    fp8_codes(y, MBITS, BIAS, MAX_BITS, HW_CVT, ROWWISE), COL_MODE)
            store_t(cs_ptr, sm, sk, M // BLK, K // BLK, M // BLK, s, COL_MODE)
    else:
        if ROWWISE:
            # 1x128 blocks along K (K divisible by 128).
            amax_r = tl.max(tl.reshape(a, (BM, BN // BLK, BLK)), 2)
            s_r = current_scale(amax_r, eps, FP8_MAX, POW2)  # (BM, BN/128)
            x3 = tl.reshape(x, (BM, BN // BLK, BLK))
            q = fp8_codes(tl.reshape(x3 * s_r[:, :, None], (BM, BN)), MBITS, BIAS, MAX_BITS,
                          HW_CVT)
            tl.store(rq_ptr + offs_m64[:, None] * K + offs_k[None, :], q, mask=mask)
            sk = pid_k * (BN // BLK) + tl.arange(0, BN // BLK)
            tl.store(rs_ptr + offs_m64[:, None] * (K // BLK) + sk[None, :], s_r,
                     mask=(offs_m < M)[:, None] & (sk < K // BLK)[None, :])
        if COLWISE:
            # 128x1 blocks along M (M divisible by 128).
            amax_c = tl.max(tl.reshape(a, (BM // BLK, BLK, BN)), 1)
            s_c = current_scale(amax_c, eps, FP8_MAX, POW2)  # (BM/128, BN)
            x3 = tl.reshape(x, (BM // BLK, BLK, BN))
            y = tl.reshape(x3 * s_c[:, None, :], (BM, BN))
            store_t(cq_ptr, offs_m, offs_k, M, K, M, fp8_codes(y, MBITS, BIAS, MAX_BITS, HW_CVT),
                    COL_MODE)
            sm = pid_m * (BM // BLK) + tl.arange(0, BM // BLK)
            store_t(cs_ptr, sm, offs_k, M // BLK, K, M // BLK, s_c, COL_MODE)


@triton.jit
def block_quant_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, stride_xm, stride_xk,
                       p0, p1, p2, p3, eps, PRO: tl.constexpr,
                       FP8_MAX: tl.constexpr, POW2: tl.constexpr, MBITS: tl.constexpr,
                       BIAS: tl.constexpr, MAX_BITS: tl.constexpr, HW_CVT: tl.constexpr,
                       TWO_D: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, COL_MODE: tl.constexpr,
                       ITERS: tl.constexpr = 1, STAGES: tl.constexpr = 1):
    """One program quantizes ITERS (BM, BN) tiles down a column of tiles; with STAGES > 1
    the loads of the next tiles are issued (asynchronously) while one is converted."""
    pid_k = tl.program_id(1)
    for t in tl.range(0, ITERS, num_stages=STAGES):
        _block_tile(tl.program_id(0) * ITERS + t, pid_k, x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr,
                    M, K, stride_xm, stride_xk, p0, p1, p2, p3, eps, PRO, FP8_MAX, POW2,
                    MBITS, BIAS, MAX_BITS, HW_CVT, TWO_D, ROWWISE, COLWISE, BM, BN, COL_MODE)
