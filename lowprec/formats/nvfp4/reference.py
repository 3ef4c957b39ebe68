"""Pure-torch reference for NVFP4 (E2M1 values, E4M3 block scales, fp32 global scale).

This is the CPU path and the ground truth GPU kernels must match bit for bit.
Every formula is evaluated in fp32, left to right, exactly as written:

* global encode scale ``S = fp32(2688) / amax`` (2688 = 448 * 6), where amax
  is taken over the *finite* elements only (one NaN/Inf poisons its block,
  not the tensor); amax 0 gives ``S = 1``, an infinite quotient the fp32 max;
* block decode scale ``d = cast_e4m3((block_amax / 6) * S)``, saturating at
  448; a block holding NaN/Inf gets ``d = NaN`` so it dequantizes to NaN;
* codes ``q = cast_e2m1((x * S) / d)`` (nearest-even or stochastic); a block
  whose ``d`` is 0 or NaN stores code 0 everywhere;
* dequantization ``(q * d) / S``.

The functions here work on one (R, C) matrix blocked along C (1x16) or in
16x16 tiles; the quantizer calls them on x (rowwise) and on the possibly
RHT-transformed transpose (columnwise).
"""

from __future__ import annotations

import torch

from ..casting import (
    E2M1_MAX,
    FP8_MAX,
    cast_fp8,
    e2m1_codes_to_float,
    pack_e2m1,
    round_e2m1_codes,
    scale_from_amax,
    stochastic_round_e2m1_codes,
    unpack_e2m1,
)

BLOCK = 16
SCALE_DTYPE = torch.float8_e4m3fn
GLOBAL_SCALE_NUMERATOR = FP8_MAX[SCALE_DTYPE] * E2M1_MAX  # 2688, exact in fp32


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite elements, as a 1-element fp32 tensor (0 if none)."""
    a = x.to(torch.float32).abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    return a.amax().reshape(1) if a.numel() else torch.zeros(1, device=x.device)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``S = 2688 / amax`` in fp32; amax 0 -> 1; overflow -> fp32 max."""
    return scale_from_amax(amax, GLOBAL_SCALE_NUMERATOR)


def _blocked(x: torch.Tensor, two_d: bool) -> torch.Tensor:
    """View (R, C) as (R', C/16, n) with one block per (r', c') and its n elements last."""
    r, c = x.shape
    if not two_d:
        return x.reshape(r, c // BLOCK, BLOCK)
    return x.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK).transpose(1, 2).reshape(
        r // BLOCK, c // BLOCK, BLOCK * BLOCK)


def _unblocked(b: torch.Tensor, shape: tuple[int, int], two_d: bool) -> torch.Tensor:
    r, c = shape
    if not two_d:
        return b.reshape(r, c)
    return b.reshape(r // BLOCK, c // BLOCK, BLOCK, BLOCK).transpose(1, 2).reshape(r, c)


def block_decode_scales(xb: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """E4M3 ``d = cast((block_amax / 6) * S)`` per block of a blocked fp32 view; NaN where
    the block holds a non-finite element."""
    bamax = xb.abs().amax(dim=-1)
    # Divide by a tensor: CUDA turns division by a Python scalar into a reciprocal multiply.
    d = cast_fp8((bamax / torch.full_like(bamax, E2M1_MAX)) * s, SCALE_DTYPE).to(torch.float32)
    bad = ~torch.isfinite(xb).all(dim=-1)
    d = torch.where(bad, torch.full_like(d, float("nan")), d)
    return d.to(SCALE_DTYPE)


def quantize_matrix(x: torch.Tensor, *, two_d: bool, rand: torch.Tensor | None = None,
                    s: torch.Tensor | None = None):
    """Quantize an (R, C) matrix along C.

    Returns ``(packed codes (R, C/2) uint8, scales float8_e4m3fn (R, C/16) or
    (R/16, C/16) when ``two_d``, encode scale S (1,) fp32)``. ``rand`` (R, C)
    uniform [0, 1) draws switch to stochastic rounding. ``s``: the encode scale to use
    instead of x's own (x a slice of the matrix that ``s`` was computed from).
    """
    x = x.to(torch.float32)
    if s is None:
        s = global_encode_scale(finite_amax(x))
    xb = _blocked(x, two_d)
    d_e4m3 = block_decode_scales(xb, s)
    d = d_e4m3.to(torch.float32).unsqueeze(-1)
    v = (xb * s) / d
    # d == 0 (zero or underflowed block) or NaN (poisoned block): store zeros.
    v = torch.where(d > 0, v, torch.zeros_like(v))
    v = _unblocked(v, tuple(x.shape), two_d)
    codes = round_e2m1_codes(v) if rand is None else stochastic_round_e2m1_codes(v, rand)
    return pack_e2m1(codes), d_e4m3, s


def dequantize_matrix(packed: torch.Tensor, scales: torch.Tensor, s: torch.Tensor, *,
                      two_d: bool) -> torch.Tensor:
    """fp32 ``(q * d) / S`` for one stored direction, shape (R, C), computed in the decoded
    values' own buffer (one (R, C) fp32 tensor alive, not three)."""
    q = e2m1_codes_to_float(unpack_e2m1(packed))
    r, c = q.shape
    d = scales.to(torch.float32)
    if two_d:  # a view of q with each 16 x 16 block's rows and columns on their own axes
        q.view(r // BLOCK, BLOCK, c // BLOCK, BLOCK).mul_(
            d.reshape(r // BLOCK, 1, c // BLOCK, 1))
    else:
        q.view(r, c // BLOCK, BLOCK).mul_(d.unsqueeze(-1))
    return q.div_(s)
