"""Pure-torch reference for per-tensor FP8 (delayed and current scaling).

This is the CPU path and the ground truth the GPU kernels must match bit for bit.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

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


# ---- delayed scaling's scales -------------------------------------------------------------
def _fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", value))[0]


_INV_MARGINS: dict = {}  # margin -> its factor: a delayed update asks once a step


def inv_margin(margin: float) -> float:
    """What torch's ``t / (2.0 ** margin)`` multiplies by on CUDA: the fp32 reciprocal of
    the fp32-rounded divisor (the update kernel multiplies by it). In Python floats, no
    tensor: it also runs while a compiler traces a backward, where a tensor would be fake.
    The reciprocal in double, rounded once to fp32, is the correctly rounded fp32 one (53
    bits are enough for a quotient of fp32 values). ``DelayedScaling`` keeps ``margin`` in
    [0, 127], so ``2**margin`` is a finite fp32."""
    if torch.compiler.is_compiling():
        # a traced backward (dynamo's autograd.Function) must not write a global dict
        return _fp32(1.0 / _fp32(2.0 ** margin))
    inv = _INV_MARGINS.get(margin)
    if inv is None:
        inv = _INV_MARGINS[margin] = _fp32(1.0 / _fp32(2.0 ** margin))
    return inv


def delayed_scale(fp8_max: torch.Tensor, amax: torch.Tensor, margin: float) -> torch.Tensor:
    """``fp8_max / amax / 2**margin`` as delayed scaling computes a scale, at most the fp32
    max, in torch ops a compiler traces with the same bits: the quotient correctly rounded
    (in fp64, then fp32, as ``casting.scale_from_amax`` does: inductor's fp32 division is
    approximate), and on CUDA the margin multiplied by its fp32 reciprocal, as torch's CUDA
    division by a scalar does. Meaningful where ``amax`` is finite and > 0."""
    quotient = (fp8_max.to(torch.float64) / amax.to(torch.float64)).to(torch.float32)
    new = quotient * inv_margin(margin) if amax.is_cuda else quotient / (2.0 ** margin)
    # a tiny amax must not give an infinite scale (0 * inf is NaN): the fp32 max, as current
    # scaling does
    return new.clamp(max=torch.finfo(torch.float32).max)


@dataclass
class FirstScale:
    """How a delayed-scaling slot quantizes before its history holds an amax: with the
    scale of the tensor's own amax (``margin`` the recipe's). The state marks such a slot
    with scale 0, which an update writes only where ``fp8_max / amax / 2**margin``
    underflows (it keeps the old scale where the amax is not finite and > 0).

    ``unseeded``: the state's host-side note that the slot may still be at 0. While it is
    set an eager quantize takes the tensor's amax before its cast (the cast kernel casts
    as it reads) and sets ``used``; the state's next update reads the scales of the used
    slots back once and clears the note of each that holds a scale now, whose quantizes
    then cast in their one pass again. One per slot, shared by the state and the slot's
    quantizers."""

    margin: float
    unseeded: bool = True
    used: bool = False


def seeded_scale(scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype,
                 margin: float) -> torch.Tensor:
    """The scale a delayed-scaling slot casts with (:class:`FirstScale`): ``scale``, or
    where it is 0 (no scale yet) the one of the tensor's own ``amax`` (1 for an amax that
    is 0 or not finite, as current scaling gives). A NaN scale stays NaN: the values it
    casts come out NaN, never silently finite."""
    own = delayed_scale(torch.full_like(amax, torch.finfo(fp8_dtype).max), amax, margin)
    own = torch.where(torch.isfinite(amax) & (amax > 0), own, torch.ones_like(own))
    return torch.where(scale == 0, own, scale)
