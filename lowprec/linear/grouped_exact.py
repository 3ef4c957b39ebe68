"""Grouped linear for block formats emulated on the bf16 tensor cores (MXFP8 on Hopper).

A per-expert MXFP8 Linear on Hopper quantizes its input (padded with zero rows to whole
32-row blocks, for wgrad's columnwise blocks), its weight and dY, and multiplies the exact
bf16 values of the quantized operands on the bf16 tensor cores
(:mod:`lowprec.backends.exact_bf16`). Here every expert does the same at once:

* the routed rows are spread into a layout where each group starts at a multiple of the
  row block, zero rows between the groups (:func:`grouped_mm.padded_layout`): the padding
  each per-expert Linear adds. Blocks then never straddle two groups, and zero rows change
  no block's scale, so one quantize of the whole padded tensor is each group's quantize;
* the experts' weights, stacked (G * N, K), are quantized once: rowwise blocks lie along
  K, columnwise ones along N, inside one expert when N is a multiple of the block;
* each direction is one ``torch._grouped_mm`` over the exact values (fp32 accumulation,
  bf16 out, as the per-expert emulation writes it), offsets on the device.

Nothing reads the group sizes on the host. It serves quantizers whose blocks scale
themselves (``blocks_are_independent``: no per-tensor statistic), whose exact values need
no divisor, one setting for every expert (:func:`exact_quantizers`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..backends import grouped_mm
from ..formats.base import QuantizedTensor
from . import weight_cache
from .function import LinearQuantizers, _caching_weights, _keep_only, quantize_operand
from .grouped_parts import fused, group_ids, layout, stacked, weight_grads
from .plan import BOTH, ROW


def _shared(qs: Sequence) -> object | None:
    """The first quantizer when every group's is the same stateless block format setting
    with exact bf16 operands and no hooks; else None."""
    first = qs[0]
    if first is None or not (first.blocks_are_independent and first.keeps_exact_bf16):
        return None
    key = first.share_key()
    if key is None:
        return None
    if any(q is None or "quantize" in q.__dict__ or q.share_key() != key for q in qs):
        # hooked quantizers (lowprec.debug, compare's probe) see each expert's own tensors
        return None
    return first


def exact_quantizers(qs: Sequence[LinearQuantizers], n: int, k: int):
    """(input, weight, grad_output) quantizers when each slot is one setting of a block
    format emulated on bf16 GEMMs, nothing is quantized at the boundaries and the features
    (``n`` out, ``k`` in) fill the blocks; else None."""
    if any(q.output is not None or q.grad_input is not None for q in qs):
        return None
    picked = tuple(_shared([getattr(q, slot) for q in qs])
                   for slot in ("input", "weight", "grad_output"))
    if any(p is None for p in picked):
        return None
    q_x, q_w, q_dy = picked
    both = {"rowwise": True, "columnwise": True}
    if (k % q_x.col_multiple(**both) or n % q_w.row_multiple(**both)
            or k % q_w.col_multiple(**both) or n % q_dy.col_multiple(**both)):
        return None  # the per-expert path pads the features or says what does not divide
    return picked


def row_align(quantizers) -> int:
    """The padded layout's group alignment: whole row blocks of the input and dY, and 16."""
    q_x, _, q_dy = quantizers
    both = {"rowwise": True, "columnwise": True}
    return math.lcm(16, q_x.row_multiple(**both), q_dy.row_multiple(**both))


def _values(t: QuantizedTensor, usage: str) -> torch.Tensor:
    values, divisor = t.bf16_operand(usage)
    if divisor is not None:  # exact_quantizers admits formats without one
        raise RuntimeError(f"{type(t).__name__} {usage} values need a divisor; the grouped "
                           f"exact path takes formats whose values are exact as they are")
    return values


def _quantized_weights(weights: Sequence[torch.Tensor], q_w, columnwise: bool):
    """The experts' weights stacked (G * N, K) and quantized with q_w (rowwise, and
    columnwise for dgrad); under ``lowprec.autocast(cache_weights=True)`` made once while
    the weights are unchanged. Returns (tensor, owned)."""
    def make(columnwise=columnwise):
        w3d = stacked(weights)
        w2d = w3d.detach().reshape(-1, w3d.shape[-1])
        return quantize_operand(q_w, w2d, rowwise=True, columnwise=columnwise, exact=ROW)[0]
    if _caching_weights() and not torch.compiler.is_compiling():
        return weight_cache.cached_value(weights, q_w, lambda: make(True)), False
    return make(), True


class GroupedExact(torch.autograd.Function):
    """Forward, dgrad and wgrad as ``torch._grouped_mm`` over exact bf16 operands (see
    the module docstring). The weights are one (G, N, K) tensor or G (N, K) ones."""

    @staticmethod
    def forward(ctx, x2d, sizes, quantizers, grad_enabled, aligned, *weights):
        q_x, q_w, q_dy = quantizers
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and any(ctx.needs_input_grad[5:])
        rows = x2d.shape[0]
        num = weights[0].shape[0] if weights[0].dim() == 3 else len(weights)
        n, k = weights[0].shape[-2:]
        if aligned:  # the caller laid the groups out in whole blocks (group_alignment)
            src = valid = dest = None
            offs, x_pad = grouped_mm.end_offsets(sizes), x2d
        else:
            src, valid, offs, _, dest = grouped_mm.padded_layout(
                sizes, group_ids(sizes, rows), rows, row_align(quantizers))
            x_pad = fused(grouped_mm.padded_rows, x2d)(x2d, src, valid)
        x_lp, _ = quantize_operand(q_x, x_pad, rowwise=True, columnwise=need_dw, exact=ROW)
        w_lp, w_owned = _quantized_weights(weights, q_w, need_dx)
        y = grouped_mm.plain_rows_by_experts(_values(x_lp, "rowwise"),
                                             _values(w_lp, "rowwise").view(num, n, k), offs)
        if dest is not None:
            y = y.index_select(0, dest)
        del x_pad
        saved_x = _keep_only(x_lp, True, "columnwise") if need_dw else None
        saved_w = _keep_only(w_lp, w_owned, "columnwise") if need_dx else None
        ctx.save_for_backward(saved_x, saved_w, src, valid, offs, dest)
        ctx.q_dy, ctx.weights, ctx.shape = q_dy, layout(weights), (num, n, k)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_lp, w_lp, src, valid, offs, dest = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], any(ctx.needs_input_grad[5:])
        num, n, k = ctx.shape
        dy = dy.contiguous()
        dy_pad = dy if src is None else fused(grouped_mm.padded_rows, dy)(dy, src, valid)
        dy_lp, _ = quantize_operand(ctx.q_dy, dy_pad, rowwise=need_dx, columnwise=need_dw,
                                    exact=BOTH, codes=False)
        del dy_pad
        dx = dw = None
        if need_dw:
            # (N, padded) and (K, padded): per group, the rows of its padded range
            dw = grouped_mm.plain_wgrad(_values(dy_lp, "columnwise").t(),
                                        _values(x_lp, "columnwise").t(), offs)
        if need_dx:
            # the weights' columnwise values are (K, G * N): expert g's are columns g*N...
            w_t = _values(w_lp, "columnwise").view(k, num, n).permute(1, 0, 2)
            dx = grouped_mm.plain_rows_by_experts(_values(dy_lp, "rowwise"), w_t, offs)
            if dest is not None:
                dx = dx.index_select(0, dest)
        return dx, None, None, None, None, *weight_grads(dw, ctx.weights)
