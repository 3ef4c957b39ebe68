"""Activation functions of LayerNormMLP and the ops API (gated ones halve the width).

Each activation is computed in fp32 whatever its input dtype and rounded once to that dtype,
forward and backward, as the fused kernels of ``lowprec.fused`` compute it: a bf16/fp16
activation built from several torch ops would otherwise round after every op. The input is
saved in its own dtype (no fp32 copy is kept for backward).

The fp32 math below is what torch's own autograd computes for these formulas, op for op, so an
fp32 input gives exactly torch's values and gradients.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_aten = torch.ops.aten
_QGELU_ALPHA = 1.702


def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _gelu_grad(g, x):
    return _aten.gelu_backward(g, x, approximate="tanh")


def _relu_grad(g, x):
    return _aten.threshold_backward(g, x, 0)


def _srelu(x):
    return torch.square(F.relu(x))


def _srelu_grad(g, x):
    r = F.relu(x)
    return _aten.threshold_backward(g * (2 * r), r, 0)


def _qgelu(x):
    return x * torch.sigmoid(_QGELU_ALPHA * x)


def _qgelu_grad(g, x):
    s = torch.sigmoid(_QGELU_ALPHA * x)
    return g * s + _aten.sigmoid_backward(g * x, s) * _QGELU_ALPHA


#: name -> (fp32 forward f(x), fp32 backward (g, x) -> g * f'(x)), for fp32 tensors.
_FP32_MATH = {
    "gelu": (_gelu, _gelu_grad),
    "relu": (F.relu, _relu_grad),
    "silu": (F.silu, _aten.silu_backward),
    "srelu": (_srelu, _srelu_grad),
    "qgelu": (_qgelu, _qgelu_grad),
}
#: gated name -> the activation applied to the first half (the second half is the gate).
_GATED = {"swiglu": "silu", "geglu": "gelu"}


def activation_fp32(name: str, x: torch.Tensor) -> torch.Tensor:
    """``activation(x)`` computed and returned in fp32 (not rounded to x's dtype)."""
    x = x.float()
    if name in _GATED:
        a, b = x.chunk(2, dim=-1)
        return _FP32_MATH[_GATED[name]][0](a) * b
    return _FP32_MATH[name][0](x)


def activation_grad_fp32(name: str, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient wrt ``x`` of ``activation(x)`` for the (plain) output gradient ``g``,
    computed and returned in fp32 (a bias gradient sums it before any rounding)."""
    x, g = x.float(), g.float()
    if name in _GATED:
        fwd, back = _FP32_MATH[_GATED[name]]
        a, b = x.chunk(2, dim=-1)
        # d(act(a) * b): d a = act'(a) * (g * b), d b = g * act(a)
        return torch.cat([back(g * b, a), g * fwd(a)], dim=-1)
    return _FP32_MATH[name][1](g, x)


class _Activation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        ctx.save_for_backward(x)
        ctx.name = name
        return activation_fp32(name, x).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return activation_grad_fp32(ctx.name, x, g).to(x.dtype), None


def apply_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """``activation(x)`` in x's dtype, differentiable in x."""
    return _Activation.apply(x, name)


#: name -> (function, gated). A gated activation takes 2n features and returns n.
ACTIVATIONS = {name: (functools.partial(apply_activation, name), name in _GATED)
               for name in ("gelu", "relu", "silu", "srelu", "qgelu", "swiglu", "geglu")}


def get_activation(name: str):
    """(function, gated) for an activation name; ValueError lists the valid names."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not supported; use one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
