"""Bias + activation as one autograd step, whose backward is the fused dact + dbias.

Backward computes ``dz = act'(z) * g`` in fp32 and ``dbias = sum(dz)`` from those fp32
values (each rounded once), from the saved input of the step, and, when the step follows
a ``BasicLinear``, quantizes ``dz`` right there with that linear's grad_output quantizer,
in the usages its dgrad and wgrad consume: the linear's backward then takes it as is
instead of reading ``dz`` again to quantize it.

Forward adds the bias (unless it is already inside the preceding GEMM) and applies the
activation in fp32, rounding once to the output dtype, and, when a linear follows,
quantizes the output with that linear's input quantizer.
"""

from __future__ import annotations

import torch

from ...activations import activation_fp32, activation_grad_fp32
from ..base import EmitSpec, Piece, RunContext, as_plain, plain, register_fusion
from ..graph import bias_activation_dtype, pre_activation


class _BiasActivationFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, add_bias, activation, emit, grad_emit):
        added = bias if add_bias else None
        # the sum itself stays fp32 until the one rounding
        ctx.out_dtype = bias_activation_dtype(y, added)
        ctx.save_for_backward(y, added)
        ctx.activation, ctx.grad_emit = activation, grad_emit
        ctx.bias_dtype = None if bias is None else bias.dtype
        out = activation_fp32(activation, pre_activation(y, added)).to(ctx.out_dtype)
        return emit.quantize(out) if emit is not None else out

    @staticmethod
    def backward(ctx, g):
        y, added = ctx.saved_tensors
        dz = activation_grad_fp32(ctx.activation, pre_activation(y, added), plain(g))
        db = None
        if ctx.needs_input_grad[1]:
            db = dz.reshape(-1, dz.shape[-1]).sum(dim=0).to(ctx.bias_dtype)
        dy = None
        if ctx.needs_input_grad[0]:
            dy = dz.to(ctx.out_dtype)
            if ctx.grad_emit is not None:
                dy = ctx.grad_emit.quantize(dy)
        return dy, db, None, None, None, None


def bias_activation(y: torch.Tensor, bias: torch.Tensor | None, activation: str, *,
                    add_bias: bool, emit: EmitSpec | None = None,
                    grad_emit: EmitSpec | None = None) -> torch.Tensor:
    """``activation(y + bias)`` (``activation(y)`` when ``add_bias`` is False: the bias is
    already in ``y``, but its gradient is still produced here), for the name of an activation
    of ``lowprec.modules.activations``; optionally quantized for the next linear (``emit``),
    with the gradient wrt ``y`` quantized for the previous one (``grad_emit``)."""
    return _BiasActivationFn.apply(y, bias, add_bias, activation, emit, grad_emit)


class BiasActivation(Piece):
    """Pattern ``Bias, Activation`` (not after a linear): one pass forward, fused
    dact + dbias backward."""

    graph_kind = "bias_act"

    def run(self, x: torch.Tensor, extra_inputs: list, ctx: RunContext) -> torch.Tensor:
        bias_part, act = self.parts
        x = as_plain(x)
        act.check_input(x)
        return bias_activation(x, bias_part.bias, act.activation, add_bias=True, emit=ctx.emit)


@register_fusion
def match_bias_activation(parts: list, i: int):
    if (i + 1 < len(parts) and parts[i].op_kind == "bias"
            and parts[i + 1].op_kind == "activation"):
        return BiasActivation(parts[i], parts[i + 1])
    return None
