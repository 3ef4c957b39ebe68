"""MXFP8 in torch ops a compiler keeps exact: the values ``reference.quantize_1x32`` gives,
dequantized, for a traced graph (``lowprec.linear.traced``).

The reference divides in fp32 and finds exponents with ``frexp``/``ldexp``. Compiled by
inductor on the GPU those are not exact (its fp32 division is approximate), so this
computes the same numbers from bits: the block quotient ``amax / fp8_max`` is divided in
fp64 and rounded once (the correctly rounded fp32 quotient, as ``casting.scale_from_amax``
argues), its ceiling power-of-two exponent is read from the fp32 bits, and powers of two
are built from their bits. Tested bit for bit against the reference, eager and compiled.
"""

from __future__ import annotations

import torch

from ..casting import E8M0_MAX_EXP, E8M0_MIN_EXP, cast_fp8
from .reference import BLOCK

_MANTISSA = 0x7FFFFF
_HALF_MIN_NORMAL = 0x400000  # the bits of 2**-127, a subnormal


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as fp32 for int32 ``e`` in [-127, 127], from its bits (2**-127 is subnormal)."""
    bits = torch.where(e == E8M0_MIN_EXP, _HALF_MIN_NORMAL, (e + 127) << 23)
    return bits.to(torch.int32).view(torch.float32)


def block_exponents(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """``reference.block_exponents``'s ``e`` (int32) for fp32 block amaxes: the exponent of
    the smallest power of two >= fp32(amax / fp8_max), clamped to [-127, 127]; -127 for a
    zero quotient, 0 for a non-finite amax."""
    q64 = amax.to(torch.float64) / torch.full_like(amax, fp8_max, dtype=torch.float64)
    v = q64.to(torch.float32)
    bits = v.view(torch.int32)
    biased, mant = bits >> 23, bits & _MANTISSA
    normal = biased - 127 + (mant != 0).to(torch.int32)
    # a subnormal quotient: above 2**-127 its ceiling is 2**-126, else the clamp's -127
    sub = torch.where(mant > _HALF_MIN_NORMAL, E8M0_MIN_EXP + 1, E8M0_MIN_EXP)
    e = torch.where(biased > 0, normal, sub).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    finite = torch.isfinite(amax)
    e = torch.where(finite & (v > 0), e, E8M0_MIN_EXP)
    return torch.where(finite, e, 0).to(torch.int32)


def _dequantized(blocks: torch.Tensor, dim, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` (fp32) quantized with one E8M0 scale over dimension(s) ``dim`` and
    dequantized: ``data * 2**e``, NaN over a block whose amax is not finite."""
    amax = blocks.abs().amax(dim=dim, keepdim=True)
    e = block_exponents(amax, torch.finfo(fp8_dtype).max)
    data = cast_fp8(blocks * pow2(-e), fp8_dtype)
    factor = torch.where(torch.isfinite(amax), pow2(e), float("nan"))
    return data.to(torch.float32) * factor


def dequantized_1x32(x2d: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 values of ``x2d`` (R, C) quantized in 1x32 blocks along C and dequantized:
    ``data * 2**e`` of ``reference.quantize_1x32``, NaN over a block whose amax is not
    finite."""
    r, c = x2d.shape
    blocks = x2d.to(torch.float32).reshape(r, c // BLOCK, BLOCK)
    return _dequantized(blocks, 2, fp8_dtype).reshape(r, c)


def dequantized_32x1(x2d: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``dequantized_1x32(x2d.t())`` (the columnwise values, (C, R)) as a transposed view,
    computed along ``x2d``'s rows: a compiler reads whole rows instead of 32 elements a
    row apart."""
    r, c = x2d.shape
    blocks = x2d.to(torch.float32).reshape(r // BLOCK, BLOCK, c)
    return _dequantized(blocks, 1, fp8_dtype).reshape(r, c).t()


def dequantized_32x32(x2d: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 values of ``x2d`` (R, C) quantized in 32x32 blocks (``reference.quantize_32x32``)
    and dequantized; the columnwise values are their transpose (a block's one scale serves
    both directions)."""
    r, c = x2d.shape
    blocks = x2d.to(torch.float32).reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK)
    return _dequantized(blocks, (1, 3), fp8_dtype).reshape(r, c)
