"""What one direction of a quantized tensor did to its input: the values its element cast
rounded, the scales it used and the values it gives back.

Each format stores its scales its own way (``lowprec.formats``); :func:`direction_scaling`
reads them back into one picture, in the layout the direction is stored in ((M, K)
rowwise, (K, M) columnwise) and in its domain (NVFP4's columnwise data may be
Hadamard-transformed):

* ``source``: the input as this direction's cast saw it;
* ``encoded``: the scaled values the element cast rounded (``source`` times the encode
  scales, exactly as the format computes them), so an element saturated (was clipped)
  where ``|encoded| > grid_max``;
* ``stored``: the dequantized values;
* ``scale``: the per-tensor encode scale (per-tensor FP8, NVFP4's global scale), else None;
* ``block_decode``: one decode scale per block (block FP8, MXFP8, NVFP4: what a block's
  element codes are multiplied by to give values), else None.

Nothing is quantized again: every number comes from the quantized tensor and the input.
A tensor that holds only exact values (``ExactTensor``, an operand only the GEMMs read on
GPU) has no scales stored; its block scales are recomputed from the input with the
format's reference rules (deterministic: no random draws), given its quantizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.base import QuantizedTensor
from ..formats.block import Float8BlockwiseTensor
from ..formats.block.reference import BLOCK as FP8_BLOCK
from ..formats.casting import E2M1_MAX, E8M0_BIAS, E8M0_NAN, FP8_MAX, exp2_int
from ..formats.exact import ExactTensor
from ..formats.float8 import Float8Tensor
from ..formats.hybrid import HybridQuantizedTensor, HybridQuantizer
from ..formats.identity import IdentityTensor
from ..formats.mxfp8 import MXFP8Tensor
from ..formats.mxfp8.reference import BLOCK as MX_BLOCK
from ..formats.mxfp8.reference import block_exponents
from ..formats.nvfp4 import NVFP4Tensor
from ..formats.nvfp4.reference import BLOCK as NV_BLOCK
from ..formats.nvfp4.reference import block_decode_scales
from ..formats.rht import rht_forward


@dataclass
class DirectionScaling:
    """One direction of one quantized tensor, read back (see the module docstring)."""

    source: torch.Tensor
    stored: torch.Tensor
    encoded: torch.Tensor | None = None
    grid_max: float | None = None
    scale: torch.Tensor | None = None
    block_decode: torch.Tensor | None = None
    #: ``source`` is not x's own values (NVFP4's RHT): SQNR is then taken in x's domain
    transformed: bool = False
    #: whether the format clips at all (False: identity, nothing saturates); a format that
    #: clips but has no ``encoded`` values here has an unknown saturation
    clips: bool = True


def direction_scaling(qt: QuantizedTensor, usage: str, x2d: torch.Tensor,
                      quantizer=None) -> DirectionScaling:
    """``usage``'s direction of ``qt``, quantized from ``x2d`` (the input as (M, K)).
    ``quantizer``: the quantizer that made ``qt``, needed only for an ``ExactTensor``."""
    if isinstance(qt, HybridQuantizedTensor):
        sub_q = None
        if isinstance(quantizer, HybridQuantizer):
            sub_q = quantizer.rowwise_quantizer if usage == "rowwise" else \
                quantizer.columnwise_quantizer
        return direction_scaling(qt.sub_tensor(usage), usage, x2d, sub_q)
    src = x2d.detach().to(torch.float32)
    src = src if usage == "rowwise" else src.t()
    for cls, read in _READERS:
        if isinstance(qt, cls):
            return read(qt, usage, src, quantizer)
    # a format this module does not know: values only, saturation unknown
    return DirectionScaling(src, _stored(qt, usage))


def _stored(qt: QuantizedTensor, usage: str) -> torch.Tensor:
    """fp32 dequantized values of ``usage`` in its stored (untransposed-domain) layout."""
    m, k = qt.shape_2d
    out = qt.dequantize(torch.float32, usage).reshape(m, k)
    return out if usage == "rowwise" else out.t()


def _expand(per_block: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A per-block (R/rows, C/cols) tensor repeated over each block's elements."""
    return per_block.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)


