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
* each direction is one grouped GEMM, offsets on the device.

Each operand is quantized through its quantizer's graph operand
(``Quantizer.graph_operand``, ``formats.graph``), the form a compiled linear traces: in
an eager call it launches eager's quantize kernels, in a compiled one it is traced into
the graph. So the same scheme runs both, with the same bits. Its ``gemms`` say which
GEMMs run: a namespace of ``forward(x, w, offs, (G, N, K), forms)``, ``dgrad(dy, w, offs,
(G, N, K), forms)`` and ``wgrad(dy, x, offs, weight dtype, forms)`` over the operands'
graph forms (``Exact``, ``Blocks``), ``forms`` the (input, weight, grad_output) graph
operands (:mod:`.grouped_exact`: bf16 GEMMs over exact values, MXFP8;
:mod:`.grouped_block_fp8`: block-scaled FP8 GEMMs).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..formats.block import Float8BlockExperts
from . import weight_cache
from .function import _caching_weights
from .grouped_parts import hooked, padded_input, padded_like, stacked


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


def forms(quantizers, x: torch.Tensor) -> tuple | str:
    """The (input, weight, grad_output) graph operands of ``quantizers`` over rows like
    ``x``, or the reason one has none."""
    picked = tuple(q.graph_operand(x, grad=slot == 2) for slot, q in enumerate(quantizers))
    return next((f for f in picked if isinstance(f, str)), picked)


def _weight_operand(weights: Sequence[torch.Tensor], q_w, keep: bool):
    """(weight form, rowwise form of the experts stacked (G * N, K), their columnwise form
    where it is made now or None, else what the form keeps to make it). Under
    ``lowprec.autocast(cache_weights=True)`` both forms are made once while the weights
    are unchanged. Experts that arrive block-quantized (:class:`Float8BlockExperts`, an
    FSDP2 quantized all-gather) give their own codes and scales."""
    if isinstance(weights[0], Float8BlockExperts):
        w2d = weights[0].blocks()
    else:
        w3d = stacked(weights)
        w2d = w3d.detach().reshape(-1, w3d.shape[-1])
    form = q_w.graph_operand(w2d)
    if isinstance(form, str):
        raise ValueError(f"grouped_linear: the weight quantizer {q_w!r} has no form for "
                         f"these experts: {form}")
    if not form.given:  # (given experts run eagerly and are not cached: their own data)
        if _caching_weights() and not torch.compiler.is_compiling():
            # both directions, in one pass where the form makes them so
            row, col = weight_cache.cached_value(weights, q_w,
                                                 lambda: form.grad(w2d, True, True))
            return form, row, col, ()
        if keep and torch.compiler.is_compiling() and form.kind("columnwise").name == "blocks":
            # fp8 blocks, a byte an element: kept from the forward's one pass as an eager
            # call keeps them, rather than the experts' weights quantized again in the
            # backward
            row, col = form.grad(w2d, True, True)
            return form, row, col, ()
    # not ``held`` even for a 3-D parameter: an eager call keeps the quantized columnwise
    # data from the forward's one pass (the experts' weights outweigh their routed rows,
    # so quantizing them again in the backward costs more than the memory it saves)
    row, kept = form.forward(w2d, keep)
    return form, row, None, kept


def _packed(form) -> tuple:
    """(tensors, layout) of a graph form (a NamedTuple of tensors, None and constants):
    the tensors for ``save_for_backward``, the rest for :func:`_unpacked`."""
    slots = tuple(v is None or isinstance(v, torch.Tensor) for v in form)
    tensors = tuple(v for v, s in zip(form, slots) if s)
    return tensors, (type(form), slots, tuple(None if s else v for v, s in zip(form, slots)))


def _unpacked(layout, tensors):
    """The graph form :func:`_packed` took apart."""
    cls, slots, constants = layout
    it = iter(tensors)
    return cls(*(next(it) if s else c for s, c in zip(slots, constants)))


class Blocks:
    """The scheme of block formats (``grouped_engine.GroupedFunction``): the padded layout,
    the operands quantized through their graph operands, and ``gemms``'s grouped GEMMs;
    ``row_align(quantizers)``: the row multiple each group is padded to."""

    def __init__(self, name: str, gemms, row_align) -> None:
        self.name, self.gemms, self.align = name, gemms, row_align

    def forward(self, plan, x2d, sizes, aligned, weights, need_dx, need_dw):
        num = weights[0].shape[0] if weights[0].dim() == 3 else len(weights)
        n, k = weights[0].shape[-2:]
        # aligned: the caller laid the groups out in whole blocks (group_alignment)
        x_pad, src, valid, offs, dest = padded_input(x2d, sizes, aligned,
                                                     self.align(plan.quantizers))
        q_x, q_w, q_dy = plan.quantizers
        op_x, op_dy = q_x.graph_operand(x_pad), q_dy.graph_operand(x_pad, grad=True)
        x_row, x_keep = op_x.forward(x_pad, need_dw)
        op_w, w_row, w_col, w_keep = _weight_operand(weights, q_w, need_dx)
        ops = (op_x, op_w, op_dy)
        y = self.gemms.forward(x_row, w_row, offs, (num, n, k), ops)
        if dest is not None:
            y = y.index_select(0, dest)
        del x_pad
        x_keep, w_keep = (x_keep if need_dw else ()), (w_keep if need_dx else ())
        w_layout = None
        if need_dx and w_col is not None:  # a columnwise form made now: its tensors kept
            w_keep, w_layout = _packed(w_col)
        state = (ops, (num, n, k), weights[0].dtype, len(x_keep), w_layout)
        return y, (src, valid, offs, dest, *x_keep, *w_keep), state

    def backward(self, plan, state, saved, dy, need_dx, need_dw):
        ops, shape, w_dtype, n_x, w_layout = state
        src, valid, offs, dest, *kept = saved
        x_keep, w_keep = kept[:n_x], kept[n_x:]
        op_x, op_w, op_dy = ops
        dy_pad = padded_like(dy, src, valid)
        dy_row, dy_col = op_dy.grad(dy_pad, need_dx, need_dw)
        del dy_pad
        dx = dw = None
        if need_dw:
            x_col = op_x.saved_columnwise(tuple(x_keep))
            dw = self.gemms.wgrad(dy_col, x_col, offs, w_dtype, ops)
        if need_dx:
            w_col = (_unpacked(w_layout, w_keep) if w_layout is not None
                     else op_w.saved_columnwise(tuple(w_keep), dy))
            dx = self.gemms.dgrad(dy_row, w_col, offs, shape, ops)
            if dest is not None:
                dx = dx.index_select(0, dest)
        return dx, dw
