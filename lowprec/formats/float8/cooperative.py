"""Current scaling in one cooperative launch (opt-in: ``tuning.one_launch_current``).

``current_quantize_kernel`` runs the amax pass and the cast of a current-scaling quantize
in one launch, with a grid-wide barrier between them. That needs every program of the grid
resident at once, which a cooperative launch guarantees (or the launch fails): the grid is
sized from the CUDA driver's occupancy of the compiled kernel. One launch instead of two
saves a launch's host time per quantize (in an H200 A/B: 67-93 us against 117-159 us a
quantize, the same GPU time). It is not the default: a grid that fills the GPU cannot start
until every SM has room for its program, so it waits for kernels of other streams (a
collective overlapped with compute) to leave, and its first programs spin meanwhile.
"""

from __future__ import annotations

import ctypes
import functools

from ...kernels.fp8_args import FP8_PARAMS, kernel_fp8_args
from ...kernels.grid import num_sms, triton_cdiv
from ...kernels.launch import launch
from ...kernels.tuning import tuning

#: Triton specialization of a launch (see ``_key``) -> programs of ``current_quantize_kernel``
#: one SM holds at once, as the CUDA driver computes it
_occupancy: dict = {}


def usable() -> bool:
    """False under Triton's interpreter, which runs programs one after another: a program
    waiting at the barrier would wait forever."""
    from triton import knobs
    return not knobs.runtime.interpret


@functools.lru_cache(maxsize=None)
def _cuda_driver():
    return ctypes.CDLL("libcuda.so.1")


def resident_programs(compiled) -> int:
    """How many programs of a compiled Triton kernel one SM holds at once, as the CUDA
    driver computes it for a cooperative launch (registers, threads, shared memory)."""
    compiled._init_handles()
    n = ctypes.c_int(0)
    err = _cuda_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(n), ctypes.c_void_p(compiled.function),
        ctypes.c_int(32 * compiled.metadata.num_warps), ctypes.c_size_t(compiled.metadata.shared))
    if err != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUresult "
                           f"{err} for {compiled.name}")
    return n.value


def _int_class(v: int) -> tuple:
    # what Triton specializes an int argument on: equal to 1, divisible by 16, 64-bit
    return v == 1, v % 16 == 0, not -2 ** 31 <= v < 2 ** 31


def _key(x, tensors, ints, consts) -> tuple:
    """What Triton compiles ``current_quantize_kernel`` differently for, besides the
    constexprs: argument dtypes, pointers 16-byte aligned or not, the int classes
    (``iters`` is never specialized: the grid size depends on this)."""
    return (x.device, tuple(consts.items()), tuple(map(_int_class, ints)),
            tuple(None if t is None else (t.dtype, t.data_ptr() % 16 == 0) for t in tensors))


def launch_current_one(x, row, col, words, scales, m, k, p, eps, pro, r, c, fp8_dtype, pow2):
    """``current_quantize_kernel`` on a cooperative grid: as many programs as the GPU holds
    at once (at most the config's count an SM), at most one a tile. ``words``: zeroed int32
    words (at least 3), left zero."""
    from .triton_kernels import current_quantize_kernel
    bm, bn, warps, per_sm = tuning.fp8_configs["current_one"]
    consts = dict(PRO=pro, POW2=pow2, FP8_MAX=FP8_PARAMS[fp8_dtype][3], ROWWISE=r,
                  COLWISE=c, BM=bm, BN=bn, num_warps=warps, launch_cooperative_grid=True,
                  **kernel_fp8_args(fp8_dtype))
    tiles = triton_cdiv(m, bm) * triton_cdiv(k, bn)
    args = [x, row, col, words, scales, m, k, x.stride(0), x.stride(1), *p, eps]
    key = _key(x, (x, *p), (m, k, x.stride(0), x.stride(1)), consts)
    fit = _occupancy.get(key)
    if fit is None:
        compiled = current_quantize_kernel.warmup(*args, 2, grid=(1,), **consts)
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        fit = resident_programs(compiled)
        if fit < 1:
            raise RuntimeError(f"current_quantize_kernel with config "
                               f"{tuning.fp8_configs['current_one']} does not fit on one SM; "
                               f"use a smaller tile or fewer warps")
        _occupancy[key] = fit
    progs = max(1, min(tiles, num_sms(x.device) * min(per_sm, fit)))
    launch(current_quantize_kernel, (progs,), *args, triton_cdiv(tiles, progs), **consts)
