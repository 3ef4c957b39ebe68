"""The arithmetic of a LayerNorm/RMSNorm over the rows of a 2-D tensor, in fp32: forward
(as ``F.layer_norm``/``F.rms_norm``) and backward. Shared by the norm modules
(``lowprec.modules.norms``) and the fused norm + quantize (``norm_quantize``), below both."""

from __future__ import annotations

import torch


def norm_gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    """The norm's scale in fp32; ``zero_centered_gamma`` stores gamma - 1, and the + 1 must
    not round in a bf16/fp16 weight's dtype."""
    return weight.float() + 1 if zero_centered_gamma else weight.float()


def norm_fp32(x2d: torch.Tensor, rms: bool, gamma: torch.Tensor, bias: torch.Tensor | None,
               eps: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(fp32 output, mean, rstd) of the norm of the rows of (M, K) ``x2d``, statistics fp32
    (M, 1) (mean None for RMSNorm); the ops are those of ``F.layer_norm``/``F.rms_norm``."""
    x = x2d.float().contiguous()
    if not rms:
        y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), gamma,
                                                None if bias is None else bias.float(), eps)
        return y, mean, rstd
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * rstd * gamma, None, rstd


def norm_backward(g2d: torch.Tensor, x2d: torch.Tensor, rms: bool, weight: torch.Tensor,
                  zero_centered_gamma: bool, bias: torch.Tensor | None, mean, rstd,
                  needs: tuple[bool, bool, bool]):
    """(dx, dweight, dbias) of the norm of (M, K) ``x2d`` for the output gradient ``g2d``,
    from fp32 (M, 1) row statistics: computed in fp32 (the parameter gradients are sums over
    M rows, which a bf16 accumulator would stall) and each rounded once to the dtype of the
    tensor it belongs to; None where ``needs`` is False."""
    need_x, need_w, need_b = needs
    need_b = need_b and bias is not None
    x, g = x2d.float().contiguous(), g2d.float().contiguous()
    gamma = norm_gamma(weight, zero_centered_gamma)
    if rms:
        (dx, dw), db = _rms_norm_backward(g, x, rstd, gamma, need_x, need_w), None
    else:
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            g, x, [x.shape[-1]], mean, rstd, gamma, None if bias is None else bias.float(),
            [need_x, need_w, need_b])
    return (dx.to(x2d.dtype) if need_x else None, dw.to(weight.dtype) if need_w else None,
            db.to(bias.dtype) if need_b else None)


def _rms_norm_backward(g, x, rstd, gamma, need_x: bool, need_w: bool):
    """fp32 (dx, dgamma) of ``x * rstd * gamma``, rstd = rsqrt(mean(x^2) + eps): the ops
    torch's autograd runs through ``F.rms_norm``'s composite, in its order."""
    n = x * rstd
    dw = (g * n).sum(0) if need_w else None
    dx = None
    if need_x:
        dn = g * gamma
        drstd = (dn * x).sum(-1, keepdim=True)
        dmean_sq = -0.5 * drstd * (rstd * rstd * rstd) / x.shape[-1]
        dx = dn * rstd + dmean_sq * (2 * x)
    return dx, dw
