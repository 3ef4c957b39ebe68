"""amax(|x|) of each group of rows (the experts of a grouped GEMM under FP8 current
scaling): one read of the rows on a GPU with Triton (kernel: :mod:`.group_amax_kernel`),
where torch ops make a row reduction, a bit mask and a scatter. Elsewhere the same torch
ops. Both give the same bits: a max is exact, NaN propagates."""

from __future__ import annotations

import torch

from . import kernel_op, use_kernels

_SIGN_OFF = 0x7FFFFFFF
_BR, _BK = 16, 512


def _amax_bits(values: torch.Tensor) -> torch.Tensor:
    # Non-negative floats order as their int32 bits, NaN above +Inf: a max over the bits is
    # the max over the values with NaN propagating (scatter_reduce's float max may not).
    return values.to(torch.float32).view(torch.int32) & _SIGN_OFF


def group_amax_torch(x2d: torch.Tensor, group_ids: torch.Tensor,
                     num_groups: int) -> torch.Tensor:
    """:func:`group_amax` in torch ops."""
    rows = _amax_bits(x2d.abs().amax(dim=1)) if x2d.shape[1] else group_ids.new_zeros(
        group_ids.shape, dtype=torch.int32)
    out = torch.zeros(num_groups, dtype=torch.int32, device=x2d.device)
    return out.scatter_reduce_(0, group_ids, rows, "amax").view(torch.float32)


@kernel_op("lowprec::group_amax", mutates_args=())
def _group_amax(x2d: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    from .group_amax_kernel import group_amax_kernel
    from .launch import launch
    m, k = x2d.shape
    out = torch.zeros(num_groups, dtype=torch.int32, device=x2d.device)
    if m and k:
        with torch.cuda.device(x2d.device):
            launch(group_amax_kernel, (-(-m // _BR),), x2d, group_ids, out, m, k,
                   x2d.stride(0), BR=_BR, BK=_BK, num_warps=4)
    return out.view(torch.float32)


@_group_amax.register_fake
def _(x2d, group_ids, num_groups):
    return x2d.new_empty((num_groups,), dtype=torch.float32)


def group_amax(x2d: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """amax(|x|) of each group's rows as a (num_groups,) fp32 tensor (0 for an empty group,
    NaN where a row holds NaN). ``group_ids[r]`` (int64) is row r's group."""
    if (use_kernels(x2d) and x2d.dim() == 2 and x2d.stride(1) == 1
            and group_ids.is_contiguous() and group_ids.dtype == torch.int64):
        return _group_amax(x2d, group_ids, num_groups)
    return group_amax_torch(x2d, group_ids, num_groups)
