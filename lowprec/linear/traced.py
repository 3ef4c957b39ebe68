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

FP8 block scaling (1x128 inputs and gradients, 128x128 weights) traces too, its GEMMs
``torch._scaled_mm`` with block scales on CUDA, for token counts that fill whole blocks.
Its quantize is the reference's torch ops off CUDA and eager's Triton kernel on CUDA (a
``triton_op`` inductor launches itself), where inductor's code for the per-block amax took
several times the kernel's GPU time. Off CUDA every recipe's GEMMs are the fp32 emulation
eager runs there.
MXFP8 (1x32 blocks) traces as its exact dequantized values (``formats.mxfp8.compiled``)
multiplied by bf16 GEMMs on CUDA, as eager runs it on GPUs without MX tensor cores; NVFP4
likewise, with its global scales and stochastic-rounding keys (``traced_nvfp4``).

Inductor computes fused bf16 ops in fp32 and skips the rounding between them; the traced
quantizes therefore round their input as eager's bf16 tensor is rounded, and build bf16
outputs from their bits (``traced_steps``), so a neighbour fused into them reads and hands
on eager's values. Bit identity assumes inductor's default GEMM lowering (the cuBLAS
calls); ``max-autotune`` may pick GEMM kernels of its own.

Delayed scaling traces as per-tensor FP8 whose scales the module's state holds: the
quantizes read them and record their amaxes into the state in place
(:class:`_TracedDelayedLinear`).

