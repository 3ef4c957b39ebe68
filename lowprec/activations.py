"""The activations lowprec knows: one registry from name to everything about each.

For every name, :data:`REGISTRY` holds its fp32 forward and backward (the math of
``lowprec.modules.activations``, ``lowprec.ops`` and the fused activation + quantize
backward), whether it is gated (takes 2n features, returns n: ``act(first half) * second
half``) and its ``PRO`` code in the fused Triton prologue (``load_tile`` in
``lowprec.kernels.prologue``: ``code >= 20`` is gated there, and a gated code applies
the activation of its ``base`` code to the first half).

The fp32 math below is what torch's own autograd computes for these formulas, op for op, so an
fp32 input gives exactly torch's values and gradients. Inputs are taken as fp32 tensors.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

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


def _gated_forward(fwd, x):
    a, b = x.chunk(2, dim=-1)
    return fwd(a) * b


def _gated_backward(fwd, back, g, x):
    a, b = x.chunk(2, dim=-1)
    # d(act(a) * b): d a = act'(a) * (g * b), d b = g * act(a)
    return torch.cat([back(g * b, a), g * fwd(a)], dim=-1)


class Activation(NamedTuple):
    """One activation: fp32 ``forward(x)`` and ``backward(g, x) -> dx`` (g the gradient of
    the output), ``gated``, and ``code``, its fused-kernel prologue code."""

    name: str
    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    gated: bool
    code: int
    #: ``backward`` is one ATen op that computes in fp32 from bf16/fp16 operands and rounds
    #: once: on such operands it gives ``backward`` of their fp32 values rounded to their
    #: dtype, bit for bit, without writing fp32 copies (``activation_grad``)
    one_op_grad: bool = False


def _plain(name: str, fwd, back, code: int, one_op_grad: bool = False) -> Activation:
    return Activation(name, fwd, back, False, code, one_op_grad)


def _gated(name: str, base: Activation, code: int) -> Activation:
    return Activation(name, functools.partial(_gated_forward, base.forward),
                      functools.partial(_gated_backward, base.forward, base.backward), True, code)


_GELU = _plain("gelu", _gelu, _gelu_grad, 10, one_op_grad=True)
_SILU = _plain("silu", F.silu, _aten.silu_backward, 12, one_op_grad=True)

#: name -> :class:`Activation`, the one table of activations.
REGISTRY: dict[str, Activation] = {a.name: a for a in (
    _GELU,
    _plain("relu", F.relu, _relu_grad, 11, one_op_grad=True),
    _SILU,
    _plain("srelu", _srelu, _srelu_grad, 13),
    _plain("qgelu", _qgelu, _qgelu_grad, 14),
    _gated("swiglu", _SILU, 20),
    _gated("geglu", _GELU, 21),
)}


def activation_fp32(name: str, x: torch.Tensor) -> torch.Tensor:
    """``activation(x)`` computed and returned in fp32 (not rounded to x's dtype)."""
    return REGISTRY[name].forward(x.float())


def activation_grad_fp32(name: str, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient wrt ``x`` of ``activation(x)`` for the (plain) output gradient ``g``,
    computed and returned in fp32 (a bias gradient sums it before any rounding)."""
    return REGISTRY[name].backward(g.float(), x.float())


def activation_grad(name: str, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``activation_grad_fp32(name, x, g)`` rounded once to x's dtype; for a one-op
    gradient with ``g`` in x's dtype, that op run on them directly (the same bits)."""
    act = REGISTRY[name]
    if act.one_op_grad and g.dtype == x.dtype:
        return act.backward(g, x)
    return activation_grad_fp32(name, x, g).to(x.dtype)


__all__ = ["Activation", "REGISTRY", "activation_fp32", "activation_grad", "activation_grad_fp32"]
