"""Triton launches with less host time than ``kernel[grid](...)``.

A quantized Linear step on a 16384-token batch is bound by host time on an H200 host: one
``kernel[grid](...)`` costs about 30 us of Python there (binding and specializing every
argument, building a cache key from them, reading Triton's knobs), and a step makes a dozen
launches. :func:`launch` does the first launch of each (kernel, argument specialization,
constexprs) the normal way, keeps the compiled kernel Triton returns, and afterwards calls
its launcher directly, as ``JITFunction.run`` itself does once it has found the kernel.

The cache key holds everything Triton specializes a compiled kernel on: each tensor's dtype
and 16-byte alignment, each integer's value 1 / divisibility by 16 / 64-bit range, the
constexprs and launch options, and the device. Anything else in an argument list (a type
this module does not know) takes the normal path. The direct call relies on Triton 3.6's
``CompiledKernel`` interface, so other Triton versions always take the normal path.
"""

from __future__ import annotations

import torch

#: Set False to launch every kernel the normal way (for A/B timing).
ENABLED = True

_cache: dict = {}
_supported: bool | None = None


def _fast_path_supported() -> bool:
    global _supported
    if _supported is None:
        import triton
        _supported = triton.__version__.startswith("3.6.")
    return _supported


def _jit_function():
    from triton.runtime.jit import JITFunction
    return JITFunction


def _spec(a):
    """What Triton specializes a compiled kernel on for the runtime argument ``a``."""
    t = type(a)
    if t is bool:
        return ("b", a)
    if t is int:
        return ("i", a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31))
    if t is float:
        return "f"
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    raise TypeError  # unknown to the fast path: launch the normal way


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``: runtime arguments positional, constexprs and
    launch options (``num_warps``, ``enable_fp_fusion``...) as keywords."""
    if not (ENABLED and _fast_path_supported() and type(kernel) is _jit_function()):
        kernel[grid](*args, **kwargs)  # also the interpreter's kernels (TRITON_INTERPRET=1)
        return
    from triton import knobs
    from triton.runtime.driver import driver
    device = driver.active.get_current_device()
    try:
        key = (kernel, device, tuple(map(_spec, args)), tuple(sorted(kwargs.items())))
        entry = _cache.get(key)
    except TypeError:  # an argument the key cannot describe (or an unhashable option)
        kernel[grid](*args, **kwargs)
        return
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        # every parameter after the positional ones, in order: keyword or default value
        tail = tuple((p.name, p.default) for p in kernel.params[len(args):])
        compiled.run  # loads the binary: function handle and launcher exist from here on
        _cache[key] = (compiled, tail)
        return
    compiled, tail = entry
    full = args + tuple(kwargs.get(name, default) for name, default in tail)
    stream = driver.active.get_current_stream(device)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *full),
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *full)
