"""NVFP4 of the routed rows of every expert at once: one global scale per group.

A mixture-of-experts layer's per-expert NVFP4 Linear quantizes each expert's rows on their
own, with that expert's global encode scale ``S``. Here the rows of all experts lie in one
(M, K) tensor, each group starting at a multiple of 16 rows (zero rows pad a group to whole
16-row blocks, as each per-expert Linear pads its own input), and ``block_group`` names the
group of every 16-row block. Then:

* :func:`group_scales`: each group's ``S`` of its rows (rowwise) and of their transpose
  (columnwise; of the RHT'd transpose when ``with_rht``), in one pass over x, read on the
  device only;
* :func:`grouped_exact`: the exact bf16 ``q * d`` of either direction, each 16-row block
  quantized with its group's ``S``: the values of each group's own quantize, bit for bit
  (the blocks never straddle two groups, and zero rows change no amax).

Stochastic rounding draws one key per direction for the whole tensor (:mod:`.draws`, the
element at (r, c) of a direction's matrix drawing index ``r * cols + c``), so its draws
are not those of one quantize per expert, which would draw a key per expert.

Both are torch custom ops with fakes; off the GPU they run :mod:`.reference` a group at a
time (the groups read on the host).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...kernels import kernel_op, use_kernels
from ...kernels.launch import launch
from ..rht import rht_forward
from .draws import uniforms
from .reference import BLOCK, dequantize_matrix, global_encode_scale, quantize_matrix


def _check(x: Tensor, block_group: Tensor | None = None) -> None:
    if x.dim() != 2 or x.shape[0] % BLOCK or x.shape[1] % BLOCK:
        raise ValueError(f"grouped NVFP4 takes an (M, K) tensor with M and K multiples of "
                         f"{BLOCK}, got shape {tuple(x.shape)}")
    if block_group is not None and tuple(block_group.shape) != (x.shape[0] // BLOCK,):
        raise ValueError(f"block_group must hold one group a 16-row block "
                         f"({x.shape[0] // BLOCK},), got shape {tuple(block_group.shape)}")


@kernel_op("lowprec::nvfp4_group_scales", mutates_args=())
def group_scales(x: Tensor, block_group: Tensor, num_groups: int, with_rht: bool) -> Tensor:
    """(G, 2) fp32: each group's global encode scale of its rows of x ([:, 0], rowwise)
    and of their transpose ([:, 1], columnwise: RHT'd along M when ``with_rht``). A group
    with no blocks, or only zeros, gets 1. ``block_group``: the group of each 16-row block
    (int32, (M/16,))."""
    _check(x, block_group)
    if use_kernels(x):
        amax = _group_amax_kernel(x.contiguous(), block_group, num_groups, with_rht)
    else:
        amax = _group_amax_torch(x, block_group, num_groups, with_rht)
    return global_encode_scale(amax.reshape(-1)).reshape(num_groups, 2)


@group_scales.register_fake
def _(x, block_group, num_groups, with_rht):
    return x.new_empty((num_groups, 2), dtype=torch.float32)


def _group_amax_kernel(x, block_group, num_groups, with_rht):
    from . import triton_kernels
    from .launch import _idx64
    m, k = x.shape
    ws = torch.zeros((num_groups, 2), dtype=torch.int32, device=x.device)
    if m and k:
        kw = 4
        launch(triton_kernels._nvfp4_group_amax_kernel, (m // 64 + (m % 64 > 0),), x, m, k,
               block_group.to(torch.int32), ws, RHT=bool(with_rht), KW=kw,
               EVEN=m % 64 == 0 and k % (16 * kw) == 0, IDX64=_idx64(m, k), num_warps=kw,
               enable_fp_fusion=False)
    amax = ws.view(torch.float32)
    return amax if with_rht else amax[:, :1].expand(-1, 2)


def _finite_abs(x: Tensor) -> Tensor:
    a = x.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a))


def _group_amax_torch(x, block_group, num_groups, with_rht):
    xf = x.to(torch.float32)
    out = torch.zeros((num_groups, 2), dtype=torch.float32, device=x.device)
    idx = block_group.to(torch.int64)
    cols = [_finite_abs(xf)]
    if with_rht:
        cols.append(_finite_abs(rht_forward(xf.t().contiguous())).t())
    for j, a in enumerate(cols):
        per_block = a.amax(dim=1).reshape(-1, BLOCK).amax(dim=1) if a.numel() else \
            a.new_zeros(a.shape[0] // BLOCK)
        out[:, j].scatter_reduce_(0, idx, per_block, "amax")
    if not with_rht:
        out[:, 1] = out[:, 0]
    return out


@kernel_op("lowprec::nvfp4_grouped_exact", mutates_args=())
def grouped_exact(x: Tensor, row_scales: Optional[Tensor], col_scales: Optional[Tensor],
                  key_row: Optional[Tensor], key_col: Optional[Tensor], with_rht: bool,
                  two_d: bool) -> tuple[Tensor, Tensor]:
    """(rowwise (M, K), columnwise (K, M)) exact bf16 ``q * d`` of x, each 16-row block
    quantized with its own global scale: ``row_scales`` / ``col_scales`` (M/16,) fp32 (None:
    that direction is not made, an empty tensor is returned). The columnwise direction is
    RHT'd along M when ``with_rht``; ``key_row`` / ``key_col``: stochastic-rounding keys
    (both or neither, for the directions made)."""
    _check(x)
    m, k = x.shape
    for name, sc in (("row_scales", row_scales), ("col_scales", col_scales)):
        if sc is not None and tuple(sc.shape) != (m // BLOCK,):
            raise ValueError(f"{name} must hold one scale a 16-row block ({m // BLOCK},), "
                             f"got shape {tuple(sc.shape)}")
    if use_kernels(x):
        return _exact_kernels(x.contiguous(), row_scales, col_scales, key_row, key_col,
                              with_rht, two_d)
    return _exact_torch(x, row_scales, col_scales, key_row, key_col, with_rht, two_d)


@grouped_exact.register_fake
def _(x, row_scales, col_scales, key_row, key_col, with_rht, two_d):
    m, k = x.shape
    return (x.new_empty((m, k) if row_scales is not None else (0,), dtype=torch.bfloat16),
            x.new_empty((k, m) if col_scales is not None else (0,), dtype=torch.bfloat16))


def _exact_kernels(x, row_scales, col_scales, key_row, key_col, with_rht, two_d):
    from .launch import _idx64, _launch_col, _launch_row
    m, k = x.shape
    rows = x.new_empty((m, k) if row_scales is not None else (0,), dtype=torch.bfloat16)
    cols = x.new_empty((k, m) if col_scales is not None else (0,), dtype=torch.bfloat16)
    if m == 0 or k == 0:
        return rows, cols
    idx64 = _idx64(m, k)
    if row_scales is not None:
        _launch_row(x, k, rows, rows, row_scales.contiguous(), key_row, 0, rows, two_d, False,
                    idx64, grouped=True)
    if col_scales is not None:
        _launch_col(x, k, cols, cols, col_scales.contiguous(), key_col, 0, cols,
                    bool(with_rht), two_d, False, idx64, grouped=True)
    return rows, cols


def _runs(scales: Tensor):
    """(first row, end row, S) of each run of 16-row blocks sharing one scale."""
    values = scales.tolist()
    start = 0
    for b in range(1, len(values) + 1):
        if b == len(values) or values[b] != values[start]:
            yield start * BLOCK, b * BLOCK, scales[start:start + 1].to(torch.float32)
            start = b


def _exact_of(matrix, rand, s, two_d):
    data, scale, _ = quantize_matrix(matrix, two_d=two_d, rand=rand, s=s)
    ones = torch.ones(1, dtype=torch.float32, device=matrix.device)
    return dequantize_matrix(data, scale, ones, two_d=two_d).to(torch.bfloat16)


def _exact_torch(x, row_scales, col_scales, key_row, key_col, with_rht, two_d):
    """The reference, one run of blocks with one scale at a time (a run's blocks lie in one
    group, or in groups of equal scales, which quantize alike)."""
    m, k = x.shape
    xf = x.to(torch.float32)
    rows = x.new_empty((m, k) if row_scales is not None else (0,), dtype=torch.bfloat16)
    cols = x.new_empty((k, m) if col_scales is not None else (0,), dtype=torch.bfloat16)
    if row_scales is not None:
        rand = uniforms(key_row, m, k) if key_row is not None else None
        for r0, r1, s in _runs(row_scales):
            rows[r0:r1] = _exact_of(xf[r0:r1], None if rand is None else rand[r0:r1], s, two_d)
    if col_scales is not None:
        xt = xf.t().contiguous()
        if with_rht:
            xt = rht_forward(xt)
        rand = uniforms(key_col, k, m) if key_col is not None else None
        for r0, r1, s in _runs(col_scales):
            cols[:, r0:r1] = _exact_of(xt[:, r0:r1].contiguous(),
                                       None if rand is None else rand[:, r0:r1], s, two_d)
    return rows, cols
