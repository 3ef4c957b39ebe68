"""Which device's GEMM routes a call takes.

A GEMM's route (``lowprec.gemm``'s backends, ``lowprec.gemm.route``) depends on
the device: cuBLAS FP8 and the exact bf16 emulation on CUDA, the fp32 emulation on the CPU.
:class:`cuda_routes` makes CPU calls on this thread decide as CUDA calls do and run each
CUDA route's computation with CPU ops (``torch._scaled_mm``'s CPU kernel, the bf16 GEMM,
the block-scaled product from its scales), so the route decisions of every operand pair,
eager and traced, and their agreement are tested on a machine without a GPU. The bits of
a CUDA library call are not the CPU's: what the simulation shows is which route each form
takes, and that both forms take the same one.
"""

from __future__ import annotations

import threading

import torch

from ..kernels import ThreadFlagOn, triton_available
from .table import GroupedDevice

_LOCAL = threading.local()


def routes_cuda(*tensors: torch.Tensor) -> bool:
    """Whether a GEMM of ``tensors`` takes the CUDA routes: they are CUDA tensors, or this
    thread is inside :class:`cuda_routes`."""
    return getattr(_LOCAL, "cuda", False) or all(t.is_cuda for t in tensors)


class cuda_routes(ThreadFlagOn):
    """Context manager: within the block, GEMMs of CPU tensors on this thread take the
    CUDA routes (see the module docstring). The CPU autograd engine runs a CPU backward
    on the thread that called ``backward``, so a backward inside the block takes them too."""

    _local, _flag = _LOCAL, "cuda"


def block_scaled_mm_cpu(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                        scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm(a, b, scale_a, scale_b)`` with cuBLAS's block scales (1x128 or
    128x128 decode scales of (M, K) ``a`` and (K, N) ``b``) on the CPU: each operand's
    values times its block's decode scale, multiplied in fp32 (cuBLAS's CPU stand-in
    under :class:`cuda_routes`)."""
    def expanded(data, scale, rows, cols):
        s = scale.to(torch.float32)
        rb = -(-rows // s.shape[0])
        cb = -(-cols // s.shape[1])
        s = s.repeat_interleave(rb, 0)[:rows].repeat_interleave(cb, 1)[:, :cols]
        return data.to(torch.float32) * s
    m, k = a.shape
    n = b.shape[1]
    # 1x128 scales of a arrive (M, K/128); of b (K/128, N); 128x128 ones by blocks
    av = expanded(a, scale_a, m, k)
    bv = expanded(b, scale_b, k, n)
    return (av @ bv).to(out_dtype)


_GROUPED_DEVICES: dict = {}


def grouped_device(t: torch.Tensor) -> GroupedDevice:
    """What ``t``'s device offers the grouped routes (``table.grouped_route``)."""
    if torch.compiler.is_compiling():
        # (a traced autograd.Function asks too, where dynamo refuses a write to a global)
        return _described(t)
    got = _GROUPED_DEVICES.get(t.device)
    if got is None:
        got = _GROUPED_DEVICES[t.device] = _described(t)
    return got


def _described(t: torch.Tensor) -> GroupedDevice:
    hopper = t.is_cuda and torch.cuda.get_device_capability(t.device) >= (9, 0)
    return GroupedDevice(hopper=hopper, triton=hopper and triton_available(),
                         grouped_mm=hasattr(torch, "_grouped_mm"),
                         scaled_grouped_mm=hasattr(torch, "_scaled_grouped_mm"))
