"""Grouped GEMMs on Hopper: every expert's rows in one launch (``torch._grouped_mm`` and
``torch._scaled_grouped_mm``), the groups given by device offsets, never read on the host.

Two shapes of problem, as an MoE layer runs them:

* rows by experts (forward and dgrad): ``out[rows of g] = a[rows of g] @ b[g].T`` with
  ``a`` (M, K) and ``b`` (G, N, K);
* rows contracted per group (wgrad): ``out[g] = a[rows of g].T @ b[rows of g]``, (G, N, K)
  from ``a`` (M, N) and ``b`` (M, K).

The FP8 forms take per-tensor decode scales (``1 / scale``) per group: each row gets its
group's, as the kernels' row-wise scales. FP8 wgrad needs each group's rows to start at a
multiple of 16: where the caller has not laid the groups out so, the rows are spread into
a zero-padded copy first (zero rows add nothing to the sums), then transposed.
"""

from __future__ import annotations

import torch

from ..kernels.moe_route import row_count
from .device import grouped_device
from .table import grouped_mm_takes

#: the row multiple FP8 wgrad needs at each group start (16-byte row strides)
ALIGN = 16


def plain_available(a: torch.Tensor, k: int, n: int) -> bool:
    """Whether :func:`plain_rows_by_experts` / :func:`plain_wgrad` run ``a``'s problem
    (bf16 on a Hopper GPU, feature sizes the kernel's 16-byte strides allow; the GEMM
    table's ``grouped_mm_takes``)."""
    return grouped_mm_takes(grouped_device(a), a.dtype, n, k)


def end_offsets(sizes: torch.Tensor) -> torch.Tensor:
    """Each group's end row, int32, as the grouped kernels take it."""
    return torch.cumsum(sizes, 0, dtype=torch.int32)


def plain_rows_by_experts(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(M, N) = each group's rows of ``a`` times its ``b[g].T``, in ``a``'s dtype."""
    return torch._grouped_mm(a, b.transpose(1, 2), offs=offs)


def plain_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(G, N, K) = per group, ``a[rows].T @ b[rows]``; an empty group gives zeros."""
    return torch._grouped_mm(a.t(), b, offs=offs)


def fp8_rows_by_experts(a: torch.Tensor, a_decode: torch.Tensor, b: torch.Tensor,
                        b_decode: torch.Tensor, offs: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 rows by experts: ``a`` (M, K) fp8 with ``a_decode`` (M,) per row, ``b`` (G, N, K)
    fp8 with one decode scale per expert (``b_decode`` (G,)). fp32 accumulation."""
    g, n = b.shape[0], b.shape[1]
    return torch._scaled_grouped_mm(a, b.transpose(1, 2), a_decode.contiguous(),
                                    b_decode[:, None].expand(g, n).contiguous(), offs=offs,
                                    out_dtype=out_dtype)


def padded_layout(sizes: torch.Tensor, group_ids: torch.Tensor, rows: int, align: int = ALIGN):
    """(source row of each padded row, whether it has one, padded end offsets int32, padded
    row count, each row's padded place): every group starts at a multiple of ``align``
    (a multiple of 16: the FP8 kernels' 16-byte row strides; a block format's row block).
    The count is an upper bound known on the host, a multiple of ``align``."""
    if align % ALIGN:
        raise ValueError(f"padded_layout align must be a multiple of {ALIGN}, got {align}")
    padded = (sizes + (align - 1)) // align * align
    padded_end = torch.cumsum(padded, 0)
    shift = (padded_end - padded) - (torch.cumsum(sizes, 0) - sizes)
    dest = torch.arange(rows, device=sizes.device) + shift[group_ids]
    total = row_count(rows, 1, sizes.shape[0], align)
    # index_copy_/index_fill_: an indexed assignment of a Python scalar copies it from the
    # host, a sync
    src = torch.zeros(total, dtype=torch.int64, device=sizes.device).index_copy_(
        0, dest, torch.arange(rows, device=sizes.device))
    valid = torch.zeros(total, dtype=torch.bool, device=sizes.device).index_fill_(0, dest, True)
    return src, valid, padded_end.to(torch.int32), total, dest


def padded_rows(t: torch.Tensor, src: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``t``'s rows at their padded places (``src``, ``valid`` from :func:`padded_layout`),
    zeros between the groups."""
    # moved as 8-byte words where the rows allow (a byte at a time is several times slower)
    word = torch.int64 if (t.shape[1] * t.element_size()) % 8 == 0 and t.is_contiguous() else None
    bits = t.view(word) if word is not None else t
    rows = torch.where(valid[:, None], bits[src], torch.zeros((), dtype=bits.dtype,
                                                              device=t.device))
    return rows.view(t.dtype)


def fp8_wgrad(a_t: torch.Tensor, a_decode: torch.Tensor, b_t: torch.Tensor,
              b_decode: torch.Tensor, padded_offs: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 wgrad: (G, N, K) = per group ``a[rows].T @ b[rows]``, from the transposes of
    :func:`padded_rows` (``a_t`` (N, padded), ``b_t`` (K, padded)), one
    decode scale per group each (``a_decode``, ``b_decode`` (G,))."""
    g = a_decode.shape[0]
    scale_a = a_decode[:, None].expand(g, a_t.shape[0]).reshape(-1).contiguous()
    scale_b = b_decode[:, None].expand(g, b_t.shape[0]).reshape(-1).contiguous()
    return torch._scaled_grouped_mm(a_t, b_t.t(), scale_a, scale_b, offs=padded_offs,
                                    out_dtype=out_dtype)
