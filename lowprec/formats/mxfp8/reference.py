"""Pure-torch reference for MXFP8 (E8M0-scaled blocks of 32).

This is the CPU path and the ground truth GPU kernels must match bit for bit.
Every function works on 2-D fp32 matrices; callers pick the direction
(columnwise = the same routine on the transposed matrix).
"""

from __future__ import annotations

import torch

from ..casting import (
    E8M0_BIAS,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    E8M0_NAN,
    FP8_MAX,
    cast_fp8,
    ceil_pow2_exponent,
    exp2_int,
)

BLOCK = 32


def block_exponents(amax: torch.Tensor, fp8_dtype: torch.dtype):
    """Block exponents and their E8M0 codes for fp32 block amaxes.

    ``e`` is the exponent of the smallest power of two >= ``fp32(amax /
    fp8_max)`` (RCEIL), clamped to [-127, 127]; a zero quotient (all-zero
    block, or an amax so small that the quotient underflows) gives -127. A
    non-finite amax gets code 255 (NaN) and ``e = 0`` for computing its data.
    Returns ``(e int32, code uint8)``.
    """
    amax = amax.to(torch.float32)
    # Divide by a tensor, not a Python scalar: CUDA turns division by a scalar into a
    # multiplication by its reciprocal, which is not the correctly rounded quotient.
    v = amax / torch.full_like(amax, FP8_MAX[fp8_dtype])
    finite = torch.isfinite(amax)
    positive = finite & (v > 0)
    e = ceil_pow2_exponent(torch.where(positive, v, torch.ones_like(v)))
    e = e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    e = torch.where(positive, e, torch.full_like(e, E8M0_MIN_EXP))
    e = torch.where(finite, e, torch.zeros_like(e))
    code = torch.where(finite, e + E8M0_BIAS, torch.full_like(e, E8M0_NAN)).to(torch.uint8)
    return e, code


def quantize_1x32(x2d: torch.Tensor, fp8_dtype: torch.dtype):
    """Quantize an (R, C) matrix in 1x32 blocks along C.

    Returns ``(data (R, C) fp8, scale (R, C/32) uint8 E8M0)``, both contiguous.
    """
    r, c = x2d.shape
    blocks = x2d.to(torch.float32).contiguous().reshape(r, c // BLOCK, BLOCK)
    e, code = block_exponents(blocks.abs().amax(dim=-1), fp8_dtype)
    # 2**-e is an exact power of two, so the product only rounds where it lands far below
    # the fp8 subnormal range (it flushes to zero either way).
    data = cast_fp8(blocks * exp2_int(-e).unsqueeze(-1), fp8_dtype)
    return data.reshape(r, c).contiguous(), code.contiguous()


def quantize_32x32(x2d: torch.Tensor, fp8_dtype: torch.dtype):
    """Quantize an (M, K) matrix in 32x32 blocks.

    Returns ``(data (M, K) fp8, scale (M/32, K/32) uint8 E8M0)``.
    """
    m, k = x2d.shape
    blocks = x2d.to(torch.float32).contiguous().reshape(m // BLOCK, BLOCK, k // BLOCK, BLOCK)
    e, code = block_exponents(blocks.abs().amax(dim=(1, 3)), fp8_dtype)
    data = cast_fp8(blocks * exp2_int(-e)[:, None, :, None], fp8_dtype)
    return data.reshape(m, k).contiguous(), code.contiguous()


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, *, block_rows: int) -> torch.Tensor:
    """fp32 ``data * 2**e`` for (R, C) data and (R/block_rows, C/32) E8M0 scales.

    Blocks whose code is 255 come back as NaN.
    """
    r, c = data.shape
    nan = scale == E8M0_NAN
    e = torch.where(nan, torch.zeros_like(scale), scale).to(torch.int32) - E8M0_BIAS
    factor = torch.where(nan, torch.full(e.shape, float("nan"), device=e.device), exp2_int(e))
    # multiplied in place: one fp32 copy of the data, not two
    blocks = data.to(torch.float32, copy=True).reshape(r // block_rows, block_rows, c // BLOCK,
                                                        BLOCK)
    return blocks.mul_(factor[:, None, :, None]).reshape(r, c)
