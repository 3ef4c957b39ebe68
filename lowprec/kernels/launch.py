"""``launch(kernel, grid, *args, **kwargs)``: ``kernel[grid](*args, **kwargs)`` for less host time.

A Triton launch through ``JITFunction.run`` spends most of its host time outside the
launch itself: it looks up the current device and stream, turns the options into a string
for its cache key, builds launch metadata, checks the globals the kernel read and then
calls the compiled kernel's C launcher. Measured on an H200 host (Triton 3.6,
``tools/launch_cost.py``): 26 us a launch that way, 9.6 us calling the C launcher
directly. A quantized Linear step makes 6-14 launches, and small steps are bound by the
host.

:func:`launch` keeps the part that decides *which* compiled kernel runs, Triton's own
binder (the same specialization: dtypes, 16-byte alignment of pointers and integers,
integers equal to 1), and keys its cache on that specialization and the launch options.
On a miss it launches through ``kernel[grid]``, which compiles when needed and
hands back the compiled kernel it ran; on a hit it calls that kernel's launcher directly on
the current stream. Anything it does not cover takes the ordinary path: launch hooks (a
profiler's; Triton 3.6 keeps an empty hook chain when there are none), pre-run hooks, a
callable grid, Triton's interpreter or a stand-in object, and the whole fast path inside
:class:`slow_launches` (for A/B comparisons and to rule it out). What the fast path skips,
Triton's check that the globals a kernel read have not changed since it was compiled,
holds here: lowprec's kernels read only constants.
"""

from __future__ import annotations

import functools

import torch

from . import FlagOff

_enabled = True

#: (id(kernel), device, specialization, options) -> (kernel, compiled kernel); keyed by id
#: because hashing a JITFunction takes a lock
_compiled: dict = {}


class slow_launches(FlagOff):
    """Context manager: every launch goes through ``JITFunction.run`` (see module doc)."""

    _module, _flag = __name__, "_enabled"


@functools.lru_cache(maxsize=None)
def _knobs():
    """Triton's knobs when this Triton's ``JITFunction`` internals are the ones the
    fast path was written against (3.6: ``device_caches[device][4]`` is the binder), else
    None: every launch then takes the ordinary path."""
    import triton
    from triton import knobs
    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    return knobs if (major, minor) == (3, 6) else None


def _quiet(hook) -> bool:
    """Whether a launch hook slot calls nothing: None, or Triton's empty ``HookChain``."""
    return hook is None or getattr(hook, "calls", None) == []


def _remember(key, kernel, compiled) -> None:
    """Caches ``compiled``, what ``kernel[grid](...)`` just ran, under ``key`` (None: the
    arguments had no hashable key)."""
    if hasattr(compiled, "result"):  # an asynchronous compile's future
        compiled = compiled.result()
    if key is not None and compiled is not None:
        _compiled[key] = (kernel, compiled)


def launch(kernel, grid, *args, **kwargs) -> None:
    """Launch ``kernel`` (a ``@triton.jit`` or Gluon kernel) on ``grid`` (a tuple of up
    to three ints), as ``kernel[grid](*args, **kwargs)`` does, on the current device and
    stream."""
    caches = getattr(kernel, "device_caches", None) if _enabled else None
    knobs = _knobs() if caches is not None else None
    if knobs is None or kernel.pre_run_hooks or callable(grid) \
            or not _quiet(knobs.runtime.launch_enter_hook) \
            or not _quiet(knobs.runtime.launch_exit_hook):
        kernel[grid](*args, **kwargs)
        return
    # the two options JITFunction.run adds before binding: part of the key, so turning
    # Triton's debug mode (device asserts) or an instrumentation on takes effect here too
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    device = torch.cuda.current_device()
    first = device not in caches  # the kernel's first launch here builds its binder
    if first:
        compiled = kernel[grid](*args, **kwargs)
    bound, specialization, options = caches[device][4](*args, **kwargs)
    key = (id(kernel), device, tuple(specialization), tuple(options.items()))
    try:
        hit = _compiled.get(key)
    except TypeError:  # an unhashable constexpr or option: no cache entry for it
        key = hit = None
    if first:
        _remember(key, kernel, compiled)
        return
    if hit is None or hit[0] is not kernel:
        _remember(key, kernel, kernel[grid](*args, **kwargs))
        return
    compiled = hit[1]
    stream = torch._C._cuda_getCurrentRawStream(device)
    n = len(grid)
    compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, None, None, None,
                 *bound.values())
