"""Per-tensor FP8 current scaling over row groups (the experts of a grouped GEMM).

Each group of consecutive rows is quantized as its own tensor would be: its own amax, its
own scale. The group boundaries are a device tensor, so nothing here waits on the host.
The values are the reference's: the scale is ``scale_from_amax`` of the group's amax and
the cast is ``cast_fp8(x * scale)`` element by element, so a group equals the
:class:`Float8CurrentScalingQuantizer` quantize of its rows, bit for bit. On a GPU the cast
is one Triton pass (``launch.fp8_cast_rows``, the per-tensor kernels' cast code).
"""

from __future__ import annotations

import torch

from ...kernels import use_kernels
from ...kernels.group_amax import group_amax
from ..casting import cast_fp8, scale_from_amax
from . import launch
from .quantizer import Float8CurrentScalingQuantizer

__all__ = ["group_amax", "expert_amax", "scales_and_decodes", "quantize_rows",
           "quantize_groups", "quantize_groups_both", "quantize_experts"]


def expert_amax(w3d: torch.Tensor) -> torch.Tensor:
    """amax(|w_g|) of each (N, K) matrix of a (G, N, K) stack, as a (G,) fp32 tensor (NaN
    where the matrix holds NaN)."""
    # one reduction pass that splits each matrix over many blocks (a reduction of
    # w.abs() under inductor with dynamic shapes gave each matrix one block: 10 ms a call)
    return torch.linalg.vector_norm(w3d, float("inf"), dim=(1, 2)).to(torch.float32)


def scales_and_decodes(amax: torch.Tensor, quantizer: Float8CurrentScalingQuantizer):
    """(encode, decode) scales of each amax under the quantizer's current-scaling rule, the
    decode ``torch.reciprocal`` of the encode: one launch on a GPU, where the rule's torch
    ops make several."""
    if use_kernels(amax) and amax.is_contiguous():
        return launch.fp8_group_scales(amax, quantizer.fp8_dtype == torch.float8_e5m2,
                                       quantizer.force_pow_2_scales,
                                       float(quantizer.amax_epsilon))
    scale = scale_from_amax(amax, torch.finfo(quantizer.fp8_dtype).max,
                            eps=quantizer.amax_epsilon, pow2=quantizer.force_pow_2_scales)
    return scale, torch.reciprocal(scale)


def quantize_rows(x2d: torch.Tensor, row_scale: torch.Tensor, fp8_dtype: torch.dtype
                  ) -> torch.Tensor:
    """``cast_fp8(x * scale)`` with each row's own scale ((M,) fp32)."""
    return cast_fp8(x2d.to(torch.float32) * row_scale[:, None], fp8_dtype)


def quantize_groups(x2d: torch.Tensor, group_ids: torch.Tensor, num_groups: int,
                    quantizer: Float8CurrentScalingQuantizer, with_decode: bool = False):
    """(fp8 rows (M, K), per-group encode scales (G,)) of ``x2d`` under ``quantizer``;
    ``with_decode``: the decode scales (G,) after them."""
    scale, decode = scales_and_decodes(group_amax(x2d, group_ids, num_groups), quantizer)
    if use_kernels(x2d) and x2d.stride(1) == 1:
        # one pass instead of the ops' several (their values: the same cast code)
        codes = launch.fp8_cast_rows(x2d, scale, group_ids,
                                     quantizer.fp8_dtype == torch.float8_e5m2).view(
            quantizer.fp8_dtype)
    else:
        codes = quantize_rows(x2d, scale[group_ids], quantizer.fp8_dtype)
    return (codes, scale, decode) if with_decode else (codes, scale)


def quantize_groups_both(x2d: torch.Tensor, group_ids: torch.Tensor, num_groups: int,
                         quantizer: Float8CurrentScalingQuantizer, with_decode: bool = False):
    """(fp8 rows (M, K), their transpose (K, M), per-group encode scales (G,)): the codes
    of :func:`quantize_groups` in both layouts (on a GPU from one pass); ``with_decode``:
    the decode scales (G,) after them."""
    scale, decode = scales_and_decodes(group_amax(x2d, group_ids, num_groups), quantizer)
    if use_kernels(x2d) and x2d.stride(1) == 1:
        rows, cols = launch.fp8_cast_rows_both(x2d, scale, group_ids,
                                               quantizer.fp8_dtype == torch.float8_e5m2)
        rows, cols = rows.view(quantizer.fp8_dtype), cols.view(quantizer.fp8_dtype)
    else:
        rows = quantize_rows(x2d, scale[group_ids], quantizer.fp8_dtype)
        cols = rows.t().contiguous()
    return (rows, cols, scale, decode) if with_decode else (rows, cols, scale)


def quantize_experts(w3d: torch.Tensor, quantizer: Float8CurrentScalingQuantizer,
                     transposed: bool = False, with_decode: bool = False):
    """(fp8 (G, N, K), per-expert encode scales (G,)): each expert's matrix on its own.
    ``transposed``: (fp8 (G, N, K), the stacked codes' transpose (K, G * N), scales), the
    transpose from the same pass on a GPU (expert g's columnwise copy: columns g*N...).
    ``with_decode``: the decode scales (G,) last."""
    scale, decode = scales_and_decodes(expert_amax(w3d), quantizer)
    g, n, k = w3d.shape
    e5m2 = quantizer.fp8_dtype == torch.float8_e5m2
    cols = None
    if use_kernels(w3d) and w3d.is_contiguous():
        # each row's expert: row // N (the cast needs no ids tensor)
        if transposed:
            rows, cols = launch.fp8_cast_rows_both(w3d.view(g * n, k), scale, None, e5m2, n)
            cols = cols.view(quantizer.fp8_dtype)
        else:
            rows = launch.fp8_cast_rows(w3d.view(g * n, k), scale, None, e5m2, n)
        codes = rows.view(quantizer.fp8_dtype).view(g, n, k)
    else:
        codes = cast_fp8(w3d.to(torch.float32) * scale[:, None, None], quantizer.fp8_dtype)
        if transposed:
            cols = codes.view(g * n, k).t().contiguous()
    out = (codes, cols, scale) if transposed else (codes, scale)
    return (*out, decode) if with_decode else out
