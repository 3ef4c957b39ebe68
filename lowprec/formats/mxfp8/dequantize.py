"""MXFP8 data and E8M0 scales to exact bf16 values, ``data * 2**e``: the operand the exact
bf16 GEMM multiplies. A Triton kernel registered as a torch custom op (traceable by
``torch.compile``) on CUDA where :func:`lowprec.kernels.use_kernels` allows it, else the
torch version; both give the same bits (the product is exact in bf16).
"""

from __future__ import annotations

import torch

from ...kernels import kernel_op, use_kernels
from ...kernels.launch import launch
from ..casting import E8M0_BIAS, E8M0_NAN, exp2_int

_MX_BLOCK = 32

#: MXFP8 dequantize tile: BR rows x NB blocks of 32 per program, num_warps (timed on an
#: H200).
MX_DEQUANT_CONFIG = {"BR": 32, "NB": 8, "warps": 8}


def mxfp8_dequantize_bf16_torch(data: torch.Tensor, scale: torch.Tensor,
                                block_rows: int) -> torch.Tensor:
    r, c = data.shape
    nan = scale == E8M0_NAN
    e = torch.where(nan, torch.zeros_like(scale), scale).to(torch.int32) - E8M0_BIAS
    factor = torch.where(nan, torch.full(e.shape, float("nan"), device=e.device), exp2_int(e))
    blocks = data.to(torch.bfloat16).reshape(r // block_rows, block_rows, c // _MX_BLOCK, _MX_BLOCK)
    # bf16 x bf16 multiplies in fp32 and rounds once; the exact product is representable.
    return (blocks * factor.to(torch.bfloat16)[:, None, :, None]).reshape(r, c)


@kernel_op("lowprec_gemm::mxfp8_dequant_bf16", mutates_args=())
def _mxfp8_dequant_op(data: torch.Tensor, scale: torch.Tensor, block_rows: int) -> torch.Tensor:
    from .triton_kernels import mxfp8_dequant_bf16_kernel

    data, scale = data.contiguous(), scale.contiguous()
    r, c = data.shape
    out = torch.empty((r, c), dtype=torch.bfloat16, device=data.device)
    nblk = c // _MX_BLOCK
    cfg = MX_DEQUANT_CONFIG
    br, nb = cfg["BR"], cfg["NB"]
    grid = ((r + br - 1) // br, (nblk + nb - 1) // nb)
    launch(mxfp8_dequant_bf16_kernel, grid, data, scale, out, r, c, nblk,
           BLOCK_ROWS=block_rows, BR=br, NB=nb, num_warps=cfg["warps"])
    return out


@_mxfp8_dequant_op.register_fake
def _(data, scale, block_rows):
    return data.new_empty(data.shape, dtype=torch.bfloat16)


def mxfp8_dequantize_bf16(data: torch.Tensor, scale: torch.Tensor, block_rows: int) -> torch.Tensor:
    """Exact bf16 ``data * 2**e`` of one stored MXFP8 direction (R, C)."""
    if use_kernels(data) and data.numel():
        return _mxfp8_dequant_op(data, scale, block_rows)
    return mxfp8_dequantize_bf16_torch(data, scale, block_rows)
