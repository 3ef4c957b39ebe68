"""The one autograd Function of every grouped path, over a plan decided from the quantizers.

A grouped call (:func:`lowprec.linear.grouped.grouped_linear`) that takes a grouped path
runs :class:`GroupedFunction` over a :class:`GroupedPlan`: the scheme of the format its
quantizers pick (decided once per set of quantizers and kind of call, see ``grouped.py``)
and those quantizers. The Function does what every path does (which gradients are needed,
what is saved, the weight gradients in the layout the weights came in); the scheme
quantizes and multiplies, in its format's module:

* :data:`PLAIN`: high precision, one ``torch._grouped_mm`` a direction (here);
* ``grouped_current.CURRENT``: FP8 current scaling, each group its own scale;
* ``grouped_blocks.Blocks``: block formats in a padded layout, through the quantizers'
  graph operands, with grouped GEMMs over exact bf16 values (``grouped_exact.EXACT``,
  MXFP8) or block-scaled FP8 codes (``grouped_block_fp8.BLOCK_FP8``);
* ``grouped_nvfp4.NVFP4``: NVFP4, each group its own global scales.

A scheme has ``name``, ``align(quantizers)`` (the row multiple it pads each group to,
1 for none), ``forward(plan, x2d, sizes, aligned, weights, need_dx, need_dw)`` giving
``(y, tensors to save, state)`` and ``backward(plan, state, saved, dy, need_dx,
need_dw)`` giving ``(dx, dw)``, dW (G, N, K) or None.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..gemm import grouped_mm
from .grouped_parts import layout, stacked, weight_grads


class GroupedPlan(NamedTuple):
    """What a grouped call runs: the format's ``scheme``, the (input, weight, grad_output)
    ``quantizers`` (None: high precision) and, for FP8 current scaling, the grouped GEMM
    the device and the row count take (``grouped_current.gemm_backend``)."""

    scheme: object
    quantizers: Optional[tuple] = None
    backend: Optional[str] = None

    @property
    def name(self) -> str:
        return self.scheme.name

    @property
    def align(self) -> int:
        """The row multiple the path pads each group to (1: none)."""
        return self.scheme.align(self.quantizers)


class GroupedFunction(torch.autograd.Function):
    """``y = x @ W_g.T`` for each group ``g`` of rows over a :class:`GroupedPlan`. The
    weights are one (G, N, K) tensor or G (N, K) ones (each gets its own gradient);
    ``aligned``: the caller laid the groups out at multiples of the plan's ``align``."""

    @staticmethod
    def forward(ctx, x2d, sizes, plan: GroupedPlan, grad_enabled: bool, aligned: bool,
                *weights):
        # needs_input_grad ignores no_grad(): an evaluation forward keeps nothing
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and any(ctx.needs_input_grad[5:])
        y, saved, ctx.state = plan.scheme.forward(plan, x2d, sizes, aligned, weights, need_dx,
                                                  need_dw)
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.weights = plan, layout(weights)
        return y

    @staticmethod
    def backward(ctx, dy):
        need_dx, need_dw = ctx.needs_input_grad[0], any(ctx.needs_input_grad[5:])
        dx, dw = ctx.plan.scheme.backward(ctx.plan, ctx.state, ctx.saved_tensors,
                                          dy.contiguous(), need_dx, need_dw)
        return dx, None, None, None, None, *weight_grads(dw, ctx.weights)


class _Plain:
    """High precision: one ``torch._grouped_mm`` a direction."""

    name = "plain"

    @staticmethod
    def align(quantizers) -> int:
        return 1

    @staticmethod
    def forward(plan, x2d, sizes, aligned, weights, need_dx, need_dw):
        w3d = stacked(weights)
        offs = grouped_mm.end_offsets(sizes)
        y = grouped_mm.plain_rows_by_experts(x2d, w3d, offs)
        return y, (x2d if need_dw else None, w3d if need_dx else None, offs), None

    @staticmethod
    def backward(plan, state, saved, dy, need_dx, need_dw):
        x2d, w3d, offs = saved
        dw = grouped_mm.plain_wgrad(dy, x2d, offs) if need_dw else None
        dx = grouped_mm.plain_rows_by_experts(dy, w3d.transpose(1, 2), offs) if need_dx else None
        return dx, dw


#: high precision's scheme
PLAIN = _Plain()
