"""NVFP4Tensor: E2M1 data in 16-element blocks with E4M3 block scales and an fp32 global scale."""

from __future__ import annotations

import torch

from ...kernels import use_kernels
from ...kernels.transpose import transpose_contiguous
from ..base import QuantizedTensor
from ..casting import pack_e2m1, unpack_e2m1
from ..graph import Kind
from ..rht import rht_inverse_
from .reference import BLOCK, dequantize_matrix


class NVFP4Tensor(QuantizedTensor):
    """NVFP4 data (two E2M1 codes per byte) with per-block E4M3 decode scales.

    With ``M = prod(shape[:-1])`` and ``K = shape[-1]``:

    * ``rowwise_data`` (M, K/2) uint8: codes of ``x`` in 1x16 blocks along K,
      element ``2i`` in the low nibble, sign in bit 3 of each code;
      ``rowwise_scale`` float8_e4m3fn (M, K/16), or (M/16, K/16) for 16x16
      blocks (``with_2d_quantization``): the block *decode* scales ``d``;
      ``rowwise_global`` (1,) fp32: the global *encode* scale
      ``S = 2688 / amax`` (values were encoded as ``x * S / d`` and decode
      as ``q * d / S``).
    * ``columnwise_data`` (K, M/2), ``columnwise_scale`` (K, M/16) (2D:
      (K/16, M/16)), ``columnwise_global`` (1,): the same for the transpose
      of x, Hadamard-transformed along M first when ``with_rht``. The
      columnwise encode scale is computed from the transformed values.

    A block whose input held NaN/Inf stores a NaN decode scale and
    dequantizes to NaN. ``dequantize(usage="columnwise")`` returns the
    original domain (inverse RHT applied in fp32);
    :meth:`dequantize_stored` gives the stored-domain values a GEMM whose two
    operands both carry the RHT consumes. In 16x16 tiles without the transform
    each direction derives from the other (the same tiles, decode scales and
    global scale, transposed: ``update_usage`` makes the missing one); in 1x16
    blocks, or with the transform, neither does (each has its own blocks), so
    ``update_usage`` can only drop a direction.

    A dimension that is not a multiple of 16 rounds its scale count up (the last block is
    partial, ``partial(usage)``) and an odd one its data bytes (the last code's partner
    nibble is zero).
    """

    _inner = ("rowwise_data", "rowwise_scale", "rowwise_global",
              "columnwise_data", "columnwise_scale", "columnwise_global")
    _meta = ("with_rht", "with_2d_quantization")
    #: exact bf16 ``q * d`` of a direction (stored layout and domain, no global scale),
    #: where the quantize kernel wrote it (``Quantizer.quantize_for_gemm``); read by the
    #: bf16 GEMM emulation
    _derived = ("_exact_rowwise", "_exact_columnwise")

    _packing = 2

    def _stored_block(self, usage: str) -> tuple[int, int]:
        return (BLOCK if self.with_2d_quantization else 1), BLOCK

    def dequantize_stored(self, usage: str = "rowwise") -> torch.Tensor:
        """fp32 ``(q * d) / S`` in the stored 2-D layout and domain.

        Rowwise: (M, K). Columnwise: (K, M), still RHT-transformed along M
        when ``with_rht``.
        """
        if not self.has_usage(usage):
            raise RuntimeError(f"{type(self).__name__} holds no {usage} data")
        return dequantize_matrix(getattr(self, f"{usage}_data"), getattr(self, f"{usage}_scale"),
                                 getattr(self, f"{usage}_global"),
                                 two_d=self.with_2d_quantization)

    def _gemm_kind(self, usage: str, read: bool) -> Kind:
        # E2M1 x E4M3 has at most 6 significant bits, exact in bf16 beside the global scale
        # where the kernels make them (the reference's are fp32 values, as its traced form's
        # are); the RHT'd columnwise values only meet another RHT'd operand exactly
        kernel = use_kernels(self)
        return Kind("exact", rht=kernel and usage == "columnwise" and self.with_rht,
                    divisor=kernel, bf16=kernel)

    def bf16_operand(self, usage: str) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 ``q * d`` in the stored layout and domain, divisor the global encode scale S."""
        exact = self._exact_bf16_record(usage)
        if exact is not None:
            return exact, getattr(self, f"{usage}_global")
        from .launch import dequantize_unscaled_bf16  # kernel on CUDA, else torch
        return dequantize_unscaled_bf16(self, usage)

    def _derive(self, usage: str) -> dict[str, torch.Tensor]:
        if not self.with_2d_quantization or self.with_rht:
            return super()._derive(usage)
        other = "columnwise" if usage == "rowwise" else "rowwise"
        rows, cols = self._stored_dims(other)
        codes = unpack_e2m1(getattr(self, f"{other}_data"))[:, :cols].t()
        if rows % 2:  # an odd count of codes: the last one's partner nibble is zero
            codes = torch.cat([codes, codes.new_zeros(cols, 1)], dim=1)
        return {f"{usage}_data": pack_e2m1(codes),
                f"{usage}_scale": transpose_contiguous(getattr(self, f"{other}_scale")),
                f"{usage}_global": getattr(self, f"{other}_global")}

    def _dequantize_2d(self, usage: str) -> torch.Tensor:
        out = self.dequantize_stored(usage)
        if usage == "columnwise" and self.with_rht:
            out = rht_inverse_(out)  # a new tensor of this call's own
        return out
