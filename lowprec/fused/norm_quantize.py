"""LayerNorm/RMSNorm whose output is written only in quantized form.

Forward: one statistics kernel (per-row mean/rstd; for current scaling also the amax of
the normalized output) and one quantize kernel that normalizes each tile as it loads it
(``load_tile``). Backward: the norm's gradient from the saved input and statistics.
"""

from __future__ import annotations

import torch

from ..formats.base import QuantizedTensor
from .prologue import norm_prologue, norm_stats


def _plain(g: torch.Tensor) -> torch.Tensor:
    return g.dequantize() if isinstance(g, QuantizedTensor) else g


class _NormQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalization, eps, zero_centered_gamma, quantizer,
                rowwise, columnwise):
        k = x.shape[-1]
        x2d = x.reshape(-1, k).contiguous()
        gamma = (weight + 1 if zero_centered_gamma else weight).contiguous()
        rms = normalization == "RMSNorm"
        want_amax = getattr(quantizer, "wants_producer_amax", False)
        mean, rstd, amax_bits = norm_stats(x2d, gamma, gamma if bias is None else bias,
                                           float(eps), rms, want_amax)
        pro = norm_prologue(normalization, None if rms else mean, rstd, gamma, bias,
                            amax_bits if want_amax else None)
        quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
        # Quantized in x's own shape: a view of the result would keep the un-viewed tensor
        # (and the rowwise data release_fprop_copy drops) alive as its base.
        out = quantizer.quantize_fused(x, pro)
        ctx.save_for_backward(x2d, gamma, bias, mean, rstd)
        ctx.rms, ctx.x_shape = rms, x.shape
        return out

    @staticmethod
    def backward(ctx, g):
        x2d, gamma, bias, mean, rstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = _plain(g).reshape(x2d.shape)
        m, k = x2d.shape
        if ctx.rms:
            xhat = x2d.float() * rstd[:, None]
            dxhat = g.float() * gamma.float()
            dx = rstd[:, None] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
            dx = dx.to(x2d.dtype) if need_x else None
            dw = (g.float() * xhat).sum(0).to(gamma.dtype) if need_w else None
            db = None
        else:
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(
                g.contiguous(), x2d, [k], mean.view(m, 1), rstd.view(m, 1), gamma, bias,
                [need_x, need_w, need_b and bias is not None])
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
