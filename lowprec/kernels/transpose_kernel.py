"""Triton kernel of ``lowprec.kernels.transpose`` (imported on first launch)."""

import triton
import triton.language as tl


@triton.jit
def transpose_kernel(x_ptr, y_ptr, M, N, stride_xm, BM: tl.constexpr, BN: tl.constexpr):
    """y (N, M) contiguous = x (M, N) with unit inner stride, transposed: one (BM, BN)
    tile a program, read and written along rows of its own layout."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tile = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rn[None, :], mask=mask)
    out = rn[:, None].to(tl.int64) * M + rm[None, :]
    tl.store(y_ptr + out, tl.trans(tile), mask=(rn[:, None] < N) & (rm[None, :] < M))
