"""Launch grids, tile configs, devices and the prologue arguments every quantize launcher
shares. Importing this module needs neither Triton nor CUDA."""

from __future__ import annotations

import contextlib
import functools

import torch

from .tuning import tuning

#: CUDA's limit on a launch grid's axes 1 and 2 (axis 0 goes to 2**31 - 1)
MAX_GRID_YZ = 65535


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launches(rowwise: bool, columnwise: bool, key: str):
    """The (rowwise, columnwise) flags of each kernel launch for the requested usages
    (``tuning.split_both``)."""
    if rowwise and columnwise and tuning.split_both.get(key, False):
        return [(True, False), (False, True)]
    return [(rowwise, columnwise)]


def tile_config(cfg: tuple) -> tuple:
    """(BM, BN, num_warps, ITERS, STAGES, K_FAST) of a config entry; ITERS and STAGES
    default to 1 (one tile per program, no software pipelining), K_FAST to False (grid
    axis 0 along M, see :func:`tile_grid`)."""
    bm, bn, warps, *rest = cfg
    iters, stages, k_fast = (tuple(rest) + (1, 1, 0))[:3]
    return bm, bn, warps, iters, stages, bool(k_fast)


def cast_bottom_up(cfg: tuple) -> bool:
    """The 7th item of a ``cast_*`` config: the cast takes x's row tiles from the last one
    up (see ``cast_kernel``); False when absent."""
    return len(cfg) > 6 and bool(cfg[6])


def order_axes(grid: tuple, k_fast: bool) -> tuple[tuple, bool]:
    """(launch grid, K_FAST to pass the kernel) of a (programs down M, programs along K)
    grid: ``k_fast`` swaps the axes, unless that would put more than CUDA's 65535 programs
    on axis 1; the other order then runs (the same tiles in another order)."""
    for fast in (bool(k_fast), not k_fast):
        ordered = grid[::-1] if fast else grid
        if ordered[1] <= MAX_GRID_YZ:
            return ordered, fast
    raise ValueError(f"a quantize grid of {grid[0]} x {grid[1]} programs (down M x along K) "
                     f"exceeds CUDA's {MAX_GRID_YZ} programs on grid axis 1 either way; "
                     f"quantize the tensor in row slices")


def tile_grid(m: int, k: int, bm: int, bn: int, iters: int, k_fast: bool) -> tuple[tuple, bool]:
    """Launch grid of a tiled quantize and the K_FAST the kernel must read it with: (groups
    of ITERS tiles down M, tiles along K), the axes swapped with ``k_fast`` (see
    :func:`order_axes`)."""
    return order_axes((triton_cdiv(triton_cdiv(m, bm), iters), triton_cdiv(k, bn)), k_fast)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # CPU interpreter (logic checks only)


def device_guard(device: torch.device):
    """Launch on ``device`` (Triton launches on the current CUDA device); no device switch
    (and none of its host cost) when it already is the current one."""
    if device.type == "cuda" and device.index is not None \
            and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def logical_shape(x: torch.Tensor, pro: int) -> tuple[int, int]:
    """(M, K) of what a kernel quantizes: ``x`` itself, or a gated activation's half."""
    m, k = x.shape
    return (m, k // 2) if pro >= 20 else (m, k)


def prologue_args(x: torch.Tensor, pro_args: list) -> list:
    """The four prologue pointers of a launch; unused ones are None, which Triton makes a
    constexpr (no pointer to specialize and pass per launch: host time)."""
    return list(pro_args) + [None] * (4 - len(pro_args))


def prologue_launch_args(prologue) -> tuple[int, list]:
    """(pro code, pro tensors) of a launcher call for an optional prologue."""
    return (prologue.code, prologue.kernel_tensors()) if prologue is not None else (0, [])
