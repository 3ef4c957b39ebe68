"""The layout of a mixture-of-experts layer's routed rows: the slots of ``top_k_index``
(T, k) sorted by expert, stably (slot ``t * k + j`` in flat order within an expert), each
expert's group starting at a multiple of ``align`` with zero rows after it, and what the
layer needs to move rows in and out of that layout. Three Triton launches on a GPU
(kernels: :mod:`.moe_route_kernel`), where torch ops make a sort and some twenty more;
elsewhere those torch ops. Both give the same integers."""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import kernel_op, use_kernels

#: tokens a block of the kernels, and the widest expert table the kernels hold
_BT, _MAX_EXPERTS, _MAX_K = 32, 256, 64


class Routing(NamedTuple):
    """The routed rows' layout. ``sizes`` (E,) int64: each expert's group, rounded up to
    ``align``, the last one also taking the rows past the others up to :func:`row_count`;
    ``token_of`` (R,) int64: each row's token, T for a padding row; ``slot_of`` (R,) int64:
    each row's slot (``t * k + j``), 0 for a padding row; ``valid`` (R,) bool: whether the
    row is a slot's; ``rows_of`` (T, k) int64: each token's rows, ascending (expert
    order)."""

    sizes: torch.Tensor
    token_of: torch.Tensor
    slot_of: torch.Tensor
    valid: torch.Tensor
    rows_of: torch.Tensor


def row_count(tokens: int, k: int, num_experts: int, align: int) -> int:
    """R: the routed rows' count with every group's padding, a bound known on the host (a
    multiple of ``align``)."""
    return -(-(tokens * k + (align - 1) * num_experts) // align) * align


def route_torch(top_k_index: torch.Tensor, num_experts: int, align: int) -> Routing:
    """:func:`route` in torch ops."""
    t, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    n = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + (align - 1)) // align * align
    total = row_count(t, k, num_experts, align)
    start = torch.cumsum(padded, 0) - padded
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    place = start[flat[order]] + rank  # the row of routed slot order[r]
    valid = torch.zeros(total, dtype=torch.bool, device=dev).index_fill_(0, place, True)
    token_of = torch.full((total,), t, dtype=torch.int64, device=dev).index_copy_(
        0, place, order // k)
    slot_of = torch.zeros(total, dtype=torch.int64, device=dev).index_copy_(0, place, order)
    sizes = torch.cat([padded[:-1], padded[-1:] + (total - padded.sum())])
    rows_of = torch.empty_like(place).scatter_(0, order, place).view(t, k).sort(1).values
    return Routing(sizes, token_of, slot_of, valid, rows_of)


@kernel_op("lowprec::moe_route", mutates_args=())
def _route(top_k_index: torch.Tensor, num_experts: int, align: int) -> list[torch.Tensor]:
    from .launch import launch
    from .moe_route_kernel import route_bases_kernel, route_count_kernel, route_place_kernel
    t, k = top_k_index.shape
    dev = top_k_index.device
    total = row_count(t, k, num_experts, align)
    ep = max(2, 1 << (num_experts - 1).bit_length())
    kp = max(2, 1 << (k - 1).bit_length())
    blocks = -(-t // _BT)
    block_counts = torch.empty((blocks, ep), dtype=torch.int32, device=dev)
    bases = torch.empty_like(block_counts)
    sizes = torch.empty(num_experts, dtype=torch.int64, device=dev)
    token_of = torch.empty(total, dtype=torch.int64, device=dev)
    slot_of = torch.empty_like(token_of)
    valid = torch.empty(total, dtype=torch.bool, device=dev)
    rows_of = torch.empty((t, k), dtype=torch.int64, device=dev)
    ids = top_k_index.contiguous()
    with torch.cuda.device(dev):
        launch(route_count_kernel, (blocks,), ids, block_counts, t * k, BLK=_BT * k, CH=64,
               EP=ep, num_warps=4)
        launch(route_bases_kernel, (1,), block_counts, bases, sizes, token_of, slot_of,
               valid.view(torch.int8), blocks, num_experts, t, total, ALIGN=align, EP=ep,
               CB=max(1, 4096 // ep), AP=max(2, 1 << (align - 1).bit_length()), CR=1024,
               num_warps=4)
        launch(route_place_kernel, (blocks,), ids, bases, token_of, slot_of,
               valid.view(torch.int8), rows_of, t, K=k, KP=kp, BT=_BT, CT=64 // kp, EP=ep,
               num_warps=4)
    return [sizes, token_of, slot_of, valid, rows_of]


@_route.register_fake
def _(top_k_index, num_experts, align):
    t, k = top_k_index.shape
    total = row_count(t, k, num_experts, align)
    new = top_k_index.new_empty
    return [new(num_experts), new(total), new(total), new(total, dtype=torch.bool), new(t, k)]


@kernel_op("lowprec::group_sizes_ok", mutates_args=())
def _group_sizes_ok(sizes: torch.Tensor, rows: int, align: int) -> torch.Tensor:
    from .launch import launch
    from .moe_route_kernel import group_sizes_ok_kernel
    ok = torch.empty((), dtype=torch.bool, device=sizes.device)
    with torch.cuda.device(sizes.device):
        launch(group_sizes_ok_kernel, (1,), sizes, ok.view(torch.int8), sizes.shape[0], rows,
               align, GP=max(2, 1 << (sizes.shape[0] - 1).bit_length()), num_warps=4)
    return ok


@_group_sizes_ok.register_fake
def _(sizes, rows, align):
    return sizes.new_empty((), dtype=torch.bool)


def group_sizes_ok(sizes: torch.Tensor, rows: int, align: int = 1) -> torch.Tensor:
    """A bool scalar on ``sizes``' device: every size (int64) non-negative and a multiple of
    ``align``, their sum ``rows``. One launch on a GPU."""
    if (use_kernels(sizes) and sizes.dim() == 1 and 0 < sizes.shape[0] <= 4096
            and sizes.is_contiguous() and not torch.compiler.is_compiling()):
        return _group_sizes_ok(sizes, rows, align)
    return torch.all(sizes >= 0) & (sizes.sum() == rows) & torch.all(sizes % align == 0)


def route(top_k_index: torch.Tensor, num_experts: int, align: int = 1) -> Routing:
    """The layout of the slots of ``top_k_index`` (T, k) int64 expert ids in
    ``[0, num_experts)``, each expert's group starting at a multiple of ``align``
    (see :class:`Routing`). No host sync."""
    t, k = top_k_index.shape
    if (use_kernels(top_k_index) and t > 0 and num_experts <= _MAX_EXPERTS and k <= _MAX_K
            and top_k_index.dtype == torch.int64 and not torch.compiler.is_compiling()):
        return Routing(*_route(top_k_index, num_experts, align))
    return route_torch(top_k_index, num_experts, align)
