"""MXFP8Quantizer: E8M0-scaled FP8 in 1x32 / 32x1 blocks (32x32 with 2-D quantization)."""

from __future__ import annotations

import torch

from ...kernels import use_kernels
from ..base import Quantizer, check_bool_option, check_divisible, columnwise_from_backward
from ..casting import check_fp8_dtype
from ..exact import ExactTensor
from ..gemm_slicer import block_gemm_slicer
from . import graph, launch
from .reference import BLOCK, quantize_1x32, quantize_32x32
from .tensor import MXFP8Tensor


class MXFP8Quantizer(Quantizer):
    """MXFP8 block scaling with power-of-two (E8M0) scales.

    Per block: ``e`` = exponent of the smallest power of two >=
    ``fp32(block_amax / fp8_max)`` ("RCEIL", as NVIDIA hardware rounds),
    clamped to [-127, 127] (an all-zero block gets -127); the data is
    ``cast_fp8(x * 2**-e)`` and dequantizes as ``data * 2**e``. A block holding
    NaN or Inf gets the NaN scale code 255 and dequantizes to NaN.

    Rowwise blocks are 1x32 along the last dimension, columnwise blocks 32x1
    (the rowwise quantization of the transposed matrix). With
    ``with_2d_quantization`` (a bool, else ValueError) both directions share
    32x32 blocks.
    """

    # every block scales itself: a part quantizes alone (quantize_part)
    blocks_are_independent = True

    format_name = "mxfp8"
    stateless = True
    keeps_exact_bf16 = True
    exact_tensor_type = ExactTensor

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *,
                 with_2d_quantization: bool = False) -> None:
        super().__init__()
        self.fp8_dtype = check_fp8_dtype(fp8_dtype)
        self.with_2d_quantization = check_bool_option(type(self).__name__, "with_2d_quantization",
                                                      with_2d_quantization)

    def _tensor_class(self):
        return MXFP8Tensor

    def _check_shape(self, shape, m: int, k: int) -> None:
        if self.with_2d_quantization:
            if self.rowwise_usage or self.columnwise_usage:
                check_divisible(shape, m, k, row_block=BLOCK, col_block=BLOCK,
                                what="MXFP8 with 2D (32x32) quantization")
            return
        if self.rowwise_usage:
            check_divisible(shape, m, k, row_block=BLOCK, col_block=1, what="MXFP8 rowwise usage")
        if self.columnwise_usage:
            check_divisible(shape, m, k, row_block=1, col_block=BLOCK,
                            what="MXFP8 columnwise usage")

    def row_multiple(self, *, rowwise: bool, columnwise: bool) -> int:
        if self.with_2d_quantization:
            return BLOCK if (rowwise or columnwise) else 1
        return BLOCK if columnwise else 1

    def col_multiple(self, *, rowwise: bool, columnwise: bool) -> int:
        if self.with_2d_quantization:
            return BLOCK if (rowwise or columnwise) else 1
        return BLOCK if rowwise else 1

    def _meta_fields(self) -> dict:
        return {"fp8_dtype": self.fp8_dtype, "with_2d_quantization": self.with_2d_quantization}

    def _quantize_2d_fused(self, x2d, prologue):
        return launch.quantize_mxfp8(self, x2d, prologue)

    def gemm_slicer(self, x2d):
        # Slices start at multiples of 128 rows or columns: every block lies inside one.
        return block_gemm_slicer(self, x2d)

    def _quantize_exact_2d(self, x2d: torch.Tensor) -> dict:
        return launch.quantize_mxfp8_exact(self, x2d)

    def _quantize_2d(self, x2d: torch.Tensor) -> dict:
        if use_kernels(x2d):
            return launch.quantize_mxfp8(self, x2d)
        fields = dict.fromkeys(MXFP8Tensor._inner)
        if self.with_2d_quantization:
            data, scale = quantize_32x32(x2d, self.fp8_dtype)
            if self.rowwise_usage:
                fields.update(rowwise_data=data, rowwise_scale=scale)
            if self.columnwise_usage:
                fields.update(columnwise_data=data.t().contiguous(),
                              columnwise_scale=scale.t().contiguous())
        else:
            if self.rowwise_usage:
                fields["rowwise_data"], fields["rowwise_scale"] = quantize_1x32(x2d, self.fp8_dtype)
            if self.columnwise_usage:
                fields["columnwise_data"], fields["columnwise_scale"] = quantize_1x32(
                    x2d.t(), self.fp8_dtype)
        return {**fields, **self._meta_fields()}

    def _empty_fields(self, m, k, device):
        data = lambda *s: torch.empty(s, dtype=self.fp8_dtype, device=device)  # noqa: E731
        scale = lambda *s: torch.empty(s, dtype=torch.uint8, device=device)  # noqa: E731
        fields = dict.fromkeys(MXFP8Tensor._inner)
        rows_per_scale = BLOCK if self.with_2d_quantization else 1
        if self.rowwise_usage:
            fields.update(rowwise_data=data(m, k),
                          rowwise_scale=scale(m // rows_per_scale, k // BLOCK))
        if self.columnwise_usage:
            fields.update(columnwise_data=data(k, m),
                          columnwise_scale=scale(k // rows_per_scale, m // BLOCK))
        return {**fields, **self._meta_fields()}

    def graph_operand(self, t, *, grad=False):
        if not self._quantizes_as(MXFP8Quantizer):
            return super().graph_operand(t, grad=grad)
        if isinstance(t, MXFP8Tensor):  # a weight that arrives quantized: read as it is
            later = columnwise_from_backward(t)
            if (t.rowwise_data is None or t.with_2d_quantization or t.fp8_dtype != self.fp8_dtype
                    or (t.columnwise_data is None and not later)
                    or t.dim() != 2 or t.shape[0] % BLOCK or t.shape[1] % BLOCK):
                return ("an MXFP8 weight that is not 1x32 blocks of this fp8 dtype, whole, "
                        "with its columnwise data now or from the backward's gather")
            return graph.GivenMX(kernel=use_kernels(t), columnwise_in_backward=later)
        return graph.MXBlocks(self.fp8_dtype, kernel=use_kernels(t),
                              two_d=self.with_2d_quantization)

    def _repr_params(self):
        return self._meta_fields()
