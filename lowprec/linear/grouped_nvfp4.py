"""Grouped linear for NVFP4 emulated on the bf16 tensor cores (Hopper): every expert
quantized at once with its own global scales, each direction one grouped GEMM, nothing
read on the host.

A per-expert NVFP4 Linear on Hopper quantizes its input (padded with zero rows to whole
16-row blocks), its weight and dY, each with its own global encode scale ``S``, and
multiplies the exact bf16 ``q * d`` values on the bf16 tensor cores, applying
``1 / (S_a * S_b)`` to the fp32 sum before the one rounding (cuBLASLt's alpha,
:mod:`lowprec.gemm.exact_bf16`). Here:

* the routed rows are spread so that each group starts at a multiple of 16 rows, zero
  rows between the groups (the padding of each per-expert Linear);
* one pass finds every group's ``S`` of its rows and of their (RHT'd) transpose, and one
  pass a direction writes the exact values, each 16-row block with its group's ``S``
  (:mod:`lowprec.formats.nvfp4.grouped`); the experts' weights likewise, stacked
  (G * N, K), once per optimizer step under ``lowprec.autocast(cache_weights=True)``;
* each direction is one launch of the grouped GEMM of :mod:`lowprec.gemm.fp8_grouped`
  over the bf16 values, with each group's alpha ``RN32(1 / (S_a * S_b))``.

Without stochastic rounding the result is the per-expert Linears' bit for bit. With it,
each direction draws one key for all experts (per-expert Linears draw one an expert), so
the draws differ while their law is the same.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..formats import NVFP4Quantizer
from ..formats.nvfp4 import NVFP4Experts, draw_key, draw_keys, group_scales, grouped_exact
from ..gemm import fp8_grouped, gemm_alpha_torch, grouped_device, grouped_route
from . import weight_cache
from .function import _caching_weights
from .grouped_parts import hooked, padded_input, padded_like, stacked

#: every group starts at a multiple of this many rows (NVFP4's 16-row columnwise blocks)
ALIGN = 16


def _setting(q) -> tuple | None:
    if type(q) is not NVFP4Quantizer or hooked(q):
        return None
    # the generator by identity (None: torch's default one; dynamo takes no id() of None)
    gen = None if q.generator is None else id(q.generator)
    return (q.with_rht, q.with_2d_quantization, q.stochastic_rounding, gen)


def nvfp4_quantizers(qs: Sequence, n: int, k: int):
    """(input, weight, grad_output) quantizers when every group's slot is one NVFP4 setting
    (one generator), nothing is quantized at the boundaries, the features ``n`` and ``k``
    are multiples of 16, the weight carries no RHT and the input and dY carry it alike
    (the pairs the per-expert GEMMs run on the bf16 tensor cores); else None."""
    if n % 16 or k % 16:
        return None
    if any(q.output is not None or q.grad_input is not None for q in qs):
        return None
    picked = []
    for slot in ("input", "weight", "grad_output"):
        first = getattr(qs[0], slot)
        key = _setting(first)
        if key is None or any(_setting(getattr(q, slot)) != key for q in qs):
            return None
        picked.append(first)
    q_x, q_w, q_dy = picked
    if q_w.with_rht or q_x.with_rht != q_dy.with_rht:
        return None
    return tuple(picked)


def runs_on(x2d: torch.Tensor, n: int, k: int) -> bool:
    """Whether the grouped kernels run ``x2d``'s problem (bf16 rows on a Hopper GPU)."""
    return grouped_route("nvfp4", x2d.dtype, (), x2d.shape[0], n, k, 1,
                         grouped_device(x2d)) == "fp8_grouped"


