"""SwiGLU ``silu(h[:, :I]) * h[:, I:]`` of a (M, 2I) tensor and its backward, one pass each
on a GPU with Triton (kernels: :mod:`.swiglu_kernel`), eager torch's bits in both: the
forward reads ``h`` once and writes ``a``; the backward reads ``h`` and ``da`` and writes
``dh`` whole (eager makes the silu, two products, silu's backward and a concatenation,
five passes). Elsewhere the same torch ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernel_op, use_kernels

_BM, _BI = 32, 128


def _takes(h: torch.Tensor) -> bool:
    return (use_kernels(h) and h.dim() == 2 and h.stride(1) == 1 and h.shape[1] % 2 == 0
            and h.dtype in (torch.bfloat16, torch.float16) and h.numel() > 0)


def _grid(m: int, i: int) -> tuple[int, int]:
    return -(-m // _BM), -(-i // _BI)


@kernel_op("lowprec::swiglu_fwd", mutates_args=())
def swiglu_fwd(h: torch.Tensor) -> torch.Tensor:
    """(M, I): ``silu(h[:, :I]) * h[:, I:]``."""
    from .launch import launch
    from .swiglu_kernel import swiglu_fwd_kernel
    m, i = h.shape[0], h.shape[1] // 2
    a = torch.empty((m, i), dtype=h.dtype, device=h.device)
    with torch.cuda.device(h.device):
        launch(swiglu_fwd_kernel, _grid(m, i), h, a, m, i, h.stride(0), a.stride(0),
               BM=_BM, BI=_BI, num_warps=4)
    return a


@swiglu_fwd.register_fake
def _(h):
    return h.new_empty((h.shape[0], h.shape[1] // 2))


@kernel_op("lowprec::swiglu_bwd", mutates_args=())
def swiglu_bwd(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """(M, 2I): the gradient of :func:`swiglu_fwd` at ``h`` for ``da``."""
    from .launch import launch
    from .swiglu_kernel import swiglu_bwd_kernel
    m, i = da.shape
    dh = torch.empty_like(h, memory_format=torch.contiguous_format)
    with torch.cuda.device(h.device):
        launch(swiglu_bwd_kernel, _grid(m, i), h, da, dh, m, i, h.stride(0), da.stride(0),
               dh.stride(0), BM=_BM, BI=_BI, num_warps=4)
    return dh


@swiglu_bwd.register_fake
def _(h, da):
    return torch.empty_like(h, memory_format=torch.contiguous_format)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return swiglu_fwd(h)

    @staticmethod
    def backward(ctx, da):
        (h,) = ctx.saved_tensors
        return swiglu_bwd(h, da.contiguous())


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` with ``gate, up = h.chunk(2, dim=-1)`` (bits and gradient), in
    one pass each way where the kernels run (2-D, 16-bit, unit inner stride)."""
    if _takes(h):  # in a compiled graph too: the kernels' bits are eager's
        return _SwiGLU.apply(h)
    return swiglu_torch(h)


def swiglu_torch(h: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu` in torch ops (in a compiled graph, silu as an op of its own:
    :func:`silu`)."""
    gate, up = h.chunk(2, dim=-1)
    return silu(gate) * up


@torch.library.custom_op("lowprec::silu", mutates_args=())
def _silu_op(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


@_silu_op.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("lowprec::silu_backward", mutates_args=())
def _silu_backward_op(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.silu_backward(grad, x)


@_silu_backward_op.register_fake
def _(grad, x):
    return torch.empty_like(x)


def _silu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _silu_grad(ctx, grad):
    (x,) = ctx.saved_tensors
    return _silu_backward_op(grad, x)


_silu_op.register_autograd(_silu_grad, setup_context=_silu_setup)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x)`` whose result a compiled graph keeps as eager makes it: one op of its own
    (eager's kernel), so a fusing compiler cannot carry the unrounded fp32 silu into the
    product that follows (a gated activation's ``silu(gate) * up``), whose bits then are
    eager's too. Eager calls are ``F.silu``."""
    if torch.compiler.is_compiling():
        return _silu_op(x)
    return F.silu(x)
