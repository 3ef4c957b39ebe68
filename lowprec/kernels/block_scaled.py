"""The one-pass Triton kernel of the block-scaled FP8 formats, one (BM, BN) tile at a time.

Two formats share it, told apart by ``E8M0`` and the block size ``BLK``:

* Float8Block (``E8M0=False``, ``BLK=128``): 1x128 / 128x1 or 128x128 blocks, fp32 encode
  scales from the current-scaling rule (``block/reference.py``);
* MXFP8 (``E8M0=True``, ``BLK=32``): 1x32 / 32x1 or 32x32 blocks, uint8 E8M0 codes with the
  multiplier 2**-e (``mxfp8/reference.py``).

Each program loads one tile of x once (BM, BN multiples of BLK where that direction is
blocked), takes the row-block and/or column-block amaxes (int32 bit patterns), and writes the
rowwise data (M, K) and the columnwise data (K, M, the blocks running along M) with their
scales. Numerics: see ``fp8_cast.py`` and ``e8m0.py``.

With ``DECODE`` (Float8Block only) it also writes each direction's decode scales
(``1 / scale``, correctly rounded as ``torch.reciprocal``) in the layout cuBLAS reads them
(``gemm/cublas_fp8.py``): for 1-D blocks the transpose of the scales, (K/128, M) rowwise
and (M/128, K) columnwise; for 128x128 blocks the scales' own layout.

With ``EXACT_ROW`` / ``EXACT_COL`` (MXFP8 only) it also writes that direction's exact bf16
values ``data * 2**e`` in the data's layout (``re_ptr`` (M, K), ``ce_ptr`` (K, M)): what the
bf16 GEMM emulation consumes, bit for bit the dequantize kernel's output
(``formats/mxfp8/triton_kernels.py``), so an operand consumed at once needs no dequantize pass.
``ROW_CODES=False`` / ``COL_CODES=False`` then skip that direction's data and scale stores
(an operand nothing reads but its GEMMs keeps only the exact values; an input keeps only
its columnwise codes for wgrad).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .e8m0 import e8m0_factor, e8m0_scale
from .fp8_cast import abs_bits, current_scale, decode_scale, fp8_codes, fp8_value, store_t, tile_ids
from .prologue import load_tile


@triton.jit
def block_scales(amax, eps, FP8_MAX: tl.constexpr, POW2: tl.constexpr, E8M0: tl.constexpr,
                 ALT: tl.constexpr = False):
    """(stored scale, multiplier) of blocks from their int32 amax bits: the E8M0 code and
    2**-e, or the fp32 encode scale twice. ``ALT``: see ``e8m0_scale``."""
    if E8M0:
        code, mult = e8m0_scale(amax, FP8_MAX, ALT)
        return code, mult
    else:
        s = current_scale(amax, eps, FP8_MAX, POW2)
        return s, s


@triton.jit
def exact_bf16(codes, sc, BM: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr,
               COLS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
               HW_CVT: tl.constexpr):
    """bf16 ``value(codes) * 2**e`` of a (BM, BN) tile whose E8M0 codes ``sc`` are
    (BM / ROWS, BN / COLS), one per ROWS x COLS block: the dequantize kernel's product
    (fp32, exact) rounded to bf16 (exact too, bf16 subnormals aside)."""
    v = tl.reshape(fp8_value(codes, MBITS, BIAS, HW_CVT), (BM // ROWS, ROWS, BN // COLS, COLS))
    f = e8m0_factor(sc)[:, None, :, None]
    return tl.reshape(v * f, (BM, BN)).to(tl.bfloat16)


@triton.jit
def _block_scaled_tile(pid_m, pid_k, x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, rd_ptr, cd_ptr, M,
                       K, stride_xm, stride_xk, p0, p1, p2, p3, eps, PRO: tl.constexpr,
                       FP8_MAX: tl.constexpr, POW2: tl.constexpr, MBITS: tl.constexpr,
                       BIAS: tl.constexpr, MAX_BITS: tl.constexpr, HW_CVT: tl.constexpr,
                       TWO_D: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, COL_MODE: tl.constexpr,
                       E8M0: tl.constexpr, BLK: tl.constexpr, DECODE: tl.constexpr,
                       re_ptr, ce_ptr, EXACT_ROW: tl.constexpr, EXACT_COL: tl.constexpr,
                       ROW_CODES: tl.constexpr, COL_CODES: tl.constexpr):
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BN + tl.arange(0, BN)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    offs_m64 = offs_m.to(tl.int64)
    x = load_tile(x_ptr, offs_m, offs_k, M, K, stride_xm, stride_xk, p0, p1, p2, p3, PRO)
    a = abs_bits(x)
    if TWO_D:
        # BLK x BLK blocks shared by both directions (M, K both divisible by BLK).
        amax = tl.max(tl.max(tl.reshape(a, (BM // BLK, BLK, BN // BLK, BLK)), 3), 1)
        sc, mult = block_scales(amax, eps, FP8_MAX, POW2, E8M0)  # (BM/BLK, BN/BLK)
        x4 = tl.reshape(x, (BM // BLK, BLK, BN // BLK, BLK))
        y = tl.reshape(x4 * mult[:, None, :, None], (BM, BN))
        sm = pid_m * (BM // BLK) + tl.arange(0, BM // BLK)
        sk = pid_k * (BN // BLK) + tl.arange(0, BN // BLK)
        smask = (sm < M // BLK)[:, None] & (sk < K // BLK)[None, :]
        if ROWWISE:
            q = fp8_codes(y, MBITS, BIAS, MAX_BITS, HW_CVT)
            if ROW_CODES:
                tl.store(rq_ptr + offs_m64[:, None] * K + offs_k[None, :], q, mask=mask)
                tl.store(rs_ptr + sm[:, None] * (K // BLK) + sk[None, :], sc, mask=smask)
            if EXACT_ROW:
                tl.store(re_ptr + offs_m64[:, None] * K + offs_k[None, :],
                         exact_bf16(q, sc, BM, BN, BLK, BLK, MBITS, BIAS, HW_CVT), mask=mask)
            if DECODE:
                tl.store(rd_ptr + sm[:, None] * (K // BLK) + sk[None, :], decode_scale(sc),
                         mask=smask)
        if COLWISE:
            # chains of their own when the rowwise codes exist too (see float8 cast_kernel)
            q_c = fp8_codes(y, MBITS, BIAS, MAX_BITS, HW_CVT, ROWWISE)
            sc_c, _ = block_scales(amax, eps, FP8_MAX, POW2, E8M0, ROWWISE)
            if COL_CODES:
                store_t(cq_ptr, offs_m, offs_k, M, K, M, q_c, COL_MODE)
                store_t(cs_ptr, sm, sk, M // BLK, K // BLK, M // BLK, sc_c, COL_MODE)
            if EXACT_COL:
                store_t(ce_ptr, offs_m, offs_k, M, K, M,
                        exact_bf16(q_c, sc_c, BM, BN, BLK, BLK, MBITS, BIAS, HW_CVT), COL_MODE)
            if DECODE:
                store_t(cd_ptr, sm, sk, M // BLK, K // BLK, M // BLK, decode_scale(sc_c),
                        COL_MODE)
    else:
        if ROWWISE:
            # 1 x BLK blocks along K (K divisible by BLK).
            amax_r = tl.max(tl.reshape(a, (BM, BN // BLK, BLK)), 2)
            sc_r, mult_r = block_scales(amax_r, eps, FP8_MAX, POW2, E8M0)  # (BM, BN/BLK)
            x3 = tl.reshape(x, (BM, BN // BLK, BLK))
            q = fp8_codes(tl.reshape(x3 * mult_r[:, :, None], (BM, BN)), MBITS, BIAS, MAX_BITS,
                          HW_CVT)
            sk = pid_k * (BN // BLK) + tl.arange(0, BN // BLK)
            smask = (offs_m < M)[:, None] & (sk < K // BLK)[None, :]
            if ROW_CODES:
                tl.store(rq_ptr + offs_m64[:, None] * K + offs_k[None, :], q, mask=mask)
                tl.store(rs_ptr + offs_m64[:, None] * (K // BLK) + sk[None, :], sc_r,
                         mask=smask)
            if EXACT_ROW:
                tl.store(re_ptr + offs_m64[:, None] * K + offs_k[None, :],
                         exact_bf16(q, sc_r, BM, BN, 1, BLK, MBITS, BIAS, HW_CVT), mask=mask)
            if DECODE:
                tl.store(rd_ptr + sk.to(tl.int64)[None, :] * M + offs_m[:, None],
                         decode_scale(sc_r), mask=smask)
        if COLWISE:
            # BLK x 1 blocks along M (M divisible by BLK).
            amax_c = tl.max(tl.reshape(a, (BM // BLK, BLK, BN)), 1)
            sc_c, mult_c = block_scales(amax_c, eps, FP8_MAX, POW2, E8M0)  # (BM/BLK, BN)
            x3 = tl.reshape(x, (BM // BLK, BLK, BN))
            y = tl.reshape(x3 * mult_c[:, None, :], (BM, BN))
            q_c = fp8_codes(y, MBITS, BIAS, MAX_BITS, HW_CVT)
            sm = pid_m * (BM // BLK) + tl.arange(0, BM // BLK)
            if COL_CODES:
                store_t(cq_ptr, offs_m, offs_k, M, K, M, q_c, COL_MODE)
                store_t(cs_ptr, sm, offs_k, M // BLK, K, M // BLK, sc_c, COL_MODE)
            if EXACT_COL:
                store_t(ce_ptr, offs_m, offs_k, M, K, M,
                        exact_bf16(q_c, sc_c, BM, BN, BLK, 1, MBITS, BIAS, HW_CVT), COL_MODE)
            if DECODE:
                tl.store(cd_ptr + sm.to(tl.int64)[:, None] * K + offs_k[None, :],
                         decode_scale(sc_c),
                         mask=(sm < M // BLK)[:, None] & (offs_k < K)[None, :])


@triton.jit
def block_scaled_quant_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, rd_ptr, cd_ptr, M, K,
                              stride_xm, stride_xk, p0, p1, p2, p3, eps, PRO: tl.constexpr,
                              FP8_MAX: tl.constexpr, POW2: tl.constexpr, MBITS: tl.constexpr,
                              BIAS: tl.constexpr, MAX_BITS: tl.constexpr, HW_CVT: tl.constexpr,
                              TWO_D: tl.constexpr, ROWWISE: tl.constexpr,
                              COLWISE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                              COL_MODE: tl.constexpr, E8M0: tl.constexpr, BLK: tl.constexpr,
                              ITERS: tl.constexpr = 1, STAGES: tl.constexpr = 1,
                              DECODE: tl.constexpr = False, re_ptr=None, ce_ptr=None,
                              EXACT_ROW: tl.constexpr = False,
                              EXACT_COL: tl.constexpr = False,
                              ROW_CODES: tl.constexpr = True, COL_CODES: tl.constexpr = True,
                              K_FAST: tl.constexpr = False):
    """One program quantizes ITERS (BM, BN) tiles down a column of tiles; with STAGES > 1
    the loads of the next tiles are issued (asynchronously) while one is converted.
    ``K_FAST``: grid axis 0 runs along K (programs launched together read neighbouring
    columns of the same rows), else along M."""
    group_m, pid_k, _ = tile_ids(K_FAST)
    eps = tl.cast(eps, tl.float32)  # fp64 where inductor launches it; a float in its analysis
    for t in tl.range(0, ITERS, num_stages=STAGES):
        _block_scaled_tile(group_m * ITERS + t, pid_k, x_ptr, rq_ptr, rs_ptr, cq_ptr,
                           cs_ptr, rd_ptr, cd_ptr, M, K, stride_xm, stride_xk, p0, p1, p2, p3,
                           eps, PRO, FP8_MAX, POW2, MBITS, BIAS, MAX_BITS, HW_CVT, TWO_D,
                           ROWWISE, COLWISE, BM, BN, COL_MODE, E8M0, BLK, DECODE, re_ptr,
                           ce_ptr, EXACT_ROW, EXACT_COL, ROW_CODES, COL_CODES)
