"""MXFP8 as a compiled linear traces it (``formats.graph``): each direction as the exact
values its GEMM multiplies. On Hopper eager runs MXFP8 GEMMs as bf16 GEMMs of these
values (``gemm.exact_bf16``), elsewhere in the fp32 emulation.

With the kernels (CUDA with Triton) a quantize is eager's Triton kernel's exact bf16
values (``mxfp8_exact_inline``, which inductor launches itself), both directions in one
pass where both are asked for; elsewhere torch ops (``formats.mxfp8.compiled``). Two
quantizes are eager's whole quantize instead, one graph op (``mxfp8_quantize_graph``) that
the compiler's common-subexpression pass merges where q/k/v (gate/up) quantize one input:
dY's in both directions, and the forward's of a tensor that is not a parameter (an input),
which keeps its columnwise codes. In 1x32 blocks that op runs the Gluon kernel, which reads
the input once for both directions and which inductor cannot launch from its own code.

An eager call (``GraphOperand.eager``) launches eager's own quantize (``mxfp8_quantize``:
the Gluon kernel where it applies, no custom-op dispatch, the same bits). The forward,
eager or traced, makes the input's columnwise codes in the pass of its rowwise values and
keeps them for wgrad (an element a byte), which dequantizes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels import graph_op
from ..graph import Exact, GraphOperand, Kind, gathered_columnwise, rounded
from .compiled import dequantized_1x32, dequantized_32x1, dequantized_32x32
from .dequantize import mxfp8_dequantize_bf16
from .launch import empty_outputs, mxfp8_exact_inline, mxfp8_quantize
from .reference import BLOCK, dequantize_blocks

E5M2 = torch.float8_e5m2
#: the kind of every MXFP8 operand, made once (``formats.graph._PLAIN_KINDS`` says why)
_EXACT = Kind("exact")


@graph_op("mxfp8_quantize_graph")
def mxfp8_quantize_graph(x: torch.Tensor, e5m2: bool, two_d: bool, rowwise: bool,
                         columnwise: bool, exact_row: bool, exact_col: bool, codes: bool,
                         row_codes: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor, torch.Tensor]:
    """Eager's quantize of the contiguous ``x`` as one op of a compiled graph (the outputs
    of ``mxfp8_quantize``)."""
    return mxfp8_quantize(x, e5m2, two_d, rowwise, columnwise, 0, [], exact_row, exact_col,
                          codes, row_codes)


@torch.library.register_fake("lowprec::mxfp8_quantize_graph")
def _mxfp8_quantize_graph_fake(x, e5m2, two_d, rowwise, columnwise, exact_row, exact_col,
                               codes, row_codes):
    return empty_outputs(x, two_d, rowwise, columnwise, 0, exact_row, exact_col, codes,
                         row_codes)


def _quantize(t, *args):
    """``mxfp8_quantize`` of ``t`` without a prologue: eager's own call outside a compiler,
    the graph op in one."""
    if torch.compiler.is_compiling():
        return mxfp8_quantize_graph(t.contiguous(), *args)
    return mxfp8_quantize(t.contiguous(), *args[:4], 0, [], *args[4:])


@dataclass(frozen=True)
class MXBlocks(GraphOperand):
    """``MXFP8Quantizer``'s settings: 1x32 blocks, or 32x32 ones (``two_d``, a weight's),
    whose one scale serves both directions."""

    fp8_dtype: torch.dtype
    kernel: bool = False
    two_d: bool = False

    @property
    def sliceable(self) -> bool:
        return not self.two_d  # 1x32 / 32x1 blocks of a slice are the whole tensor's

    @property
    def launches_eagerly(self) -> bool:
        return self.kernel

    @property
    def eager(self) -> bool:
        return self.kernel

    def kind(self, usage):
        return _EXACT

    def _launch(self, t, rowwise: bool, columnwise: bool):
        e5m2 = self.fp8_dtype == E5M2
        if torch.compiler.is_compiling() and not (rowwise and columnwise and not self.two_d):
            row, col = mxfp8_exact_inline(t, e5m2, rowwise, columnwise, self.two_d)
        else:  # eager's quantize; in a graph, its Gluon pass over both directions
            *_, row, col = _quantize(t, e5m2, self.two_d, rowwise, columnwise, rowwise,
                                     columnwise, False, True)
        return Exact(row), Exact(col)

    def forward(self, t, keep, held=False, after=()):
        if keep and not held and self.kernel:
            # one pass makes the rowwise values and the columnwise codes and scales, which
            # the backward keeps (an element a byte, as the eager Function keeps them) and
            # wgrad turns into its values; no rowwise codes, which nothing reads
            *_, cq, cs, re, _ = _quantize(t, self.fp8_dtype == E5M2, self.two_d, True, True,
                                          True, False, True, False)
            return Exact(re), (cq.view(self.fp8_dtype), cs)
        return super().forward(t, keep, held, after)

    def saved_columnwise(self, saved, grad=None):
        if len(saved) == 2:  # the columnwise codes and scales an eager forward kept
            return Exact(mxfp8_dequantize_bf16(*saved, BLOCK if self.two_d else 1))
        return super().saved_columnwise(saved)

    def rowwise(self, t):
        if self.kernel:
            return self._launch(t, True, False)[0]
        if self.two_d:
            return Exact(dequantized_32x32(rounded(t), self.fp8_dtype))
        return Exact(dequantized_1x32(rounded(t), self.fp8_dtype))

    def columnwise(self, t):
        if self.kernel:
            return self._launch(t, False, True)[1]
        if self.two_d:
            return Exact(dequantized_32x32(rounded(t), self.fp8_dtype).t())
        return Exact(dequantized_32x1(rounded(t), self.fp8_dtype))

    def grad(self, t, row, col):
        if row and col and self.kernel:
            return self._launch(t, True, True)
        return super().grad(t, row, col)


@dataclass(frozen=True)
class GivenMX(GraphOperand):
    """An MXFP8 weight in 1x32 blocks that arrives quantized (an ``MXFP8Tensor``: FSDP2's
    quantized all-gather, ``quantized_model_init``): the values of its own codes and
    scales, as eager's GEMMs read them. Dgrad reads its columnwise data: kept from the
    forward where the weight holds it, else (``columnwise_in_backward``) the buffers of
    its rowwise data, which the backward's own gather fills with the columnwise data
    transposed, read in the backward."""

    kernel: bool = False
    columnwise_in_backward: bool = False
    given = True

    def kind(self, usage):
        return _EXACT

    def _values(self, data, scale) -> Exact:
        if self.kernel:
            return Exact(mxfp8_dequantize_bf16(data, scale, 1))
        return Exact(dequantize_blocks(data, scale, block_rows=1))

    def rowwise(self, w):
        return self._values(w.rowwise_data, w.rowwise_scale)

    def save_columnwise(self, w, after=()):
        if self.columnwise_in_backward:
            return (w.rowwise_data, w.rowwise_scale)
        return (w.columnwise_data, w.columnwise_scale)

    def saved_columnwise(self, saved, grad=None):
        data, scale = saved
        if self.columnwise_in_backward:
            data, scale = gathered_columnwise(data, scale, grad, 1, BLOCK)
        return self._values(data, scale)

    def columnwise(self, w):
        return self._values(w.columnwise_data, w.columnwise_scale)
