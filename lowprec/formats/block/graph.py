"""Block-scaled FP8 as a compiled linear traces it (``formats.graph``).

With the kernels (CUDA with Triton) a quantize is eager's Triton kernel, launched by
inductor from its own code (``fp8_block_quantize_inline``): its blocked amax and cast take
a fraction of the GPU time of inductor's code for the same torch ops, and it makes both
directions in one pass. A quantize that makes 1x128 columnwise blocks is eager's whole
quantize instead (``fp8_block_quantize_graph``: the Gluon kernel, which reads the input once
for both directions and which inductor cannot launch from its own code), one op that the
compiler's common-subexpression pass merges where q/k/v (gate/up) quantize one input.
Elsewhere it is the reference's torch ops. Either way the blocks are eager's bit for bit.
The forward keeps an input's fp8 columnwise blocks for wgrad, made in its one pass, and the
backward quantizes a parameter weight again (it lives on anyway, so no fp8 copy of it
lives from forward to backward), as an eager call (``GraphOperand.eager``) does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels import graph_op
from ..graph import Blocks, GraphOperand, Kind, gathered_columnwise, rounded
from .dequant import dequantized_bf16
from .launch import empty_outputs, fp8_block_quantize, fp8_block_quantize_inline
from .reference import BLOCK, dequantize_blocks, quantize_blocks

E5M2 = torch.float8_e5m2
#: the kinds of block operands, made once (``formats.graph._PLAIN_KINDS`` says why)
_KINDS = {(dt, dim, pow2): Kind("blocks", dt, dim, pow2=pow2)
          for dt in (torch.float8_e4m3fn, E5M2) for dim in (1, 2) for pow2 in (True, False)}


@graph_op("dequantized_blocks")
def dequantized_blocks(data: torch.Tensor, scale: torch.Tensor, dim: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """Block FP8 values in ``dtype`` as eager dequantizes them (the reference's fp32
    division, which inductor's GPU code would approximate)."""
    return dequantize_blocks(data, scale, dim).to(dtype)


@torch.library.register_fake("lowprec::dequantized_blocks")
def _dequantized_blocks_fake(data, scale, dim, dtype):
    return data.new_empty(data.shape, dtype=dtype)


@graph_op("fp8_block_quantize_graph")
def fp8_block_quantize_graph(x: torch.Tensor, e5m2: bool, dim: int, pow2: bool, eps: float,
                             rowwise: bool, columnwise: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager's quantize of the contiguous ``x`` as one op of a compiled graph (the outputs
    of ``fp8_block_quantize``)."""
    return fp8_block_quantize(x, e5m2, dim, pow2, eps, rowwise, columnwise, 0, [])


@torch.library.register_fake("lowprec::fp8_block_quantize_graph")
def _fp8_block_quantize_graph_fake(x, e5m2, dim, pow2, eps, rowwise, columnwise):
    return empty_outputs(x, dim, rowwise, columnwise)


def _transposed(rep: Blocks) -> Blocks:
    """The columnwise form of 128x128 blocks: the rowwise ones transposed."""
    return Blocks(rep.data.t().contiguous(), rep.scale.t().contiguous(), 2,
                  None if rep.decode is None else rep.decode.t().contiguous())


class _BlockForms(GraphOperand):
    def dequantized(self, rep, dtype, usage="rowwise"):
        return dequantized_blocks(rep.data, rep.scale, rep.dim, dtype)

    def bf16_values(self, rep: Blocks) -> torch.Tensor:
        """The bf16 values of blocks with power-of-two scales (exact), through eager's
        dequantize (``Float8BlockwiseTensor.bf16_operand``): the operand of the bf16 GEMM
        eager runs where cuBLAS's block GEMM does not take the pair; in a compiled graph
        the kernel is launched from inductor's code."""
        return dequantized_bf16(rep.data, rep.scale, rep.dim)


@dataclass(frozen=True)
class Blockwise(_BlockForms):
    """``Float8BlockQuantizer``'s settings: 1x128 (``dim`` 1) or 128x128 (2) blocks."""

    fp8_dtype: torch.dtype
    dim: int
    pow2: bool = True
    eps: float = 0.0
    kernel: bool = False

    @property
    def sliceable(self) -> bool:
        # 1x128 blocks of a row slice are the whole tensor's; 128x128 blocks span rows
        return self.dim == 1

    @property
    def launches_eagerly(self) -> bool:
        return self.kernel

    @property
    def eager(self) -> bool:
        return self.kernel

    def kind(self, usage):
        return _KINDS[self.fp8_dtype, self.dim, self.pow2]

    def _launch(self, t, rowwise: bool, columnwise: bool):
        args = (self.fp8_dtype == E5M2, self.dim, self.pow2, self.eps, rowwise, columnwise)
        if not torch.compiler.is_compiling():  # eager's own quantize and its decodes
            rq, rs, rd, cq, cs, cd = fp8_block_quantize(t.contiguous(), *args, 0, [])
        elif columnwise and self.dim == 1:  # the Gluon kernel's pass (module docstring)
            rq, rs, rd, cq, cs, cd = fp8_block_quantize_graph(t.contiguous(), *args)
        else:
            rq, rs, _, cq, cs, _ = fp8_block_quantize_inline(t, *args)
            rd = cd = None
        return (Blocks(rq.view(self.fp8_dtype), rs, self.dim, rd),
                Blocks(cq.view(self.fp8_dtype), cs, self.dim, cd))

    def forward(self, t, keep, held=False, after=()):
        if keep and not held and self.kernel:
            # keep the fp8 blocks the backward reads rather than the input, both directions
            # made in the forward's one pass
            row, col = self._launch(t, True, True)
            return row, (col.data, col.scale, col.decode)
        return super().forward(t, keep, held, after)

    def saved_columnwise(self, saved, grad=None):
        if len(saved) == 1:
            return super().saved_columnwise(saved)
        data, scale, decode = saved  # what an eager forward kept
        return Blocks(data, scale, self.dim, decode)

    def _reference(self, t):
        return Blocks(*quantize_blocks(rounded(t), self.fp8_dtype, self.dim, pow2=self.pow2,
                                       eps=self.eps), self.dim)

    def rowwise(self, t):
        if self.kernel:
            return self._launch(t, True, False)[0]
        return self._reference(t)

    def columnwise(self, t):
        if self.kernel:  # 128x128 blocks: the kernel writes them transposed in its one pass
            return self._launch(t, False, True)[1]
        if self.dim == 2:  # 128x128 blocks serve both directions, read transposed
            return _transposed(self.rowwise(t))
        return self._reference(t.t())

    def grad(self, t, row, col):
        if row and col and self.kernel:  # both directions in one pass
            return self._launch(t, True, True)
        return super().grad(t, row, col)


@dataclass(frozen=True)
class GivenBlocks(_BlockForms):
    """A block FP8 weight that arrives quantized (a ``Float8BlockwiseTensor``: FSDP2's
    quantized all-gather, ``quantized_model_init``): its own codes and block scales. In
    128x128 blocks (``dim`` 2) dgrad reads both transposed; in 1x128 blocks its
    columnwise ones: kept from the forward where the weight holds them, else
    (``columnwise_in_backward``) the buffers of its rowwise ones, which the backward's own
    gather fills with the columnwise ones transposed, read in the backward."""

    fp8_dtype: torch.dtype
    dim: int = 2
    columnwise_in_backward: bool = False
    given = True

    def kind(self, usage):
        # whether its scales are powers of two is not known from the settings (eager reads
        # them back): the pair traces through cuBLAS's block GEMM or not at all
        return _KINDS[self.fp8_dtype, self.dim, False]

    def rowwise(self, w):
        return Blocks(w.rowwise_data, w.rowwise_scale, self.dim)

    def save_columnwise(self, w, after=()):
        if self.dim == 2 or self.columnwise_in_backward:
            return (w.rowwise_data, w.rowwise_scale)
        return (w.columnwise_data, w.columnwise_scale)

    def saved_columnwise(self, saved, grad=None):
        data, scale = saved
        if self.dim == 2:
            return _transposed(Blocks(data, scale, 2))
        if self.columnwise_in_backward:
            data, scale = gathered_columnwise(data, scale, grad, 1, BLOCK)
        return Blocks(data.contiguous(), scale.contiguous(), 1)

    def columnwise(self, w):
        return self.saved_columnwise(self.save_columnwise(w))
