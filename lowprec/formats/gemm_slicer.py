"""GemmSlicer: slices of one 2-D tensor, each quantized as the whole tensor's quantize would.

``Quantizer.gemm_slicer(x2d)`` returns one. ``lowprec.linear.exact_split`` uses it to quantize an
operand a slice at a time, each slice consumed by its GEMM and freed before the next is
made. Whatever the whole tensor fixes for all of its elements (NVFP4's global scales, the
stochastic-rounding keys) is fixed when the slicer is made, for both directions, in the
order a ``quantize`` with both usages would fix it; so every slice holds the values of
the same elements of ``quantize(x2d)``, bit for bit.

A slice is a row range ``x2d[a:b]`` for ``"rowwise"`` or a column range ``x2d[:, a:b]``
for ``"columnwise"``, with ``a`` a multiple of 128 (no block straddles a slice).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..kernels import use_kernels
from .base import QuantizedTensor, Quantizer, check_usage
from .exact import ExactTensor

#: ``fields(part, usage, start) -> dict``: the tensor fields of one slice, ``start`` its
#: first row (rowwise) or column (columnwise) in the whole tensor.
FieldsOf = Callable[[torch.Tensor, str, int], dict]


class GemmSlicer:
    """Quantizes slices of ``x2d`` (see the module docstring).

    ``codes_of`` gives a slice's fields as the format's own tensor (codes and scales);
    ``exact_of`` as an :class:`~lowprec.formats.exact.ExactTensor` of its exact bf16
    values, used where the quantize kernels run (None: the format has no such form).
    """

    def __init__(self, quantizer: Quantizer, x2d: torch.Tensor, codes_of: FieldsOf,
                 exact_of: FieldsOf | None) -> None:
        if x2d.dim() != 2:
            raise ValueError(f"GemmSlicer: needs a 2-D tensor, got shape {tuple(x2d.shape)}")
        self.quantizer = quantizer
        self.x2d = x2d
        self._codes_of = codes_of
        self._exact_of = exact_of

    def _part(self, start: int, stop: int, usage: str) -> torch.Tensor:
        check_usage(usage)
        return self.x2d[start:stop] if usage == "rowwise" else self.x2d[:, start:stop]

    def codes(self, start: int, stop: int, usage: str) -> QuantizedTensor:
        """The slice ``[start, stop)`` quantized for ``usage`` alone (codes and scales)."""
        part = self._part(start, stop, usage)
        return self.quantizer._slice_tensor(
            part, usage, lambda p: self._codes_of(p, usage, start))

    def __call__(self, start: int, stop: int, usage: str) -> QuantizedTensor:
        """The slice ``[start, stop)`` in the form a GEMM consumes at once: an ExactTensor of
        its exact bf16 values where the kernels run, else :meth:`codes`."""
        part = self._part(start, stop, usage)
        if self._exact_of is None or not use_kernels(part):
            return self.codes(start, stop, usage)
        return self.quantizer._slice_tensor(
            part, usage, lambda p: self._exact_of(p, usage, start), ExactTensor)


def block_gemm_slicer(quantizer: Quantizer, x2d: torch.Tensor) -> GemmSlicer:
    """``quantizer.gemm_slicer(x2d)`` of a format whose blocks never straddle a slice and
    which shares nothing between blocks."""
    return GemmSlicer(quantizer, x2d, lambda part, usage, start: quantizer._quantize_2d(part),
                      lambda part, usage, start: quantizer._quantize_exact_2d(part))
