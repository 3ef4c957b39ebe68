"""What one eager quantized-linear call does, decided once and reused.

A call's decisions (rows of padding, the sliced paths, which usages each operand is
quantized with, whether the weight's columnwise copy is made after fprop, how the
backward slices dY) depend only on the quantizers, the backward mode, this thread's
slicing mode (``grad_split``) and the call's shapes, dtypes and operand kinds. They are
computed once per such key into a frozen :class:`LinearPlan`, kept with the quantizers
(which a module keeps while its recipe state lives), and the autograd Function in
``lowprec.linear.function`` reads the plan instead of deciding again on every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..formats import QuantizedTensor, Quantizer
from ..recipe import BackwardMode, operand_usages
from . import exact_split, grad_split

#: The usages a GEMM consumes right after the quantize (see ``function.quantize_operand``):
#: the rowwise x and W of fprop; both directions of dY (dgrad and wgrad run at once).
ROW = ("rowwise",)
BOTH = ("rowwise", "columnwise")


#: Plans kept per set of quantizers before the cache starts over.
MAX_PLANS = 256


@dataclass(frozen=True)
class LinearPlan:
    """The decisions of one kind of call (see the module docstring)."""

    #: zero rows appended to the 2-D input so the wgrad operands fill whole blocks along M
    pad: int
    #: MXFP8/NVFP4 inside ``grad_split.sliced()``: the sliced path of ``exact_split``
    exact_split: bool
    #: the input and weight are quantized with their columnwise usage too
    x_columnwise: bool
    w_columnwise: bool
    #: the usages fprop reads right away (exact bf16 values written with the codes)
    exact: tuple[str, ...]
    #: the weight's columnwise copy is made after fprop, from the same statistics
    w_two_steps: bool
    #: (rows, columns) of dY's slices in backward (``grad_split``), or None
    split: tuple[int, int] | None
    #: the quantizes of the input (padded), the weight and dY, prepared once
    #: (``Quantizer.prepare``); None where the operand is not quantized that way
    quantize_x: Callable | None = None
    quantize_w: Callable | None = None
    quantize_dy: Callable | None = None
    #: the weight's columnwise copy from its rowwise one (``w_two_steps``), prepared once
    #: (``Quantizer.prepare_usage_like``)
    quantize_w_like: Callable | None = None
    #: with ``w_two_steps``, that copy is made in backward from the saved weight, a
    #: parameter (saving it holds no memory): the forward, whose host time bounds an eager
    #: step, does one quantize less, and no copy lives from forward to backward
    w_in_backward: bool = False


def keep(plans: dict, key, value):
    """``plans[key] = value`` in a set of quantizers' plan cache, which starts over once it
    holds :data:`MAX_PLANS` entries (many token counts: variable sequence lengths);
    returns ``value``."""
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = value
    return value


def feature_multiples(q) -> tuple[int, int]:
    """(multiple of K, multiple of N) that the blocks of ``q`` (a ``LinearQuantizers``)
    need: K for x's and W's blocks along it (rowwise, or 2-D), N for W's columnwise
    (dgrad) blocks and dY's rowwise ones."""
    def along_k(quantizer) -> int:
        return 1 if quantizer is None else quantizer.col_multiple(rowwise=True, columnwise=True)
    w_along_n = 1 if q.weight is None else q.weight.row_multiple(rowwise=True, columnwise=True)
    return (math.lcm(along_k(q.input), along_k(q.weight)),
            math.lcm(along_k(q.grad_output), w_along_n))


def row_padding(q, x: torch.Tensor, backward_mode: str, need_dw: bool) -> int:
    """Zero rows to append to the 2-D input (and to dY in backward) so that the operands
    whose blocks run along M (the token count) fill whole blocks: the wgrad operands,
    quantized columnwise, and an input in 2-D blocks (fprop's rows too).

    Zero rows change no block's amax or scale, give zero products in every GEMM and are cut
    from the output and dX: the result is the one of an input padded by hand. Without
    wgrad only 2-D input blocks run along M.
    """
    if q is None or isinstance(x, QuantizedTensor) or x.shape[-1] == 0:
        return 0
    multiple = 1 if q.input is None else q.input.row_multiple(rowwise=True, columnwise=False)
    if backward_mode == BackwardMode.DEFAULT and need_dw:
        for quantizer in (q.input, q.grad_output):
            if quantizer is not None:
                multiple = math.lcm(multiple,
                                    quantizer.row_multiple(rowwise=True, columnwise=True))
    m = x.numel() // x.shape[-1]
    return -m % multiple


