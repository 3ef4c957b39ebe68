"""@triton.jit kernel of the routed rows' sum into their tokens (launcher:
:mod:`lowprec.kernels.token_sum`): each token's ``K`` rows added one at a time in the
given order, from zero, rounded to the rows' dtype after each add, as that many torch adds
of 16-bit tensors round (fp32 arithmetic, round to nearest even).

Imported only when a launcher runs on CUDA with Triton available.
"""

import triton
import triton.language as tl


@triton.jit
def token_sum_kernel(rows_ptr, idx_ptr, out_ptr, T, H, s_r, s_o,
                     K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """``out[t] = (...((0 + rows[idx[t, 0]]) + rows[idx[t, 1]]) ...)`` for a (BT, BH) tile."""
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    tmask = tokens < T
    mask = tmask[:, None] & (cols < H)[None, :]
    acc = tl.zeros((BT, BH), dtype=out_ptr.dtype.element_ty)
    for j in tl.static_range(K):
        row = tl.load(idx_ptr + tokens.to(tl.int64) * K + j, mask=tmask, other=0)
        v = tl.load(rows_ptr + row[:, None] * s_r + cols[None, :], mask=mask, other=0.0)
        acc = (acc.to(tl.float32) + v.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * s_o + cols[None, :], acc, mask=mask)
