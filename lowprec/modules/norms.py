"""LayerNorm and RMSNorm modules, and the norm function LayerNormLinear/MLP share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: str) -> str:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}; use one of {NORMALIZATIONS}")
    return normalization


def apply_norm(x: torch.Tensor, normalization: str, weight: torch.Tensor,
               bias: torch.Tensor | None, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """Normalize over the last dim; ``zero_centered_gamma`` stores gamma - 1."""
    gamma = weight + 1 if zero_centered_gamma else weight
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


def make_norm_params(module: nn.Module, hidden_size: int, normalization: str, *,
                     zero_centered_gamma: bool, dtype, device, prefix: str) -> None:
    """Register ``<prefix>weight`` (and ``<prefix>bias`` for LayerNorm) on ``module``."""
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
        self.hidden_size, self.eps, self.zero_centered_gamma = hidden_size, eps, zero_centered_gamma
        make_norm_params(self, hidden_size, self.normalization,
                         zero_centered_gamma=zero_centered_gamma,
                         dtype=params_dtype or torch.get_default_dtype(), device=device, prefix="")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_norm(x, self.normalization, self.weight, self.bias, self.eps,
                          self.zero_centered_gamma)


class LayerNorm(_Norm):
    """LayerNorm over the last dimension (``weight``, ``bias``)."""

    normalization = "LayerNorm"


class RMSNorm(_Norm):
    """RMSNorm over the last dimension (``weight`` only)."""

    normalization = "RMSNorm"
