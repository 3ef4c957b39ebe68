"""@triton.jit kernels of the GEMM backends (launchers: :mod:`lowprec.backends.kernels`).

Imported only when a launcher runs on CUDA with Triton available.
"""

import triton
import triton.language as tl


@triton.jit
def mxfp8_dequant_bf16_kernel(data_ptr, scale_ptr, out_ptr, R, C, SC,
                              BLOCK_ROWS: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr):
    """out[r, c] = bf16(data[r, c] * 2**(scale[r // BLOCK_ROWS, c // 32] - 127)); code 255 -> NaN.

    One pass, fp8 in, bf16 out; each program takes BR rows x NB blocks of 32, held as a
    (BR, NB, 32) tile so a block's scale broadcasts along the last axis. The product
    has at most 4 significant bits and an exponent inside fp32's range, so the fp32
    multiply and the rounding to bf16 are exact (bf16 subnormals aside).
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    blocks = pid_c * NB + tl.arange(0, NB)
    lane = tl.arange(0, 32)
    row_ok = rows < R
    blk_ok = blocks < SC
    mask = (row_ok[:, None] & blk_ok[None, :])[:, :, None]
    offs = (rows.to(tl.int64)[:, None, None] * C + (blocks * 32)[None, :, None]
            + lane[None, None, :])
    x = tl.load(data_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s_offs = (rows // BLOCK_ROWS).to(tl.int64)[:, None] * SC + blocks[None, :]
    s = tl.load(scale_ptr + s_offs, mask=row_ok[:, None] & blk_ok[None, :], other=127)
    s = s.to(tl.int32)
    # 2**(s - 127) from its bits: s >= 1 is a normal float; s == 0 is the subnormal 2**-127.
    bits = tl.where(s == 0, 0x00400000, s << 23)
    f = bits.to(tl.float32, bitcast=True)
    f = tl.where(s == 255, float("nan"), f)
    tl.store(out_ptr + offs, (x * f[:, :, None]).to(tl.bfloat16), mask=mask)


@triton.jit
def scale_bias_epilogue_kernel(acc_ptr, out_ptr, div_a_ptr, div_b_ptr, bias_ptr, M, N,
                               HAS_DIV_A: tl.constexpr, HAS_DIV_B: tl.constexpr,
                               HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """out = ((acc / div_a) / div_b + bias) in fp32, rounded once to out's dtype."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    v = tl.load(acc_ptr + offs, mask=mask, other=0.0)
    if HAS_DIV_A:
        v = tl.math.div_rn(v, tl.load(div_a_ptr))
    if HAS_DIV_B:
        v = tl.math.div_rn(v, tl.load(div_b_ptr))
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm_alpha_kernel(div_a_ptr, div_b_ptr, out_ptr, HAS_DIV_A: tl.constexpr,
                      HAS_DIV_B: tl.constexpr):
    """out[0] = RN32(RN64(1 / (div_a * div_b))) (the fp64 product is exact), clamped to the
    fp32 maximum (so that 0 * alpha stays 0); out[1] = 0 (cuBLAS's beta). A missing
    divisor counts as 1."""
    p = tl.full((1,), 1.0, tl.float64)
    if HAS_DIV_A:
        p = p * tl.load(div_a_ptr + tl.arange(0, 1)).to(tl.float64)
    if HAS_DIV_B:
        p = p * tl.load(div_b_ptr + tl.arange(0, 1)).to(tl.float64)
    alpha = (1.0 / p).to(tl.float32)
    alpha = tl.where(alpha > 3.4028234663852886e38, 3.4028234663852886e38, alpha)
    tl.store(out_ptr + tl.arange(0, 1), alpha)
    tl.store(out_ptr + 1 + tl.arange(0, 1), tl.zeros((1,), tl.float32))