What this traces is decided by :func:`plan_for` from the recipe and the shapes; anything
else (a callable amax algorithm, 2-D MXFP8 weights, ``CustomRecipe``, quantized
weights other than per-tensor FP8 under current scaling and 128x128 FP8 blocks, tensor
parallelism, boundary roles, fp16, shapes eager would pad, slice or hand to another
backend) stays one opaque call (``lowprec.compiled_call``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..autocast import torch_autocast_dtype
from ..formats.base import QuantizedTensor
from ..formats.block.launch import fp8_block_quantize_inline
from ..formats.block.reference import BLOCK, dequantize_blocks, quantize_blocks
from ..formats.block.tensor import Float8BlockwiseTensor
from ..formats.casting import cast_fp8
from ..formats.float8.reference import current_scale
from ..formats.float8.tensor import Float8Tensor
from ..formats.mxfp8.compiled import dequantized_1x32, dequantized_32x1
from ..formats.mxfp8.launch import mxfp8_exact_inline
from ..formats.mxfp8.reference import BLOCK as MX_BLOCK
from ..kernels import use_kernels
from ..recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from ..state import push_amaxes
from . import grad_split
from . import traced_steps as steps
from .traced_nvfp4 import FP4Blocks, TracedNVFP4Linear, nvfp4_plan

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class Tensorwise:
    """Per-tensor FP8 with current scaling for one operand (the quantizer's settings)."""

    fp8_dtype: torch.dtype
    pow2: bool = False
    eps: float = 0.0

    def scale(self, t2d: torch.Tensor) -> torch.Tensor:
        """The fp32 scale (one element) of ``t2d``, as ``formats.float8.reference``."""
        return current_scale(steps.rounded_amax(t2d), self.fp8_dtype, pow2=self.pow2, eps=self.eps)

    def cast(self, t2d: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return cast_fp8(steps.rounded(t2d) * scale, self.fp8_dtype)

    def quantize(self, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 data, fp32 scale of one element)."""
        scale = self.scale(t2d)
        return self.cast(t2d, scale), scale

    def transposed(self, t2d: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The fp8 data of ``t2d.t()`` cast with ``scale`` (contiguous)."""
        return self.cast(t2d.t(), scale).contiguous()


@dataclass(frozen=True)
class GivenTensorwise:
    """A per-tensor FP8 weight that arrives quantized (a ``Float8Tensor``: FSDP2's
    quantized all-gather, ``quantized_model_init``): its own codes and scale, as eager's
    GEMMs read them; dgrad reads the transpose of its codes."""

    fp8_dtype: torch.dtype

    @staticmethod
    def quantize(weight) -> tuple[torch.Tensor, torch.Tensor]:
        return weight.rowwise_data, weight.shared_scale

    @staticmethod
    def transposed(weight, scale: torch.Tensor) -> torch.Tensor:
        return weight.rowwise_data.t().contiguous()


def scale_in_use(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The state's ``scale``, NaN where the matching ``amax`` is not finite (plain torch
    ops, fused into the amax pass)."""
    return torch.where(torch.isfinite(amax), scale, float("nan"))


@dataclass(frozen=True)
class Delayed:
    """Per-tensor FP8 with delayed scaling for one operand: cast with a scale the state
    holds, the tensor's amax recorded into the state (the max with what its slot holds,
    NaN sticking), as ``Float8Quantizer`` does; NaN or Inf in the tensor casts with a NaN
    scale, so it comes back NaN."""

    fp8_dtype: torch.dtype

    @staticmethod
    def amax(t2d: torch.Tensor) -> torch.Tensor:
        return steps.rounded_amax(t2d)

    def quantize(self, t2d: torch.Tensor, scale: torch.Tensor):
        """(fp8 data, the scale cast with, its amax to record) of ``t2d`` under the state's
        1-element ``scale``."""
        seen = self.amax(t2d)
        scale = scale_in_use(scale, seen)
        return self.cast(t2d, scale), scale, seen

    cast = Tensorwise.cast  # the same saturating cast with a given scale
    transposed = Tensorwise.transposed


def _exact_reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` in fp32, correctly rounded (``torch.reciprocal``'s result in eager; in
    fp64 for the reason ``formats.casting.scale_from_amax`` gives)."""
    return (1.0 / scale.to(torch.float64)).to(torch.float32)


def decode_scale(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` as a 0-d fp32 tensor (as ``Float8Tensor.decode_scale``)."""
    return _exact_reciprocal(scale).reshape(())


@dataclass(frozen=True)
class Blockwise:
    """FP8 with current-scaled blocks for one operand: 1x128 (``dim`` 1) or 128x128 (2)
    (``formats.block.reference``'s arithmetic, scales as ``Float8BlockQuantizer`` with
    power-of-two scales).

    With ``kernel`` (CUDA with Triton) the quantize is eager's Triton kernel, which
    inductor launches from its generated code (``fp8_block_quantize_inline``): its blocked
    amax and cast take a fraction of the GPU time of inductor's code for the same torch
    ops, and it makes both directions in one pass. Its results are the reference's bit
    for bit (as eager's)."""

    fp8_dtype: torch.dtype
    dim: int
    pow2: bool = True
    eps: float = 0.0
    kernel: bool = False

    def quantize(self, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 data (R, C), fp32 scales (R, C/128) or (R/128, C/128)) of ``t2d``, blocked
        along C."""
        if self.kernel:
            return self._launch(t2d, True, False)[0]
        return quantize_blocks(steps.rounded(t2d), self.fp8_dtype, self.dim, pow2=self.pow2,
                               eps=self.eps)

    def quantize_t(self, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantize(t2d.t())``: the columnwise blocks, along ``t2d``'s rows."""
        if self.kernel:
            return self._launch(t2d, False, True)[1]
        return self.quantize(t2d.t())

    def quantize_both(self, t2d: torch.Tensor) -> tuple[tuple, tuple]:
        """``(quantize(t2d), quantize_t(t2d))``, in one pass where the kernel runs."""
        if self.kernel:
            return self._launch(t2d, True, True)
        return self.quantize(t2d), self.quantize_t(t2d)

    def _launch(self, t2d: torch.Tensor, rowwise: bool, columnwise: bool) -> tuple:
        rq, rs, _, cq, cs, _ = fp8_block_quantize_inline(
            t2d, self.fp8_dtype == E5M2, self.dim, self.pow2, self.eps, rowwise, columnwise)
        return (rq.view(self.fp8_dtype), rs), (cq.view(self.fp8_dtype), cs)


@dataclass(frozen=True)
class GivenBlocks:
    """A 128x128-block FP8 weight that arrives quantized (a ``Float8BlockwiseTensor``):
    its own codes and block scales; dgrad reads both transposed."""

    fp8_dtype: torch.dtype
    dim: int = 2

    @staticmethod
    def quantize(weight) -> tuple[torch.Tensor, torch.Tensor]:
        return weight.rowwise_data, weight.rowwise_scale


def _given_weight(weight: torch.Tensor, w):
    """The operand setting of a weight that arrives quantized in a form the traced GEMMs
    read as it is (per-tensor FP8 for a per-tensor plan, 128x128 blocks for a 128x128
    block plan, in the plan's fp8 dtype), else None."""
    if isinstance(weight, Float8Tensor) and type(w) is Tensorwise:
        given = GivenTensorwise(weight.fp8_dtype)
    elif (isinstance(weight, Float8BlockwiseTensor) and type(w) is Blockwise and w.dim == 2
          and weight.block_scaling_dim == 2):
        given = GivenBlocks(weight.fp8_dtype)
    else:
        return None
    return given if weight.rowwise_data is not None and given.fp8_dtype == w.fp8_dtype else None


def reads_recipe_weights(recipe) -> bool:
    """Whether a compiled linear reads a weight quantized under ``recipe`` as it is (FSDP2's
    quantized all-gathers of it under torch.compile, ``quantized_model_init``): current
    scaling's per-tensor FP8 and block FP8 with 128x128 weight blocks, default backward."""
    return recipe.backward_mode == "default" and (
        type(recipe) is Float8CurrentScaling
        or (type(recipe) is Float8BlockScaling and recipe.w_block_scaling_dim == 2))


@dataclass(frozen=True)
class MXBlocks:
    """MXFP8 (1x32 blocks, E8M0 scales) for one operand, as the exact values its GEMM
    multiplies: on Hopper eager runs MXFP8 GEMMs as bf16 GEMMs of these values
    (``backends.exact_bf16``), elsewhere in the fp32 emulation.

    With ``kernel`` (CUDA with Triton) the values are eager's Triton kernel's exact bf16
    values (``mxfp8_exact_inline``, which inductor launches itself), both directions in
    one pass where both are asked for; otherwise torch ops (``formats.mxfp8.compiled``)."""

    fp8_dtype: torch.dtype
    kernel: bool = False

    def values(self, t2d: torch.Tensor) -> torch.Tensor:
        """Dequantized values of ``t2d`` (R, C) in blocks along C (fp32, or bf16 from
        the kernel: exact either way)."""
        if self.kernel:
            return self._launch(t2d, True, False)[0]
        return dequantized_1x32(steps.rounded(t2d), self.fp8_dtype)

    def values_t(self, t2d: torch.Tensor) -> torch.Tensor:
        """``values(t2d.t())``, computed along ``t2d``'s rows (see ``dequantized_32x1``)."""
        if self.kernel:
            return self._launch(t2d, False, True)[1]
        return dequantized_32x1(steps.rounded(t2d), self.fp8_dtype)

    def values_both(self, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values(t2d), values_t(t2d))``, in one pass where the kernel runs."""
        if self.kernel:
            return self._launch(t2d, True, True)
        return self.values(t2d), self.values_t(t2d)

    def _launch(self, t2d: torch.Tensor, rowwise: bool, columnwise: bool) -> tuple:
        return mxfp8_exact_inline(t2d, self.fp8_dtype == E5M2, rowwise, columnwise)


@dataclass(frozen=True)
class TracedPlan:
    """What a traced linear quantizes with: one setting per operand, and whether its
    GEMMs run on cuBLAS (CUDA) or in the exact fp32 emulation (elsewhere), as the eager
    dispatcher would choose for the same operands."""

    x: Tensorwise | Delayed | Blockwise | MXBlocks | FP4Blocks
    w: Tensorwise | GivenTensorwise | Delayed | Blockwise | GivenBlocks | MXBlocks | FP4Blocks
    dy: Tensorwise | Delayed | Blockwise | MXBlocks | FP4Blocks
    cublas: bool
    #: (rows per dgrad slice, columns per wgrad slice) where eager slices dY
    #: (``grad_split``; the same slices give the same GEMMs), else None
    split: tuple[int, int] | None = None


def _cublas_takes(plan_dtypes, m, k, n) -> bool:
    """Whether eager's ``cublas_fp8`` backend takes all three GEMMs of an (m, k) x (n, k)
    linear on CUDA (``backends.cublas_fp8.tensorwise_accepts``): every GEMM dimension a
    multiple of 16 (wgrad contracts over m) and no E5M2 x E5M2 pair."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    x, w, dy = plan_dtypes
    if (x == E5M2 and w == E5M2) or (dy == E5M2 and (w == E5M2 or x == E5M2)):
        return False
    return m > 0 and m % 16 == 0 and k % 16 == 0 and n % 16 == 0


def _block_plan(recipe: Float8BlockScaling, x, weight) -> TracedPlan | None:
    """Block FP8 with 1x128 inputs and gradients and 128x128 or 1x128 weights where eager
    does not pad: every dimension a multiple of 128 (M too: the columnwise blocks run
    along it). On CUDA, where eager's ``cublas_fp8_block`` takes all three GEMMs: a
    multiple of 512 where a 128x128 operand is contracted, no E5M2 x E5M2; elsewhere the
    fp32 emulation."""
    fmt = recipe.fp8_format
    dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim,
            recipe.grad_block_scaling_dim)
    if dims[0] != 1 or dims[2] != 1:
        return None
    cuda = x.device.type == "cuda"
    fwd, bwd = fmt.fwd_dtype, fmt.bwd_dtype
    if cuda and (not hasattr(torch, "_scaled_mm") or (fwd == E5M2 and bwd == E5M2)):
        return None
    k, n = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    contracted = 512 if dims[1] == 2 and cuda else BLOCK
    if not (m > 0 and m % BLOCK == 0 and k % contracted == 0 and n % contracted == 0):
        return None
    split = None
    # block slices need no statistics pass; the same rule as eager's (grad_split)
    if grad_split.slicing_allowed(slices_need_stats_pass=False):
        split = grad_split.split_sizes(m, n, k, x.dtype.itemsize, weight.dtype.itemsize)
    kernel = use_kernels(x)
    return TracedPlan(Blockwise(fwd, 1, kernel=kernel), Blockwise(fwd, dims[1], kernel=kernel),
                      Blockwise(bwd, 1, kernel=kernel), cublas=cuda, split=split)


def _mx_plan(recipe: MXFP8BlockScaling, x, weight, bias) -> TracedPlan | None:
    """MXFP8 with 1x32 blocks where eager neither pads (every dimension a multiple of 32)
    nor slices (``grad_split.sliced`` runs ``exact_split``); on CUDA, as the bf16 GEMMs of
    ``exact_bf16`` with a bf16 result and no bias (a bias takes cuBLAS's epilogue, which
    the compiler might run apart)."""
    if recipe.enable_2d_quantization or grad_split.exact_slicing():
        return None
    k, n = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    if not (m > 0 and m % MX_BLOCK == 0 and k % MX_BLOCK == 0 and n % MX_BLOCK == 0):
        return None
    cuda = x.device.type == "cuda"
    if cuda and (x.dtype != torch.bfloat16 or bias is not None):
        return None
    fmt, kernel = recipe.fp8_format, use_kernels(x)
    fwd = MXBlocks(fmt.fwd_dtype, kernel)
    return TracedPlan(fwd, fwd, MXBlocks(fmt.bwd_dtype, kernel), cublas=cuda)


def plan_for(recipe, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None, *, amp: bool = False) -> TracedPlan | None:
    """The traced plan of a linear ``x @ weight.T`` under ``recipe``, or None where the
    compiled path keeps the opaque call (see the module docstring). A weight that arrives
    quantized is read as it is where the plan's GEMMs take its form (``_given_weight``);
    under torch.autocast (``amp``) its nominal dtype need not be the input's, as in eager
    mode (the weight gradient takes the weight's)."""
    free = amp and isinstance(weight, QuantizedTensor)
    if x.dim() < 2 or (x.dtype != weight.dtype and not free):
        return None
    plan = _plan_for(recipe, x, weight, bias)
    if plan is None or not isinstance(weight, QuantizedTensor):
        return plan
    given = _given_weight(weight, plan.w)
    return None if given is None else dataclasses.replace(plan, w=given)


def _plan_for(recipe, x, weight, bias) -> TracedPlan | None:
    if recipe.backward_mode != "default":
        return None
    # fp16 keeps the opaque call: ``steps.rounded`` restores bf16 rounding only
    if x.dtype not in (torch.bfloat16, torch.float32):
        return None
    if type(recipe) is Float8BlockScaling:
        return _block_plan(recipe, x, weight)
    if type(recipe) is MXFP8BlockScaling:
        return _mx_plan(recipe, x, weight, bias)
    if type(recipe) is NVFP4BlockScaling:
        fp4 = nvfp4_plan(recipe, x, weight)
        return None if fp4 is None else TracedPlan(*fp4, cublas=x.device.type == "cuda")
    if type(recipe) is Float8CurrentScaling:
        fmt, pow2 = recipe.fp8_format, recipe.use_power_2_scales
        fwd, bwd = Tensorwise(fmt.fwd_dtype, pow2), Tensorwise(fmt.bwd_dtype, pow2)
    elif type(recipe) is DelayedScaling and recipe.amax_compute_algo in ("max", "most_recent"):
        fmt = recipe.fp8_format
        fwd, bwd = Delayed(fmt.fwd_dtype), Delayed(fmt.bwd_dtype)
    else:
        return None
    if x.device.type != "cuda":  # the fp32 emulation takes every shape
        return TracedPlan(fwd, fwd, bwd, cublas=False)
    k, n = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    if not _cublas_takes((fwd.fp8_dtype, fwd.fp8_dtype, bwd.fp8_dtype), m, k, n):
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
        res = torch._scaled_mm(a, b.t(), scale_a=decode_scale(a_scale),
                               scale_b=decode_scale(b_scale),
                               bias=bias if fused else None, out_dtype=out_dtype,
                               use_fast_accum=False)
        if bias is not None and not fused:
            res = steps.as_output(res.to(torch.float32) + bias.to(torch.float32), out_dtype)
        return res
    return steps.emulated_product(a.to(torch.float32) / a_scale,
                                  b.to(torch.float32) / b_scale, bias, out_dtype)


def _block_gemm(plan: TracedPlan, a, a_scale, a_dim, b, b_scale, b_dim, out_dtype,
                bias=None) -> torch.Tensor:
    """``mat(a) @ mat(b).T`` of two block-scaled fp8 operands, both (rows, K) with their
    encode scales: on CUDA through ``torch._scaled_mm`` with the decode scales laid out as
    ``backends.cublas_fp8.blockwise_run`` lays them out, elsewhere in the fp32 emulation
    (the reference's dequantize, an fp32 GEMM)."""
    if not plan.cublas:
        return steps.emulated_product(dequantize_blocks(a, a_scale, a_dim),
                                      dequantize_blocks(b, b_scale, b_dim), bias, out_dtype)
    decode = _exact_reciprocal
    # 1x128 (R, K/128): contiguous (K/128, R), read as its transpose; 128x128 as it is
    scale_a = decode(a_scale.t()).contiguous().t() if a_dim == 1 else decode(a_scale).contiguous()
    scale_b = decode(b_scale.t()).contiguous() if b_dim == 1 else decode(b_scale).contiguous().t()
    fused = bias is not None and out_dtype in (torch.bfloat16, torch.float16) \
        and bias.dtype == out_dtype
    res = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b,
                           bias=bias if fused else None, out_dtype=out_dtype,
                           use_fast_accum=False)
    if bias is not None and not fused:
        res = steps.as_output(res.to(torch.float32) + bias.to(torch.float32), out_dtype)
    return res


class _TracedBlockLinear(torch.autograd.Function):
    """Block FP8: x and dY are quantized in both directions (their columnwise blocks run
    along M, with scales of their own), the weight's 128x128 blocks read transposed by
    dgrad. Backward quantizes x and the weight again from the tensors themselves: a
    quantize is a function of its input, so these are the forward's blocks bit for bit,
    and no fp8 copy is held from forward to backward (the compiler recomputes x from what
    the neighbouring ops keep anyway, as for ``_TracedLinear``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: TracedPlan):
        x2d = x.reshape(-1, x.shape[-1])
        xq, xs = plan.x.quantize(x2d)
        wq, ws = plan.w.quantize(weight)
        y = _block_gemm(plan, xq, xs, 1, wq, ws, plan.w.dim, x.dtype, bias)
        return steps.finish_requantizing(ctx, x, x2d, weight, bias, plan, y)

    @staticmethod
    def backward(ctx, dy):
        return steps.traced_backward(ctx, dy, _TracedBlockLinear._grads)

    @staticmethod
    def _weight_columnwise(plan: TracedPlan, weight: torch.Tensor):
        """The weight's blocks as dgrad reads them: 128x128 blocks serve both directions
        (transposed), 1x128 blocks run along the other dimension."""
        if plan.w.dim == 2:
            wq, ws = plan.w.quantize(weight)
            return wq.t().contiguous(), ws.t().contiguous()
        return plan.w.quantize_t(weight)

    @staticmethod
    def _grads(ctx, dy2d, need_dx, need_dw, x2d, weight):
        plan = ctx.plan
        dx = dw = None
        m, n = dy2d.shape
        rows, cols = plan.split if plan.split is not None and need_dx and need_dw else (m, n)
        dyq = dyq_t = None
        if need_dx and need_dw and (rows, cols) == (m, n):  # both directions in one pass
            dyq, dyq_t = plan.dy.quantize_both(dy2d)
        if need_dw:  # mat(dY, columnwise) @ mat(X, columnwise).T, 1x128 blocks along M
            xcq, xcs = plan.x.quantize_t(x2d)
            dw = steps.joined([
                _block_gemm(plan, *(dyq_t or plan.dy.quantize_t(dy2d[:, a:a + cols])), 1, xcq,
                            xcs, 1, ctx.w_dtype) for a in range(0, n, cols)])
        if need_dx:  # mat(dY, rowwise) @ mat(W, columnwise).T
            wcq, wcs = _TracedBlockLinear._weight_columnwise(plan, weight)
            dx = steps.joined([
                _block_gemm(plan, *(dyq or plan.dy.quantize(dy2d[a:a + rows])), 1, wcq, wcs,
                            plan.w.dim, ctx.x_dtype) for a in range(0, m, rows)])
        return dx, dw


class _TracedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan: TracedPlan):
        k = x.shape[-1]
        x2d = x.reshape(-1, k)
        xq, xs = plan.x.quantize(x2d)
        wq, ws = plan.w.quantize(weight)
        y = _gemm(plan, xq, xs, wq, ws, x.dtype, bias)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Kept for backward: x and the weight as they came, with their scales. Backward
        # casts their transposes again with the same scales, which gives the forward's fp8
        # values bit for bit in the one pass a transpose of an fp8 copy would take, and
        # leaves the compiler free to recompute x from what the neighbouring ops keep
        # anyway (the norm's input) rather than hold an fp8 copy of every input.
        ctx.save_for_backward(x2d if need_dw else None, xs, weight if need_dx else None, ws)
        return steps.finish(ctx, x, weight, bias, plan, y)

    @staticmethod
    def backward(ctx, dy):
        return steps.traced_backward(ctx, dy, _TracedLinear._grads)

    @staticmethod
    def _grads(ctx, dy2d, need_dx, need_dw, x2d, xs, w, ws):
        if not (need_dx or need_dw):
            return None, None
        dyq, dys = ctx.plan.dy.quantize(dy2d)
        return _tensorwise_grads(ctx.plan, ctx, dyq, dys, need_dx, need_dw, x2d, xs, w, ws)


def _tensorwise_grads(plan: TracedPlan, ctx, dyq, dys, need_dx, need_dw, x2d, xs, w, ws):
    """(dX, dW) of a per-tensor linear from dY's fp8 data and scale: x and the weight cast
    transposed again with the forward's scales."""
    dx = dw = None
    if need_dw:  # mat(dY, columnwise) @ mat(X, columnwise).T
        dw = _gemm(plan, dyq.t().contiguous(), dys, plan.x.transposed(x2d, xs), xs, ctx.w_dtype)
    if need_dx:  # mat(dY, rowwise) @ mat(W, columnwise).T
        dx = _gemm(plan, dyq, dys, plan.w.transposed(w, ws), ws, ctx.x_dtype)
    return dx, dw


@torch.library.custom_op("lowprec::delayed_update",
                         mutates_args=("history", "amax_current", "scale"))
def delayed_update(history: torch.Tensor, amax_current: torch.Tensor, scale: torch.Tensor,
                   fp8_max: torch.Tensor, most_recent: bool, margin: float) -> None:
    """The backward state's update once a traced delayed-scaling backward has recorded its
    amaxes: eager's own update (``lowprec.state.push_amaxes``), one op in the graph."""
    push_amaxes(history, amax_current, scale, fp8_max, amax_current,
                "most_recent" if most_recent else "max", margin)


@delayed_update.register_fake
def _delayed_update_fake(history, amax_current, scale, fp8_max, most_recent, margin):
    return None


class _TracedDelayedLinear(torch.autograd.Function):
    """Delayed scaling: ``_TracedLinear`` with the scales read from the module's state and
    the amaxes recorded into it in place (x in slot 0 and the weight in slot 1 of the
    forward state, whose update the autocast region runs at its exit; dY in slot 0 of the
    backward state, whose update runs in the backward right after, as eager's does)."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: TracedPlan, fwd: tuple, bwd: tuple):
        scale, amax, handle = fwd
        x2d = x.reshape(-1, x.shape[-1])
        seen = torch.cat([plan.x.amax(x2d), plan.w.amax(weight)])
        # Backward recasts x and W with these scales, so it must keep this copy: recomputed
        # from the state, it would read scales the region's update has moved since
        # (autograd's version check then raises). The copy is taken by a cat, an op the
        # partitioner saves rather than recomputes.
        scales = scale_in_use(torch.cat([scale[0:1], scale[1:2]]), seen)
        xs, ws = scales[0:1], scales[1:2]
        xq, wq = plan.x.cast(x2d, xs), plan.w.cast(weight, ws)
        if handle is None:  # the region is in the graph
            amax[:2].copy_(torch.maximum(amax[:2], seen))
        else:
            torch.ops.lowprec.record_amaxes(amax, seen, handle)
        y = _gemm(plan, xq, xs, wq, ws, x.dtype, bias)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(x2d if need_dw else None, xs, weight if need_dx else None, ws,
                              *bwd[:4])
        ctx.update = bwd[4:]
        return steps.finish(ctx, x, weight, bias, plan, y)

    @staticmethod
    def backward(ctx, dy):
        out = steps.traced_backward(ctx, dy, _TracedDelayedLinear._grads)
        return (*out, None, None)

    @staticmethod
    def _grads(ctx, dy2d, need_dx, need_dw, x2d, xs, w, ws, scale, amax, history, fp8_max):
        plan = ctx.plan
        dx = dw = None
        if need_dx or need_dw:
            dyq, dys, seen = plan.dy.quantize(dy2d, scale[0:1])
            amax[0:1].copy_(torch.maximum(amax[0:1], seen))
            dx, dw = _tensorwise_grads(plan, ctx, dyq, dys, need_dx, need_dw, x2d, xs, w, ws)
            delayed_update(history, amax, scale, fp8_max, *ctx.update)
        return dx, dw


def _mx_gemm(plan: TracedPlan, a: torch.Tensor, b: torch.Tensor, out_dtype,
             bias=None) -> torch.Tensor:
    """``a @ b.T`` of exact fp32 values ``a`` (M, K), ``b`` (N, K): on CUDA the bf16 GEMM
    ``exact_bf16`` runs (the values are exact in bf16; bf16 result), else the fp32
    emulation. Both operands are made contiguous, as eager's are, so cuBLAS gets the
    same layouts (and so the same kernel) as in eager."""
    if plan.cublas:
        return torch.mm(a.to(torch.bfloat16).contiguous(), b.to(torch.bfloat16).contiguous().t())
    return steps.emulated_product(a, b, bias, out_dtype)


class _TracedMXLinear(torch.autograd.Function):
    """MXFP8: every operand quantized and dequantized to its exact values in the graph
    (x and W along K for fprop; dY along N and W along N for dgrad; dY and x along M for
    wgrad), multiplied as eager multiplies them. Backward quantizes x and W again from
    the tensors themselves (the same values: a quantize is a function of its input)."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: TracedPlan):
        x2d = x.reshape(-1, x.shape[-1])
        y = _mx_gemm(plan, plan.x.values(x2d), plan.w.values(weight), x.dtype, bias)
        return steps.finish_requantizing(ctx, x, x2d, weight, bias, plan, y)

    @staticmethod
    def backward(ctx, dy):
        return steps.traced_backward(ctx, dy, _TracedMXLinear._grads)

    @staticmethod
    def _grads(ctx, dy2d, need_dx, need_dw, x2d, weight):
        plan = ctx.plan
        dx = dw = None
        dyv, dyv_t = plan.dy.values_both(dy2d) if need_dx and need_dw else (None, None)
        if need_dw:  # mat(dY, columnwise) @ mat(X, columnwise).T, blocks along M
            dyv_t = plan.dy.values_t(dy2d) if dyv_t is None else dyv_t
            dw = _mx_gemm(plan, dyv_t, plan.x.values_t(x2d), ctx.w_dtype)
        if need_dx:  # mat(dY, rowwise) @ mat(W, columnwise).T, blocks along N
            dyv = plan.dy.values(dy2d) if dyv is None else dyv
            dx = _mx_gemm(plan, dyv, plan.w.values_t(weight), ctx.x_dtype)
        return dx, dw


def traced_linear(recipe, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  delayed=None):
    """``x @ weight.T + bias`` quantized per ``recipe`` in ops the compiler traces, or
    ``NotImplemented`` where :func:`plan_for` has no plan (the caller keeps the opaque op).

    Under ``torch.autocast`` the operands are first cast to its dtype (differentiably, so
    an fp32 weight gets an fp32 gradient) and the rest runs with autocast off, as
    ``lowprec.linear.quantized_linear`` does in eager mode."""
    amp = torch_autocast_dtype(x)
    if amp is not None:
        x = x.to(amp)
        if not isinstance(weight, QuantizedTensor):  # a quantized weight is read as it is
            weight = weight.to(amp)
        bias = bias.to(amp) if bias is not None else None
    plan = plan_for(recipe, x, weight, bias, amp=amp is not None)
    if plan is None or isinstance(plan.x, Delayed) != (delayed is not None):
        return NotImplemented
    fn = {Blockwise: _TracedBlockLinear, MXBlocks: _TracedMXLinear, FP4Blocks: TracedNVFP4Linear,
          Delayed: _TracedDelayedLinear}.get(type(plan.x), _TracedLinear)
    args = (x, weight, bias, plan)
    if delayed is not None:
        fwd, bwd, handle = delayed
        args += ((fwd.scale, fwd.amax_current, handle),
                 (bwd.scale, bwd.amax_current, bwd.amax_history, bwd.fp8_max,
                  recipe.amax_compute_algo == "most_recent", float(recipe.margin)))
    if isinstance(plan.x, FP4Blocks):  # its forward makes backward's operands only where needed
        args += (torch.is_grad_enabled(),)
    if amp is None:
        return fn.apply(*args)
    with torch.autocast(x.device.type, enabled=False):
        return fn.apply(*args)
