"""@triton.jit kernel of the MXFP8 dequantize to exact bf16 (launcher:
:mod:`lowprec.formats.mxfp8.dequantize`).

Imported only when the launcher runs on CUDA with Triton available.
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
