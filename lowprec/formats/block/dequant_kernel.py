"""@triton.jit kernel of the block FP8 bf16 dequantize (launcher: ``dequant.py``).
Imported only when the launcher runs on CUDA with Triton available."""

import triton
import triton.language as tl


@triton.jit
def block_dequant_bf16_kernel(q_ptr, s_ptr, out_ptr, R, C, s_qr, s_sr, s_sc, s_or,
                              BR: tl.constexpr, S_ROWS: tl.constexpr):
    """``bf16(fp32(q) / scale)`` over BR rows of one 128-column block: the reference's fp32
    division (IEEE, ``div_rn``) and round to nearest even. ``S_ROWS``: rows sharing a
    scale (1 for 1x128 blocks, 128 for 128x128)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cb = tl.program_id(1)
    cols = cb * 128 + tl.arange(0, 128)
    rmask = rows < R
    mask = rmask[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)
    q = tl.load(q_ptr + r64[:, None] * s_qr + cols[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + (rows // S_ROWS).to(tl.int64) * s_sr + cb * s_sc, mask=rmask,
                other=1.0)
    v = tl.math.div_rn(q.to(tl.float32), s[:, None])
    tl.store(out_ptr + r64[:, None] * s_or + cols[None, :], v.to(tl.bfloat16), mask=mask)
