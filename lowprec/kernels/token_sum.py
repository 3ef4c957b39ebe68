"""The routed rows of a mixture-of-experts layer summed into their tokens: ``out[t]`` adds
``rows[idx[t, 0]]``, ``rows[idx[t, 1]]``, ... one at a time from zero, rounding after each
add as torch's adds do; one pass on a GPU with Triton (kernel: :mod:`.token_sum_kernel`),
where torch makes a gather and an add per slot. Elsewhere the same torch ops."""

from __future__ import annotations

import torch

from . import kernel_op, use_kernels

_BT, _BH = 16, 256


@kernel_op("lowprec::token_sum", mutates_args=())
def _token_sum(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    from .launch import launch
    from .token_sum_kernel import token_sum_kernel
    t, k = idx.shape
    h = rows.shape[1]
    out = torch.empty((t, h), dtype=rows.dtype, device=rows.device)
    with torch.cuda.device(rows.device):
        launch(token_sum_kernel, (-(-t // _BT), -(-h // _BH)), rows, idx, out, t, h,
               rows.stride(0), out.stride(0), K=k, BT=_BT, BH=_BH, num_warps=4)
    return out


@_token_sum.register_fake
def _(rows, idx):
    return rows.new_empty((idx.shape[0], rows.shape[1]))


def token_sum(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(T, H): each token's rows of ``rows`` (R, H) at ``idx`` (T, k) int64 summed in that
    order, from zero, in ``rows``' dtype."""
    if (use_kernels(rows) and rows.dim() == 2 and rows.stride(1) == 1 and idx.is_contiguous()
            and rows.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and idx.numel() and rows.shape[1] and not torch.compiler.is_compiling()):
        return _token_sum(rows, idx)
    return token_sum_torch(rows, idx)


def token_sum_torch(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """:func:`token_sum` in torch ops: a gather and an add per slot."""
    acc = rows.new_zeros((idx.shape[0], rows.shape[1]))
    for slot in idx.unbind(1):
        acc = acc + rows[slot]
    return acc
