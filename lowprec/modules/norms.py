"""LayerNorm and RMSNorm modules, and the norm function LayerNormLinear/MLP share."""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from .. import fused
from ..fused import norm_backward, norm_fp32, norm_gamma
from ..recipe import torch_autocast_dtype, torch_autocast_off
from .params import is_count, producer_usages

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_eps(eps) -> float:
    """A norm's ``eps``: a finite real number >= 0 (numpy scalars too), as a float."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (
            math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def check_normalization(normalization: str) -> str:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}; use one of {NORMALIZATIONS}")
    return normalization


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, rms, eps, zero_centered_gamma, out_dtype):
        x2d = x.reshape(-1, x.shape[-1])
        y, mean, rstd = norm_fp32(x2d, rms, norm_gamma(weight, zero_centered_gamma), bias, eps)
        ctx.save_for_backward(x2d, weight, bias, mean, rstd)
        ctx.rms, ctx.zero_centered_gamma = rms, zero_centered_gamma
        return y.to(out_dtype).view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2d, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = norm_backward(g.reshape(x2d.shape), x2d, ctx.rms, weight,
                                   ctx.zero_centered_gamma, bias, mean, rstd,
                                   ctx.needs_input_grad[:3])
        return None if dx is None else dx.view(g.shape), dw, db, None, None, None, None


def apply_norm(x: torch.Tensor, normalization: str, weight: torch.Tensor,
               bias: torch.Tensor | None, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """Normalize over the last dim, in fp32 rounded once to x's dtype; ``zero_centered_gamma``
    stores gamma - 1. Backward keeps x in its own dtype and the fp32 row statistics.

    Under ``torch.autocast`` the output is in the autocast dtype (the dtype the GEMM after it
    quantizes from), the gradients in the dtypes of x and the parameters."""
    amp = torch_autocast_dtype(x)
    args = (x, weight, bias if normalization == "LayerNorm" else None,
            normalization == "RMSNorm", eps, zero_centered_gamma, amp or x.dtype)
    if amp is None:
        return _NormFn.apply(*args)
    with torch_autocast_off(x.device.type):
        return _NormFn.apply(*args)


def norm_output_grad(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether the norm's output of ``x`` needs a gradient (the input or a norm parameter
    does, with gradients on): the input gradient the GEMM after it computes."""
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (x, module.layer_norm_weight, module.layer_norm_bias))


def norm_into_gemm(module: nn.Module, x: torch.Tensor, quantizers, backward_mode: str,
                   gemm_weight: torch.Tensor, *, fuse: bool = True) -> torch.Tensor:
    """The norm of ``module`` (its ``layer_norm_*`` parameters) applied to ``x`` as the input
    of the GEMM with ``quantizers``: quantized by one fused kernel where
    ``lowprec.fused.can_fuse`` allows it (and ``fuse``), else in high precision."""
    args = (module.normalization, module.layer_norm_weight, module.layer_norm_bias, module.eps,
            module.zero_centered_gamma)
    q = quantizers.input if quantizers is not None else None
    if fuse and q is not None and fused.can_fuse(q, x, backward_mode):
        return fused.norm_then_quantize(x, *args, q, *producer_usages(gemm_weight,
                                                                      backward_mode))
    return apply_norm(x, *args)


def reset_norm_params(module: nn.Module, prefix: str, zero_centered_gamma: bool) -> None:
    """The initialization of :func:`make_norm_params` again, in place."""
    with torch.no_grad():
        getattr(module, prefix + "weight").fill_(0.0 if zero_centered_gamma else 1.0)
        bias = getattr(module, prefix + "bias", None)
        if bias is not None:
            bias.zero_()


def make_norm_params(module: nn.Module, hidden_size: int, normalization: str, *,
                     zero_centered_gamma: bool, dtype, device, prefix: str) -> None:
    """Register ``<prefix>weight`` (and ``<prefix>bias`` for LayerNorm) on ``module``."""
    if not is_count(hidden_size, 1):
        # a norm over no features has no mean or scale to take
        raise ValueError(f"{type(module).__name__}: the norm needs an int number of features "
                         f">= 1, got {hidden_size!r}")
    init = torch.zeros if zero_centered_gamma else torch.ones
    module.register_parameter(prefix + "weight", nn.Parameter(init(hidden_size, dtype=dtype,
                                                                    device=device)))
    bias = (nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
            if normalization == "LayerNorm" else None)
    module.register_parameter(prefix + "bias", bias)


class _Norm(nn.Module):
    normalization = "LayerNorm"

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, zero_centered_gamma: bool = False,
                 params_dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, check_eps(eps)
        self.zero_centered_gamma = zero_centered_gamma
        make_norm_params(self, hidden_size, self.normalization,
                         zero_centered_gamma=zero_centered_gamma,
                         dtype=params_dtype or torch.get_default_dtype(), device=device, prefix="")

    def reset_parameters(self) -> None:
        """The constructor's initialization again (meta-device init)."""
        reset_norm_params(self, "", self.zero_centered_gamma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_norm(x, self.normalization, self.weight, self.bias, self.eps,
                          self.zero_centered_gamma)


class LayerNorm(_Norm):
    """LayerNorm over the last dimension (``weight``, ``bias``)."""

    normalization = "LayerNorm"


class RMSNorm(_Norm):
    """RMSNorm over the last dimension (``weight`` only)."""

    normalization = "RMSNorm"