def _block_view(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(R, C) seen as (R/rows, C/cols, rows*cols): one block per leading index."""
    r, c = t.shape
    return t.reshape(r // rows, rows, c // cols, cols).transpose(1, 2).reshape(
        r // rows, c // cols, rows * cols)


def _float8(qt: Float8Tensor, usage, src, quantizer) -> DirectionScaling:
    scale = qt.shared_scale.to(torch.float32).reshape(1)
    return DirectionScaling(src, _stored(qt, usage), encoded=src * scale,
                            grid_max=FP8_MAX[qt.fp8_dtype], scale=scale)


def _block_fp8(qt: Float8BlockwiseTensor, usage, src, quantizer) -> DirectionScaling:
    scale = getattr(qt, f"{usage}_scale").to(torch.float32)
    rows = 1 if qt.block_scaling_dim == 1 else FP8_BLOCK
    return DirectionScaling(src, _stored(qt, usage),
                            encoded=src * _expand(scale, rows, FP8_BLOCK),
                            grid_max=FP8_MAX[qt.fp8_dtype], block_decode=1.0 / scale)


def _mx_factors(code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(encode 2**-e, decode 2**e) per block from E8M0 codes; NaN for a NaN block."""
    nan = code == E8M0_NAN
    e = torch.where(nan, torch.full_like(code, E8M0_BIAS), code).to(torch.int32) - E8M0_BIAS
    poison = torch.full(e.shape, float("nan"), device=e.device)
    return torch.where(nan, poison, exp2_int(-e)), torch.where(nan, poison, exp2_int(e))


def _mxfp8(qt: MXFP8Tensor, usage, src, quantizer) -> DirectionScaling:
    rows = MX_BLOCK if qt.with_2d_quantization else 1
    encode, decode = _mx_factors(getattr(qt, f"{usage}_scale"))
    return DirectionScaling(src, _stored(qt, usage), encoded=src * _expand(encode, rows, MX_BLOCK),
                            grid_max=FP8_MAX[qt.fp8_dtype], block_decode=decode)


def _nvfp4_encoded(src: torch.Tensor, s: torch.Tensor, d: torch.Tensor, two_d: bool):
    """The values NVFP4 rounds to E2M1, ``(x * S) / d`` (0 where ``d`` is not positive, as
    the format stores them), and the per-block decode scales ``d / S``."""
    d_el = _expand(d, NV_BLOCK if two_d else 1, NV_BLOCK)
    v = (src * s) / d_el
    return torch.where(d_el > 0, v, torch.zeros_like(v)), d / s


def _nvfp4(qt: NVFP4Tensor, usage, src, quantizer) -> DirectionScaling:
    transformed = usage == "columnwise" and qt.with_rht
    if transformed:
        src = rht_forward(src)
    s = getattr(qt, f"{usage}_global").to(torch.float32).reshape(1)
    d = getattr(qt, f"{usage}_scale").to(torch.float32)
    encoded, decode = _nvfp4_encoded(src, s, d, qt.with_2d_quantization)
    return DirectionScaling(src, qt.dequantize_stored(usage), encoded=encoded,
                            grid_max=E2M1_MAX, scale=s, block_decode=decode,
                            transformed=transformed)


def _exact(qt: ExactTensor, usage, src, quantizer) -> DirectionScaling:
    values = getattr(qt, f"{usage}_data").to(torch.float32)
    divisor = getattr(qt, f"{usage}_divisor")
    transformed = usage == "columnwise" and qt.columnwise_rht
    if transformed:
        src = rht_forward(src)
    stored = values if divisor is None else values / divisor
    two_d = bool(getattr(quantizer, "with_2d_quantization", False))
    if qt.source_format == "mxfp8" and getattr(quantizer, "fp8_dtype", None) in FP8_MAX:
        rows = MX_BLOCK if two_d else 1
        amax = _block_view(src, rows, MX_BLOCK).abs().amax(dim=-1)
        encode, decode = _mx_factors(block_exponents(amax, quantizer.fp8_dtype)[1])
        return DirectionScaling(src, stored, encoded=src * _expand(encode, rows, MX_BLOCK),
                                grid_max=FP8_MAX[quantizer.fp8_dtype], block_decode=decode,
                                transformed=transformed)
    if qt.source_format == "nvfp4" and divisor is not None and quantizer is not None:
        s = divisor.to(torch.float32).reshape(1)
        rows = NV_BLOCK if two_d else 1
        d = block_decode_scales(_block_view(src, rows, NV_BLOCK), s).to(torch.float32)
        encoded, decode = _nvfp4_encoded(src, s, d, two_d)
        return DirectionScaling(src, stored, encoded=encoded, grid_max=E2M1_MAX, scale=s,
                                block_decode=decode, transformed=transformed)
    return DirectionScaling(src, stored, transformed=transformed)  # saturation unknown


def _identity(qt: IdentityTensor, usage, src, quantizer) -> DirectionScaling:
    return DirectionScaling(src, _stored(qt, usage), clips=False)


_READERS = ((Float8Tensor, _float8), (Float8BlockwiseTensor, _block_fp8), (MXFP8Tensor, _mxfp8),
            (NVFP4Tensor, _nvfp4), (ExactTensor, _exact), (IdentityTensor, _identity))
