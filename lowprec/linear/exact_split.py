"""A quantized Linear for formats emulated on bf16 GEMMs, sliced to a bf16 Linear's peak.

MXFP8 and NVFP4 GEMMs run on Hopper as bf16 GEMMs of exact dequantized values
(``lowprec.gemm.exact_bf16``). Those bf16 operands are as large as the bf16
tensors they come from, so the default path, which makes them whole (x's rowwise values
for fprop, dY's two directions at once, the saved input and weight dequantized for the
backward GEMMs), peaks at 1.3-2.1x a bf16 ``nn.Linear``. Inside
:class:`lowprec.linear.grad_split.sliced` a Linear with such quantizers runs this path instead:

* forward: x is quantized columnwise for the backward (codes only) and, separately,
  rowwise in row slices of exact values, each consumed by its fprop GEMM into its rows
  of Y; the weight's rowwise exact values are made whole, and its columnwise codes only
  after fprop;
* backward, wgrad first: the saved input is dequantized once to exact values and its
  codes freed (unless the graph is kept), then dY is quantized in column slices of exact
  values, each consumed by its GEMM into its rows of dW; then dgrad likewise with the
  saved weight and row slices of dY.

Slice sizes follow from a budget, a bf16 Linear's backward peak (x, dY, dX and dW alive
at once): each loop takes what the tensors alive during it leave of that budget. Every
slice is quantized exactly as the whole tensor would be (``Quantizer.gemm_slicer``: NVFP4
slices share the whole tensor's global scales and stochastic-rounding draws), and
no GEMM's contraction is split, so the result is the default path's up to the
accumulation order a GEMM of another size may pick. It costs speed: x and dY are each
read twice, and every slice is a launch.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..formats import QuantizedTensor, Quantizer
from ..gemm import gemm
from ..recipe import BackwardMode
from . import grad_split


def applies(quantizers, x: torch.Tensor, weight: torch.Tensor, backward_mode: str,
            need_dx: bool, need_dw: bool) -> bool:
    """Whether a linear forward takes this path (see the module docstring)."""
    if not (grad_split.exact_slicing() and backward_mode == BackwardMode.DEFAULT and need_dx
            and need_dw and quantizers is not None):
        return False
    q = quantizers
    if not all(isinstance(s, Quantizer) and s.can_gemm_slice()
               for s in (q.input, q.weight, q.grad_output)):
        return False
    return (not isinstance(x, QuantizedTensor) and not isinstance(weight, QuantizedTensor)
            and x.numel() > 0 and weight.numel() > 0 and x.dim() >= 2)


def held_bytes(t) -> int:
    """Bytes a tensor holds (a quantized one: its inner tensors and exact records)."""
    if t is None:
        return 0
    if isinstance(t, QuantizedTensor):
        return t.held_bytes()
    return t.numel() * t.element_size()


def budget(m: int, n: int, k: int, itemsize: int) -> int:
    """A bf16 Linear's backward peak: x (M, K), dY (M, N), dX (M, K) and dW (N, K)."""
    return itemsize * (2 * m * k + m * n + n * k)


#: Bytes of the budget each loop leaves unused: the caching allocator hands out blocks up
#: to 1 MiB larger than asked (large blocks are not split below that).
MARGIN = 2 << 20


def _slice_len(size: int, per_unit: int, free: int) -> int:
    """Slice length along a dimension of ``size`` whose slices cost ``per_unit`` bytes a
    row or column: equal ALIGN-multiple slices within ``free - MARGIN`` bytes (at least
    ALIGN)."""
    align = grad_split.ALIGN
    limit = max(free - MARGIN, 0) // max(per_unit, 1)
    if limit >= size:
        return size
    limit = max(align, limit // align * align)
    count = -(-size // limit)
    # size / count <= limit, a multiple of ALIGN: rounding up to ALIGN stays within it
    return -(-(-(-size // count)) // align) * align


def _unfused_out_bytes(bias: torch.Tensor | None, n: int) -> int:
    """Bytes a row of an n-wide GEMM output may take besides the output itself: with a
    bias and a per-tensor divisor (NVFP4) the emulation writes an fp32 product and rounds
    it in a second kernel, not in place."""
    return 0 if bias is None else 6 * n


def forward(quantizers, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
            ) -> tuple[torch.Tensor, QuantizedTensor, QuantizedTensor]:
    """(y, x quantized columnwise, weight quantized columnwise) for the backward."""
    k = x.shape[-1]
    x2d = x.detach().reshape(-1, k)
    m, n = x2d.shape[0], weight.shape[0]
    x_slicer = quantizers.input.gemm_slicer(x2d)
    x_col = x_slicer.codes(0, k, "columnwise")
    w2d = weight.detach()
    w_slicer = quantizers.weight.gemm_slicer(w2d)
    w_exact = w_slicer(0, n, "rowwise")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    alive = held_bytes(x) + held_bytes(x_col) + held_bytes(w_exact) + held_bytes(y)
    rows = _slice_len(m, 2 * k + _unfused_out_bytes(bias, n), budget(m, n, k, x.element_size())
                      - alive)
    for a in range(0, m, rows):
        part = x_slicer(a, a + rows, "rowwise")
        gemm(part, "rowwise", w_exact, "rowwise", out_dtype=x.dtype, bias=bias,
             out=y[a:a + rows])
        del part  # free this slice before the next is made
    del w_exact
    w_col = w_slicer.codes(0, k, "columnwise")
    return y.reshape(*x.shape[:-1], n), x_col, w_col


def backward(quantizer: Quantizer, dy: torch.Tensor, x_col: QuantizedTensor,
             w_col: QuantizedTensor, dx_dtype: torch.dtype, dw_dtype: torch.dtype,
             release_x: Callable[[], None], release_w: Callable[[], None]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX as (M, K), dW as (N, K)); ``release_x`` / ``release_w`` free the saved input and
    weight where nothing will read them again (they decide)."""
    from ..gemm import as_exact
    n = dy.shape[-1]
    dy2d = dy.detach().reshape(-1, n)
    m, k = dy2d.shape[0], w_col.shape[-1]
    total = budget(m, n, k, dy.element_size())
    slicer = quantizer.gemm_slicer(dy2d)

    x_exact = as_exact(x_col, "columnwise")
    if x_exact is not x_col:
        release_x()  # its codes are no longer read
    dw = torch.empty((n, k), dtype=dw_dtype, device=dy.device)
    alive = held_bytes(dy) + held_bytes(w_col) + held_bytes(x_col) + held_bytes(x_exact) \
        + held_bytes(dw)
    cols = _slice_len(n, 2 * m, total - alive)
    for a in range(0, n, cols):
        part = slicer(a, a + cols, "columnwise")
        gemm(part, "columnwise", x_exact, "columnwise", out_dtype=dw_dtype, out=dw[a:a + cols])
        del part
    del x_exact
    release_x()

    w_exact = as_exact(w_col, "columnwise")
    if w_exact is not w_col:
        release_w()
    dx = torch.empty((m, k), dtype=dx_dtype, device=dy.device)
    alive = held_bytes(dy) + held_bytes(dw) + held_bytes(dx) + held_bytes(w_exact) \
        + held_bytes(w_col) + held_bytes(x_col)
    rows = _slice_len(m, 2 * n, total - alive)
    for a in range(0, m, rows):
        part = slicer(a, a + rows, "rowwise")
        gemm(part, "rowwise", w_exact, "columnwise", out_dtype=dx_dtype, out=dx[a:a + rows])
        del part
    return dx, dw
