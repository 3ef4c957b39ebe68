"""The Python a quantized Linear step runs, counted and timed on any machine (no GPU).

CPU tensors stand in for CUDA ones and take the GPU code path: the kernel switch says yes,
each Triton launch is a no-op and ``torch._scaled_mm`` returns an empty result. What is
left is lowprec's own host work (Python, tensor bookkeeping, allocations) in the order a
GPU run does it, so host-side changes can be compared here before spending device time.
A CUDA host adds the launches, its allocator and cache misses on top (in a full step a
CUDA host runs this Python about 2x slower than in a tight loop).

    python tools/host_calls.py [--recipes current,mxfp8] [--forward] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lowprec  # noqa: E402
import lowprec.kernels as kernels  # noqa: E402
from lowprec.kernels import launch as kernel_launch  # noqa: E402


def _pretend_gpu() -> None:
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


def step_fn(module, recipe, x, dy, backward: bool = True):
    """One training step of ``module`` (its forward alone with ``backward=False``: the part
    an eager Hugging Face step exposes, see docs/performance.md)."""
    def step():
        if recipe is None:
            y = module(x)
        else:
            with lowprec.autocast(recipe=recipe):
                y = module(x)
        if backward:
            y.backward(dy)
    return step


def time_us(fn, n=300, repeats=5) -> float:
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="current")
    p.add_argument("--shape", default="128x256x256")
    p.add_argument("--profile", action="store_true", help="print the busiest functions")
    p.add_argument("--sort", default="cumulative", help="pstats sort key for --profile")
    p.add_argument("--lines", type=int, default=60)
    p.add_argument("--forward", action="store_true",
                   help="time the forward alone (x still requires grad)")
    args = p.parse_args()
    _pretend_gpu()
    m, k, n = (int(v) for v in args.shape.split("x"))
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)

    def plain():
        y = lin(x)
        if not args.forward:
            y.backward(dy)
    print(f"{'bf16 nn.Linear':12s} {time_us(plain):8.1f} us")
    for name in args.recipes.split(","):
        recipe = None if name == "none" else lowprec.recipe.Recipe.from_name(name)
        module = lowprec.Linear(k, n, bias=False, params_dtype=torch.bfloat16)
        step = step_fn(module, recipe, x, dy, backward=not args.forward)
        us = time_us(step)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(100):
            step()
        pr.disable()
        stats = pstats.Stats(pr)
        calls = sum(v[1] for v in stats.stats.values()) / 100
        print(f"{name:12s} {us:8.1f} us   {calls:6.0f} function calls a step")
        if args.profile:
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(args.sort).print_stats(args.lines)
            print(s.getvalue())


if __name__ == "__main__":
    main()
