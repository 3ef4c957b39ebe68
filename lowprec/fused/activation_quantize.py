"""An activation whose output is written only in quantized form (the next GEMM's input).

Forward: the quantize kernels apply the activation as they load each tile (current
scaling's amax pass does too). Backward: the activation's gradient from its saved input,
recomputing the activation under autograd (the input is all the unfused op keeps too).
"""

from __future__ import annotations

import torch

from ..formats.base import QuantizedTensor
from ..modules.activations import get_activation
from .prologue import activation_prologue


class _ActivationQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, activation, quantizer, rowwise, columnwise):
        quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
        out = quantizer.quantize_fused(h, activation_prologue(activation))
        ctx.save_for_backward(h)
        ctx.activation = activation
        return out

    @staticmethod
    def backward(ctx, g):
        (h,) = ctx.saved_tensors
        if isinstance(g, QuantizedTensor):
            g = g.dequantize()
        fn, _ = get_activation(ctx.activation)
        with torch.enable_grad():
            hh = h.detach().requires_grad_(True)
            (dh,) = torch.autograd.grad(fn(hh), hh, g)
        return dh, None, None, None, None


def activation_then_quantize(h: torch.Tensor, activation: str, quantizer, rowwise: bool,
                             columnwise: bool) -> QuantizedTensor:
    """``quantizer(activation(h))`` with the given usages, the activation never written in
    high precision (check ``lowprec.fused.can_fuse`` first). Differentiable in h."""
    return _ActivationQuantize.apply(h, activation, quantizer, rowwise, columnwise)
