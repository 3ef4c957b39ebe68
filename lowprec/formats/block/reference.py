"""Pure-torch reference for block-scaled FP8 (1x128 and 128x128 blocks).

This is the CPU path and the ground truth the GPU kernels must match bit for
bit. Every block is quantized exactly like per-tensor current scaling, with
the block as the tensor: ``amax`` over the block in fp32,
``scale = casting.scale_from_amax(amax, fp8_max, eps, pow2)``,
``data = cast_fp8(x_fp32 * scale)``, and ``dequant = data / scale`` in fp32.
"""

from __future__ import annotations

import torch

from ..casting import cast_fp8, scale_from_amax

#: Edge of a scaling block (1x128 for block_scaling_dim=1, 128x128 for 2).
BLOCK = 128


def _blocked(t: torch.Tensor, block_scaling_dim: int) -> torch.Tensor:
    """(R, C) -> a view whose block elements are on their own axes."""
    r, c = t.shape
    if block_scaling_dim == 1:
        return t.reshape(r, c // BLOCK, BLOCK)
    return t.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK)


def _per_element(scale: torch.Tensor, block_scaling_dim: int) -> torch.Tensor:
    """Broadcast a (R, C/128) or (R/128, C/128) scale against the blocked view."""
    if block_scaling_dim == 1:
        return scale.unsqueeze(-1)
    return scale[:, None, :, None]


def block_amax(x2d: torch.Tensor, block_scaling_dim: int) -> torch.Tensor:
    """max |x| per block as fp32: (R, C/128) for dim 1, (R/128, C/128) for dim 2.

    NaN anywhere in a block gives NaN (torch's amax propagates NaN), Inf gives Inf.
    """
    a = _blocked(x2d.to(torch.float32).abs(), block_scaling_dim)
    return a.amax(dim=-1) if block_scaling_dim == 1 else a.amax(dim=(1, 3))


def quantize_blocks(x2d: torch.Tensor, fp8_dtype: torch.dtype, block_scaling_dim: int, *,
                    pow2: bool, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize an (R, C) matrix blocked along C (1x128) or in 128x128 tiles.

    Returns ``(data, scale)``: data (R, C) contiguous fp8, scale fp32 encode
    scales, (R, C/128) or (R/128, C/128). A block holding NaN/Inf gets a NaN
    scale, so its data is NaN and it dequantizes to NaN; an all-zero block
    gets scale 1 and zero data.
    """
    # The columnwise caller passes a transposed view: materialize it so the fp8
    # data comes out contiguous in the blocked (contraction) dimension.
    x = x2d.to(torch.float32).contiguous()
    amax = block_amax(x, block_scaling_dim)
    scale = scale_from_amax(amax, torch.finfo(fp8_dtype).max, eps=eps, pow2=pow2)
    scaled = _blocked(x, block_scaling_dim) * _per_element(scale, block_scaling_dim)
    data = cast_fp8(scaled, fp8_dtype).reshape(x.shape)
    return data, scale


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor,
                      block_scaling_dim: int) -> torch.Tensor:
    """``data / scale`` per block in fp32, in the stored (R, C) layout (divided in place:
    one fp32 copy of the data, not two)."""
    values = _blocked(data.to(torch.float32, copy=True), block_scaling_dim)
    return values.div_(_per_element(scale, block_scaling_dim)).reshape(data.shape)
