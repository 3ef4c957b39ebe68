"""LayerNorm/RMSNorm whose output is written only in quantized form.

Forward: one statistics kernel (per-row mean/rstd; for current scaling also the amax of
the normalized output) and one quantize kernel that normalizes each tile as it loads it
(``load_tile``), in fp32 rounded once to the input dtype. Backward: the unfused norm's
fp32 gradient (``lowprec.modules.norms.norm_backward``) from the saved input and statistics.
"""

from __future__ import annotations

import torch

from ..formats import QuantizedTensor
from .norm_math import norm_backward
from .prologue import norm_prologue, norm_stats


def _plain(g: torch.Tensor) -> torch.Tensor:
    return g.dequantize() if isinstance(g, QuantizedTensor) else g


def kernel_norm(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rms: bool,
                eps: float, zero_centered_gamma: bool, want_amax: bool):
    """(prologue, mean, rstd) of the norm of a contiguous (M, K) ``x2d`` from the statistics
    kernel: what the fused kernels (and the compiled graph's norm) apply as they load x;
    with ``want_amax`` the prologue carries its output's amax."""
    # The kernels convert gamma to fp32 as they load it, so a weight goes in as it is;
    # weight + 1 is formed in fp32, never rounded to the weight's dtype.
    gamma = (weight.float() + 1 if zero_centered_gamma else weight).contiguous()
    mean, rstd, amax_bits = norm_stats(x2d, gamma, gamma if bias is None else bias,
                                       float(eps), rms, want_amax)
    pro = norm_prologue("RMSNorm" if rms else "LayerNorm", None if rms else mean, rstd,
                        gamma, bias, amax_bits if want_amax else None)
    return pro, mean, rstd


class _NormQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalization, eps, zero_centered_gamma, quantizer,
                rowwise, columnwise):
        k = x.shape[-1]
        x2d = x.reshape(-1, k).contiguous()
        rms = normalization == "RMSNorm"
        pro, mean, rstd = kernel_norm(x2d, weight, bias, rms, eps, zero_centered_gamma,
                                      getattr(quantizer, "wants_producer_amax", False))
        quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
        # Quantized in x's own shape: a view of the result would keep the un-viewed tensor
        # (and the rowwise data release_fprop_copy drops) alive as its base.
        out = quantizer.quantize_fused(x, pro)
        ctx.save_for_backward(x2d, weight, bias, mean, rstd)
        ctx.rms, ctx.zero_centered_gamma, ctx.x_shape = rms, zero_centered_gamma, x.shape
        return out

    @staticmethod
    def backward(ctx, g):
        x2d, weight, bias, mean, rstd = ctx.saved_tensors
        m = x2d.shape[0]
        dx, dw, db = norm_backward(_plain(g).reshape(x2d.shape), x2d, ctx.rms, weight,
                                   ctx.zero_centered_gamma, bias, mean.view(m, 1),
                                   rstd.view(m, 1), ctx.needs_input_grad[:3])
        if dx is not None:
            dx = dx.view(ctx.x_shape)
        return dx, dw, db, None, None, None, None, None, None


def norm_then_quantize(x: torch.Tensor, normalization: str, weight: torch.Tensor,
                       bias: torch.Tensor | None, eps: float, zero_centered_gamma: bool,
                       quantizer, rowwise: bool, columnwise: bool) -> QuantizedTensor:
    """``quantizer(norm(x))`` with the given usages, the norm never written in high
    precision (check ``lowprec.fused.can_fuse`` first). Differentiable in x, weight, bias."""
    return _NormQuantize.apply(x, weight, bias, normalization, eps, zero_centered_gamma,
                               quantizer, rowwise, columnwise)