def _block_groups(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The group of each 16-row block of the padded rows (int32); blocks past the last
    group (zero rows) counted in the last."""
    starts = torch.arange(0, rows, ALIGN, device=offs.device, dtype=offs.dtype)
    ids = torch.searchsorted(offs, starts, right=True)
    return ids.clamp_(max=offs.shape[0] - 1).to(torch.int32)


def _keys(q: NVFP4Quantizer, t: torch.Tensor, rowwise: bool, columnwise: bool):
    """The stochastic-rounding keys of the directions in use, rowwise first (None: nearest).
    Traced, torch's default generator is read through an op that calls eager's draw
    (``formats.nvfp4.compiled.draw_keys``), so compiled and eager draw the same keys."""
    if not q.stochastic_rounding:
        return None, None
    count = int(rowwise) + int(columnwise)
    if torch.compiler.is_compiling() and q.generator is None:
        keys = list(draw_keys(t, count).unbind(0))
    else:
        keys = [draw_key(q.generator, t.device) for _ in range(count)]
    key_row = keys.pop(0) if rowwise else None
    key_col = keys.pop(0) if columnwise else None
    return key_row, key_col


def quantize_rows(q: NVFP4Quantizer, t: torch.Tensor, block_groups: torch.Tensor, num: int,
                  rowwise: bool, columnwise: bool):
    """(rowwise values or None, columnwise values or None, (G, 2) global scales) of the
    grouped rows ``t``, each group quantized by ``q`` on its own."""
    scales = group_scales(t, block_groups, num, bool(q.with_rht and columnwise))
    key_row, key_col = _keys(q, t, rowwise, columnwise)
    row_s = scales[:, 0][block_groups] if rowwise else None
    col_s = scales[:, 1][block_groups] if columnwise else None
    rows, cols = grouped_exact(t, row_s, col_s, key_row, key_col, q.with_rht,
                               q.with_2d_quantization)
    return (rows if rowwise else None), (cols if columnwise else None), scales


def _quantized_weights(weights, q_w, columnwise: bool):
    """(forward operand (G, N, K), dgrad operand (G, K, N) or None, (G,) S) of the stacked
    experts' exact values; under ``lowprec.autocast(cache_weights=True)`` made once while
    they are unchanged.

    16x16 blocks rounded to nearest quantize W^T as the transpose of W's blocks (the same
    block amaxes and S), so dgrad reads the rowwise values transposed; otherwise the
    columnwise direction is quantized too. Experts that arrive quantized so
    (:class:`NVFP4Experts`, an FSDP2 quantized all-gather) give their exact values and
    scales as they are."""
    if isinstance(weights[0], NVFP4Experts):
        fwd = weights[0].exact()
        return fwd, (fwd.transpose(1, 2) if columnwise else None), weights[0].globals

    def make(columnwise=columnwise):
        w3d = stacked(weights).detach()
        num, n, k = w3d.shape
        w2d = w3d.reshape(num * n, k)
        blocks = torch.arange(w2d.shape[0] // ALIGN, device=w2d.device,
                              dtype=torch.int32) // (n // ALIGN)
        transposed = q_w.with_2d_quantization and not q_w.stochastic_rounding
        rows, cols, scales = quantize_rows(q_w, w2d, blocks, num, True,
                                           columnwise and not transposed)
        fwd = rows.view(num, n, k)
        if not columnwise:
            dgrad = None
        elif transposed:
            dgrad = fwd.transpose(1, 2)
        else:  # (K, G * N): expert g's columns g*N...
            dgrad = cols.view(k, num, n).permute(1, 0, 2)
        return fwd, dgrad, scales[:, 0]
    if _caching_weights() and not torch.compiler.is_compiling():
        return weight_cache.cached_value(weights, q_w, lambda: make(True))
    return make()


class _NVFP4:
    """NVFP4's scheme (``grouped_engine``): see the module docstring."""

    name = "nvfp4"

    @staticmethod
    def align(quantizers) -> int:
        return ALIGN

    @staticmethod
    def forward(plan, x2d, sizes, aligned, weights, need_dx, need_dw):
        q_x, q_w, _ = plan.quantizers
        num = weights[0].shape[0] if weights[0].dim() == 3 else len(weights)
        n, k = weights[0].shape[-2:]
        x_pad, src, valid, offs, dest = padded_input(x2d, sizes, aligned, ALIGN)
        blocks = _block_groups(offs, x_pad.shape[0])
        x_rows, x_cols, sx = quantize_rows(q_x, x_pad, blocks, num, True, need_dw)
        w_fwd, w_dgrad, sw = _quantized_weights(weights, q_w, need_dx)
        ones = torch.ones(num, dtype=torch.float32, device=x2d.device)
        # each expert's alpha, cuBLASLt's of its own GEMM
        alpha = gemm_alpha_torch(sx[:, 0], sw)
        y = fp8_grouped.rows_by_experts(x_rows, alpha, w_fwd, ones, offs, x2d.dtype)
        if dest is not None:
            y = y.index_select(0, dest)
        saved = (x_cols, sx[:, 1], w_dgrad if need_dx else None, sw, src, valid, offs, dest,
                 blocks)
        return y, saved, weights[0].dtype

    @staticmethod
    def backward(plan, w_dtype, saved, dy, need_dx, need_dw):
        x_cols, sx_col, w_dgrad, sw, src, valid, offs, dest, blocks = saved
        num = sw.shape[0]
        dy_pad = padded_like(dy, src, valid)
        dy_rows, dy_cols, sdy = quantize_rows(plan.quantizers[2], dy_pad, blocks, num, need_dx,
                                              need_dw)
        del dy_pad
        ones = torch.ones(num, dtype=torch.float32, device=dy.device)
        dx = dw = None
        if need_dw:
            alpha = gemm_alpha_torch(sdy[:, 1], sx_col)
            dw = fp8_grouped.wgrad(dy_cols, alpha, x_cols, ones, offs, w_dtype)
        if need_dx:
            alpha = gemm_alpha_torch(sdy[:, 0], sw)
            dx = fp8_grouped.rows_by_experts(dy_rows, alpha, w_dgrad, ones, offs, dy.dtype)
            if dest is not None:
                dx = dx.index_select(0, dest)
        return dx, dw


#: NVFP4's scheme
NVFP4 = _NVFP4()
