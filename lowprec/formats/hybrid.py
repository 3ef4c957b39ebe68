"""HybridQuantizer: a different format per GEMM direction.

The rowwise representation (fprop, and dY in dgrad) comes from one
quantizer, the columnwise one (W in dgrad, both wgrad operands) from
another. A :class:`HybridQuantizedTensor` simply holds the two ordinary
quantized tensors; GEMMs pick the sub-tensor of the direction they consume.
"""

from __future__ import annotations

import math

import torch

from .base import QuantizedTensor, Quantizer, flatten_2d
from .graph import HybridOperand


class HybridQuantizedTensor(QuantizedTensor):
    """Holds ``rowwise_data`` (a quantized tensor with rowwise data only) and
    ``columnwise_data`` (one with columnwise data only), either may be None."""

    _inner = ("rowwise_data", "columnwise_data")
    _meta = ()

    def sub_tensor(self, usage: str) -> QuantizedTensor:
        """The quantized tensor that holds ``usage``."""
        if not self.has_usage(usage):
            raise RuntimeError(f"HybridQuantizedTensor holds no {usage} data")
        return getattr(self, f"{usage}_data")

    def _dequantize_2d(self, usage: str) -> torch.Tensor:
        return self.sub_tensor(usage)._stored_values(usage)

    def partial(self, usage: str) -> bool:
        return self.sub_tensor(usage).partial(usage)

    def _stored_values(self, usage: str) -> torch.Tensor:
        return self.sub_tensor(usage)._stored_values(usage)

    def _halves(self) -> str:
        """Each half this tensor holds, by its type (``rowwise=Float8Tensor, ...``)."""
        return ", ".join(f"{u}={type(getattr(self, f'{u}_data')).__name__}"
                         for u in ("rowwise", "columnwise") if self.has_usage(u))

    def form(self) -> str:
        return f"HybridQuantizedTensor({self._halves()})"

    def __repr__(self, *, tensor_contents=None):
        return (f"HybridQuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, {self._halves()})")


