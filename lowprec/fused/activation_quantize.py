"""An activation whose output is written only in quantized form (the next GEMM's input).

Forward: the quantize kernels apply the activation as they load each tile (current
scaling's amax pass does too). Backward: the activation's gradient from its saved input
through the same aten backward ops torch's autograd uses for gelu, relu and silu (and
their gated forms), so it equals the unfused gradient bit for bit and allocates no
activation output; the rarer ones recompute the activation under autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats.base import QuantizedTensor
from ..modules.activations import get_activation
from .prologue import Prologue, activation_prologue, apply_prologue_with_amax

_aten = torch.ops.aten
_DIRECT = {
    "gelu": (lambda g, h: _aten.gelu_backward(g, h, approximate="tanh"),
             lambda a: F.gelu(a, approximate="tanh")),
    "relu": (lambda g, h: _aten.threshold_backward(g, F.relu(h), 0), F.relu),
    "silu": (lambda g, h: _aten.silu_backward(g, h), F.silu),
}
_GATED = {"swiglu": "silu", "geglu": "gelu"}


def activation_backward(name: str, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d activation(h) / dh applied to ``g``, as torch's autograd computes it."""
    if name in _DIRECT:
        return _DIRECT[name][0](g, h)
    if name in _GATED:
        back, fwd = _DIRECT[_GATED[name]]
        a, b = h.chunk(2, dim=-1)
        # autograd of act(a) * b: d act(a) = g * b, d b = g * act(a)
        return torch.cat([back(g * b, a), g * fwd(a)], dim=-1)
    fn, _ = get_activation(name)
    with torch.enable_grad():
        hh = h.detach().requires_grad_(True)
        (dh,) = torch.autograd.grad(fn(hh), hh, g)
    return dh


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
        return activation_backward(ctx.activation, h, g), None, None, None, None


def activation_then_quantize(h: torch.Tensor, activation: str, quantizer, rowwise: bool,
                             columnwise: bool) -> QuantizedTensor:
    """``quantizer(activation(h))`` with the given usages, the activation never written in
    high precision (check ``lowprec.fused.can_fuse`` first). Differentiable in h."""
    return _ActivationQuantize.apply(h, activation, quantizer, rowwise, columnwise)
