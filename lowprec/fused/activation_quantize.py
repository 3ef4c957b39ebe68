"""An activation whose output is written only in quantized form (the next GEMM's input).

Forward: the quantize kernels apply the activation as they load each tile (current
scaling's amax pass does too), in fp32 rounded once to the input dtype, as
``lowprec.activations`` computes it. Backward: that registry's gradient from the saved
input, so it equals the unfused gradient bit for bit and allocates no activation output.
"""

from __future__ import annotations

import torch

from ..activations import activation_grad
from ..formats import QuantizedTensor
from .prologue import Prologue, activation_prologue, apply_prologue_with_amax


class _ActivationQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, activation, quantizer, rowwise, columnwise):
        quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
        pro = activation_prologue(activation)
        if getattr(quantizer, "wants_producer_amax", False):
            # Current scaling needs the amax before the cast: one pass writes the activation
            # and its amax, the cast reads it (the activation is computed once, not twice).
            k = h.shape[-1]
            a, amax_bits = apply_prologue_with_amax(h.reshape(-1, k).contiguous(), pro)
            a = a.view(*h.shape[:-1], a.shape[-1])
            out = quantizer.quantize_fused(a, Prologue(0, (), amax_bits))
        else:
            out = quantizer.quantize_fused(h, pro)
        ctx.save_for_backward(h)
        ctx.activation = activation
        return out

    @staticmethod
    def backward(ctx, g):
        (h,) = ctx.saved_tensors
        if isinstance(g, QuantizedTensor):
            g = g.dequantize()
        return activation_grad(ctx.activation, h, g), None, None, None, None


def activation_then_quantize(h: torch.Tensor, activation: str, quantizer, rowwise: bool,
                             columnwise: bool) -> QuantizedTensor:
    """``quantizer(activation(h))`` with the given usages, the activation never written in
    high precision (check ``lowprec.fused.can_fuse`` first). Differentiable in h."""
    return _ActivationQuantize.apply(h, activation, quantizer, rowwise, columnwise)
