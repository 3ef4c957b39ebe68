"""Grouped block-scaled FP8 GEMMs on Hopper: every expert's rows in one launch, the groups
given by device offsets, never read on the host. Two kernels compute the same bits: a
Gluon one (:mod:`._block_grouped_gluon`, operands by TMA) where Gluon imports and TMA can
read the operands, with configs by problem and expert size in
``tuning.block_grouped_gluon_configs``, else the Triton one
(:mod:`._block_grouped_kernels`).

The two shapes of problem of :mod:`.grouped_mm`, with block-scaled operands (fp8 codes
contiguous along the contraction, one decode scale ``1 / scale`` per 128 contraction
elements and per row, or per 128 rows for 128x128 blocks):

* :func:`rows_by_experts` (forward, dgrad): ``out[rows of g] = a[rows of g] @ b[g].T``;
* :func:`wgrad`: ``out[g] = a[:, rows of g] @ b[:, rows of g].T``.

Each 128-long chunk of the contraction is a tensor-core dot started from zero, scaled by
its two decode scales and added to an fp32 accumulator, as cuBLAS's block-scaled
``torch._scaled_mm`` does: on the H100 the results are bit-identical to one cuBLAS GEMM
per group (``tests/linear/test_grouped_block_fp8.py``). Groups start at multiples of 128
rows (:data:`ALIGN`): a tile, and a columnwise block, never straddles two groups. Off the
GPU the same sum runs in torch ops (``_reference``), for the CPU tests of the grouped path.
"""

from __future__ import annotations

import functools

import torch

from ..kernels import gluon_available, kernel_op
from ..kernels.launch import launch
from ..kernels.tuning import tuning

#: the row multiple every group starts at (a block along the rows, the kernel's row tile)
ALIGN = 128
#: (BM, BN, warps, stages, bands of row tiles): the fastest of the configs timed on an H100
#: at the MoE layer's shapes (``tools/probe_block_grouped.py``)
_CONFIG = {False: (128, 128, 8, 3, 8), True: (128, 128, 8, 3, 8)}


def _tma_2d(t: torch.Tensor):
    """``t`` as the 2-D (rows, contraction) matrix a TMA descriptor reads, with the row and
    column offsets of consecutive groups when ``t`` is (G, R, C); None where TMA cannot
    read it (a non-unit inner stride, an unaligned row stride or base)."""
    if t.stride(-1) != 1 or t.data_ptr() % 16 or t.stride(-2) % 16:
        return None
    if t.dim() == 2:
        return t, 0, 0
    num, r, c = t.shape
    row_stride = t.stride(1)
    if t.stride(0) == r * row_stride and row_stride >= c:  # experts stacked by rows
        return t.as_strided((num * r, c), (row_stride, 1)), r, 0
    if t.stride(0) == c and row_stride >= num * c:  # experts side by side along columns
        return t.as_strided((r, num * c), (row_stride, 1)), 0, c
    return None


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int):
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)


@functools.lru_cache(maxsize=None)  # checked once a config, not on every launch
def check_gluon_config(cfg) -> None:
    """Raises on a Gluon config (BN, STAGES, OVERLAP, GROUP_M, warps) the kernels do not run:
    OVERLAP 2 (the warp-specialized kernel: two consumer warpgroups and a loader warp over a
    128-row tile) needs ``warps`` 4, a partition's; OVERLAP 1 needs 8 (two warpgroups). With
    one warpgroup, OVERLAP 1 gives outputs off cuBLAS's on an H100 in every run, so it is
    refused rather than run."""
    overlap, warps = int(cfg[2]), cfg[4]
    need = {0: None, 1: 8, 2: 4}
    if overlap not in need:
        raise ValueError(f"block grouped Gluon config {cfg}: OVERLAP must be 0, 1 or 2 "
                         f"(2: the warp-specialized kernel), got {cfg[2]}")
    if need[overlap] is not None and warps != need[overlap]:
        raise ValueError(f"block grouped Gluon config {cfg}: OVERLAP {overlap} runs "
                         f"{need[overlap]} warps, got {warps}")
    if overlap == 0 and warps not in (4, 8):
        raise ValueError(f"block grouped Gluon config {cfg}: warps must be 4 or 8 "
                         f"(16 rows a warp), got {warps}")


