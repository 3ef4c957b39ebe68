"""Zeroed int32 scratch that the kernels reading it leave zeroed again.

A kernel that combines its programs' results with atomics (the NVFP4 amax pass: two
maxima and a ticket counter) needs zeroed scratch, and a memset a call costs a launch's
worth of host time, which a compiled step pays once per quantize. A kernel whose last
program returns the scratch to zero can share one buffer per device and stream instead:
launches on one stream run in order, so each finds it zeroed. During CUDA graph capture
each call gets a fresh zeroed tensor (the graph's pool then owns it).
"""

from __future__ import annotations

import torch

#: (device index, raw stream, length) -> the shared zeroed int32 scratch
_held: dict = {}


def zeroed_scratch(n: int, device: torch.device) -> torch.Tensor:
    """An int32 (n,) zeroed tensor on ``device`` for a kernel that leaves it zeroed (see
    the module doc); shared by every such call on the current stream."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, torch._C._cuda_getCurrentRawStream(idx), n)
    ws = _held.get(key)
    if ws is None:
        ws = _held[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return ws
