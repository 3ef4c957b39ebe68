"""NVFP4 as a compiled linear traces it (``formats.graph``): each direction as the values
its GEMM multiplies (``formats.nvfp4.compiled``), and dY's stochastic-rounding keys drawn
by an op of the graph from torch's default generator, in eager's order (rowwise first).

The forward keeps the values backward multiplies where one pass makes them with fprop's:
the input's columnwise values, made in the pass of its rowwise ones (one amax pass for
both, as eager's); a weight in 16x16 blocks with nearest rounding and no transform has the
transpose of its rowwise values as its columnwise ones, so it keeps those and dgrad reads
them transposed. A columnwise half on its own (a hybrid's) is made in the backward.

An eager call (``GraphOperand.eager``) launches eager's quantize directly and draws its
keys directly, and keeps the codes of those directions rather than their values (half a
byte an element, as the eager Function keeps them); the backward turns them into values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..graph import Exact, GraphOperand, Kind, gathered_columnwise, rounded
from . import compiled as fp4
from .launch import nvfp4_dequantize_unscaled_bf16, nvfp4_quantize
from .reference import BLOCK, dequantize_matrix

#: the kinds of NVFP4 operands by (transform, divisor), made once
#: (``formats.graph._PLAIN_KINDS`` says why)
_KINDS = {(rht, div): Kind("exact", rht=rht, divisor=div, bf16=div)
          for rht in (False, True) for div in (False, True)}


def _is_key(t) -> bool:
    """Whether a kept tensor is a stochastic-rounding key (int64), not a divisor (fp32)."""
    return t is not None and t.dtype == torch.int64


@dataclass(frozen=True)
class FP4Blocks(GraphOperand):
    """``NVFP4Quantizer``'s settings: ``rht`` on its columnwise direction, 16x16 blocks
    (``two_d``), stochastic rounding (``sr``); ``kernel``: eager's Triton kernels make
    the values (CUDA)."""

    rht: bool = False
    two_d: bool = False
    sr: bool = False
    kernel: bool = False

    @property
    def launches_eagerly(self) -> bool:
        return self.kernel

    @property
    def eager(self) -> bool:
        return self.kernel

    @property
    def transposes(self) -> bool:
        """Whether the columnwise values are the rowwise ones transposed (one global
        scale, the same blocks either way)."""
        return self.two_d and not (self.rht or self.sr)

    def kind(self, usage):
        # the kernels' values carry the global scale as a divisor and the transform; the
        # reference's are the emulation's fp32 values in the original domain
        return _KINDS[self.kernel and self.rht and usage == "columnwise", self.kernel]

    def _keys(self, t, row: bool, col: bool, grad: bool = False, after: tuple = ()):
        """(rowwise key or None, columnwise key or None), drawn rowwise first; a forward
        operand's (not ``grad``) in the graph's order of effects (``draw_keys_ordered``),
        after the tensors ``after`` (``GraphOperand.forward``)."""
        if not self.sr:
            return None, None
        keys = fp4.keys(t, int(row) + int(col), ordered=not grad, after=after)
        return keys[0] if row else None, keys[int(row)] if col else None

    def _values(self, t, row: bool, col: bool, grad: bool = False, after: tuple = ()):
        if grad and self.sr and self.kernel:  # keys drawn in the values' own op
            return self._keyed_values(t, row, col, None, None, draw=True)
        key_row, key_col = self._keys(t, row, col, grad, after)
        return self._keyed_values(t, row, col, key_row, key_col)

    def _column_values(self, t, key_col):
        return self._keyed_values(t, False, True, None, key_col)[1]

    def _keyed_values(self, t, row: bool, col: bool, key_row, key_col, draw: bool = False):
        if self.kernel:
            (rv, rd), (cv, cd) = fp4.kernel_values(t, row, col, rht=self.rht, two_d=self.two_d,
                                                   key_row=key_row, key_col=key_col,
                                                   draw=draw)
            return (Exact(rv, rd) if row else None,
                    Exact(cv, cd, self.rht) if col else None)
        r = rounded(t)
        return (Exact(fp4.reference_values(r, True, rht=self.rht, two_d=self.two_d,
                                           key=key_row)) if row else None,
                Exact(fp4.reference_values(r, False, rht=self.rht, two_d=self.two_d,
                                           key=key_col)) if col else None)

    def rowwise(self, t):
        return self._values(t, True, False)[0]

    def forward(self, t, keep, held=False, after=()):
        if not keep:
            return self._values(t, True, False, after=after)[0], ()
        if self.kernel and not torch.compiler.is_compiling() and (self.transposes or not held):
            # an eager call keeps the codes backward reads (half a byte an element, as the
            # eager Function keeps them), made in the forward's one pass: the columnwise
            # ones, or for 16x16 blocks the rowwise ones, which dgrad reads transposed
            col = not self.transposes
            key_row, key_col = self._keys(t, True, col)
            rd, rsc, rg, cd, csc, cg, rv, _ = nvfp4_quantize(
                t, key_row, key_col, True, col, self.rht, self.two_d, True, False, True)
            return Exact(rv, rg), ((cd, csc, cg) if col else (rd, rsc, rg))
        if self.transposes:
            row = self.rowwise(t)
            return row, (row.values, row.divisor)
        row, col = self._values(t, True, True, after=after)
        return row, (col.values, col.divisor)

    # save_columnwise keeps ``t`` itself: where the columnwise values take a pass of their
    # own (a hybrid's columnwise half, a weight), the backward makes them. They are as
    # large as a bf16 ``t``, which the backward may hold anyway, and the forward, whose
    # host time a step exposes, launches one quantize less. Stochastic rounding draws the
    # key now all the same: eager quantizes both directions in the forward, and a key
    # drawn in the backward would come from another point of the generator's sequence
    # (the backward runs the layers in reverse).

    def save_columnwise(self, t, after=()):
        if not self.sr:
            return (t,)
        return (t, self._keys(t, False, True, after=after)[1])

    def saved_columnwise(self, saved, grad=None):
        if len(saved) == 1:
            return self.columnwise(saved[0])
        if len(saved) == 2 and _is_key(saved[1]):  # (t, its columnwise key)
            return self._column_values(saved[0], saved[1])
        if len(saved) == 3:  # the codes an eager forward kept: their values first
            data, scale, glob = saved
            saved = (nvfp4_dequantize_unscaled_bf16(data, scale, self.two_d), glob)
        values, divisor = saved
        if self.transposes:
            return Exact(values.t().contiguous(), divisor)
        return Exact(values, divisor, self.rht and self.kernel)

    def columnwise(self, t):
        if self.transposes:  # one global scale and the same blocks either way
            row = self.rowwise(t)
            return Exact(row.values.t().contiguous(), row.divisor)
        return self._values(t, False, True)[1]

    def grad(self, t, row, col):
        if not (row or col):
            return None, None
        return self._values(t, row, col, grad=True)


@dataclass(frozen=True)
class GivenFP4(GraphOperand):
    """An NVFP4 weight without the transform that arrives quantized (an ``NVFP4Tensor``:
    FSDP2's quantized all-gather, ``quantized_model_init``): the values of its own codes,
    as eager's GEMMs read them. In 16x16 tiles (``two_d``) the columnwise values are the
    rowwise ones transposed (one global scale, the same tiles): the backward keeps the
    rowwise codes, half a byte an element (a gathered weight's own buffers, which FSDP
    gathers again for the backward), and dgrad reads their values transposed. In 1x16
    blocks dgrad reads the weight's columnwise codes: kept from the forward where the
    weight holds them, else (``columnwise_in_backward``) the buffers of its rowwise codes,
    which the backward's own gather fills with the columnwise ones transposed, read in the
    backward (the global scale is one for both directions without the transform)."""

    kernel: bool = False
    two_d: bool = True
    columnwise_in_backward: bool = False
    given = True

    def kind(self, usage):
        return _KINDS[False, self.kernel]

    def _values(self, data, scale, glob) -> Exact:
        if self.kernel:
            return Exact(nvfp4_dequantize_unscaled_bf16(data, scale.view(torch.uint8),
                                                        self.two_d), glob)
        return Exact(dequantize_matrix(data, scale, glob, two_d=self.two_d))

    def rowwise(self, w):
        return self._values(w.rowwise_data, w.rowwise_scale, w.rowwise_global)

    def save_columnwise(self, w, after=()):
        if self.two_d or self.columnwise_in_backward:
            return (w.rowwise_data, w.rowwise_scale, w.rowwise_global)
        return (w.columnwise_data, w.columnwise_scale, w.columnwise_global)

    def saved_columnwise(self, saved, grad=None):
        if self.two_d:
            row = self._values(*saved)
            return Exact(row.values.t().contiguous(), row.divisor)
        data, scale, glob = saved
        if self.columnwise_in_backward:
            data, scale = gathered_columnwise(data, scale, grad, 2, BLOCK)
        return self._values(data, scale, glob)

    def columnwise(self, w):
        return self.saved_columnwise(self.save_columnwise(w))
