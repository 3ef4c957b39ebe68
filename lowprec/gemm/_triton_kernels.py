"""@triton.jit kernels of the GEMM backends (launchers: :mod:`lowprec.gemm.kernels`).

Imported only when a launcher runs on CUDA with Triton available.
"""

import triton
import triton.language as tl


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
