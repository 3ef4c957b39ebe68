"""The steps every traced linear shares (``lowprec.linear.traced``): bf16 rounding that a
fusing compiler cannot elide, the bias add and bias gradient as ops of the graph, and the
bookkeeping between an ``autograd.Function``'s forward and backward.

Inductor computes fused bf16 ops in fp32 and skips the rounding between them; a traced
quantize therefore rounds its input to bf16 in integer arithmetic (:func:`rounded`) and
builds bf16 outputs from their bits (:func:`as_output`), so a neighbour fused into it reads
and hands on eager's values.
"""

from __future__ import annotations

import torch

from ..kernels import graph_op


def bf16_rne_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 bits (int32) rounded to nearest even at bf16 precision, still 32 bits wide
    (NaN stays NaN: eager's bf16 NaNs keep high mantissa bits, and inductor's are
    canonical)."""
    return bits + (0x7FFF + ((bits >> 16) & 1))


def rounded(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, rounded to bf16 precision in integer arithmetic: for a bf16 tensor
    its exact value. A compiler that fuses the op producing ``t`` computes it in fp32 and
    hands on the unrounded value (inductor elides the bf16 round trip between fused ops);
    this rounds it as eager's bf16 tensor is rounded, in whatever kernel it lands. fp32
    passes through."""
    if t.dtype == torch.float32:
        return t
    return (bf16_rne_bits(t.to(torch.float32).view(torch.int32)) & -65536).view(torch.float32)


def rounded_amax(t2d: torch.Tensor) -> torch.Tensor:
    """amax(|t2d|) of ``t2d``'s bf16-rounded values (1-element fp32), as eager's amax of the
    bf16 tensor. Rounding to nearest is monotonic and symmetric, so the largest rounded
    magnitude is the rounded largest magnitude: the rounding is applied to the one result,
    and the reduction reads the producer's expression alone, which inductor then fuses
    with its neighbours' reductions (the amaxes of dgate and dup in one pass) instead of
    writing the rounded magnitudes to an fp32 buffer first. The rounding reads the
    reduction's dtype (bf16), as inductor may hand on its fp32 value unrounded."""
    return rounded(t2d.abs().amax()).reshape(1)


def as_output(out_fp32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out_fp32.to(dtype)`` whose bf16 rounding a fused consumer cannot elide: the bf16
    values are made from their bits, so any kernel the compiler fuses this into reads the
    rounded numbers eager's consumer reads."""
    if dtype != torch.bfloat16:
        return out_fp32.to(dtype)
    half = bf16_rne_bits(out_fp32.view(torch.int32)) >> 16
    return half.to(torch.int16).view(torch.bfloat16)


def plus_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``out + bias`` in fp32 after the GEMM, as eager's emulation adds it: a custom op,
    so the compiler does not fold the add into the GEMM (an ``addmm`` accumulates the bias
    with the products and rounds differently)."""
    return out if bias is None else bias_add(out, bias)


def emulated_product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T (+ bias)`` of fp32 operand values rounded once to ``out_dtype``: the fp32
    GEMM emulation eager runs off CUDA (``backends.emulated_fp32``), every traced plan's."""
    return as_output(plus_bias(a @ b.t(), bias), out_dtype)


@graph_op("bias_add")
def bias_add(out: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``out + bias`` in fp32 (``out`` fp32 (M, N), ``bias`` (N,))."""
    return out + bias.to(torch.float32)


@torch.library.register_fake("lowprec::bias_add")
def _bias_add_fake(out, bias):
    return torch.empty_like(out)


@graph_op("bias_grad")
def bias_grad(dy2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dy2d.sum(0)`` in ``dtype``, as eager sums it (a reduction the compiler would
    order its own way)."""
    return dy2d.sum(dim=0).to(dtype)


@torch.library.register_fake("lowprec::bias_grad")
def _bias_grad_fake(dy2d, dtype):
    return dy2d.new_empty(dy2d.shape[1:], dtype=dtype)


def finish(ctx, x, weight, bias, plan, y: torch.Tensor) -> torch.Tensor:
    """Record what backward needs besides the saved tensors; y in x's leading shape."""
    ctx.plan, ctx.has_bias = plan, bias is not None
    ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
    return y.reshape(*x.shape[:-1], weight.shape[0])


def finish_requantizing(ctx, x, x2d, weight, bias, plan, y: torch.Tensor) -> torch.Tensor:
    """:func:`finish` for a Function whose backward quantizes x and the weight again from the
    tensors themselves: keeps x (for wgrad) and the weight (for dgrad), as they came."""
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    ctx.save_for_backward(x2d if need_dw else None, weight if need_dx else None)
    return finish(ctx, x, weight, bias, plan, y)


def joined(parts: list) -> torch.Tensor:
    """The slices' results as one tensor (the one result itself where there is one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def traced_backward(ctx, dy, grads) -> tuple:
    """The traced Functions' backward: ``grads(ctx, dy2d, need_dx, need_dw, *saved)``
    gives (dX as 2-D or None, dW or None); the bias gradient is eager's sum. It runs with
    torch.autocast off, as eager's backward does (AOT traces the backward under the
    forward's autocast state)."""
    with torch.autocast(dy.device.type, enabled=False):
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx, dw = grads(ctx, dy2d, need_dx, need_dw, *ctx.saved_tensors)
        db = bias_grad(dy2d, ctx.w_dtype) if need_db and ctx.has_bias else None
        return None if dx is None else dx.reshape(ctx.x_shape), dw, db, None
