"""Optimizer state in FP8 (E4M3) blocks: codes the size of the tensor and one power-of-two
fp32 scale per 128 elements of a row, stored with stochastic rounding.

Blocks run along the last dimension, so a tensor split by rows (FSDP2) keeps every block
on one rank. The scale is the power of two that brings the block's largest magnitude to
at most 448 (E4M3's largest), so scaling is exact in every implementation; the rounding
to the E4M3 grid is stochastic with the same hash bits as ``rounding``, so a decaying
second moment keeps decaying and every stored value is unbiased.
"""

from __future__ import annotations

import torch

from .rounding import random_bits

BLOCK = 128
E4M3 = torch.float8_e4m3fn
_MAX = 448.0


def scale_shape(shape: torch.Size) -> tuple:
    """Shape of the scales of a tensor of ``shape`` (at least 2-D)."""
    return (*shape[:-1], -(-shape[-1] // BLOCK))


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., K) as (rows, blocks, 128), zero-padded along K."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    pad = -k % BLOCK
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.view(rows.shape[0], -1, BLOCK)


def decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of FP8 ``codes`` (..., K) with their block ``scales`` (..., K/128)."""
    k = codes.shape[-1]
    vals = _blocks(codes.float()) * scales.reshape(-1, scales.shape[-1], 1)
    return vals.reshape(vals.shape[0], -1)[:, :k].reshape(codes.shape)


def encode_(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, key: int,
            offset: int) -> None:
    """Store fp32 ``x`` into ``codes``/``scales`` in place, rounded stochastically to the
    E4M3 grid of each block (``offset``: index of x's first element in the whole tensor,
    for the random bits)."""
    blocks = _blocks(x)
    amax = blocks.abs().amax(dim=-1)
    # the least power of two 2**e with amax / 2**e <= 448 = 0.875 * 2**9, from amax's
    # exact mantissa and exponent; 1 for an all-zero block
    mant, ex = torch.frexp(amax)
    e = (ex - 9 + (mant > 0.875).to(ex.dtype)).clamp(min=-126).float()
    scale = torch.where(amax > 0, torch.exp2(e), torch.ones_like(amax))
    y = (blocks / scale[..., None]).reshape(blocks.shape[0], -1)[:, :x.shape[-1]]
    y = y.reshape(-1)
    mag = y.abs().clamp(max=_MAX)
    # the grid spacing where |y| lies: 2**(E - 3) for normals, 2**-9 below 2**-6
    exp = ((mag.view(torch.int32) >> 23) - 127).clamp(min=-6)
    spacing = torch.exp2((exp - 3).float())
    down = torch.floor(mag / spacing) * spacing
    frac = (mag - down) / spacing
    u = (random_bits(y.numel(), key, offset, y.device) >> 8).float() * 2.0 ** -24
    q = torch.where(u < frac, down + spacing, down).clamp(max=_MAX)
    codes.copy_(torch.copysign(q, y).to(E4M3).view(codes.shape))
    scales.copy_(scale.view(scales.shape))
