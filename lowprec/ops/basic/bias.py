"""Bias: ``y = x + bias`` over the last dimension."""

from __future__ import annotations

import torch
from torch import nn

from ..base import BasicOperation, RunContext, as_plain, emit_output
from ..graph import bias_operand


def bias_forward(x: torch.Tensor, bias: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    x = as_plain(x)
    return emit_output(x + bias_operand(x, bias), ctx)


class Bias(BasicOperation):
    """Adds a learnable ``bias`` (initialized to zero) to the last dimension.

    After a ``BasicLinear`` it is fused into the GEMM (see ``lowprec.ops.fused``).
    """

    op_kind = "bias"
    can_emit = True

    def __init__(self, size: int, *, params_dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.size = size
        self.bias = nn.Parameter(torch.zeros(size, dtype=params_dtype or torch.get_default_dtype(),
                                             device=device))

    def reset_parameters(self) -> None:
        """The constructor's initialization again (zeros; meta-device init)."""
        with torch.no_grad():
            self.bias.zero_()

    def op_forward(self, x: torch.Tensor, extra_inputs: list, ctx: RunContext) -> torch.Tensor:
        return bias_forward(x, self.bias, ctx)

    def extra_repr(self) -> str:
        return f"size={self.size}"
