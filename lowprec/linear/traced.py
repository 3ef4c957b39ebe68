"""The quantized linear as ``torch.compile`` sees it: torch ops and cuBLAS calls in the graph.

Under ``torch.compile`` a Linear whose plan can be traced is not an opaque call: dynamo
traces :class:`_TracedLinear` (an autograd Function) into the graph, so inductor sees
every step. Per-tensor FP8 is written in the reference's own torch ops (the amax, the
scale rule of ``formats.casting``, the saturating cast), which inductor fuses into the
kernels that produce the operand (the norm, the SwiGLU, the attention output), and its
GEMMs are ``torch._scaled_mm`` calls, the cuBLAS calls the eager path makes. The compiled
forward and gradients are therefore the eager ones bit for bit: the quantized values are
exact functions of the input (any order of a max reduction gives the same amax), the GEMMs
are the same library calls on the same operands, and the one reduction whose order
matters (the bias gradient) runs as a custom op around eager's own sum.

What this traces is decided by :func:`plan_for` from the recipe and the shapes; anything
else (delayed scaling's history, block and MX formats, ``CustomRecipe``, quantized
weights, tensor parallelism, boundary roles) stays one opaque call
(``lowprec.compiled_call``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.casting import cast_fp8, scale_from_amax
from ..recipe import Float8CurrentScaling

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class Tensorwise:
    """Per-tensor FP8 with current scaling for one operand (the quantizer's settings)."""

    fp8_dtype: torch.dtype
    pow2: bool = False
    eps: float = 0.0

    def quantize(self, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 data, fp32 scale of one element): ``formats.float8.reference``'s arithmetic."""
        amax = t2d.abs().amax().to(torch.float32).reshape(1)
        # finfo(...).max is FP8_MAX's value, folded to a constant by torch.compile
        scale = scale_from_amax(amax, torch.finfo(self.fp8_dtype).max, eps=self.eps,
                                pow2=self.pow2)
        return cast_fp8(t2d.to(torch.float32) * scale, self.fp8_dtype), scale


@dataclass(frozen=True)
class TracedPlan:
    """What a traced linear quantizes with: one setting per operand, and whether its
    GEMMs run on cuBLAS (CUDA) or in the exact fp32 emulation (elsewhere), as the eager
    dispatcher would choose for the same operands."""

    x: Tensorwise
    w: Tensorwise
    dy: Tensorwise
    cublas: bool


def _cublas_takes(plan_dtypes, m, k, n, device: torch.device) -> bool:
    """Whether eager's ``cublas_fp8`` backend takes all three GEMMs of an (m, k) x (n, k)
    linear (``backends.cublas_fp8.tensorwise_accepts``): every GEMM dimension a multiple of
    16 (wgrad contracts over m) and no E5M2 x E5M2 pair."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    x, w, dy = plan_dtypes
    if (x == E5M2 and w == E5M2) or (dy == E5M2 and (w == E5M2 or x == E5M2)):
        return False
    return m > 0 and m % 16 == 0 and k % 16 == 0 and n % 16 == 0


def plan_for(recipe, x: torch.Tensor, weight: torch.Tensor) -> TracedPlan | None:
    """The traced plan of a linear ``x @ weight.T`` under ``recipe``, or None where the
    compiled path keeps the opaque call (see the module docstring)."""
    if type(recipe) is not Float8CurrentScaling or recipe.backward_mode != "default":
        return None
    if x.dim() < 2 or x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16,
                                                                   torch.float32):
        return None
    fmt, pow2 = recipe.fp8_format, recipe.use_power_2_scales
    fwd, bwd = Tensorwise(fmt.fwd_dtype, pow2), Tensorwise(fmt.bwd_dtype, pow2)
    if x.device.type != "cuda":  # the fp32 emulation takes every shape
        return TracedPlan(fwd, fwd, bwd, cublas=False)
    k, n = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    if not _cublas_takes((fwd.fp8_dtype, fwd.fp8_dtype, bwd.fp8_dtype), m, k, n, x.device):
        return None  # eager takes another backend for some GEMM: keep the opaque call
    return TracedPlan(fwd, fwd, bwd, cublas=True)


# ---- GEMMs ---------------------------------------------------------------------------------
def _gemm(plan: TracedPlan, a, a_scale, b, b_scale, out_dtype, bias=None) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale).T (+ bias)`` for fp8 ``a`` (M, K), ``b`` (N, K): what
    ``lowprec.gemm`` computes for two Float8Tensors (cuBLAS on CUDA, else the fp32
    emulation)."""
    if plan.cublas:
        fused = bias is not None and out_dtype in (torch.bfloat16, torch.float16) \
            and bias.dtype == out_dtype
        res = torch._scaled_mm(a, b.t(), scale_a=torch.reciprocal(a_scale).reshape(()),
                               scale_b=torch.reciprocal(b_scale).reshape(()),
                               bias=bias if fused else None, out_dtype=out_dtype,
                               use_fast_accum=False)
        if bias is not None and not fused:
            res = (res.to(torch.float32) + bias.to(torch.float32)).to(out_dtype)
        return res
    out = (a.to(torch.float32) / a_scale) @ (b.to(torch.float32) / b_scale).t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


@torch.library.custom_op("lowprec::bias_grad", mutates_args=())
def bias_grad(dy2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dy2d.sum(0)`` in ``dtype``, as eager sums it (a reduction the compiler would
    order its own way)."""
    return dy2d.sum(dim=0).to(dtype)


@bias_grad.register_fake
def _bias_grad_fake(dy2d, dtype):
    return dy2d.new_empty(dy2d.shape[1:], dtype=dtype)


class _TracedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan: TracedPlan):
        k = x.shape[-1]
        x2d = x.reshape(-1, k)
        xq, xs = plan.x.quantize(x2d)
        wq, ws = plan.w.quantize(weight)
        y = _gemm(plan, xq, xs, wq, ws, x.dtype, bias)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # only fp8 operands are kept: what the backward GEMMs read
        ctx.save_for_backward(xq if need_dw else None, xs, wq if need_dx else None, ws)
        ctx.plan, ctx.has_bias = plan, bias is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xq, xs, wq, ws = ctx.saved_tensors
        plan = ctx.plan
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if need_dx or need_dw:
            dyq, dys = plan.dy.quantize(dy2d)
            if need_dw:  # mat(dY, columnwise) @ mat(X, columnwise).T
                dw = _gemm(plan, dyq.t().contiguous(), dys, xq.t().contiguous(), xs,
                           ctx.w_dtype)
            if need_dx:  # mat(dY, rowwise) @ mat(W, columnwise).T
                dx = _gemm(plan, dyq, dys, wq.t().contiguous(), ws,
                           ctx.x_dtype).reshape(ctx.x_shape)
        if need_db and ctx.has_bias:
            db = bias_grad(dy2d, ctx.w_dtype)
        return dx, dw, db, None


def traced_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  plan: TracedPlan) -> torch.Tensor:
    """``x @ weight.T + bias`` quantized as ``plan`` says, in ops the compiler traces."""
    return _TracedLinear.apply(x, weight, bias, plan)
