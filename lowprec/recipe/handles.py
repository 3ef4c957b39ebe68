"""Handles: a CPU int64 scalar tensor naming a live Python object (a module, a delayed-scaling
state) to a compiled graph, whose host-side ops take tensors rather than objects. The graph
takes the handle as an input, so dynamo guards on its shape alone and same-shaped layers
share compiled code; the op finds the object by the handle's value when it runs."""

from __future__ import annotations

import itertools
import weakref

import torch

_LIVE: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def new_handle(obj) -> torch.Tensor:
    """A fresh handle naming ``obj`` while it lives (on the CPU whatever the default device:
    a module made under ``torch.device("meta")`` still has a readable one)."""
    key = next(_NEXT)
    _LIVE[key] = obj
    return torch.tensor(key, dtype=torch.int64, device="cpu")


def resolve(handle: torch.Tensor, what: str):
    """The live object ``handle`` names (RuntimeError naming ``what`` where it is gone)."""
    obj = _LIVE.get(int(handle.item()))
    if obj is None:
        raise RuntimeError(f"a compiled lowprec graph names a {what} that no longer exists")
    return obj
