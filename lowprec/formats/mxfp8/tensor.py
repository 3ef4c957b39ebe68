"""MXFP8Tensor: FP8 data with one E8M0 (power-of-two) scale per block of 32."""

from __future__ import annotations

import torch

from ...kernels.transpose import transpose_contiguous
from ..base import QuantizedTensor
from ..graph import Kind
from .dequantize import mxfp8_dequantize_bf16
from .reference import BLOCK, dequantize_blocks


class MXFP8Tensor(QuantizedTensor):
    """MXFP8 data: fp8 elements, uint8 E8M0 block scales (biased exponent, 255 = NaN).

    With ``M = prod(shape[:-1])``, ``K = shape[-1]``:

    * ``rowwise_data`` (M, K) fp8, ``rowwise_scale`` (M, K/32): 1x32 blocks along K;
    * ``columnwise_data`` (K, M) fp8, ``columnwise_scale`` (K, M/32): the 1x32
      rowwise quantization of the transposed matrix (32x1 blocks of the original).

    With ``with_2d_quantization`` the blocks are 32x32: ``rowwise_scale`` is
    (M/32, K/32), the columnwise data and scale are the transposes of the
    rowwise ones, so either direction derives from the other.

    A dimension that is not a multiple of 32 rounds its scale count up: the last block is
    partial (``partial(usage)``), scaled by the values it holds.
    """

    _inner = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")
    _meta = ("fp8_dtype", "with_2d_quantization")
    #: exact bf16 ``data * 2**e`` of a direction, in its data's layout, where the quantize
    #: kernel wrote it (``Quantizer.quantize_for_gemm``); read by the bf16 GEMM emulation
    _derived = ("_exact_rowwise", "_exact_columnwise")

    def _stored_block(self, usage: str) -> tuple[int, int]:
        return (BLOCK if self.with_2d_quantization else 1), BLOCK

    def _dequantize_2d(self, usage: str) -> torch.Tensor:
        return dequantize_blocks(getattr(self, f"{usage}_data"), getattr(self, f"{usage}_scale"),
                                 block_rows=BLOCK if self.with_2d_quantization else 1)

    def _gemm_kind(self, usage: str, read: bool) -> Kind:
        return Kind("exact")  # E4M3/E5M2 times 2**e: at most 4 significant bits, in bf16

    def bf16_operand(self, usage: str) -> tuple[torch.Tensor, None]:
        exact = self._exact_bf16_record(usage)
        if exact is not None:
            return exact, None
        return mxfp8_dequantize_bf16(getattr(self, f"{usage}_data"),
                                     getattr(self, f"{usage}_scale"),
                                     BLOCK if self.with_2d_quantization else 1), None

    def _derive(self, usage: str) -> dict[str, torch.Tensor]:
        if not self.with_2d_quantization:
            # 1x32 and 32x1 blocks scale different element groups: no way back without x.
            return super()._derive(usage)
        other = "columnwise" if usage == "rowwise" else "rowwise"
        return {f"{usage}_data": transpose_contiguous(getattr(self, f"{other}_data")),
                f"{usage}_scale": transpose_contiguous(getattr(self, f"{other}_scale"))}
