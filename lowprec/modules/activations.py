"""Activation functions of LayerNormMLP and the ops API (gated ones halve the width).

Each activation is computed in fp32 whatever its input dtype and rounded once to that dtype,
forward and backward, as the fused kernels of ``lowprec.fused`` compute it: a bf16/fp16
activation built from several torch ops would otherwise round after every op. The input is
saved in its own dtype (no fp32 copy is kept for backward). The fp32 math is
:data:`lowprec.activations.REGISTRY`'s.
"""

from __future__ import annotations

import functools

import torch

from ..activations import REGISTRY, activation_fp32, activation_grad


class _Activation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        ctx.save_for_backward(x)
        ctx.name = name
        return activation_fp32(name, x).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return activation_grad(ctx.name, x, g), None


def apply_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """``activation(x)`` in x's dtype, differentiable in x."""
    return _Activation.apply(x, name)


#: name -> (function, gated). A gated activation takes 2n features and returns n.
ACTIVATIONS = {name: (functools.partial(apply_activation, name), act.gated)
               for name, act in REGISTRY.items()}


def get_activation(name: str):
    """(function, gated) for an activation name; ValueError lists the valid names."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not supported; use one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
