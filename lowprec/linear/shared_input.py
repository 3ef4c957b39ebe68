"""One quantize of an input that several Linears read in a row.

q/k/v of an attention block, and gate/up of a gated MLP, are separate Linears called one
after the other on the same tensor. Under a stateless format (current-scaling and block
FP8, MXFP8: the quantized tensor is a function of the input and the settings alone) the
three quantizes of that tensor would give the same tensor three times; the autocast
region instead keeps the last one made, and a Linear whose input is the same tensor
(same object, unchanged since: its version counter), with an equal quantizer
(``Quantizer.share_key``) and the same usages, takes it. The result is unchanged bit for
bit, and the backward graphs of those Linears hold one columnwise copy between them
instead of one each.

A ``torch.utils.checkpoint`` recompute, which runs outside the region, shares in the
same way (its frame keeps the last quantize), so it runs the forward's ops.

Only the last quantize is kept, in the region (per thread), so what it holds beyond the
saved columnwise copy (the rowwise data fprop read) lives until the next Linear quantizes
another input, or the region ends.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..formats import QuantizedTensor, Quantizer
from ..memory import replaying_frame
from ..recipe import active_region


@dataclass
class _Last:
    source: weakref.ref
    version: int
    key: tuple
    quantized: QuantizedTensor
    hits: int = 0  # Linears that took it after the one that made it


def quantize(quantizer: Quantizer | None, x: torch.Tensor, *, columnwise: bool,
             exact: tuple[str, ...], make) -> QuantizedTensor | None:
    """The quantized ``x`` (rowwise, and columnwise when asked) shared with the Linears
    before this one that read it, made by ``make()`` where none was kept; None where
    sharing does not apply (outside a region, a stateful format, a quantized or
    inference-mode input, while tracing). The result is not the caller's to trim:
    it takes what it keeps with ``usage_copy``."""
    region = active_region()
    if region is None:  # a checkpoint's recompute shares as its forward's region did
        region = replaying_frame()
    # is_compiling first: dynamo cannot trace is_inference() (a graph break)
    if (region is None or quantizer is None or torch.compiler.is_compiling()
            or isinstance(x, QuantizedTensor) or x.is_inference()):
        return None
    share = quantizer.share_key()
    if share is None:
        return None
    return _kept_or_made(region, x, (share, columnwise, exact), make)


def _kept_or_made(region, x: torch.Tensor, key: tuple, make):
    """The region's last result for this same, unchanged ``x`` under ``key``, else
    ``make()``'s, kept in its place."""
    last = region.shared_input
    if (last is not None and last.key == key and last.source() is x
            and last.version == x._version):
        last.hits += 1
        return last.quantized
    made = make()
    region.shared_input = _Last(weakref.ref(x), x._version, key, made)
    return made


def shared_form(form, x: torch.Tensor, keep: bool, make):
    """``make()``, an eager call's (rowwise form, what backward keeps) of ``x`` under the
    traced form ``form`` (``lowprec.linear.traced``), shared as :func:`quantize` shares a
    quantized tensor: the Linears before this one that read the same, unchanged ``x`` with
    an equal form made it already. Only for forms that run eagerly (their quantize is a
    function of the input and the form's settings), inside a region, outside tracing."""
    if torch.compiler.is_compiling():
        return make()
    region = active_region()
    if region is None:  # a checkpoint's recompute shares as its forward's region did
        region = replaying_frame()
    if region is None or not form.eager or x.is_inference():
        return make()
    return _kept_or_made(region, x, ("form", form, keep), make)


def made_from(x: torch.Tensor) -> _Last | None:
    """The active region's kept quantize where ``x`` made it, else None (a CUDA graph's
    capture keeps it, so that the Linears after it read the quantize from its memory:
    ``lowprec.linear.graphed``)."""
    region = active_region()
    last = region.shared_input if region is not None else None
    return last if last is not None and last.source() is x else None


def lend(made: _Last, x: torch.Tensor) -> _Last | None:
    """Keeps ``made``'s quantize in the active region as made from ``x`` (as it is now), so
    that the next Linear reading ``x`` with an equal quantize takes it; returns the kept
    record, whose ``hits`` say whether one did (None outside a region)."""
    region = active_region()
    if region is None:
        return None
    region.shared_input = lent = _Last(weakref.ref(x), x._version, made.key, made.quantized)
    return lent
