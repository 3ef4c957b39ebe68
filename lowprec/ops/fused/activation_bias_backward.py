"""Bias + activation as one autograd step, whose backward is the fused dact + dbias.

Backward computes ``dz = act'(z) * g`` and ``dbias = sum(dz)`` together from
the one saved tensor ``z`` (the pre-activation), and, when the step follows a
``BasicLinear``, quantizes ``dz`` right there with that linear's grad_output
quantizer, in the usages its dgrad and wgrad consume: the linear's backward
then takes it as is instead of reading ``dz`` again to quantize it.

Forward adds the bias (unless it is already inside the preceding GEMM),
applies the activation and, when a linear follows, quantizes the output
with that linear's input quantizer.
"""

from __future__ import annotations

import torch

from ..base import EmitSpec, Piece, RunContext, as_plain, plain, register_fusion


class _BiasActivationFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, add_bias, act_fn, emit, grad_emit):
        z = y + bias if (add_bias and bias is not None) else y
        ctx.save_for_backward(z)
        ctx.act_fn, ctx.grad_emit = act_fn, grad_emit
        ctx.bias_dtype = None if bias is None else bias.dtype
        out = act_fn(z)
        return emit.quantize(out) if emit is not None else out

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        with torch.enable_grad():
            zz = z.detach().requires_grad_(True)
            (dz,) = torch.autograd.grad(ctx.act_fn(zz), zz, plain(g))
        db = None
        if ctx.needs_input_grad[1]:
            db = dz.reshape(-1, dz.shape[-1]).sum(dim=0).to(ctx.bias_dtype)
        dy = dz
        if ctx.grad_emit is not None and ctx.needs_input_grad[0]:
            dy = ctx.grad_emit.quantize(dz)
        return dy, db, None, None, None, None


def bias_activation(y: torch.Tensor, bias: torch.Tensor | None, act_fn, *, add_bias: bool,
                    emit: EmitSpec | None = None, grad_emit: EmitSpec | None = None) -> torch.Tensor:
    """``act(y + bias)`` (``act(y)`` when ``add_bias`` is False: the bias is already in
    ``y``, but its gradient is still produced here), optionally quantized for the next
    linear (``emit``), with the gradient wrt ``y`` quantized for the previous one
    (``grad_emit``)."""
    return _BiasActivationFn.apply(y, bias, add_bias, act_fn, emit, grad_emit)


class BiasActivation(Piece):
    """Pattern ``Bias, Activation`` (not after a linear): one pass forward, fused
    dact + dbias backward."""

    def run(self, x: torch.Tensor, extra_inputs: list, ctx: RunContext) -> torch.Tensor:
        bias_part, act = self.parts
        x = as_plain(x)
        act.check_input(x)
        return bias_activation(x, bias_part.bias, act.fn, add_bias=True, emit=ctx.emit)


@register_fusion
def match_bias_activation(parts: list, i: int):
    if (i + 1 < len(parts) and parts[i].op_kind == "bias"
            and parts[i + 1].op_kind == "activation"):
        return BiasActivation(parts[i], parts[i + 1])
    return None
