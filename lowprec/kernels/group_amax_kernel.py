"""@triton.jit kernel of the per-group amax over row groups (launcher:
:mod:`lowprec.kernels.group_amax`).

Each |value| is taken as its fp32 bits with the sign cleared: non-negative floats order as
those int32 bits, and NaN (any payload) lies above +Inf, so an integer max is the float max
with NaN propagating. Each program reduces ``BR`` rows to one max a row and adds them to
their groups' slots with ``atomic_max``: a max is the same whatever order it is taken in.

Imported only when a launcher runs on CUDA with Triton available.
"""

import triton
import triton.language as tl


@triton.jit
def group_amax_kernel(x_ptr, ids_ptr, out_ptr, M, K, s_m,
                      BR: tl.constexpr, BK: tl.constexpr):
    """``out[ids[r]] = max(out[ids[r]], bits(max_k |x[r, k]|))`` for BR rows ``r``."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < M
    base = x_ptr + rows.to(tl.int64)[:, None] * s_m
    acc = tl.zeros((BR, BK), dtype=tl.int32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        v = tl.load(base + cols[None, :], mask=rmask[:, None] & (cols < K)[None, :], other=0.0)
        bits = v.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        acc = tl.maximum(acc, bits)
    row_max = tl.max(acc, axis=1)
    group = tl.load(ids_ptr + rows, mask=rmask, other=0)
    tl.atomic_max(out_ptr + group, row_max, mask=rmask, sem="relaxed")
