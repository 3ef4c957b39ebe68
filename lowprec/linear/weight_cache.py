"""Quantized weights reused across micro-batches (``lowprec.autocast(cache_weights=True)``).

With gradient accumulation a weight keeps its values over several forwards, between
two optimizer steps; quantizing it again in each is wasted work (Transformer Engine asks
the caller for ``is_first_microbatch``). Here the weight itself says when it changed: a
quantized copy is reused while the weight's version counter and storage are those it was
made from and the slot's quantizer is the same object. An optimizer step (an in-place
update, which bumps the version) or a recipe switch (new quantizers) makes the next
forward quantize again. Writes through ``weight.data`` bypass the version counter and
are not seen.

Cost: each cached weight holds its quantized copy (the usages training needs) until the
next re-quantization or until the weight is freed.
"""

from __future__ import annotations

import weakref

import torch

from ..formats import Quantizer

#: id(weight) -> (weak reference to the weight, (version, data_ptr, cast dtype), quantizer,
#: columnwise, quantized copy); an entry goes when its weight is freed. (Keyed by id: a
#: WeakKeyDictionary would compare tensors with ``==``.)
_CACHE: dict = {}


def _forget(key: int):
    def callback(_ref) -> None:
        _CACHE.pop(key, None)
    return callback


def cached_weight(weight: torch.Tensor, quantizer: Quantizer, *, columnwise: bool,
                  dtype: torch.dtype | None = None):
    """``weight`` (cast to ``dtype`` where given: torch.autocast) quantized by ``quantizer``
    with the rowwise usage (and the columnwise one when asked), reused from an earlier call
    while the weight and quantizer are unchanged."""
    key = (weight._version, weight.data_ptr(), dtype)
    entry = _CACHE.get(id(weight))
    if entry is not None:
        ref, ekey, equantizer, ecol, quantized = entry
        if (ref() is weight and ekey == key and equantizer is quantizer
                and (ecol or not columnwise)):
            return quantized
    with quantizer.usages(rowwise=True, columnwise=columnwise):
        quantized = quantizer.quantize(weight.detach().to(dtype or weight.dtype))
    _CACHE[id(weight)] = (weakref.ref(weight, _forget(id(weight))), key, quantizer,
                          columnwise, quantized)
    return quantized


def clear() -> None:
    """Drop every cached quantized weight (their memory is freed)."""
    _CACHE.clear()


def cached_value(weights, owner, make):
    """``make()`` (any value derived from the tensors ``weights`` for ``owner``, e.g. the
    quantized experts of a 3-D weight or of a list of 2-D ones, and their scales), reused
    while every weight's version and storage and ``owner`` (compared by identity) are those
    it was made from. Kept with the first weight."""
    first = weights[0]
    key = tuple((w._version, w.data_ptr()) for w in weights)
    entry = _CACHE.get(id(first))
    if entry is not None:
        ref, ekey, eowner, _, value = entry
        if ref() is first and ekey == key and eowner is owner:
            return value
    value = make()
    _CACHE[id(first)] = (weakref.ref(first, _forget(id(first))), key, owner, True, value)
    return value
