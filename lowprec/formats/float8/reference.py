"""Pure-torch reference for per-tensor FP8 (delayed and current scaling).

This is the CPU path and the ground truth the GPU kernels must match bit for bit.
"""

from __future__ import annotations

import torch

from ..casting import cast_fp8, scale_from_amax


def tensor_amax(x2d: torch.Tensor) -> torch.Tensor:
    """amax(|x|) as a 1-element fp32 tensor (NaN if any element is NaN)."""
    return x2d.abs().amax().to(torch.float32).reshape(1)


def current_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, *, pow2: bool,
                  eps: float) -> torch.Tensor:
    """Per-tensor current-scaling scale (see casting.scale_from_amax)."""
    return scale_from_amax(amax, torch.finfo(fp8_dtype).max, eps=eps, pow2=pow2)


def quantize_per_tensor(x2d: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *,
                        rowwise: bool, columnwise: bool):
    """Cast ``x * scale`` to fp8; returns (rowwise (M, K) or None, columnwise (K, M) or None)."""
    scaled = x2d.to(torch.float32) * scale
    data = cast_fp8(scaled, fp8_dtype)
    row = data if rowwise else None
    col = data.t().contiguous() if columnwise else None
    return row, col


def dequantize_per_tensor(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data / scale`` in fp32 (the scale used at quantize time), divided in place: one
    fp32 copy of the data, not two."""
    return data.to(torch.float32, copy=True).div_(scale)
