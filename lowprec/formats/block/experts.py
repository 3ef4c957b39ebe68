"""``Float8BlockExperts``: a 3-D expert weight held as FP8 codes with one scale a 128x128
block.

The grouped block-scaled FP8 path quantizes a (E, N, K) expert weight as one (E * N, K)
matrix of 128x128 blocks; with N a multiple of 128 no block straddles two experts, so each
expert's blocks are its own quantize's. A weight that arrives in that form (the unsharded
parameter of an FSDP2 quantized all-gather, :mod:`lowprec.distributed.experts_gather`) is
a ``Float8BlockExperts``: its GEMMs read the codes and scales instead of quantizing the
weight again (the same bits). What it supports and refuses:
:class:`lowprec.formats.experts.QuantizedExperts`.
"""

from __future__ import annotations

import torch

from ..base import QuantizedTensor
from ..experts import QuantizedExperts
from .reference import BLOCK, dequantize_blocks
from .tensor import Float8BlockwiseTensor


class Float8BlockExperts(QuantizedExperts):
    """(E, N, K) experts as FP8 ``codes`` (E * N, K) and fp32 encode ``scales``
    (E * N / 128, K / 128), one a 128x128 block; ``pow2``: the scales were forced to powers
    of two. ``dtype``: the weight's high-precision dtype (its gradient's)."""

    _inner = ("codes", "scales")
    _meta = ("pow2",)
    _block = BLOCK

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, codes: torch.Tensor, scales: torch.Tensor,
                pow2: bool, requires_grad: bool = False):
        return QuantizedExperts.__new__(cls, shape, dtype, requires_grad=requires_grad,
                                        codes=codes, scales=scales, pow2=pow2)

    def _layout(self, e: int, n: int, k: int) -> dict:
        return {"codes": ((torch.float8_e4m3fn, torch.float8_e5m2), "float8", (e * n, k)),
                "scales": ((torch.float32,), "fp32", (e * n // BLOCK, k // BLOCK))}

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.codes.dtype

    def _tensor(self, codes, scales, rows: int, columnwise: bool) -> Float8BlockwiseTensor:
        fields = dict(rowwise_data=codes, rowwise_scale=scales, columnwise_data=None,
                      columnwise_scale=None, fp8_dtype=self.fp8_dtype, block_scaling_dim=2)
        if self.pow2:
            fields["_pow2_rowwise"] = QuantizedTensor.derived_record(scales, True)
        t = Float8BlockwiseTensor((rows, self.shape[2]), self.dtype, **fields)
        return t.update_usage(columnwise_usage=True) if columnwise else t

    def blocks(self, columnwise: bool = False) -> Float8BlockwiseTensor:
        """Every expert as one (E * N, K) block-scaled tensor, as the grouped path's
        quantize of the stacked weight makes it; ``columnwise``: with the transposed
        codes dgrad reads (a new copy, this tensor's own codes are untouched)."""
        e, n, _ = self.shape
        return self._tensor(self.codes, self.scales, e * n, columnwise)

    def expert(self, g: int, columnwise: bool = False) -> Float8BlockwiseTensor:
        """Expert ``g``'s (N, K) weight as its own quantize makes it: rowwise, and
        ``columnwise`` (its transpose; else derived where a GEMM needs it)."""
        n = self.shape[1]
        return self._tensor(self.codes[g * n:(g + 1) * n],
                            self.scales[g * n // BLOCK:(g + 1) * n // BLOCK], n, columnwise)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The experts' values ``codes / scale`` of their blocks as a plain tensor (the
        weight's dtype)."""
        values = dequantize_blocks(self.codes, self.scales, 2).view(self.shape)
        return values.to(dtype or self.dtype)
