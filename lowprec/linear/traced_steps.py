"""The steps every traced linear shares (``lowprec.linear.traced``): the bias gradient as
an op of the graph, and the bookkeeping between an ``autograd.Function``'s forward and
backward. The GEMMs and their bias add are ``lowprec.gemm.traced``'s; the bf16 rounding a
fusing compiler cannot elide (``rounded``, ``as_output``) is ``lowprec.formats.graph``'s.
"""

from __future__ import annotations

import contextlib

import torch

from ..kernels import graph_op


@graph_op("bias_grad")
def bias_grad(dy2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dy2d.sum(0)`` in ``dtype``, as eager sums it (a reduction the compiler would
    order its own way)."""
    return dy2d.sum(dim=0).to(dtype)


@torch.library.register_fake("lowprec::bias_grad")
def _bias_grad_fake(dy2d, dtype):
    return dy2d.new_empty(dy2d.shape[1:], dtype=dtype)


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix of its last dimension's rows (``t`` itself when 2-D: a reshape is
    a dispatched op even where it changes nothing, and eager calls are host-bound)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def finish(ctx, x, weight, bias, plan, y: torch.Tensor) -> torch.Tensor:
    """Record what backward needs besides the saved tensors; y in x's leading shape."""
    ctx.plan, ctx.has_bias = plan, bias is not None
    ctx.compiling = torch.compiler.is_compiling()
    ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
    if x.dim() == 2 and not ctx.compiling:
        return y  # (dynamo 2.11 loses the weight's gradient of a forward returning y as is)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def joined(parts: list) -> torch.Tensor:
    """The slices' results as one tensor (the one result itself where there is one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def traced_backward(ctx, dy, grads) -> tuple:
    """The traced Functions' backward: ``grads(ctx, dy2d, need_dx, need_dw, *saved)``
    gives (dX as 2-D or None, dW or None); the bias gradient is eager's sum. It runs with
    torch.autocast off, as eager's backward does (AOT traces the backward under the
    forward's autocast state)."""
    if ctx.compiling and not torch.compiler.is_compiling():
        # AOT autograd tracing the backward of a forward it traced natively (a decided
        # linear's graph node), under torch 2.11
        with compile_session():
            return traced_backward(ctx, dy, grads)
    # an eager backward outside torch.autocast skips the context (host time); a traced one
    # always takes it, since the trace's autocast state is not the one the graph runs in
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(dy.device.type):
        with torch.autocast(dy.device.type, enabled=False):
            return _backward(ctx, dy, grads)
    return _backward(ctx, dy, grads)


def _backward(ctx, dy, grads) -> tuple:
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dy2d = as_2d(dy)
    dx, dw = grads(ctx, dy2d, need_dx, need_dw, *ctx.saved_tensors)
    db = bias_grad(dy2d, ctx.w_dtype) if need_db and ctx.has_bias else None
    if dx is not None and len(ctx.x_shape) != 2:
        dx = dx.reshape(ctx.x_shape)
    return dx, dw, db, None


@contextlib.contextmanager
def compile_session():
    """Hold ``torch.compiler.is_compiling()`` True within the block, as torch 2.13 holds it
    for a whole compile session. torch 2.11 holds it only while dynamo interprets bytecode,
    so Python that AOT autograd runs natively as it traces (a graph node dynamo did not
    interpret) would take eager's paths: kernel launches on fake tensors, random draws
    recorded inline."""
    held = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = held
