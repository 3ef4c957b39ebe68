"""Zero padding that makes a quantized linear's operands whole blocks.

A quantizer's blocks must tile the dimensions they run along. Where ``x @ weight.T``'s do
not, the linear pads with zeros, which change no block's amax or scale and give zero
products in every GEMM, and cuts the padding from the output (autograd cuts it from the
gradients: dY gets zero rows and columns, dX and dW lose theirs):

* K and N, the feature dimensions (:func:`feature_padding`): zero columns of x and W, zero
  rows of W and of the bias; a partial block then scales by its own values, as Transformer
  Engine's does;
* M, the token count (``plan.row_padding``): zero rows of x, so that the wgrad operands,
  quantized columnwise, fill whole blocks along M (only a call that computes dW).

:func:`padding_for` decides it once per kind of call; :class:`Padding` pads the operands
and cuts the output, the same ops in an eager call and in a traced one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..formats import QuantizedTensor
from .plan import feature_multiples, row_padding


@dataclass(frozen=True)
class Padding:
    """Zero columns along K, zero rows along N (weight, bias) and zero rows along M (x)."""

    k: int = 0
    n: int = 0
    rows: int = 0

    def __bool__(self) -> bool:
        return bool(self.k or self.n or self.rows)

    def operands(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """(x, weight, bias) padded: x 2-D where rows are appended."""
        if self.k:
            x = F.pad(x, (0, self.k))
        if self.k or self.n:
            weight = F.pad(weight, (0, self.k, 0, self.n))
            bias = F.pad(bias, (0, self.n)) if bias is not None else None
        if self.rows:
            x = F.pad(x.reshape(-1, x.shape[-1]), (0, 0, 0, self.rows))
        return x, weight, bias

    def cut(self, y: torch.Tensor, x_shape: torch.Size) -> torch.Tensor:
        """The output of the padded operands without its padding, in x's leading shape."""
        if self.rows:
            y = y[:y.shape[0] - self.rows].reshape(*x_shape[:-1], y.shape[-1])
        return y[..., :y.shape[-1] - self.n] if self.n else y


NONE = Padding()


def padding_for(q, backward_mode: str, x: torch.Tensor, weight: torch.Tensor,
                weight_grad: bool | None = None) -> Padding:
    """The padding of a call with quantizers ``q`` (a ``LinearQuantizers`` or None); rows
    for the wgrad operands only where the call computes dW (gradients on, a weight that
    needs one: ``weight_grad``, default ``weight.requires_grad``)."""
    pad_k, pad_n = feature_padding(q, x, weight)
    need_dw = weight.requires_grad if weight_grad is None else weight_grad
    rows = row_padding(q, x, backward_mode, torch.is_grad_enabled() and need_dw)
    return Padding(pad_k, pad_n, rows) if pad_k or pad_n or rows else NONE


def feature_padding(q, x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    """(zero columns for K, zero rows for N) that make every operand of ``x @ weight.T``
    fill whole blocks along its feature dimensions. Nothing for quantized operands or a
    quantized output (boundary roles), whose quantizers keep refusing a partial block."""
    if (q is None or isinstance(x, QuantizedTensor) or isinstance(weight, QuantizedTensor)
            or q.output is not None or q.grad_input is not None or weight.dim() != 2):
        return 0, 0
    k_multiple, n_multiple = _feature_multiples(q)
    return -x.shape[-1] % k_multiple, -weight.shape[0] % n_multiple


def _feature_multiples(q) -> tuple[int, int]:
    """``plan.feature_multiples(q)``: fixed for the quantizers, so kept with their plans
    rather than worked out each call."""
    if torch.compiler.is_compiling():  # the compiler reads the quantizers, keeps nothing
        return feature_multiples(q)
    multiples = q.plans.get("feature_multiples")
    if multiples is None:
        multiples = q.plans["feature_multiples"] = feature_multiples(q)
    return multiples
