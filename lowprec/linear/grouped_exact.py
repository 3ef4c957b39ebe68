"""Grouped linear for block formats emulated on the bf16 tensor cores (MXFP8 on Hopper).

A per-expert MXFP8 Linear on Hopper quantizes its input (padded with zero rows to whole
32-row blocks, for wgrad's columnwise blocks), its weight and dY, and multiplies the exact
bf16 values of the quantized operands on the bf16 tensor cores
(:mod:`lowprec.gemm.exact_bf16`). Here every expert does the same at once:

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

from ..gemm import bf16_operand, grouped_mm
from .function import LinearQuantizers
from .grouped_blocks import Blocks, slot_quantizers


def exact_quantizers(qs: Sequence[LinearQuantizers], n: int, k: int):
    """(input, weight, grad_output) quantizers when each slot is one setting of a block
    format emulated on bf16 GEMMs, nothing is quantized at the boundaries and the features
    (``n`` out, ``k`` in) fill the blocks; else None."""
    picked = slot_quantizers(qs)
    if picked is None or not all(p.blocks_are_independent and p.keeps_exact_bf16
                                 for p in picked):
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


def _values(rep, form, usage: str) -> torch.Tensor:
    values, divisor = bf16_operand(rep, form.half(usage))
    if divisor is not None:  # exact_quantizers admits formats without one
        raise RuntimeError(f"{type(form).__name__} values need a divisor; the grouped exact "
                           f"path takes formats whose values are exact as they are")
    return values


class ExactGemms:
    """The three grouped GEMMs over the operands' exact bf16 values (fp32 accumulation,
    bf16 out, as the per-expert emulation writes them)."""

    @staticmethod
    def forward(x, w, offs, shape, forms):
        return grouped_mm.plain_rows_by_experts(_values(x, forms[0], "rowwise"),
                                                _values(w, forms[1], "rowwise").view(shape), offs)

    @staticmethod
    def dgrad(dy, w, offs, shape, forms):
        num, n, k = shape
        # the weights' columnwise values are (K, G * N): expert g's are columns g*N...
        w_t = _values(w, forms[1], "columnwise").view(k, num, n).permute(1, 0, 2)
        return grouped_mm.plain_rows_by_experts(_values(dy, forms[2], "rowwise"), w_t, offs)

    @staticmethod
    def wgrad(dy, x, offs, w_dtype, forms):
        # (N, padded) and (K, padded): per group, the rows of its padded range
        return grouped_mm.plain_wgrad(_values(dy, forms[2], "columnwise").t(),
                                      _values(x, forms[0], "columnwise").t(), offs)


#: the scheme of block formats emulated on bf16 GEMMs (``grouped_engine``)
EXACT = Blocks("exact", ExactGemms, row_align)
