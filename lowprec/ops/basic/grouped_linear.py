"""GroupedLinear op: lowprec.GroupedLinear taking m_splits as an extra input."""

from __future__ import annotations

import torch

from ...modules import grouped_linear
from ..base import BasicOperation, RunContext, as_plain


class GroupedLinear(grouped_linear.GroupedLinear, BasicOperation):
    """``forward(x, m_splits)``; in a Sequential, ``m_splits`` is the next extra input.

    Same constructor, parameters (``weight0..``, ``bias0..``), roles
    (``module_type`` ``grouped_linear``) and numerics as
    :class:`lowprec.GroupedLinear`; quantized weights keep every usage.
    Each group is quantized on its own rows, so it takes a plain input.
    """

    op_kind = "grouped_linear"
    num_extra_inputs = 1

    def op_forward(self, x: torch.Tensor, extra_inputs: list, ctx: RunContext) -> torch.Tensor:
        return grouped_linear.GroupedLinear.forward(self, as_plain(x), extra_inputs[0])