class HybridQuantizer(Quantizer):
    """Rowwise representation from ``rowwise_quantizer``, columnwise from
    ``columnwise_quantizer``; each runs only when its usage is on.

    The two must be distinct objects (each is configured for one direction)
    and neither may itself be a HybridQuantizer.
    """

    format_name = "hybrid"

    def __init__(self, rowwise_quantizer: Quantizer, columnwise_quantizer: Quantizer) -> None:
        super().__init__()
        for name, q in (("rowwise_quantizer", rowwise_quantizer),
                        ("columnwise_quantizer", columnwise_quantizer)):
            if not isinstance(q, Quantizer):
                raise TypeError(f"HybridQuantizer: {name} must be a lowprec Quantizer, got "
                                f"{type(q).__name__}")
            if isinstance(q, HybridQuantizer):
                raise ValueError(f"HybridQuantizer: {name} is itself a HybridQuantizer; nested "
                                 f"hybrids are not supported, give the per-direction quantizers")
        if rowwise_quantizer is columnwise_quantizer:
            raise ValueError("HybridQuantizer needs two distinct quantizer objects (each is set to "
                             "one direction); pass q and q.copy() to use one format both ways")
        self.rowwise_quantizer = rowwise_quantizer
        self.columnwise_quantizer = columnwise_quantizer

    def copy(self) -> "HybridQuantizer":
        out = super().copy()
        out.rowwise_quantizer = self.rowwise_quantizer.copy()
        out.columnwise_quantizer = self.columnwise_quantizer.copy()
        return out

    def _tensor_class(self):
        return HybridQuantizedTensor

    def tensor_form(self) -> str:
        return (f"HybridQuantizedTensor(rowwise={self.rowwise_quantizer.tensor_form()}, "
                f"columnwise={self.columnwise_quantizer.tensor_form()})")

    def makes_form_of(self, t) -> bool:
        # each half that ``t`` holds must be its direction's quantizer's form
        return type(t) is HybridQuantizedTensor and all(
            q.makes_form_of(t.sub_tensor(usage))
            for usage, q in (("rowwise", self.rowwise_quantizer),
                             ("columnwise", self.columnwise_quantizer)) if t.has_usage(usage))

    def _both(self, method: str, rowwise: bool, columnwise: bool) -> int:
        """lcm of what each direction's quantizer needs (``row_multiple``/``col_multiple``)."""
        return math.lcm(
            getattr(self.rowwise_quantizer, method)(rowwise=rowwise, columnwise=False)
            if rowwise else 1,
            getattr(self.columnwise_quantizer, method)(rowwise=False, columnwise=columnwise)
            if columnwise else 1)

    def row_multiple(self, *, rowwise: bool, columnwise: bool) -> int:
        return self._both("row_multiple", rowwise, columnwise)

    def col_multiple(self, *, rowwise: bool, columnwise: bool) -> int:
        return self._both("col_multiple", rowwise, columnwise)

    def _check_shape(self, shape, m, k):
        if self.rowwise_usage:
            self.rowwise_quantizer.set_usage(rowwise=True, columnwise=False)
            self.rowwise_quantizer._check_shape(shape, m, k)
        if self.columnwise_usage:
            self.columnwise_quantizer.set_usage(rowwise=False, columnwise=True)
            self.columnwise_quantizer._check_shape(shape, m, k)

    def _whole_blocks(self, shape, m, k):
        # each direction's quantizer takes its own partial blocks
        for usage, q in (("rowwise", self.rowwise_quantizer),
                         ("columnwise", self.columnwise_quantizer)):
            if getattr(self, f"{usage}_usage"):
                q.set_usage(rowwise=usage == "rowwise", columnwise=usage == "columnwise")
                q._whole_blocks(shape, m, k)
        return m, k

    def _quantize_2d(self, x2d):
        fields = {"rowwise_data": None, "columnwise_data": None}
        for usage, q in (("rowwise", self.rowwise_quantizer),
                         ("columnwise", self.columnwise_quantizer)):
            if getattr(self, f"{usage}_usage"):
                q.set_usage(rowwise=usage == "rowwise", columnwise=usage == "columnwise")
                fields[f"{usage}_data"] = q.quantize(x2d)
        return fields

    def quantize(self, x: torch.Tensor) -> HybridQuantizedTensor:
        return _nominal_subs(super().quantize(x))

    def make_empty(self, shape, dtype=torch.float32, device=None) -> HybridQuantizedTensor:
        # Each half is built by its own quantizer with the nominal shape and dtype (an
        # identity half stores data in that dtype).
        shape = tuple(shape)
        m, k = flatten_2d(shape)
        self._whole_blocks(shape, m, k)
        fields = {"rowwise_data": None, "columnwise_data": None}
        for usage, q in (("rowwise", self.rowwise_quantizer),
                         ("columnwise", self.columnwise_quantizer)):
            if getattr(self, f"{usage}_usage"):
                q.set_usage(rowwise=usage == "rowwise", columnwise=usage == "columnwise")
                fields[f"{usage}_data"] = q.make_empty(shape, dtype=dtype, device=device)
        return self._holding_self(HybridQuantizedTensor(shape, dtype, **fields))

    def graph_operand(self, t, *, grad=False):
        if not self._quantizes_as(HybridQuantizer):
            return super().graph_operand(t, grad=grad)
        row = self.rowwise_quantizer.graph_operand(t, grad=grad)
        col = self.columnwise_quantizer.graph_operand(t, grad=grad)
        for half in (row, col):
            if isinstance(half, str):
                return half
        return HybridOperand(row, col)

    def _repr_params(self):
        return {"rowwise_quantizer": self.rowwise_quantizer,
                "columnwise_quantizer": self.columnwise_quantizer}


def _nominal_subs(qt: HybridQuantizedTensor) -> HybridQuantizedTensor:
    """Sub-tensors are made from the 2-D view; give them the hybrid's nominal shape and dtype."""
    for usage in ("rowwise", "columnwise"):
        sub = getattr(qt, f"{usage}_data")
        if sub is not None:
            setattr(qt, f"{usage}_data", sub._rebuild(lambda t: t, shape=qt.shape, dtype=qt.dtype))
    return qt
