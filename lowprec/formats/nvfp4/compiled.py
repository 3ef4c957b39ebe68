"""NVFP4 in a traced graph (``lowprec.linear.traced``): each direction's values as
eager's GEMMs read them, and the stochastic-rounding keys drawn where eager draws them.

* With the kernels (CUDA with Triton) a direction is the exact bf16 ``q * d`` that
  eager's quantize writes for its bf16 GEMM (``launch.nvfp4_quantize`` with
  ``codes=False``), with the global encode scale ``S`` as the GEMM's divisor: the same op,
  so the same bits.
* Elsewhere it is what eager's fp32 emulation multiplies: the reference's ``(q * d) / S``
  in fp32, a columnwise direction carrying the RHT brought back to the original domain
  (``NVFP4Tensor._dequantize_2d``), and no divisor. The caller rounds a bf16 input first
  (a fused producer hands on fp32 values, see ``linear.traced_steps``).
* Keys: eager draws one key per quantized direction from torch's default generator when
  it quantizes, rowwise first (``NVFP4Quantizer._kernel_keys``). ``torch.randint`` traced
  into a graph would draw from the compiler's own generator, so :func:`draw_keys` is an op
  that calls eager's ``draws.draw_key``. It reads the tensor being quantized, which places
  it after that tensor's producer. A forward operand's draws (:func:`draw_keys_ordered`)
  are an *ordered* effectful op besides: the compiler threads one effect token through
  them, so draws with no data dependency between them (two layers' forward keys, two
  experts') keep the order eager drew them in, where the scheduler could swap them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...kernels import graph_op, register_ordered
from ..rht import rht_forward, rht_inverse
from .draws import draw_key, uniforms
from .launch import exact_values, nvfp4_quantize, quantize_outputs
from .reference import dequantize_matrix, quantize_matrix


def keys(anchor: Tensor, count: int, ordered: bool = False, after: tuple = ()):
    """:func:`draw_keys` in a graph (:func:`draw_keys_ordered` for ``ordered``, drawn after
    the tensors ``after`` exist); an eager call draws them directly (a list)."""
    if torch.compiler.is_compiling():
        if ordered:
            return draw_keys_ordered(anchor, count, list(after))
        return draw_keys(anchor, count)
    return [draw_key(None, anchor.device) for _ in range(count)]


def _draw(anchor: Tensor, count: int) -> Tensor:
    return torch.stack([draw_key(None, anchor.device) for _ in range(count)])


@graph_op("nvfp4_draw_keys", tags=(torch.Tag.nondeterministic_seeded,))
def draw_keys(anchor: Tensor, count: int) -> Tensor:
    """``count`` stochastic-rounding keys, (count, 2) int64 on ``anchor``'s device, drawn
    one after another from its default generator as eager's quantize draws them. For a
    gradient's keys: the gradient itself orders the draw (it exists once the layer above's
    backward made it)."""
    return _draw(anchor, count)


@graph_op("nvfp4_draw_keys_ordered", tags=(torch.Tag.nondeterministic_seeded,))
def draw_keys_ordered(anchor: Tensor, count: int, after: list[Tensor]) -> Tensor:
    """:func:`draw_keys` for a forward operand's keys, as an ordered effectful op: nothing
    in the data orders two layers' (or two experts') forward draws, so AOT autograd
    threads an effect token through them. Inductor (2.11-2.13) does not order its
    kernels by that token (the dependency it records is filed under the buffer's name,
    and its scheduler looks it up under the operation's), so a draw whose anchor is ready
    early (a weight) can run before one traced ahead of it; ``after`` (the forms of the
    same call made before this one, unread) makes that order a data dependency. (The
    token costs compile time, so the gradients' draws, which their data orders, do
    without it.)"""
    return _draw(anchor, count)


torch.library.register_fake("lowprec::nvfp4_draw_keys")(
    lambda anchor, count: anchor.new_empty((count, 2), dtype=torch.int64))
torch.library.register_fake("lowprec::nvfp4_draw_keys_ordered")(
    lambda anchor, count, after: anchor.new_empty((count, 2), dtype=torch.int64))

register_ordered(draw_keys_ordered)


def _values(x2d: Tensor, key_row: Optional[Tensor], key_col: Optional[Tensor],
            rowwise: bool, columnwise: bool, rht: bool, two_d: bool):
    if x2d.numel():
        return exact_values(x2d, key_row, key_col, rowwise, columnwise, rht, two_d)
    _, _, rs, _, _, cs, rv, cv = nvfp4_quantize(x2d, key_row, key_col, rowwise, columnwise,
                                                rht, two_d, rowwise, columnwise, False)
    return rv, rs, cv, cs


@graph_op("nvfp4_graph_values")
def _graph_values(x2d: Tensor, key_row: Optional[Tensor], key_col: Optional[Tensor],
                  rowwise: bool, columnwise: bool, rht: bool,
                  two_d: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(rowwise ``q * d``, its S, columnwise ``q * d``, its S): eager's quantize launches
    with ``codes=False`` (a graph op costs a third of the custom op's host time)."""
    return _values(x2d, key_row, key_col, rowwise, columnwise, rht, two_d)


def _drawn_keys(x2d: Tensor, rowwise: bool, columnwise: bool):
    key_row = draw_key(None, x2d.device) if rowwise else None
    return key_row, draw_key(None, x2d.device) if columnwise else None


@graph_op("nvfp4_graph_values_drawn", tags=(torch.Tag.nondeterministic_seeded,))
def _graph_values_drawn(x2d: Tensor, rowwise: bool, columnwise: bool, rht: bool,
                        two_d: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_graph_values` with stochastic rounding, its keys drawn in the op as
    :func:`draw_keys` draws them (rowwise first): one op for a gradient, whose data orders
    the draw, where a separate draw would cost a second op's host time."""
    return _values(x2d, *_drawn_keys(x2d, rowwise, columnwise), rowwise, columnwise, rht,
                   two_d)


@torch.library.register_fake("lowprec::nvfp4_graph_values")
def _graph_values_fake(x2d, key_row, key_col, rowwise, columnwise, rht, two_d):
    outs = quantize_outputs(x2d, rowwise, columnwise, two_d, rowwise, columnwise, False)
    return outs[6], outs[2], outs[7], outs[5]


@torch.library.register_fake("lowprec::nvfp4_graph_values_drawn")
def _graph_values_drawn_fake(x2d, rowwise, columnwise, rht, two_d):
    return _graph_values_fake(x2d, None, None, rowwise, columnwise, rht, two_d)


def kernel_values(x2d: Tensor, rowwise: bool, columnwise: bool, *, rht: bool, two_d: bool,
                  key_row: Optional[Tensor] = None, key_col: Optional[Tensor] = None,
                  draw: bool = False):
    """((rowwise bf16 ``q * d``, S), (columnwise (K, M) ``q * d``, S)) of a 2-D CUDA input
    in one pass of eager's kernels; a direction not asked for is (None, None). ``draw``:
    stochastic rounding with keys drawn now, rowwise first (a gradient's; the keys are
    then not given). An eager call launches them directly (no op dispatch)."""
    if torch.compiler.is_compiling():
        if draw:
            rv, rs, cv, cs = _graph_values_drawn(x2d, rowwise, columnwise, rht, two_d)
        else:
            rv, rs, cv, cs = _graph_values(x2d, key_row, key_col, rowwise, columnwise, rht,
                                           two_d)
    else:
        if draw:
            key_row, key_col = _drawn_keys(x2d, rowwise, columnwise)
        rv, rs, cv, cs = _values(x2d, key_row, key_col, rowwise, columnwise, rht, two_d)
    return (rv, rs) if rowwise else (None, None), (cv, cs) if columnwise else (None, None)


def reference_values(x: Tensor, rowwise: bool, *, rht: bool, two_d: bool,
                     key: Optional[Tensor] = None) -> Tensor:
    """fp32 values of one direction of the 2-D fp32 ``x`` as eager's fp32 emulation reads
    them: rowwise (M, K), columnwise (K, M) in the original domain."""
    m = x if rowwise else x.t().contiguous()
    if rht and not rowwise:
        m = rht_forward(m)
    rand = None if key is None else uniforms(key, *m.shape)
    values = dequantize_matrix(*quantize_matrix(m, two_d=two_d, rand=rand), two_d=two_d)
    return rht_inverse(values) if rht and not rowwise else values
