"""Where a graphed Linear's CUDA graphs read a tensor they are handed (an input, dY):
where it lies, or from a buffer it is copied into (``lowprec.linear.graphed``)."""

from __future__ import annotations

import threading
import weakref

import torch


def mark(t: torch.Tensor) -> tuple:
    """``t`` as it is now (a weak reference and its version), for :func:`unchanged`."""
    return weakref.ref(t), t._version


def unchanged(marked: tuple | None, t: torch.Tensor) -> bool:
    """Whether ``t`` is the tensor ``marked`` was taken of, unchanged since."""
    return marked is not None and marked[0]() is t and marked[1] == t._version


def layout(t: torch.Tensor) -> tuple:
    """What a graph that reads ``t`` where it lies checks of a later tensor."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


class At:
    """A graph's view of the tensor it was captured on, read where it lies: a later call
    whose tensor lies at the same address, in the same layout, replays without a copy. The
    caching allocator hands a training step's tensors the same memory step after step, so
    in steady state a replay copies nothing in. The view does not own the memory (the
    tensor it was made from may be freed and its memory reused): a graph reads it only
    while it replays for a tensor that lies there."""

    def __init__(self, t: torch.Tensor):
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        memory = torch._C._construct_storage_from_data_pointer(
            t.data_ptr(), t.device, span * t.element_size())
        self.buffer = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            memory, 0, t.shape, t.stride())
        self.layout = layout(t)

    def accepts(self, t: torch.Tensor) -> bool:
        return layout(t) == self.layout

    def fill(self, t: torch.Tensor) -> bool:
        """Nothing to copy: the graph reads ``t`` where it lies. (Whether it copied.)"""
        return False


class Input:
    """A buffer that graphs copy a tensor into. ``shared``: read only while a graph replays
    (a forward's input that the forward does not save, a backward's dY), so every such
    graph of one layout shares it, and graphs that read one tensor in a row (q/k/v,
    gate/up) copy it in once: the buffer knows which tensor (and which version of it) it
    holds."""

    def __init__(self, like: torch.Tensor, shared: bool = False):
        self.buffer = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype,
                                          device=like.device)
        self.shared = shared
        self.holds = None  # ``mark`` of the tensor copied in last

    def accepts(self, t: torch.Tensor) -> bool:
        return True

    def fill(self, x: torch.Tensor) -> bool:
        """Copies ``x`` in unless the buffer holds it already; whether it copied."""
        if unchanged(self.holds, x):
            return False
        self.buffer.copy_(x)
        self.holds = mark(x)
        return True


class _Shared(threading.local):
    """This thread's shared buffers (inputs, dY), by (device, shape, strides, dtype); the
    graphs hold them, the table only finds them for the next capture."""

    def __init__(self):
        self.by_layout = weakref.WeakValueDictionary()

    def get(self, x: torch.Tensor) -> Input:
        key = (x.device, x.shape, x.stride(), x.dtype)
        found = self.by_layout.get(key)
        if found is None:
            found = self.by_layout[key] = Input(x, shared=True)
        return found


SHARED = _Shared()


def forward_source(t: torch.Tensor, where: bool):
    """What a forward graph reads ``t`` from: where it lies (``where``), else the shared
    buffer of its layout."""
    return At(t) if where and t.numel() > 0 else SHARED.get(t)
