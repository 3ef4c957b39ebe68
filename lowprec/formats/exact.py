"""ExactTensor: only the exact bf16 values of another format's quantization.

An operand that nothing reads but the GEMMs right after its quantize (dY in a linear
backward) needs neither its codes nor its scales when those GEMMs are emulated on a bf16
tensor core: MXFP8 and NVFP4 quantize kernels can write the exact values instead
(``Quantizer.quantize_for_gemm(x, exact, codes=False)``). This tensor holds them.
"""

from __future__ import annotations

import torch

from .base import QuantizedTensor
from .graph import Kind


class ExactTensor(QuantizedTensor):
    """The values of a quantized tensor as exact bf16 matrices, per direction.

    With ``M = prod(shape[:-1])``, ``K = shape[-1]``:

    * ``rowwise_data`` (M, K) bf16 and ``columnwise_data`` (K, M) bf16: the
      values of each direction in the layout the source format stores it
      (columnwise: in the Hadamard domain along M when ``columnwise_rht``);
    * ``rowwise_divisor`` / ``columnwise_divisor``: None, or a (1,) fp32 tensor
      the values are divided by (NVFP4's global encode scale ``S``).

    ``source_format`` names the format quantized (``"mxfp8"``, ``"nvfp4"``).
    Dequantizing gives bit for bit what the source tensor would give: the bf16
    values are exact, and the division (and the inverse RHT) run in fp32 as
    the source format's reference does.
    """

    _inner = ("rowwise_data", "rowwise_divisor", "columnwise_data", "columnwise_divisor")
    _meta = ("source_format", "columnwise_rht")

    @staticmethod
    def one_usage_fields(usage: str, values: torch.Tensor, divisor: torch.Tensor | None, *,
                         source_format: str, rht: bool = False) -> dict:
        """Fields of an ExactTensor holding ``usage``'s values alone (``rht``: columnwise
        values in the Hadamard domain)."""
        other = "columnwise" if usage == "rowwise" else "rowwise"
        return {f"{usage}_data": values, f"{usage}_divisor": divisor, f"{other}_data": None,
                f"{other}_divisor": None, "source_format": source_format,
                "columnwise_rht": bool(rht and usage == "columnwise")}

    def _gemm_kind(self, usage: str, read: bool) -> Kind:
        return Kind("exact", rht=usage == "columnwise" and self.columnwise_rht,
                    divisor=getattr(self, f"{usage}_divisor") is not None,
                    bf16=getattr(self, f"{usage}_data").dtype == torch.bfloat16)

    def bf16_operand(self, usage: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return getattr(self, f"{usage}_data"), getattr(self, f"{usage}_divisor")

    def _dequantize_2d(self, usage: str) -> torch.Tensor:
        values = getattr(self, f"{usage}_data").to(torch.float32)
        divisor = getattr(self, f"{usage}_divisor")
        if divisor is not None:
            values = values / divisor
        if usage == "columnwise" and self.columnwise_rht:
            from .rht import rht_inverse
            values = rht_inverse(values)
        return values

    def __repr__(self, *, tensor_contents=None):
        held = [u for u in ("rowwise", "columnwise") if self.has_usage(u)]
        return (f"ExactTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, source={self.source_format}, usages={held})")