def _launch_gluon(a, da, b, db, offs, out, group_k: bool, a_rows: int, b_rows: int) -> bool:
    """Launches the Gluon kernel (``_block_grouped_gluon.py``); False where it does not
    apply (the Triton kernel runs instead)."""
    if not (tuning.block_grouped_gluon and gluon_available()):
        return False
    g = offs.shape[0]
    rows = a.shape[1] if group_k else a.shape[0]  # every group's rows, padding included
    cfg = tuning.block_grouped_gluon_configs[
        ("wgrad" if group_k else "rows", rows >= tuning.block_grouped_large_rows * g)]
    if cfg is None or a.numel() == 0 or b.numel() == 0:
        return False  # (a TMA descriptor needs every dimension non-empty)
    a2, b2 = _tma_2d(a), _tma_2d(b)
    if a2 is None or b2 is None:
        return False
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ._block_grouped_gluon import block_grouped_gluon_kernel, block_grouped_ws_kernel
    check_gluon_config(cfg)
    bn, stages, overlap, band, warps = cfg
    ws = overlap == 2
    bm = 128 if ws else 16 * warps  # 64 rows a warpgroup
    (a2, _, _), (b2, b_group_rows, b_group_cols) = a2, b2
    a_desc = TensorDescriptor(a2, list(a2.shape), list(a2.stride()), [bm, 128],
                              _smem_layout(bm))
    b_desc = TensorDescriptor(b2, list(b2.shape), list(b2.stride()), [bn, 128],
                              _smem_layout(bn))
    m, n = a.shape[-2], b.shape[-2]
    if group_k:
        s_db, s_o = (0, *db.stride()), out.stride()
    else:
        s_db, s_o = db.stride(), (0, *out.stride())
    grid = (-(-m // bm) * -(-n // bn), g if group_k else 1)
    common = (grid, a_desc, b_desc, da, db, out, offs, m, n, g, b_group_rows, b_group_cols,
              *da.stride(), *s_db, *s_o)
    consts = dict(GROUP_K=group_k, A_ROWS=a_rows, B_ROWS=b_rows,
                  GP=max(2, 1 << (g - 1).bit_length()), GROUP_M=band, STAGES=stages)
    if ws:
        launch(block_grouped_ws_kernel, *common, **consts, num_warps=4)
    else:
        launch(block_grouped_gluon_kernel, *common, **consts, OVERLAP=bool(overlap),
               num_warps=warps)
    return True


def _launch(a, da, b, db, offs, out, group_k: bool, a_rows: int, b_rows: int) -> None:
    if _launch_gluon(a, da, b, db, offs, out, group_k, a_rows, b_rows):
        return
    from ._block_grouped_kernels import block_grouped_gemm_kernel
    bm, bn, warps, stages, band = _CONFIG[group_k]
    g = offs.shape[0]
    m, n = a.shape[-2], b.shape[-2]
    k = a.shape[-1]
    if group_k:
        s_b, s_db, s_o = (0, *b.stride()), (0, *db.stride()), out.stride()
    else:
        s_b, s_db, s_o = b.stride(), db.stride(), (0, *out.stride())
    grid = (-(-m // bm) * -(-n // bn), g if group_k else 1)
    launch(block_grouped_gemm_kernel, grid, a, b, da, db, out, offs, m, n, k, g,
           *a.stride(), *s_b, *da.stride(), *s_db, *s_o,
           GROUP_K=group_k, A_ROWS=a_rows, B_ROWS=b_rows, BM=bm, BN=bn, BK=128,
           GP=max(2, 1 << (g - 1).bit_length()), GROUP_M=band, num_warps=warps,
           num_stages=stages)


def _chunked(a, da, b, db) -> torch.Tensor:
    """The kernel's sum in torch (fp32): ``a`` (m, C) and ``b`` (n, C) fp8, ``da`` (m, C/128)
    and ``db`` (n, C/128) decode scales. Each chunk's dot is an fp32 matmul here, not the
    tensor cores' order: the same values to fp32 rounding."""
    acc = torch.zeros((a.shape[0], b.shape[0]), dtype=torch.float32, device=a.device)
    for c in range(a.shape[1] // 128):
        part = a[:, c * 128:(c + 1) * 128].float() @ b[:, c * 128:(c + 1) * 128].float().t()
        acc += part * (da[:, c, None].float() * db[None, :, c].float())
    return acc


def _reference(a, da, b, db, offs, out, group_k: bool, a_rows: int, b_rows: int) -> None:
    """What the kernel writes into ``out``, in torch ops, a group at a time (the groups'
    ends read on the host): the path off the GPU."""
    start = 0
    for g, end in enumerate(offs.tolist()):
        if group_k:
            out[g] = _chunked(a[:, start:end], da[:, start // 128:end // 128],
                              b[:, start:end], db[:, start // 128:end // 128])
        elif end > start:
            rows = torch.arange(start, end, device=a.device) // a_rows
            cols = torch.arange(b.shape[1], device=a.device) // b_rows
            out[start:end] = _chunked(a[start:end], da[rows], b[g], db[g][cols])
        start = end


def _run(a, da, b, db, offs, out, group_k: bool, a_rows: int, b_rows: int) -> None:
    if a.is_cuda:
        _launch(a, da, b, db, offs, out, group_k, a_rows, b_rows)
    else:
        _reference(a, da, b, db, offs, out, group_k, a_rows, b_rows)


@kernel_op("lowprec::block_grouped_rows", mutates_args=())
def rows_by_experts(a: torch.Tensor, a_decode: torch.Tensor, b: torch.Tensor,
                    b_decode: torch.Tensor, offs: torch.Tensor, a_rows: int, b_rows: int,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """(M, N): each group's rows of ``a`` (M, K) times its ``b[g].T`` (``b`` (G, N, K), any
    strides). ``a_decode[r // a_rows, c]`` and ``b_decode[g, j // b_rows, c]`` are the decode
    scales of row r / row j and chunk c. ``offs``: each group's end row (int32), multiples
    of :data:`ALIGN`; rows past the last group are left unwritten."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    _run(a, a_decode, b, b_decode, offs, out, False, a_rows, b_rows)
    return out


@rows_by_experts.register_fake
def _(a, a_decode, b, b_decode, offs, a_rows, b_rows, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@kernel_op("lowprec::block_grouped_wgrad", mutates_args=())
def wgrad(a: torch.Tensor, a_decode: torch.Tensor, b: torch.Tensor, b_decode: torch.Tensor,
          offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(G, N, K): per group, ``a[:, rows] @ b[:, rows].T`` from ``a`` (N, M) and ``b``
    (K, M), 128x1 blocks along M (``a_decode`` (N, M/128), ``b_decode`` (K, M/128), any
    strides). ``offs``: each group's end (int32), multiples of :data:`ALIGN`; an empty
    group gives zeros."""
    out = torch.empty((offs.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype,
                      device=a.device)
    _run(a, a_decode, b, b_decode, offs, out, True, 1, 1)
    return out


@wgrad.register_fake
def _(a, a_decode, b, b_decode, offs, out_dtype):
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype)
