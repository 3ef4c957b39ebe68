"""Host cost of one Triton launch, taken apart (tight loops on tiny tensors).

* ``jit``: ``kernel[grid](...)`` as lowprec launches (binder, cache lookup, launcher);
* ``run(tensors)`` (every parameter, constexprs too, as ``JITFunction.run`` passes them): the
  compiled kernel's launcher called directly with the tensors;
* ``run(ints)``: the same with the pointers passed as ints (no ``data_ptr()`` call and no
  ``cuPointerGetAttribute`` per pointer in Triton's C launcher);
* torch ops for scale: ``torch.zeros(1)`` (an allocation and a fill), ``x.add_(1)``;
* ``cuPointerGetAttribute`` alone (ctypes, libcuda), what the launcher calls per pointer.

    python tools/launch_cost.py
"""

from __future__ import annotations

import ctypes
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _probe_kernel(p0, p1, p2, p3, p4, p5, p6, p7, n0, n1, n2, n3, f0, B: tl.constexpr):
    if tl.program_id(0) < 0:  # never true: the launch is what is timed
        tl.store(p0 + n0, tl.load(p1 + n1) * f0)


def per_call_us(fn, n=2000, runs=7):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    best.sort()
    return best[runs // 2]


def main():
    ts = [torch.zeros(64, device="cuda") for _ in range(8)]
    ints = (64, 128, 256, 7)
    args = (*ts, *ints, 1.5)
    k = _probe_kernel[(4,)](*args, B=1)  # compiles; returns the CompiledKernel
    stream = torch.cuda.current_stream().cuda_stream
    md = k.launch_metadata((4,), stream, *args)

    def jit():
        _probe_kernel[(4,)](*args, B=1)

    def run_tensors():
        k.run(4, 1, 1, stream, k.function, k.packed_metadata, md, None, None, *args, 1)

    ptrs = tuple(t.data_ptr() for t in ts)
    iargs = (*ptrs, *ints, 1.5)

    def run_ints():
        k.run(4, 1, 1, stream, k.function, k.packed_metadata, md, None, None, *iargs, 1)

    x = torch.zeros(64, device="cuda")
    libcuda = ctypes.CDLL("libcuda.so.1")
    out = ctypes.c_uint64()

    def get_attr8():
        for p in ptrs:
            libcuda.cuPointerGetAttribute(ctypes.byref(out), 2, ctypes.c_uint64(p))

    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    for name, fn in (("jit launch (8 tensors, 5 scalars)", jit),
                     ("launcher, tensors", run_tensors), ("launcher, int pointers", run_ints),
                     ("torch.zeros(1)", lambda: torch.zeros(1, device="cuda")),
                     ("x.add_(1)", lambda: x.add_(1)),
                     ("8 x cuPointerGetAttribute (ctypes)", get_attr8),
                     ("8 x t.data_ptr()", lambda: [t.data_ptr() for t in ts])):
        print(f"  {name:40s} {per_call_us(fn):7.2f} us")


if __name__ == "__main__":
    main()
