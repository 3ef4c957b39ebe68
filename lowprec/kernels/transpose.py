"""A contiguous transpose of 2-D data: what deriving one direction of a quantized tensor
from the other costs (the FP8 codes of a per-tensor or 2-D-block tensor).

torch's own copy of a transposed 1-byte view reads or writes a byte at a time across
rows; the kernel moves whole tiles, so deriving an FP8 weight's columnwise copy costs about
what reading and writing its bytes does.
"""

from __future__ import annotations

import torch

from . import kernel_op, use_kernels

#: element sizes the kernel moves (as unsigned integers of that width)
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_TILE = 64


def transpose_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.t().contiguous()`` of a 2-D tensor, through the kernel where it runs."""
    if (t.dim() != 2 or not use_kernels(t) or t.element_size() not in _AS_INT
            or t.stride(1) != 1 or t.numel() == 0):
        return t.t().contiguous()
    as_int = _AS_INT[t.element_size()]
    return transpose_2d(t.view(as_int)).view(t.dtype)


@kernel_op("lowprec::transpose_2d", mutates_args=())
def transpose_2d(x: torch.Tensor) -> torch.Tensor:
    """(N, M) contiguous transpose of the (M, N) integer tensor ``x`` (unit inner stride)."""
    from .launch import launch
    from .transpose_kernel import transpose_kernel
    m, n = x.shape
    y = torch.empty((n, m), dtype=x.dtype, device=x.device)
    with torch.cuda.device(x.device):
        launch(transpose_kernel, (triton_cdiv(m, _TILE), triton_cdiv(n, _TILE)), x, y, m, n,
               x.stride(0), BM=_TILE, BN=_TILE, num_warps=4)
    return y


@transpose_2d.register_fake
def _(x):
    return x.new_empty((x.shape[1], x.shape[0]))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
