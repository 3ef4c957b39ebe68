"""``Float8Experts``: a 3-D expert weight held as FP8 codes with one scale an expert.

FP8 current scaling's grouped path quantizes a (E, N, K) expert weight one expert at a time
(:func:`.grouped.quantize_experts`: each expert's amax, scale and codes). A weight that
arrives already in that form (the unsharded parameter of an FSDP2 quantized all-gather,
:mod:`lowprec.distributed.experts_gather`) is a ``Float8Experts``: the module's weight for
the forward and backward, whose GEMMs read its codes and scales instead of quantizing the
weight again (the same bits: the quantize is each expert's own). What it supports and
refuses: :class:`lowprec.formats.experts.QuantizedExperts`.
"""

from __future__ import annotations

import torch

from ..experts import QuantizedExperts


class Float8Experts(QuantizedExperts):
    """(E, N, K) experts as FP8 ``codes`` (E, N, K) and fp32 encode ``scales`` (E,): the
    value of expert e is ``codes[e] / scales[e]``. ``dtype``: the weight's high-precision
    dtype (its gradient's)."""

    _inner = ("codes", "scales")

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                requires_grad: bool = False):
        return QuantizedExperts.__new__(cls, codes.shape, dtype, requires_grad=requires_grad,
                                        codes=codes, scales=scales)

    def _check(self) -> None:
        codes, scales = self.codes, self.scales
        if codes.dim() != 3 or codes.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"Float8Experts codes must be a 3-D float8 tensor, got "
                             f"{codes.dtype} of shape {tuple(codes.shape)}")
        if tuple(scales.shape) != (codes.shape[0],) or scales.dtype != torch.float32:
            raise ValueError(f"Float8Experts scales must be fp32 of shape ({codes.shape[0]},), "
                             f"got {scales.dtype} of shape {tuple(scales.shape)}")

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.codes.dtype

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The experts' values ``codes / scales`` as a plain tensor (the weight's dtype)."""
        values = self.codes.to(torch.float32) / self.scales[:, None, None]
        return values.to(dtype or self.dtype)
