"""Activation ops (the functions of :mod:`lowprec.modules.activations`)."""

from __future__ import annotations

import torch

from ...modules import get_activation
from ..base import BasicOperation, RunContext, as_plain
from ..fused.activation_bias_backward import bias_activation


class Activation(BasicOperation):
    """``Activation(name)`` for any name of ``lowprec.modules.activations.ACTIVATIONS``;
    gated ones (swiglu, geglu) take 2n features and return n.

    Only the name is stored (the function is looked up at forward), so the op pickles.
    """

    op_kind = "activation"
    can_emit = True

    def __init__(self, activation: str) -> None:
        super().__init__()
        _, self.gated = get_activation(activation)  # ValueError for an unknown name
        self.activation = activation

    @property
    def fn(self):
        return get_activation(self.activation)[0]

    def check_input(self, x: torch.Tensor) -> None:
        if self.gated and x.shape[-1] % 2:
            raise ValueError(f"{self.activation} is gated and needs an even last dimension, got "
                             f"shape {tuple(x.shape)}")

    def output_shape(self, shape: tuple) -> tuple:
        return (*shape[:-1], shape[-1] // 2) if self.gated else shape

    def op_forward(self, x: torch.Tensor, extra_inputs: list, ctx: RunContext) -> torch.Tensor:
        x = as_plain(x)
        self.check_input(x)
        if ctx.emit is None:
            return self.fn(x)
        return bias_activation(x, None, self.activation, add_bias=False, emit=ctx.emit)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


def _named(cls_name: str, act: str, doc: str):
    def __init__(self) -> None:
        Activation.__init__(self, act)
    return type(cls_name, (Activation,), {"__init__": __init__, "__doc__": doc,
                                          "__module__": __name__})


GELU = _named("GELU", "gelu", "GELU, tanh approximation.")
ReLU = _named("ReLU", "relu", "ReLU.")
SiLU = _named("SiLU", "silu", "SiLU (swish).")
SReLU = _named("SReLU", "srelu", "Squared ReLU.")
QGELU = _named("QGELU", "qgelu", "Quick GELU: x * sigmoid(1.702 x).")
SwiGLU = _named("SwiGLU", "swiglu", "silu(a) * b for x = [a, b] (gated: 2n -> n).")
GEGLU = _named("GEGLU", "geglu", "gelu(a) * b for x = [a, b] (gated: 2n -> n).")
