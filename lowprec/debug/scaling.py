"""What one direction of a quantized tensor did to its input: the values its element cast
rounded, the scales it used and the values it gives back.

Each format stores its scales its own way (``lowprec.formats``); :func:`direction_scaling`
reads them back into one picture, in the layout the direction is stored in ((M, K)
rowwise, (K, M) columnwise) and in its domain (NVFP4's columnwise data may be
Hadamard-transformed):

* ``source``: the input as this direction's cast saw it, in x's own dtype where the
  direction is untransformed (products with the fp32 scales promote to fp32, the values
  the cast computes);
* ``encoded``: the scaled values the element cast rounded (``source`` times the encode
  scales, exactly as the format computes them), so an element saturated (was clipped)
  where ``|encoded| > grid_max``;
* ``stored``: the dequantized values;
* ``scale``: the per-tensor encode scale (per-tensor FP8, NVFP4's global scale), else None;
* ``block_decode``: one decode scale per block (block FP8, MXFP8, NVFP4: what a block's
  element codes are multiplied by to give values), else None.

Nothing is quantized again: every number comes from the quantized tensor and the input.
Per-block scales are broadcast over their blocks' elements (no per-element copy of the
scales is made). A tensor that holds only exact values (``ExactTensor``, an operand only
the GEMMs read on GPU) has no scales stored; its block scales are recomputed from the
input with the format's reference rules (deterministic: no random draws), given its
quantizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import (
    E2M1_MAX,
    E8M0_BIAS,
    E8M0_NAN,
    FP8_MAX,
    ExactTensor,
    Float8BlockwiseTensor,
    Float8Tensor,
    HybridQuantizedTensor,
    HybridQuantizer,
    IdentityTensor,
    MXFP8Tensor,
    NVFP4Tensor,
    QuantizedTensor,
    exp2_int,
    rht_forward,
    rht_inverse,
)
from ..formats.block import BLOCK as FP8_BLOCK
from ..formats.mxfp8 import BLOCK as MX_BLOCK
from ..formats.mxfp8 import block_exponents
from ..formats.nvfp4 import BLOCK as NV_BLOCK
from ..formats.nvfp4 import block_decode_scales


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
                      quantizer=None, x_dir: torch.Tensor | None = None) -> DirectionScaling:
    """``usage``'s direction of ``qt``, quantized from ``x2d`` (the input as (M, K)).
    ``quantizer``: the quantizer that made ``qt``, needed only for an ``ExactTensor``.
    ``x_dir``: ``x2d`` already in the direction's layout (a contiguous (K, M) copy for
    columnwise), else a view of ``x2d`` is used."""
    if isinstance(qt, HybridQuantizedTensor):
        sub_q = None
        if isinstance(quantizer, HybridQuantizer):
            sub_q = quantizer.rowwise_quantizer if usage == "rowwise" else \
                quantizer.columnwise_quantizer
        return direction_scaling(qt.sub_tensor(usage), usage, x2d, sub_q, x_dir)
    src = x_dir if x_dir is not None else x2d if usage == "rowwise" else x2d.t()
    src = src.detach()
    for cls, read in _READERS:
        if isinstance(qt, cls):
            return read(qt, usage, src, quantizer)
    # a format this module does not know: values only, saturation unknown
    return DirectionScaling(src, _stored(qt, usage))


def stored_values(qt: QuantizedTensor, usage: str) -> torch.Tensor:
    """fp32 dequantized values of ``usage`` in its stored layout and domain (NVFP4's and an
    exact tensor's columnwise ones still RHT-transformed): the values the direction gives
    the GEMM, read without undoing a transform."""
    if isinstance(qt, HybridQuantizedTensor):
        return stored_values(qt.sub_tensor(usage), usage)
    if isinstance(qt, NVFP4Tensor):
        return qt.dequantize_stored(usage)
    if isinstance(qt, ExactTensor):
        values = getattr(qt, f"{usage}_data").to(torch.float32)
        divisor = getattr(qt, f"{usage}_divisor")
        return values if divisor is None else values / divisor
    return _stored(qt, usage)


def _stored(qt: QuantizedTensor, usage: str) -> torch.Tensor:
    """fp32 dequantized values of ``usage`` in its stored layout ((M, K) rowwise, (K, M)
    columnwise), in x's domain (what ``dequantize`` gives, without its transposes)."""
    return qt._dequantize_2d(usage).to(torch.float32)


def x_domain(sc: DirectionScaling) -> torch.Tensor:
    """``sc.stored`` in x's own domain (the RHT undone), in the direction's layout."""
    return rht_inverse(sc.stored) if sc.transformed else sc.stored


def _expand(per_block: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A per-block (R/rows, C/cols) tensor repeated over each block's elements."""
    return per_block.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)


def _blockwise(op, src: torch.Tensor, per_block: tuple[torch.Tensor, ...], rows: int,
               cols: int) -> torch.Tensor:
    """``op(src, *per_block)`` with each (R/rows, C/cols) per-block tensor applied to its
    block's elements of the (R, C) ``src``: broadcast over a blocked view of ``src`` (a
    transposed ``src`` is taken in its own memory order), no per-element copy of the
    scales. The same values as ``op(src, *(_expand(p, rows, cols) for p in per_block))``."""
    r, c = src.shape
    if not src.is_contiguous() and src.t().is_contiguous():
        return _blockwise(op, src.t(), tuple(p.t() for p in per_block), cols, rows).t()
    if r % rows or c % cols or any(p.shape != (r // rows, c // cols) for p in per_block):
        return op(src, *(_expand(p, rows, cols) for p in per_block))
    blocks = src.reshape(r // rows, rows, c // cols, cols)
    return op(blocks, *(p[:, None, :, None] for p in per_block)).reshape(r, c)


def _times(src: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return src * factor


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
                            encoded=_blockwise(_times, src, (scale,), rows, FP8_BLOCK),
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
    return DirectionScaling(src, _stored(qt, usage),
                            encoded=_blockwise(_times, src, (encode,), rows, MX_BLOCK),
                            grid_max=FP8_MAX[qt.fp8_dtype], block_decode=decode)


def _nvfp4_encoded(src: torch.Tensor, s: torch.Tensor, d: torch.Tensor, two_d: bool):
    """The values NVFP4 rounds to E2M1, ``(x * S) / d`` (0 where ``d`` is not positive, as
    the format stores them), and the per-block decode scales ``d / S``."""
    def encode(x, d_el):
        v = (x * s) / d_el
        return torch.where(d_el > 0, v, 0.0)

    return _blockwise(encode, src, (d,), NV_BLOCK if two_d else 1, NV_BLOCK), d / s


def _nvfp4(qt: NVFP4Tensor, usage, src, quantizer) -> DirectionScaling:
    transformed = usage == "columnwise" and qt.with_rht
    if transformed:
        src = rht_forward(src)  # fp32
    s = getattr(qt, f"{usage}_global").to(torch.float32).reshape(1)
    d = getattr(qt, f"{usage}_scale").to(torch.float32)
    encoded, decode = _nvfp4_encoded(src, s, d, qt.with_2d_quantization)
    return DirectionScaling(src, qt.dequantize_stored(usage), encoded=encoded,
                            grid_max=E2M1_MAX, scale=s, block_decode=decode,
                            transformed=transformed)


def _exact(qt: ExactTensor, usage, src, quantizer) -> DirectionScaling:
    src = src.to(torch.float32)  # the block scales below are recomputed in fp32
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
        return DirectionScaling(src, stored,
                                encoded=_blockwise(_times, src, (encode,), rows, MX_BLOCK),
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
