"""IdentityQuantizer: keep a tensor role in high precision inside any recipe."""

from __future__ import annotations

import torch

from .base import HIGH_PRECISION_DTYPES, QuantizedTensor, Quantizer, flatten_2d
from .graph import Kind, PlainOperand, plain_kind


class IdentityTensor(QuantizedTensor):
    """A high-precision tensor in quantized-tensor clothing.

    Both directions refer to the same storage: ``rowwise_data`` is the
    (M, K) matrix and ``columnwise_data`` its transposed *view* (K, M), so
    holding both costs nothing. GEMMs consume the data as it is.
    """

    _inner = ("rowwise_data", "columnwise_data")
    _meta = ()

    def _dequantize_2d(self, usage: str) -> torch.Tensor:
        return getattr(self, f"{usage}_data").to(torch.float32)

    def _dequantize(self, dtype=None, usage=None):
        # Skip the fp32 round trip: the held values are the values.
        usage = self._held_usage(usage)
        if not self.has_usage(usage):
            return super()._dequantize(dtype, usage)  # raises with the standard message
        data = getattr(self, f"{usage}_data")
        data = data.t() if usage == "columnwise" else data
        return data.reshape(self.shape).to(dtype or self.dtype)

    def _gemm_kind(self, usage: str, read: bool) -> Kind:
        return plain_kind(getattr(self, f"{usage}_data").dtype)

    def bf16_operand(self, usage: str) -> tuple[torch.Tensor, None]:
        return getattr(self, f"{usage}_data"), None

    def holds_gemm_layout(self, usage: str) -> bool:
        # the GEMMs read the transposed view as it is
        return self.has_usage(usage)

    def _derive(self, usage: str) -> dict[str, torch.Tensor]:
        other = "columnwise" if usage == "rowwise" else "rowwise"
        return {f"{usage}_data": getattr(self, f"{other}_data").t()}


class IdentityQuantizer(Quantizer):
    """Keeps the high-precision tensor (cast to ``dtype`` when given)."""

    format_name = "identity"

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if dtype is not None and dtype not in HIGH_PRECISION_DTYPES:
            raise ValueError(f"IdentityQuantizer dtype must be None or one of "
                             f"{HIGH_PRECISION_DTYPES}, got {dtype}")
        self.dtype = dtype

    def _tensor_class(self):
        return IdentityTensor

    def _quantize_2d(self, x2d):
        data = x2d if self.dtype is None else x2d.to(self.dtype)
        return {"rowwise_data": data if self.rowwise_usage else None,
                "columnwise_data": data.t() if self.columnwise_usage else None}

    def make_empty(self, shape, dtype=torch.float32, device=None):
        # The held dtype defaults to the nominal one, which the generic hook does not see.
        if dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"make_empty: dtype must be one of {HIGH_PRECISION_DTYPES}, "
                            f"got {dtype}")
        m, k = flatten_2d(tuple(shape))
        data = torch.empty(m, k, dtype=self.dtype or dtype, device=device)
        return self._holding_self(IdentityTensor(tuple(shape), dtype, **self._quantize_2d(data)))

    def graph_operand(self, t, *, grad=False):
        if not self._quantizes_as(IdentityQuantizer):
            return super().graph_operand(t, grad=grad)
        return PlainOperand(self.dtype or t.dtype)

    def _repr_params(self):
        return {"dtype": self.dtype}
