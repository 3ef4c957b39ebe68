"""The ops' own steps as ``torch.compile`` sees them: a ``Bias`` op and the fused
bias + activation step (``fused/activation_bias_backward.py``), each an op around eager's
computation, so a traced ``Sequential`` gives eager's bits (inductor's own code for a sum
or an fp32 activation may round differently). The add of a ``Bias`` op is one rounding,
which inductor computes as eager does; its gradient, a sum over the rows, is an op. The
steps' shared rules (the bias an add reads, the fp32 pre-activation, the output dtype)
live here, read by the eager steps too."""

from __future__ import annotations

import torch

from ..activations import REGISTRY, activation_fp32, activation_grad_fp32
from ..kernels import graph_op
from ..recipe import torch_autocast_dtype


def bias_operand(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The bias a ``Bias`` op adds to ``x``: checked against x's last dimension, and in the
    autocast dtype under torch.autocast (as ``nn.Linear``'s bias)."""
    if x.shape[-1] != bias.shape[0]:
        raise ValueError(f"Bias of size {bias.shape[0]} cannot be added to an input of shape "
                         f"{tuple(x.shape)}")
    return bias.to(x.dtype) if torch_autocast_dtype(x) is not None else bias


def pre_activation(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y + bias`` in fp32 (``y`` itself when there is no bias to add)."""
    return y.float() if bias is None else y.float() + bias.float()


def bias_activation_dtype(y: torch.Tensor, added: torch.Tensor | None) -> torch.dtype:
    """The output dtype of the bias + activation step: that of the unfused Bias op then the
    activation (under torch.autocast that op adds the bias in y's dtype)."""
    if added is None or torch_autocast_dtype(y) is not None:
        return y.dtype
    return torch.promote_types(y.dtype, added.dtype)


# ---- Bias -------------------------------------------------------------------------------------
@graph_op("graph_bias_grad")
def _bias_grad_op(g: torch.Tensor, size: int) -> torch.Tensor:
    """The gradient of a bias of ``size`` broadcast over ``g``, as autograd sums it."""
    return g.sum_to_size(size)


@torch.library.register_fake("lowprec::graph_bias_grad")
def _(g, size):
    return g.new_empty((size,))


class _GraphBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        ctx.bias_dtype = bias.dtype
        return x + bias

    @staticmethod
    def backward(ctx, g):
        db = None
        if ctx.needs_input_grad[1]:
            db = _bias_grad_op(g, g.shape[-1])
            if db.dtype != ctx.bias_dtype:
                db = db.to(ctx.bias_dtype)
        return g if ctx.needs_input_grad[0] else None, db


def graph_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x + bias`` (the caller casts the bias as the eager op does)."""
    return _GraphBias.apply(x, bias)


# ---- bias + activation ------------------------------------------------------------------------
@graph_op("graph_bias_activation")
def _bias_activation_op(y2d: torch.Tensor, bias: torch.Tensor | None, name: str,
                        dtype: torch.dtype) -> torch.Tensor:
    """``activation(y + bias)`` in fp32, rounded once to ``dtype``."""
    return activation_fp32(name, pre_activation(y2d, bias)).to(dtype)


@torch.library.register_fake("lowprec::graph_bias_activation")
def _(y2d, bias, name, dtype):
    k = y2d.shape[1]
    return y2d.new_empty((y2d.shape[0], k // 2 if REGISTRY[name].gated else k), dtype=dtype)


@graph_op("graph_bias_activation_backward")
def _bias_activation_backward_op(g2d: torch.Tensor, y2d: torch.Tensor,
                                 added: torch.Tensor | None, name: str, dtype: torch.dtype,
                                 bias_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy in ``dtype``, dbias in ``bias_dtype``): both from the fp32 ``act'(z) * g``, the
    bias gradient summed before any rounding."""
    dz = activation_grad_fp32(name, pre_activation(y2d, added), g2d)
    return dz.to(dtype), dz.sum(dim=0).to(bias_dtype)


@torch.library.register_fake("lowprec::graph_bias_activation_backward")
def _(g2d, y2d, added, name, dtype, bias_dtype):
    return (torch.empty_like(y2d, dtype=dtype),
            y2d.new_empty((y2d.shape[1],), dtype=bias_dtype))


class _GraphBiasActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, add_bias, name, dtype):
        added = bias if add_bias else None
        y2d = y.reshape(-1, y.shape[-1])
        out = _bias_activation_op(y2d, added, name, dtype)
        ctx.save_for_backward(y2d, added)
        ctx.name, ctx.dtype, ctx.y_shape = name, dtype, y.shape
        ctx.bias_dtype = bias.dtype
        return out.view(*y.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, g):
        y2d, added = ctx.saved_tensors
        dy, db = _bias_activation_backward_op(g.reshape(y2d.shape[0], -1), y2d, added,
                                              ctx.name, ctx.dtype, ctx.bias_dtype)
        return (dy.view(ctx.y_shape) if ctx.needs_input_grad[0] else None,
                db if ctx.needs_input_grad[1] else None, None, None, None)


def graph_bias_activation(y: torch.Tensor, bias: torch.Tensor, activation: str, *,
                          add_bias: bool, dtype: torch.dtype) -> torch.Tensor:
    """``bias_activation(y, bias, activation, add_bias=...)`` with its output in ``dtype``
    (the eager step's output dtype), the bias gradient summed from the fp32 values."""
    return _GraphBiasActivation.apply(y, bias, add_bias, activation, dtype)
