"""Float8Tensor: per-tensor scaled FP8 data (delayed or current scaling)."""

from __future__ import annotations

import torch

from ...kernels.transpose import transpose_contiguous
from ..base import QuantizedTensor
from ..graph import Kind
from .reference import dequantize_per_tensor


class Float8Tensor(QuantizedTensor):
    """Per-tensor FP8.

    ``shared_scale`` is the 1-element fp32 *encode* scale used at quantize
    time (values were cast from ``x * scale``; dequantization is
    ``data / scale``). It is NaN when the input held NaN/Inf, so the whole
    tensor dequantizes to NaN. The columnwise data is the transpose of the
    rowwise data, so either direction derives from the other.

    Tensors made from one quantize one usage at a time (a weight's columnwise copy
    made after fprop, the slices of a sliced dY) share one ``shared_scale`` tensor:
    an in-place write to one's scale changes the other's too.
    """

    _inner = ("rowwise_data", "columnwise_data", "shared_scale")
    _meta = ("fp8_dtype",)
    #: ``(scale, scale._version, 1 / scale)`` as the quantize kernel wrote it, or None.
    _derived = ("_decode",)

    def decode_scale(self) -> torch.Tensor:
        """``1 / shared_scale`` as a 0-d fp32 tensor, the scale a GEMM multiplies its fp8
        product by. The quantize kernel's copy while ``shared_scale`` is the same,
        unmodified tensor (it saves a launch per GEMM operand); else computed here."""
        s = self.shared_scale
        rec = self._read_derived("_decode", s)
        if rec is not None:
            return rec
        return torch.reciprocal(s.to(torch.float32)).reshape(())

    def _dequantize_2d(self, usage: str) -> torch.Tensor:
        return dequantize_per_tensor(getattr(self, f"{usage}_data"), self.shared_scale)

    def _gemm_kind(self, usage: str, read: bool) -> Kind:
        return Kind("fp8", self.fp8_dtype)

    def bf16_operand(self, usage: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"{usage}_data").to(torch.bfloat16), self.shared_scale

    def _derive(self, usage: str) -> dict[str, torch.Tensor]:
        other = "columnwise" if usage == "rowwise" else "rowwise"
        return {f"{usage}_data": transpose_contiguous(getattr(self, f"{other}_data"))}
