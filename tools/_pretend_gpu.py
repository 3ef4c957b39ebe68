"""Not a script: what ``backward_speculation.py`` and ``compile_costs.py --pretend`` use to
take lowprec's GPU code path on a machine without one. CPU tensors stand in for CUDA ones:
the kernel switch says yes, each Triton launch is a no-op, ``torch._scaled_mm`` returns an
empty result and the traced plans pick CUDA's GEMM routes, so what dynamo and AOT autograd
trace is what they trace on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lowprec.kernels as kernels  # noqa: E402
from lowprec.kernels import launch as kernel_launch  # noqa: E402


def pretend_gpu() -> None:
    """Route CPU tensors through the GPU path with no-op launches and GEMMs."""
    def use_kernels(t):
        return True
    kernels.use_kernels.__code__ = use_kernels.__code__
    kernels._triton_found = None

    def launch(kernel, grid, *args, **kwargs):
        return None
    kernel_launch.launch.__code__ = launch.__code__

    def bind(kernel, grid, n, *args, **kwargs):
        return lambda *tensors: None

    def fast_launches():
        return True
    kernel_launch.bind.__code__ = bind.__code__
    kernel_launch.fast_launches.__code__ = fast_launches.__code__

    class _NoKernel:  # what BoundCalls binds: a launcher that launches nothing
        function = packed_metadata = None

        @staticmethod
        def run(*args):
            return None

    def bound_values(kernel, grid, args, kwargs):
        return _NoKernel, [None] * len(kernel.arg_names), 0
    kernel_launch._bound_values = bound_values
    torch.cuda.current_device = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda index: 0
    torch.cuda.is_current_stream_capturing = lambda: False

    def scaled_mm(a, b, scale_a=None, scale_b=None, bias=None, out_dtype=None, **kw):
        return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype or a.dtype)
    torch._scaled_mm = scaled_mm
    from lowprec.gemm import cublas_fp8
    cublas_fp8._on_cuda = lambda ad, bd: True  # both per-tensor and block backends ask it
    from lowprec.linear import traced
    gpu_route = traced.route
    # the traced plan's GEMM table as on CUDA (cuBLAS FP8, not the fp32 emulation)
    traced.route = lambda a, b, m, n, k, out, bias, cuda: gpu_route(a, b, m, n, k, out, bias,
                                                                    True)