def _weight_in_two_steps(quantizer: Quantizer | None, weight: torch.Tensor,
                         columnwise: bool) -> bool:
    """Whether the forward quantizes the weight rowwise for fprop and makes its columnwise
    copy only afterwards, with the same statistics (``Quantizer.quantize_usage_like``)."""
    return (columnwise and quantizer is not None and not isinstance(weight, QuantizedTensor)
            and weight.numel() > 0 and grad_split.weight_in_two_steps()
            and quantizer.can_quantize_usage_like())


def _split(q, x: torch.Tensor, weight: torch.Tensor, pad: int) -> tuple[int, int] | None:
    """``grad_split.split_sizes`` for a backward whose saved input and weight are quantized
    (a dY quantized upstream is never sliced: the backward checks that itself)."""
    if not grad_split.slicing_enabled(q.grad_output) or x.dim() < 2:
        return None
    k = x.shape[-1]
    m = (x.numel() // k if k else 0) + pad
    return grad_split.split_sizes(m, weight.shape[0], weight.shape[-1], x.dtype.itemsize,
                                  weight.dtype.itemsize)


def _decide(q, x, weight, backward_mode: str, need_dx: bool, need_dw: bool,
            cached_weight: bool) -> LinearPlan:
    pad = row_padding(q, x, backward_mode, need_dw)
    exact = ROW if backward_mode != BackwardMode.DEQUANTIZED else ()
    if not cached_weight and exact_split.applies(q, x, weight, backward_mode, need_dx, need_dw):
        return LinearPlan(pad, True, True, True, exact, False, None)
    usages = operand_usages(backward_mode, need_dx, need_dw)
    quantized = q is not None
    x_col, w_col = quantized and usages.input[1], quantized and usages.weight[1]
    w_two_steps = (not cached_weight and not isinstance(weight, QuantizedTensor)
                   and _weight_in_two_steps(q.weight if q else None, weight, w_col))
    split = None
    if quantized and backward_mode == BackwardMode.DEFAULT and need_dx and need_dw:
        split = _split(q, x, weight, pad)
    prepared = {}
    if quantized:
        lead = (x.numel() // x.shape[-1] + pad,) if pad else tuple(x.shape[:-1])
        if q.input is not None and not isinstance(x, QuantizedTensor):
            prepared["quantize_x"] = q.input.prepare(
                torch.Size(lead + (x.shape[-1],)), x.dtype, x.device, rowwise=True,
                columnwise=x_col, exact=exact)
        if (q.weight is not None and not cached_weight
                and not isinstance(weight, QuantizedTensor)):
            prepared["quantize_w"] = q.weight.prepare(
                weight.shape, weight.dtype, weight.device, rowwise=True,
                columnwise=w_col and not w_two_steps, exact=exact)
            if w_two_steps:
                prepared["quantize_w_like"] = q.weight.prepare_usage_like(
                    weight.shape, weight.dtype, weight.device, "columnwise")
                prepared["w_in_backward"] = type(weight) is torch.nn.Parameter
        if (q.grad_output is not None and backward_mode == BackwardMode.DEFAULT
                and (need_dx or need_dw)):
            prepared["quantize_dy"] = q.grad_output.prepare(
                torch.Size(lead + (weight.shape[0],)), x.dtype, x.device, rowwise=need_dx,
                columnwise=need_dw, exact=BOTH, codes=False)
    return LinearPlan(pad, False, x_col, w_col, exact, w_two_steps, split, **prepared)


def plan_for(q, x: torch.Tensor, weight: torch.Tensor, backward_mode: str, need_dx: bool,
             need_dw: bool, cached_weight: bool) -> LinearPlan:
    """The plan of a call with quantizers ``q`` (a ``LinearQuantizers`` or None), reused
    from ``q``'s cache for calls with the same key."""
    key = (backward_mode, need_dx, need_dw, cached_weight, grad_split.mode(), tuple(x.shape),
           x.dtype, type(x), tuple(weight.shape), weight.dtype, type(weight))
    plans = q.plans if q is not None else None
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        plan = _decide(q, x, weight, backward_mode, need_dx, need_dw, cached_weight)
        if plans is not None:
            keep(plans, key, plan)
    return plan
