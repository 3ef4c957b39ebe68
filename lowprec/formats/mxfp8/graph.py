"""MXFP8 as a compiled linear traces it (``formats.graph``): each direction as the exact
values its GEMM multiplies. On Hopper eager runs MXFP8 GEMMs as bf16 GEMMs of these
values (``backends.exact_bf16``), elsewhere in the fp32 emulation.

With the kernels (CUDA with Triton) the values are eager's Triton kernel's exact bf16
values (``mxfp8_exact_inline``, which inductor launches itself), both directions in one
pass where both are asked for; elsewhere torch ops (``formats.mxfp8.compiled``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..graph import Exact, GraphOperand, Kind, rounded
from .compiled import dequantized_1x32, dequantized_32x1
from .launch import mxfp8_exact_inline

E5M2 = torch.float8_e5m2


@dataclass(frozen=True)
class MXBlocks(GraphOperand):
    """``MXFP8Quantizer``'s settings with 1x32 blocks."""

    fp8_dtype: torch.dtype
    kernel: bool = False
    sliceable = True  # 1x32 / 32x1 blocks of a slice are the whole tensor's

    @property
    def launches_eagerly(self) -> bool:
        return self.kernel

    def kind(self, usage):
        return Kind("exact")

    def _launch(self, t, rowwise: bool, columnwise: bool):
        row, col = mxfp8_exact_inline(t, self.fp8_dtype == E5M2, rowwise, columnwise)
        return Exact(row), Exact(col)

    def rowwise(self, t):
        if self.kernel:
            return self._launch(t, True, False)[0]
        return Exact(dequantized_1x32(rounded(t), self.fp8_dtype))

    def columnwise(self, t):
        if self.kernel:
            return self._launch(t, False, True)[1]
        return Exact(dequantized_32x1(rounded(t), self.fp8_dtype))

    def grad(self, t, row, col):
        if row and col and self.kernel:
            return self._launch(t, True, True)
        return super().grad(t, row, col)
