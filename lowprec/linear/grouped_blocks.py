"""The grouped linear of block formats: every expert quantized at once, each direction one
grouped GEMM, nothing read on the host.

A per-expert Linear of a block format pads its input with zero rows to whole row blocks
(for wgrad's columnwise blocks) and quantizes its input, its weight and dY. Here every
expert does the same at once:

* the routed rows are spread into a layout where each group starts at a multiple of the
  row block, zero rows between the groups (:func:`grouped_mm.padded_layout`): the padding
  each per-expert Linear adds. Blocks then never straddle two groups, and zero rows change
  no block's scale, so one quantize of the whole padded tensor is each group's quantize;
* the experts' weights, stacked (G * N, K), are quantized once: rowwise blocks lie along
  K, columnwise ones along N, inside one expert when N is a multiple of the block;
* each direction is one grouped GEMM, offsets on the device. ``gemms`` says which: a
  namespace of ``forward(x_lp, w_lp, offs, (G, N, K))``, ``dgrad(dy_lp, w_lp, offs,
  (G, N, K))`` and ``wgrad(dy_lp, x_lp, offs, weight dtype)`` over the quantized operands
  (:mod:`.grouped_exact`: bf16 GEMMs over exact values, MXFP8; :mod:`.grouped_block_fp8`:
  block-scaled FP8 GEMMs).

The autograd Functions of those modules hand their ``forward`` and ``backward`` to
:func:`blocks_forward` and :func:`blocks_backward`, with the arguments ``(x2d, sizes,
quantizers, grad_enabled, aligned, *weights)``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..formats.block import Float8BlockExperts
from . import weight_cache
from .function import _caching_weights, _keep_only, quantize_operand
from .grouped_parts import hooked, layout, padded_input, padded_like, stacked, weight_grads
from .plan import BOTH, ROW


def one_setting(qs: Sequence):
    """The first quantizer when every group's is the same stateless setting with no hooks;
    else None."""
    first = qs[0]
    key = first.share_key() if first is not None else None
    if key is None:
        return None
    if any(q is None or hooked(q) or q.share_key() != key for q in qs):
        return None
    return first


def slot_quantizers(qs: Sequence):
    """(input, weight, grad_output) quantizers of the groups' ``LinearQuantizers`` when each
    slot is one stateless setting for every group and nothing is quantized at the
    boundaries; else None."""
    if any(q.output is not None or q.grad_input is not None for q in qs):
        return None
    picked = tuple(one_setting([getattr(q, slot) for q in qs])
                   for slot in ("input", "weight", "grad_output"))
    return None if any(p is None for p in picked) else picked


def _quantized_weights(weights: Sequence[torch.Tensor], q_w, columnwise: bool):
    """The experts' weights stacked (G * N, K) and quantized with q_w (rowwise, and
    columnwise for dgrad); under ``lowprec.autocast(cache_weights=True)`` made once while
    the weights are unchanged. Returns (tensor, owned). Experts that arrive block-quantized
    (:class:`Float8BlockExperts`, an FSDP2 quantized all-gather) give their codes and
    scales as they are."""
    if isinstance(weights[0], Float8BlockExperts):
        return weights[0].blocks(columnwise), True  # a new tensor over the weight's codes

    def make(columnwise=columnwise):
        w3d = stacked(weights)
        w2d = w3d.detach().reshape(-1, w3d.shape[-1])
        return quantize_operand(q_w, w2d, rowwise=True, columnwise=columnwise, exact=ROW)[0]
    if _caching_weights() and not torch.compiler.is_compiling():
        return weight_cache.cached_value(weights, q_w, lambda: make(True)), False
    return make(), True


def blocks_forward(ctx, gemms, align: int, x2d, sizes, quantizers, grad_enabled, aligned,
                   weights):
    """The forward of a grouped block-format Function (see the module docstring); groups
    padded to multiples of ``align`` rows unless the caller laid them out so
    (``aligned``)."""
    q_x, q_w, q_dy = quantizers
    need_dx = grad_enabled and ctx.needs_input_grad[0]
    need_dw = grad_enabled and any(ctx.needs_input_grad[5:])
    num = weights[0].shape[0] if weights[0].dim() == 3 else len(weights)
    n, k = weights[0].shape[-2:]
    # aligned: the caller laid the groups out in whole blocks (group_alignment)
    x_pad, src, valid, offs, dest = padded_input(x2d, sizes, aligned, align)
    x_lp, _ = quantize_operand(q_x, x_pad, rowwise=True, columnwise=need_dw, exact=ROW)
    w_lp, w_owned = _quantized_weights(weights, q_w, need_dx)
    y = gemms.forward(x_lp, w_lp, offs, (num, n, k))
    if dest is not None:
        y = y.index_select(0, dest)
    del x_pad
    saved_x = _keep_only(x_lp, True, "columnwise") if need_dw else None
    saved_w = _keep_only(w_lp, w_owned, "columnwise") if need_dx else None
    ctx.save_for_backward(saved_x, saved_w, src, valid, offs, dest)
    ctx.q_dy, ctx.weights, ctx.shape, ctx.gemms = q_dy, layout(weights), (num, n, k), gemms
    ctx.w_dtype = weights[0].dtype
    return y


def blocks_backward(ctx, dy):
    """The backward of a grouped block-format Function: (dx, four Nones, *weight grads)."""
    x_lp, w_lp, src, valid, offs, dest = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], any(ctx.needs_input_grad[5:])
    dy = dy.contiguous()
    dy_pad = padded_like(dy, src, valid)
    dy_lp, _ = quantize_operand(ctx.q_dy, dy_pad, rowwise=need_dx, columnwise=need_dw,
                                exact=BOTH, codes=False)
    del dy_pad
    dx = dw = None
    if need_dw:
        dw = ctx.gemms.wgrad(dy_lp, x_lp, offs, ctx.w_dtype)
    if need_dx:
        dx = ctx.gemms.dgrad(dy_lp, w_lp, offs, ctx.shape)
        if dest is not None:
            dx = dx.index_select(0, dest)
    return dx, None, None, None, None, *weight_grads(dw, ctx.weights)
