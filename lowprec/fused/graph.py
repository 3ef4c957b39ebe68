"""The norm and the activation of LayerNormLinear/LayerNormMLP as ``torch.compile`` sees
them: one op each way around eager's own computation, so the traced linear after them
(``lowprec.linear.traced``) quantizes the values eager quantizes.

Eager mode hands a GEMM its input through a fused kernel where the quantizer takes one
(``lowprec.fused``): that kernel quantizes exactly what ``apply_prologue`` writes out, so
the compiled form writes the prologue's output with that kernel (``kernel=True``) and the
traced quantize reads it. Elsewhere (no Triton, a norm output the caller returns, no
kernel for the activation) it is the unfused fp32 math of ``norm_math``/``activations``.
The backward ops are the functions both eager forms run. Inductor cannot fuse the norm
into its neighbours this way; what it gains is every host step of the call. The kernel
form stays an op around eager's launch rather than a ``triton_op``: launched from
inductor's code, the same kernels gave other bits for some inputs (H100, Triton 3.6).
"""

from __future__ import annotations

import torch

from ..activations import REGISTRY, activation_fp32, activation_grad
from ..kernels import graph_op, use_kernels
from .norm_math import norm_backward, norm_fp32, norm_gamma
from .norm_quantize import kernel_norm
from .prologue import activation_prologue, apply_prologue


def producer_kernel(x: torch.Tensor, quantizer, backward_mode: str) -> bool:
    """Whether eager mode hands ``quantizer`` ``x``'s producer through a fused kernel
    (``lowprec.fused.can_fuse``), which the traced form then runs too."""
    from .switch import can_fuse
    return use_kernels(x) and can_fuse(quantizer, x, backward_mode)


