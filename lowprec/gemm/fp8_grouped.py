"""Grouped FP8 GEMMs with per-tensor scales on Hopper, bit for bit one cuBLAS GEMM per
group: every expert's rows in one Triton launch, the groups given by device offsets, never
read on the host (kernel: :mod:`._fp8_grouped_kernels`). The same kernel takes bf16
operands with one fp32 factor per group, applied to the fp32 sum before the one rounding:
the grouped form of cuBLASLt's ``alpha`` epilogue over exact bf16 values (NVFP4 emulated
on Hopper, :mod:`lowprec.linear.grouped_nvfp4`).

The two shapes of problem of :mod:`.grouped_mm`, with fp8 codes (or bf16 values)
contiguous along the contraction and one decode scale (``1 / scale``) per group and
operand:

* :func:`rows_by_experts` (forward, dgrad): ``out[rows of g] = a[rows of g] @ b[g].T``;
  groups of any size, no padding;
* :func:`wgrad`: ``out[g] = a[:, rows of g] @ b[:, rows of g].T``; groups start at
  multiples of :data:`ALIGN`.

The contraction is summed in 128-long tensor-core chunks, each added to an fp32
accumulator, and the product of the two decode scales is applied at the end: cuBLAS's
``torch._scaled_mm`` without fast accumulation gives the same bits on the H100
(``tests/gemm/test_fp8_grouped.py``), where
``torch._scaled_grouped_mm`` differs in the last bits and runs at 250-290 TFLOP/s at
fine-grained experts' shapes (about 1,000 rows an expert), against 450-720 here. Off the
GPU the same sum runs in torch ops (``_reference``), for the CPU tests.
"""

from __future__ import annotations

import torch

from ..kernels import kernel_op
from ..kernels.launch import launch
from .device import grouped_device
from .table import fp8_grouped_takes

#: the multiple every wgrad group starts at (16-byte loads along the contraction)
ALIGN = 16
#: (BM, BN, BK, warps, stages, bands of row tiles) by operand width: the fastest of the
#: configs timed on an H100 at the MoE layer's shapes (fp8 and bf16 operands); bf16 at
#: 94-98% of ``torch._grouped_mm`` there
_CONFIG = {1: (128, 128, 128, 8, 4, 8), 2: (128, 256, 64, 8, 3, 8)}
#: mean rows an expert below which FP8 operands take the persistent form of the kernel (one
#: program an SM looping over the tiles, same sums): at Qwen3's 1,000 rows an expert it ran
#: 4-13% faster in each of the six GEMMs of a layer, at Mixtral's 4,000 from 14% slower to
#: 3% faster (H100)
PERSISTENT_ROWS = 2048


def available(a: torch.Tensor, *dtypes: torch.dtype) -> bool:
    """Whether the kernel runs on ``a``'s device for operands of ``dtypes``: a Hopper GPU
    with Triton, and E4M3 or E5M2 operands (not both E5M2, which cuBLAS does not take) or
    bf16 ones (the GEMM table's ``fp8_grouped_takes``)."""
    return fp8_grouped_takes(grouped_device(a), dtypes)


def _launch(a, da, b, db, offs, out, group_k: bool) -> None:
    from ._fp8_grouped_kernels import fp8_grouped_gemm_kernel, fp8_grouped_gemm_persistent_kernel
    fp8 = a.element_size() == 1
    bm, bn, bk, warps, stages, band = _CONFIG[a.element_size()]
    g = offs.shape[0]
    m, n, k = a.shape[0], out.shape[-1], a.shape[1]
    if group_k:
        s_b, s_o, m_tiles = (0, *b.stride()), out.stride(), -(-m // bm)
    else:
        # each group's tiles start at its first row: at most one more tile a group
        s_b, s_o, m_tiles = b.stride(), (0, *out.stride()), -(-m // bm) + g
    args = (a, b, da, db, out, offs, m, n, k, g, *a.stride(), *s_b, *s_o)
    meta = dict(GROUP_K=group_k, BM=bm, BN=bn, BK=bk, GP=max(2, 1 << (g - 1).bit_length()),
                GROUP_M=band, MASK_K=group_k or k % bk != 0, FP8=fp8, num_warps=warps,
                num_stages=stages)
    if fp8 and (k if group_k else m) < PERSISTENT_ROWS * g:
        programs = torch.cuda.get_device_properties(a.device).multi_processor_count
        launch(fp8_grouped_gemm_persistent_kernel, (programs,), *args, PROGRAMS=programs,
               **meta)
    else:
        launch(fp8_grouped_gemm_kernel, (m_tiles * -(-n // bn), g if group_k else 1), *args,
               **meta)


def _chunked(a, b, scale) -> torch.Tensor:
    """The kernel's sum in torch (fp32): ``a`` (m, C) and ``b`` (n, C) fp8, 128-long chunks
    summed apart (each an fp32 matmul here, not the tensor cores' order: the same values to
    fp32 rounding), times ``scale``."""
    acc = torch.zeros((a.shape[0], b.shape[0]), dtype=torch.float32, device=a.device)
    for c in range(0, a.shape[1], 128):
        acc += a[:, c:c + 128].float() @ b[:, c:c + 128].float().t()
    return acc * scale


def _reference(a, da, b, db, offs, out, group_k: bool) -> None:
    """What the kernel writes into ``out``, in torch ops, a group at a time (the groups'
    ends read on the host): the path off the GPU."""
    start = 0
    for g, end in enumerate(offs.tolist()):
        scale = da[g].float() * db[g].float()
        if group_k:
            out[g] = _chunked(a[:, start:end], b[:, start:end], scale)
        elif end > start:
            out[start:end] = _chunked(a[start:end], b[g], scale)
        start = end


def _run(a, da, b, db, offs, out, group_k: bool) -> None:
    if a.is_cuda:
        _launch(a, da, b, db, offs, out, group_k)
    else:
        _reference(a, da, b, db, offs, out, group_k)


@kernel_op("lowprec::fp8_grouped_rows", mutates_args=())
def rows_by_experts(a: torch.Tensor, a_decode: torch.Tensor, b: torch.Tensor,
                    b_decode: torch.Tensor, offs: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """(M, N): each group's rows of ``a`` (M, K) times its ``b[g].T`` (``b`` (G, N, K), any
    strides; fp8 ones contiguous along K), scaled by ``a_decode[g] * b_decode[g]`` ((G,) fp32 each).
    ``offs``: each group's end row (int32); rows past the last group are left unwritten."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    _run(a, a_decode, b, b_decode, offs, out, False)
    return out


@rows_by_experts.register_fake
def _(a, a_decode, b, b_decode, offs, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@kernel_op("lowprec::fp8_grouped_wgrad", mutates_args=())
def wgrad(a: torch.Tensor, a_decode: torch.Tensor, b: torch.Tensor, b_decode: torch.Tensor,
          offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(G, N, K): per group, ``a[:, cols] @ b[:, cols].T`` from ``a`` (N, M) and ``b``
    (K, M), contiguous along M, scaled by ``a_decode[g] * b_decode[g]``. ``offs``: each
    group's end (int32), multiples of :data:`ALIGN`; an empty group gives zeros."""
    out = torch.empty((offs.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype,
                      device=a.device)
    _run(a, a_decode, b, b_decode, offs, out, True)
    return out


@wgrad.register_fake
def _(a, a_decode, b, b_decode, offs, out_dtype):
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype)
