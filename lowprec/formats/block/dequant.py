"""Block FP8 codes to their exact bf16 values in one pass (the operands of the exact bf16
GEMMs: ``Float8BlockwiseTensor.bf16_operand``). The reference divides in fp32 and casts
(``reference.dequantize_blocks``): three passes over fp32 copies of the operand. The
kernel reads the codes once and writes bf16, the same bits on a GPU (tested against the
reference's ops there)."""

from __future__ import annotations

import torch

from ...kernels import kernel_op, use_kernels
from ...kernels.launch import launch, launch_in_graph
from .reference import BLOCK, dequantize_blocks

#: rows a program
_BR = 32


@kernel_op("lowprec::block_dequant_bf16", mutates_args=())
def dequantize_bf16(data: torch.Tensor, scale: torch.Tensor,
                    block_scaling_dim: int) -> torch.Tensor:
    """(R, C) bf16 ``data / scale``: ``data`` (R, C) fp8 codes (unit inner stride), ``scale``
    (R, C/128) or (R/128, C/128) fp32 encode scales, any strides."""
    return _dequantize(data, scale, block_scaling_dim, launch)


def _dequantize(data, scale, block_scaling_dim: int, run) -> torch.Tensor:
    """The kernel, launched by ``run``; the reference's ops where it does not take ``data``
    (no kernels, or an inner stride other than 1)."""
    if not (use_kernels(data) and data.stride(1) == 1):
        return dequantize_blocks(data, scale, block_scaling_dim).to(torch.bfloat16)
    from .dequant_kernel import block_dequant_bf16_kernel
    r, c = data.shape
    out = torch.empty((r, c), dtype=torch.bfloat16, device=data.device)
    if r and c:
        run(block_dequant_bf16_kernel, (-(-r // _BR), -(-c // BLOCK)), data, scale, out,
            r, c, data.stride(0), *scale.stride(), out.stride(0), BR=_BR,
            S_ROWS=1 if block_scaling_dim == 1 else BLOCK, num_warps=4)
    return out


@dequantize_bf16.register_fake
def _(data, scale, block_scaling_dim):
    return data.new_empty(data.shape, dtype=torch.bfloat16)


@torch.library.triton_op("lowprec::block_dequant_bf16_inline", mutates_args=())
def dequantize_bf16_inline(data: torch.Tensor, scale: torch.Tensor,
                           block_scaling_dim: int) -> torch.Tensor:
    """:func:`dequantize_bf16` for compiled graphs on CUDA with Triton: a ``triton_op``, so
    inductor launches the same kernel from its own code, without a custom-op dispatch and a
    Python launcher per GEMM operand (``data`` of another inner stride than 1 gets the
    reference's ops, which inductor then fuses)."""
    return _dequantize(data, scale, block_scaling_dim, launch_in_graph)


def dequantized_bf16(data: torch.Tensor, scale: torch.Tensor,
                     block_scaling_dim: int) -> torch.Tensor:
    """:func:`dequantize_bf16`; in a compiled graph, :func:`dequantize_bf16_inline` where
    kernels run (an eager call skips the op's dispatch through the kernel op)."""
    # the stride is asked inside the op: dynamo speculates a backward that reads a tensor's
    # strides a second time, and torch (2.11 to 2.13) then leaves the first attempt's
    # torch.autocast state behind ("Global autocast state changed while dynamo tracing")
    if torch.compiler.is_compiling() and use_kernels(data):
        return dequantize_bf16_inline(data, scale, block_scaling_dim)
    return dequantize_bf16(data, scale, block_scaling_dim)
