"""Grouped linear for block-scaled FP8 (the DeepSeek-V3 recipe: 1x128 activations and
gradients, 128x128 or 1x128 weights) on Hopper: the grouped block layout of
:mod:`.grouped_blocks`, each direction one launch of lowprec's grouped block-scaled FP8
GEMM (:mod:`lowprec.gemm.block_grouped`).

That kernel accumulates as cuBLAS's block-scaled ``torch._scaled_mm`` does, so the result
is bit for bit the per-expert Linears'. Where a per-expert GEMM does not run on cuBLAS,
because cuBLAS takes 128x128 weight scales only with 4 blocks a row of scales (16 bytes:
a contraction of a multiple of 512), it runs on the exact bf16 emulation of the
power-of-two scaled values, and the grouped direction does the same as one
``torch._grouped_mm`` (:mod:`.grouped_exact`). The path takes E4M3 operands, bf16
activations, 1x128 input and gradient blocks, power-of-two scales and features that
fill the blocks.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..formats.block import Float8BlockQuantizer
from ..gemm import block_decode, block_grouped, block_scales_fit, grouped_device, grouped_route
from .function import LinearQuantizers
from .grouped_blocks import Blocks, slot_quantizers
from .grouped_exact import ExactGemms


def block_fp8_quantizers(qs: Sequence[LinearQuantizers], n: int, k: int):
    """(input, weight, grad_output) quantizers when the grouped block FP8 path takes the
    groups' settings with experts of ``n`` out and ``k`` in features (see the module
    docstring; :func:`runs_on` says whether the device does); else None."""
    picked = slot_quantizers(qs)
    if picked is None or not all(type(p) is Float8BlockQuantizer for p in picked):
        return None
    q_x, q_w, q_dy = picked
    if q_x.block_scaling_dim != 1 or q_dy.block_scaling_dim != 1:
        return None
    if n % 128 or k % 128 or not all(p.force_pow_2_scales for p in picked):
        return None
    return picked


def runs_on(x: torch.Tensor, quantizers) -> bool:
    """Whether the grouped kernel runs ``x``'s rows with ``quantizers``
    (:func:`block_fp8_quantizers`): bf16 on a Hopper GPU, E4M3 operands."""
    return grouped_route("block", x.dtype, tuple(q.fp8_dtype for q in quantizers), x.shape[0],
                         0, 0, 1, grouped_device(x)) == "block_grouped"


def _rows(rep) -> int:
    """The rows of a weight's block: 128 for 128x128 blocks, 1 for 1x128 ones."""
    return 128 if rep.dim == 2 else 1


def _decode(rep) -> torch.Tensor:
    """``1 / scale`` of 1x128 blocks as the (rows, K/128) view of their cuBLAS layout, of
    128x128 blocks as it is."""
    decode = block_decode(rep)
    return decode if rep.dim == 2 else decode.t()


class _BlockGemms:
    """The three grouped GEMMs over block-scaled FP8 codes and decode scales (the graph
    forms ``Blocks``). Where a per-expert GEMM of the weight does not run on cuBLAS
    (:func:`block_scales_fit` over its contraction), the exact bf16 GEMMs."""

    @staticmethod
    def forward(x, w, offs, shape, forms):
        num, n, k = shape
        if not block_scales_fit(1, w.dim, k):
            return ExactGemms.forward(x, w, offs, shape, forms)
        w_dec = _decode(w)
        w_dec = (w_dec.view(num, n // 128, k // 128) if w.dim == 2
                 else w_dec.reshape(num, n, k // 128))
        return block_grouped.rows_by_experts(x.data, _decode(x), w.data.view(num, n, k), w_dec,
                                             offs, 1, _rows(w), torch.bfloat16)

    @staticmethod
    def dgrad(dy, w, offs, shape, forms):
        num, n, k = shape
        if not block_scales_fit(1, w.dim, n):
            return ExactGemms.dgrad(dy, w, offs, shape, forms)
        # the weights' columnwise codes are (K, G * N): expert g's (K, N) are columns g*N...
        w_t = w.data.view(k, num, n).permute(1, 0, 2)
        w_dec = _decode(w)
        w_dec = (w_dec.view(k // 128, num, n // 128) if w.dim == 2
                 else w_dec.reshape(k, num, n // 128)).permute(1, 0, 2)
        return block_grouped.rows_by_experts(dy.data, _decode(dy), w_t, w_dec, offs, 1,
                                             _rows(w), torch.bfloat16)

    @staticmethod
    def wgrad(dy, x, offs, w_dtype, forms):
        return block_grouped.wgrad(dy.data, _decode(dy), x.data, _decode(x), offs, w_dtype)


#: the scheme of block-scaled FP8 (``grouped_engine``)
BLOCK_FP8 = Blocks("block", _BlockGemms, lambda quantizers: block_grouped.ALIGN)
