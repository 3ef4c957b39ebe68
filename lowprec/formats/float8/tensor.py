"""Float8Tensor: per-tensor scaled FP8 data (delayed or current scaling)."""

from __future__ import annotations

import torch

from ..base import QuantizedTensor
from .reference import dequantize_per_tensor


class Float8Tensor(QuantizedTensor):
    """Per-tensor FP8.

    ``shared_scale`` is the 1-element fp32 *encode* scale used at quantize
    time (values were cast from ``x * scale``; dequantization is
    ``data / scale``). It is NaN when the input held NaN/Inf, so the whole
    tensor dequantizes to NaN. The columnwise data is the transpose of the
    rowwise data, so either direction derives from the other.
    """

    _inner = ("rowwise_data", "columnwise_data", "shared_scale")
    _meta = ("fp8_dtype",)

    def _dequantize_2d(self, usage: str) -> torch.Tensor:
        return dequantize_per_tensor(getattr(self, f"{usage}_data"), self.shared_scale)

    def _derive(self, usage: str) -> dict[str, torch.Tensor]:
        other = "columnwise" if usage == "rowwise" else "rowwise"
        return {f"{usage}_data": getattr(self, f"{other}_data").t().contiguous()}