def _none(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(0)


# ---- the norm ---------------------------------------------------------------------------------
@graph_op("graph_norm")
def _norm_op(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rms: bool,
             eps: float, zero_centered_gamma: bool, kernel: bool, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(norm output in ``dtype``, fp32 (M,) mean (zeros for RMSNorm), fp32 (M,) rstd);
    ``kernel`` (the fused kernel's computation) only for ``dtype`` x's."""
    m = x2d.shape[0]
    if kernel:  # as ``norm_quantize._NormQuantize`` computes it
        x2d = x2d.contiguous()
        pro, mean, rstd = kernel_norm(x2d, weight, bias, rms, eps, zero_centered_gamma, False)
        return apply_prologue(x2d, pro), mean, rstd
    y, mean, rstd = norm_fp32(x2d, rms, norm_gamma(weight, zero_centered_gamma), bias, eps)
    mean = rstd.new_zeros(m) if mean is None else mean.reshape(m)
    return y.to(dtype), mean, rstd.reshape(m)


@torch.library.register_fake("lowprec::graph_norm")
def _(x2d, weight, bias, rms, eps, zero_centered_gamma, kernel, dtype):
    m = x2d.shape[0]
    return (torch.empty_like(x2d, dtype=dtype), x2d.new_empty((m,), dtype=torch.float32),
            x2d.new_empty((m,), dtype=torch.float32))


@graph_op("graph_norm_backward")
def _norm_backward_op(g2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor,
                      rms: bool, zero_centered_gamma: bool, need_x: bool, need_w: bool,
                      need_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) of ``norm_math.norm_backward``; an empty tensor where not needed."""
    m = x2d.shape[0]
    grads = norm_backward(g2d, x2d, rms, weight, zero_centered_gamma, bias,
                          None if rms else mean.view(m, 1), rstd.view(m, 1),
                          (need_x, need_w, need_b))
    return tuple(_none(x2d) if t is None else t for t in grads)


@torch.library.register_fake("lowprec::graph_norm_backward")
def _(g2d, x2d, weight, bias, mean, rstd, rms, zero_centered_gamma, need_x, need_w, need_b):
    need_b = need_b and bias is not None
    return (torch.empty_like(x2d) if need_x else _none(x2d),
            torch.empty_like(weight) if need_w else _none(x2d),
            torch.empty_like(bias) if need_b else _none(x2d))


class _GraphNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, rms, eps, zero_centered_gamma, kernel, dtype):
        x2d = x.reshape(-1, x.shape[-1])
        y, mean, rstd = _norm_op(x2d, weight, bias, rms, eps, zero_centered_gamma, kernel,
                                 dtype)
        ctx.save_for_backward(x2d, weight, bias, mean, rstd)
        ctx.rms, ctx.zero_centered_gamma, ctx.x_shape = rms, zero_centered_gamma, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2d, weight, bias, mean, rstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx, dw, db = _norm_backward_op(g.reshape(x2d.shape), x2d, weight, bias, mean, rstd,
                                       ctx.rms, ctx.zero_centered_gamma, need_x, need_w,
                                       need_b and bias is not None)
        return (dx.view(ctx.x_shape) if need_x else None, dw if need_w else None,
                db if need_b and bias is not None else None, None, None, None, None, None)


def graph_norm(module, x: torch.Tensor, *, kernel: bool,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """The norm of ``module`` (its ``layer_norm_*`` parameters, as ``norms.norm_into_gemm``
    reads them) of ``x``, in x's dtype: computed as eager's fused kernel computes it with
    ``kernel``, else as ``norms.apply_norm``, whose output under torch.autocast is in the
    autocast dtype (``dtype``; its gradients stay in x's and the parameters' dtypes)."""
    return graph_norm_of(x, module.normalization, module.layer_norm_weight,
                         module.layer_norm_bias, module.eps, module.zero_centered_gamma,
                         kernel=kernel, dtype=dtype)


def graph_norm_of(x: torch.Tensor, normalization: str, weight: torch.Tensor,
                  bias: torch.Tensor | None, eps: float, zero_centered_gamma: bool, *,
                  kernel: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`graph_norm` of the norm with these settings and parameters (``bias`` is
    ignored for RMSNorm), as ``norms.apply_norm`` takes them."""
    rms = normalization == "RMSNorm"
    return _GraphNorm.apply(x, weight, None if rms else bias, rms, float(eps),
                            zero_centered_gamma, kernel, dtype or x.dtype)


# ---- the activation ---------------------------------------------------------------------------
@graph_op("graph_activation")
def _activation_op(h2d: torch.Tensor, name: str, kernel: bool) -> torch.Tensor:
    """``activation(h2d)`` in h's dtype: the fused kernels' prologue with ``kernel``, else
    the registry's fp32 math rounded once (``modules.activations``)."""
    if kernel:
        return apply_prologue(h2d.contiguous(), activation_prologue(name))
    return activation_fp32(name, h2d).to(h2d.dtype)


@torch.library.register_fake("lowprec::graph_activation")
def _(h2d, name, kernel):
    k = h2d.shape[1]
    return h2d.new_empty((h2d.shape[0], k // 2 if REGISTRY[name].gated else k))


@graph_op("graph_activation_backward")
def _activation_backward_op(g2d: torch.Tensor, h2d: torch.Tensor, name: str) -> torch.Tensor:
    """The gradient both eager forms of the activation return (fp32 math, h's dtype)."""
    return activation_grad(name, h2d, g2d)


@torch.library.register_fake("lowprec::graph_activation_backward")
def _(g2d, h2d, name):
    return torch.empty_like(h2d)


class _GraphActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, name, kernel):
        h2d = h.reshape(-1, h.shape[-1])
        a = _activation_op(h2d, name, kernel)
        ctx.save_for_backward(h2d)
        ctx.name, ctx.h_shape = name, h.shape
        return a.view(*h.shape[:-1], a.shape[-1])

    @staticmethod
    def backward(ctx, g):
        (h2d,) = ctx.saved_tensors
        dh = _activation_backward_op(g.reshape(h2d.shape[0], -1), h2d, ctx.name)
        return dh.view(ctx.h_shape), None, None


def graph_activation(name: str, h: torch.Tensor, *, kernel: bool) -> torch.Tensor:
    """``activation(h)`` in h's dtype as eager computes it: the fused kernels' prologue
    with ``kernel`` (only for an activation that has one), else the registry's math."""
    return _GraphActivation.apply(h, name, kernel and activation_prologue(name) is not None)
