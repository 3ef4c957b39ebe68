"""Measuring what the collectives move (for tests and benchmarks)."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

#: the tensor all-gathers FSDP2 calls (by torch version)
_ALL_GATHERS = ("all_gather_into_tensor", "all_gather_single")


class AllGatherBytes:
    """Bytes of the all-gather outputs seen so far (what this rank receives)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0


@contextlib.contextmanager
def count_all_gather_bytes():
    """Inside, count the bytes of every tensor all-gather this process runs through
    ``torch.distributed`` (FSDP2's parameter gathers among them); yields the counter."""
    counter = AllGatherBytes()
    saved = {}

    def counting(fn):
        def wrapper(output_tensor, input_tensor, *args, **kwargs):
            counter.bytes += output_tensor.numel() * output_tensor.element_size()
            counter.calls += 1
            return fn(output_tensor, input_tensor, *args, **kwargs)
        return wrapper

    for name in _ALL_GATHERS:
        fn = getattr(dist, name, None)
        if fn is not None:
            saved[name] = fn
            setattr(dist, name, counting(fn))
    try:
        yield counter
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
