"""NVFP4 linears as ``torch.compile`` traces them (``lowprec.linear.traced`` picks this).

Every operand becomes the values its GEMM multiplies (``formats.nvfp4.compiled``), and the
GEMMs are eager's: on CUDA the bf16 GEMM of ``backends.exact_bf16`` (exact ``q * d``
values, the global scales applied in cuBLASLt's epilogue), elsewhere the fp32 emulation.
So the compiled forward and gradients are eager's bit for bit:

* the forward keeps the values backward multiplies (x's columnwise ones, made in the
  pass of its rowwise ones; the weight's, see :class:`TracedNVFP4Linear`);
* dY's keys are drawn by an op of the graph from torch's default generator, in eager's
  order (rowwise first; layer by layer, since each layer's dY comes from the one above).

Where eager would pad (a dimension that is not a multiple of 16), slice
(``grad_split.sliced``), or find no kernels on CUDA, :func:`nvfp4_plan` declines and the
call stays opaque.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.exact_bf16 import exact_product
from ..formats.nvfp4 import compiled as fp4
from ..formats.nvfp4.reference import BLOCK
from ..kernels import use_kernels
from ..recipe import NVFP4BlockScaling
from . import grad_split
from . import traced_steps as steps


@dataclass(frozen=True)
class FP4Blocks:
    """NVFP4 settings of one operand (the quantizer the recipe gives its role):
    ``rht`` on its columnwise direction, 16x16 blocks (``two_d``), stochastic rounding
    (``sr``); ``kernel``: eager's Triton kernels make the values (CUDA)."""

    rht: bool = False
    two_d: bool = False
    sr: bool = False
    kernel: bool = False

    def values_both(self, t2d: torch.Tensor, rowwise: bool, columnwise: bool, keys):
        """((values, divisor or None) rowwise, the same columnwise) of ``t2d`` for the
        directions asked for (the others (None, None); see the module doc), in one pass
        where the kernels run; ``keys`` (count, 2), one per direction asked for, rowwise
        first, or None."""
        key_row = key_col = None
        if keys is not None:
            key_row = keys[0] if rowwise else None
            key_col = keys[int(rowwise)] if columnwise else None
        if self.kernel:
            return fp4.kernel_values(t2d, rowwise, columnwise, rht=self.rht,
                                     two_d=self.two_d, key_row=key_row, key_col=key_col)
        t = steps.rounded(t2d)

        def reference(row: bool, key):
            return fp4.reference_values(t, row, rht=self.rht, two_d=self.two_d, key=key), None
        return (reference(True, key_row) if rowwise else (None, None),
                reference(False, key_col) if columnwise else (None, None))


def nvfp4_plan(recipe: NVFP4BlockScaling, x: torch.Tensor,
               weight: torch.Tensor) -> tuple[FP4Blocks, FP4Blocks, FP4Blocks] | None:
    """(x, weight, dY) settings of a traced NVFP4 linear, or None where eager pads (a
    dimension that is not a multiple of 16), slices (inside ``grad_split.sliced``) or runs
    no kernels on CUDA."""
    if grad_split.exact_slicing():
        return None
    k, n = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    if not (m > 0 and m % BLOCK == 0 and k % BLOCK == 0 and n % BLOCK == 0):
        return None
    kernel = use_kernels(x)
    if x.device.type == "cuda" and not kernel:
        return None
    rht = not recipe.disable_rht
    return (FP4Blocks(rht=rht, kernel=kernel),
            FP4Blocks(two_d=not recipe.disable_2d_quantization, kernel=kernel),
            FP4Blocks(rht=rht, sr=not recipe.disable_stochastic_rounding, kernel=kernel))


def _gemm(plan, a, div_a, b, div_b, out_dtype, bias=None) -> torch.Tensor:
    """``a @ b.T`` (+ bias) as eager multiplies these operands: ``exact_bf16`` on CUDA,
    the fp32 emulation (values already divided) elsewhere."""
    if plan.cublas:
        return exact_product(a, div_a, b, div_b, out_dtype, bias, in_graph=True)
    return steps.emulated_product(a, b, bias, out_dtype)


class TracedNVFP4Linear(torch.autograd.Function):
    """NVFP4: x and W rowwise for fprop; dY in both directions (with its keys), W
    columnwise for dgrad and x columnwise (RHT'd along M where both wgrad operands carry
    it, which then cancels) for wgrad.

    The forward makes x's columnwise values in the pass of its rowwise ones (one amax
    pass for both, as eager) and keeps them, bf16 values in place of the bf16 input it
    would otherwise keep. A weight in 16x16 blocks (no RHT, no stochastic rounding) has
    the transpose of its rowwise values as its columnwise ones, so the forward keeps the
    rowwise values and dgrad reads them transposed: no second pass over the weight."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan, grad_enabled: bool):
        x2d = x.reshape(-1, x.shape[-1])
        # needs_input_grad ignores no_grad(): an evaluation forward makes no columnwise values
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        (xv, xd), x_col = plan.x.values_both(x2d, True, need_dw, None)
        transposes = _transposes(plan.w)
        w_row, w_col = plan.w.values_both(weight, True, need_dx and not transposes, None)
        y = _gemm(plan, xv, xd, *w_row, x.dtype, bias)
        w_keep = w_row if transposes else w_col
        ctx.save_for_backward(*(x_col if need_dw else (None, None)),
                              *(w_keep if need_dx else (None, None)))
        ctx.w_transposed = transposes
        return steps.finish(ctx, x, weight, bias, plan, y)

    @staticmethod
    def backward(ctx, dy):
        return *steps.traced_backward(ctx, dy, TracedNVFP4Linear._grads), None

    @staticmethod
    def _grads(ctx, dy2d, need_dx, need_dw, xc, xcd, wv, wd):
        if not (need_dx or need_dw):
            return None, None
        plan = ctx.plan
        keys = fp4.draw_keys(dy2d, int(need_dx) + int(need_dw)) if plan.dy.sr else None
        dy_row, dy_col = plan.dy.values_both(dy2d, need_dx, need_dw, keys)
        dx = dw = None
        if need_dw:  # mat(dY, columnwise) @ mat(X, columnwise).T
            dw = _gemm(plan, *dy_col, xc, xcd, ctx.w_dtype)
        if need_dx:  # mat(dY, rowwise) @ mat(W, columnwise).T
            wc = wv.t().contiguous() if ctx.w_transposed else wv
            dx = _gemm(plan, *dy_row, wc, wd, ctx.x_dtype)
        return dx, dw


def _transposes(w: FP4Blocks) -> bool:
    """Whether the weight's columnwise values are the transpose of its rowwise ones: 16x16
    blocks (the same blocks either way, one global scale) with nearest rounding and no
    transform."""
    return w.two_d and not (w.rht or w.sr)
