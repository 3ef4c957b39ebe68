"""Launchers for the per-tensor FP8 Triton kernels, registered as torch custom ops.

The ops return uint8 codes (viewed as the fp8 dtype here, outside the op) and take plain
tensors and scalars, so ``torch.compile(fullgraph=True)`` traces them through their fake
implementations. Importing this module needs neither Triton nor CUDA: the kernels module is
imported on first launch.

Passes over memory (M x K input):

* current scaling: amax pass (read x) + one cast pass (read x, write rowwise and/or the
  transposed columnwise data); the scale is computed on the device, no host sync. With
  ``ONE_LAUNCH_CURRENT`` both run in one cooperative launch (``cooperative.py``);
* delayed scaling: one pass (read x, write both directions, record the amax) whose last
  program stores the amax and scale and, only for a NaN/Inf input, fills the data with NaN
  (a separate finishing kernel when the cast is split in two launches);
* a cast with a known scale (one usage after the other, slices): one pass.

Each quantize also stores ``1 / scale`` (``DECODE_AT``), which the GEMMs take as their
decode scale instead of launching a reciprocal per operand, and counts in int32 words kept
on its quantizer that it leaves zero (``kept_amax_words``): no zeroing launch per quantize.

The cast kernel works on (BM, BN) tiles: each program loads its tile once, casts it, and
writes the rowwise tile and/or its transpose (columnwise (K, M) layout).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

from ...kernels import _tracing, kernel_op
from ..base import QuantizedTensor
from ...kernels.launch import launch

# fp8 dtype -> (mantissa bits, exponent bias, fp32 bits of the max finite value, max)
FP8_PARAMS = {
    torch.float8_e4m3fn: (3, 7, 0x43E00000, 448.0),
    torch.float8_e5m2: (2, 15, 0x47600000, 57344.0),
}

#: Use the hardware fp32 -> fp8 conversion (cvt.rn.satfinite) after an explicit saturation;
#: False computes the rounding with integer arithmetic (same bits, more instructions).
HW_CVT = True

#: How the kernels write a transposed (columnwise) tile (see triton_kernels.store_t):
#: 0 ``tl.trans`` of the fp8 codes, 3 transposed pointers (the compiler arranges the
#: coalesced store). Both are verified bit-exact on sm90; 0 was as fast or faster.
COL_MODE = 0

#: Formats whose "both usages" quantization runs as two launches (rowwise-only, then
#: columnwise-only) instead of one fused pass: keys "pertensor", "block1", "block2", "mx1",
#: "mx2". The fused pass reads the input once; the split one twice, which can still be faster
#: where the fused kernel's in-register transposition costs more than the second read.
SPLIT_BOTH = {"pertensor": False, "block1": True, "block2": False, "mx1": False, "mx2": False}


def launches(rowwise: bool, columnwise: bool, key: str):
    """The (rowwise, columnwise) flags of each kernel launch for the requested usages."""
    if rowwise and columnwise and SPLIT_BOTH.get(key, False):
        return [(True, False), (False, True)]
    return [(rowwise, columnwise)]


#: Delayed scaling: the cast launch's last program stores the scales (and NaN-fills a
#: NaN/Inf input) instead of a second, finishing launch. It saves one launch's host time;
#: the NaN fill then runs in one program, slow, but only for NaN/Inf inputs.
FUSED_FINISH = True

#: Tile configs: name -> (BM, BN, num_warps[, ITERS, STAGES, K_FAST, BOTTOM_UP] of the
#: casts: see tile_config and cast_bottom_up), picked by timing 16384x4096 bf16 on an H200
#: (tools/sweep_fp8_quantize.py and tools/sweep_fp8_cast.py).
#: tests/slow/test_fuzz_kernels_fp8.py checks them bit for bit against the reference. The casts take the rows
#: the amax pass read last first, from L2 (``cast_kernel``).
CONFIGS = {
    "amax": (32, 256, 8),
    "cast_row": (32, 512, 8, 4, 1, 1, 1),
    "cast_col": (64, 128, 8, 1, 1, 1, 1),
    "cast_both": (128, 128, 8, 1, 1, 1, 1),
    "finish": (4096, 0, 4),
    # current scaling in one cooperative launch: (BM, BN, warps, programs per SM at most;
    # how many fit is the driver's count for the compiled variant: 2 with 128 registers
    # when M, K and the row stride are multiples of 16, 1 for a variant near 255)
    "current_one": (128, 128, 8, 2),
}

#: Current scaling's amax pass and cast in one cooperative launch (``cooperative.py``)
#: when no producer computed the amax, instead of two launches (``amax_kernel``, then
#: ``cast_kernel``). Off by default: it saves one launch's host time per quantize, but a
#: cooperative grid the size of the GPU cannot start until every SM has room for it, so it
#: waits for kernels of other streams (communication overlapped with compute) to leave.
ONE_LAUNCH_CURRENT = False

#: int32 words a per-tensor quantize counts in: the amax bits and program counts (two for
#: the cooperative kernel's barrier), padded to 16 bytes; see ``kept_amax_words``
AMAX_WORDS = 4


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


#: CUDA's limit on a launch grid's axes 1 and 2 (axis 0 goes to 2**31 - 1)
MAX_GRID_YZ = 65535


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


def fp8_dtype_of(is_e5m2: bool) -> torch.dtype:
    return torch.float8_e5m2 if is_e5m2 else torch.float8_e4m3fn


def kernel_fp8_args(fp8_dtype: torch.dtype) -> dict:
    mbits, bias, max_bits, fmax = FP8_PARAMS[fp8_dtype]
    return {"MBITS": mbits, "BIAS": bias, "MAX_BITS": max_bits, "HW_CVT": HW_CVT,
            "COL_MODE": COL_MODE}


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


def _cast_cfg(rowwise: bool, columnwise: bool):
    if rowwise and columnwise:
        return CONFIGS["cast_both"]
    return CONFIGS["cast_row"] if rowwise else CONFIGS["cast_col"]


def logical_shape(x: torch.Tensor, pro: int) -> tuple[int, int]:
    """(M, K) of what a kernel quantizes: ``x`` itself, or a gated activation's half."""
    m, k = x.shape
    return (m, k // 2) if pro >= 20 else (m, k)


def prologue_args(x: torch.Tensor, pro_args: list) -> list:
    """The four prologue pointers of a launch; unused ones are None, which Triton makes a
    constexpr (no pointer to specialize and pass per launch: host time)."""
    return list(pro_args) + [None] * (4 - len(pro_args))


def _outputs(x: torch.Tensor, rowwise: bool, columnwise: bool, pro: int = 0):
    m, k = logical_shape(x, pro)
    row = x.new_empty((m, k) if rowwise else (0,), dtype=torch.uint8)
    col = x.new_empty((k, m) if columnwise else (0,), dtype=torch.uint8)
    return row, col


def _launch_amax(x: torch.Tensor, pro: int = 0, pro_args: list = (),
                 words: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The amax pass into ``words[0]`` (zero, see ``kept_amax_words``), or into a fresh zero."""
    from .triton_kernels import amax_kernel
    m, k = logical_shape(x, pro)
    bm, bn, warps = CONFIGS["amax"]
    amax_bits = torch.zeros(1, dtype=torch.int32, device=x.device) if words is None else words
    tiles = triton_cdiv(m, bm) * triton_cdiv(k, bn)
    progs = max(1, min(tiles, num_sms(x.device) * 4))
    launch(amax_kernel, (progs,), x, amax_bits, m, k, x.stride(0), x.stride(1),
           *prologue_args(x, pro_args), tiles, triton_cdiv(tiles, progs),
           PRO=pro, BM=bm, BN=bn, num_warps=warps)
    return amax_bits


@kernel_op("lowprec::fp8_amax", mutates_args=())
def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """amax(|x|) of a 2-D tensor as int32 bits of the fp32 value (NaN above +Inf)."""
    with device_guard(x.device):
        return _launch_amax(x)


@fp8_amax.register_fake
def _(x):
    return x.new_empty((1,), dtype=torch.int32)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: A quantize's scale buffer: the scale at 0, the decode scale at DECODE_AT (16-byte
#: aligned, as cuBLAS wants its scale pointers; see triton_kernels.DECODE_AT).
DECODE_AT = 4
SCALE_BUFFER = DECODE_AT + 1


def _scale_buffer(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(SCALE_BUFFER, dtype=torch.float32, device=x.device)


# ---- current scaling ----------------------------------------------------------------------
@kernel_op("lowprec::fp8_current_quantize", mutates_args=("amax_words",))
def fp8_current_quantize(x: torch.Tensor, e5m2: bool, pow2: bool, eps: float, rowwise: bool,
                         columnwise: bool, pro: int, pro_args: list[torch.Tensor],
                         amax_bits: Optional[torch.Tensor], amax_words: Optional[torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``amax_bits``: the int32 amax bits when the producer already computed them (the
    fused norm statistics), else None and an amax pass runs first, into ``amax_words``
    (see ``kept_amax_words``; None allocates a zero)."""
    fp8_dtype = fp8_dtype_of(e5m2)
    m, k = logical_shape(x, pro)
    row, col = _outputs(x, rowwise, columnwise, pro)
    scales = _scale_buffer(x)
    p = prologue_args(x, pro_args)
    reset = False
    with device_guard(x.device):
        if amax_bits is None and ONE_LAUNCH_CURRENT:
            from .cooperative import launch_current_one, usable
            if usable():
                if amax_words is None:
                    amax_words = torch.zeros(AMAX_WORDS, dtype=torch.int32, device=x.device)
                launch_current_one(x, row, col, amax_words, scales, m, k, p, eps, pro,
                                   rowwise, columnwise, fp8_dtype, pow2)
                return row, col, scales
        try:
            if amax_bits is None:
                reset = amax_words is not None  # before the launch: it may raise after it
                amax_bits = _launch_amax(x, pro, pro_args, amax_words)
            parts = launches(rowwise, columnwise, "pertensor")
            for i, (r, c) in enumerate(parts):
                _launch_cast(x, row, col, amax_bits, scales, scales, m, k, p, eps, pro, r, c,
                             fp8_dtype, current=True, pow2=pow2, record=False,
                             reset=reset and i == len(parts) - 1)
        except BaseException:
            # The amax pass may have raised the kept amax word, and no cast reset it. (Under
            # capture the words are the graph's own and the stream may be unusable.)
            if reset and not torch.cuda.is_current_stream_capturing():
                amax_words.zero_()
            raise
    return row, col, scales


@fp8_current_quantize.register_fake
def _(x, e5m2, pow2, eps, rowwise, columnwise, pro, pro_args, amax_bits, amax_words):
    row, col = _outputs(x, rowwise, columnwise, pro)
    return row, col, x.new_empty((SCALE_BUFFER,), dtype=torch.float32)


def _launch_cast(x, row, col, amax_bits, scale_in, scale_out, m, k, p, eps, pro, r, c,
                 fp8_dtype, *, current, pow2, record, amax_out=None, reset=False):
    """One ``cast_kernel`` launch; ``amax_out`` (delayed scaling): finish in this launch,
    recording the amax there (``amax_bits`` then holds two zeroed words, left zero);
    ``reset`` (current scaling): the amax word and a zeroed count after it are left zero."""
    from .triton_kernels import cast_kernel
    cfg = _cast_cfg(r, c)
    bm, bn, warps, iters, stages, k_fast = tile_config(cfg)
    bottom_up = cast_bottom_up(cfg)
    grid, k_fast = tile_grid(m, k, bm, bn, iters, k_fast)
    finish = amax_out is not None
    launch(cast_kernel, grid, x, row, col, amax_bits, scale_in, scale_out,
           amax_out if finish else scale_out, m, k, x.stride(0), x.stride(1), *p,
           eps, PRO=pro, CURRENT=current, POW2=pow2,
           FP8_MAX=FP8_PARAMS[fp8_dtype][3], ROWWISE=r, COLWISE=c, BM=bm, BN=bn,
           RECORD=record, FINISH=finish, RESET=reset, ITERS=iters, STAGES=stages,
           K_FAST=k_fast, BOTTOM_UP=bottom_up, num_warps=warps, **kernel_fp8_args(fp8_dtype))


# ---- delayed scaling ----------------------------------------------------------------------
@kernel_op("lowprec::fp8_delayed_quantize", mutates_args=("amax", "amax_words"))
def fp8_delayed_quantize(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, e5m2: bool,
                         rowwise: bool, columnwise: bool, pro: int,
                         pro_args: list[torch.Tensor], amax_words: Optional[torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``amax_words``: zeroed int32 words (the first two used: amax bits, finished
    programs) a one-launch cast counts in and leaves zero (see ``kept_amax_words``); None
    allocates them."""
    from .triton_kernels import delayed_finish_kernel
    fp8_dtype = fp8_dtype_of(e5m2)
    m, k = logical_shape(x, pro)
    row, col = _outputs(x, rowwise, columnwise, pro)
    p = prologue_args(x, pro_args)
    scale_out = _scale_buffer(x)
    parts = launches(rowwise, columnwise, "pertensor")
    with device_guard(x.device):
        # the kernel counts elements in int32 for its fill: larger inputs finish apart
        if len(parts) == 1 and FUSED_FINISH and m * k < 2 ** 31:
            if amax_words is None:
                amax_words = torch.zeros(2, dtype=torch.int32, device=x.device)
            _launch_cast(x, row, col, amax_words, scale, scale_out, m, k, p, 0.0, pro,
                         *parts[0], fp8_dtype, current=False, pow2=False, record=True,
                         amax_out=amax)
            return row, col, scale_out
        amax_bits = torch.zeros(2, dtype=torch.int32, device=x.device)
        for r, c in parts:
            _launch_cast(x, row, col, amax_bits, scale, scale_out, m, k, p, 0.0, pro, r, c,
                         fp8_dtype, current=False, pow2=False, record=True)
        block, _, warps = CONFIGS["finish"]
        n = m * k
        progs = max(1, min(triton_cdiv(n, block), num_sms(x.device) * 2))
        launch(delayed_finish_kernel, (progs,), amax_bits, scale, scale_out, amax, row, col, n,
               triton_cdiv(triton_cdiv(n, block), progs),
               ROWWISE=rowwise, COLWISE=columnwise, BLOCK=block,
               num_warps=warps)
    return row, col, scale_out


@fp8_delayed_quantize.register_fake
def _(x, scale, amax, e5m2, rowwise, columnwise, pro, pro_args, amax_words):
    row, col = _outputs(x, rowwise, columnwise, pro)
    return row, col, x.new_empty((SCALE_BUFFER,), dtype=torch.float32)


# ---- cast with a known scale --------------------------------------------------------------
@kernel_op("lowprec::fp8_cast_with_scale", mutates_args=())
def fp8_cast_with_scale(x: torch.Tensor, scale: torch.Tensor, e5m2: bool, rowwise: bool,
                        columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x * scale`` with a scale that already accounts for x's amax (NaN when x held
    NaN/Inf, so the codes come out NaN as the reference's): one pass, nothing recorded."""
    fp8_dtype = fp8_dtype_of(e5m2)
    m, k = x.shape
    row, col = _outputs(x, rowwise, columnwise)
    p = prologue_args(x, [])
    with device_guard(x.device):
        for r, c in launches(rowwise, columnwise, "pertensor"):
            _launch_cast(x, row, col, scale, scale, scale, m, k, p, 0.0, 0, r, c, fp8_dtype,
                         current=False, pow2=False, record=False)
    return row, col


@fp8_cast_with_scale.register_fake
def _(x, scale, e5m2, rowwise, columnwise):
    return _outputs(x, rowwise, columnwise)


# ---- what the quantizers call -------------------------------------------------------------
def _fields(quantizer, row, col, scale, decode=None) -> dict:
    """Float8Tensor fields; ``decode``: the record of ``1 / scale`` (see ``Float8Tensor``)."""
    dt = quantizer.fp8_dtype
    return {"rowwise_data": row.view(dt) if quantizer.rowwise_usage else None,
            "columnwise_data": col.view(dt) if quantizer.columnwise_usage else None,
            "shared_scale": scale, "fp8_dtype": dt, "_decode": decode}


def _kernel_fields(quantizer, row, col, scales) -> dict:
    """Fields of a quantize launch, whose ``scales`` holds the scale at 0 and its reciprocal
    at ``DECODE_AT`` (kept for the GEMMs). Not kept for inference tensors
    (``torch.inference_mode``): they have no version counter to tell it is still valid; nor
    under ``torch.compile``, where ``decode_scale`` never reads it."""
    scale = scales[0:1]
    return _fields(quantizer, row, col, scale,
                   QuantizedTensor.derived_record(scale, scales[DECODE_AT]))


def quantize_current(quantizer, x2d: torch.Tensor, prologue=None, amax_bits=None) -> dict:
    """Float8CurrentScalingQuantizer._quantize_2d through the kernels (same fields), of
    ``prologue(x2d)`` when given (a norm prologue may carry its amax bits). ``amax_bits``:
    the amax of a larger tensor ``x2d`` is a slice of (see ``slice_quantizer``)."""
    pro, pro_args = prologue_launch_args(prologue)
    if amax_bits is None and prologue is not None:
        amax_bits = prologue.amax_bits
    words = None if amax_bits is not None else kept_amax_words(quantizer, x2d.device)
    row, col, scale = fp8_current_quantize(
        x2d, quantizer.fp8_dtype == torch.float8_e5m2, quantizer.force_pow_2_scales,
        quantizer.amax_epsilon, quantizer.rowwise_usage, quantizer.columnwise_usage, pro,
        pro_args, amax_bits, words)
    return _kernel_fields(quantizer, row, col, scale)


def quantize_with_scale(quantizer, x2d: torch.Tensor, scale: torch.Tensor,
                        decode=None) -> dict:
    """Cast ``x2d * scale`` with a scale already known: a delayed-scaling slice (its scale
    NaN-poisoned by the whole tensor's amax), or one usage of a tensor whose other usage
    set the scale (``quantize_usage_like``, which passes that tensor's ``decode`` record).
    The result shares ``scale``."""
    row, col = fp8_cast_with_scale(x2d, scale, quantizer.fp8_dtype == torch.float8_e5m2,
                                   quantizer.rowwise_usage, quantizer.columnwise_usage)
    return _fields(quantizer, row, col, scale, decode)


def kept_amax_words(quantizer, device: torch.device) -> Optional[torch.Tensor]:
    """The int32 words (``AMAX_WORDS``: amax bits, program counts) a quantize of
    ``quantizer`` on ``device`` counts in, kept on the quantizer, one set per CUDA stream.

    They are zero between quantizes: the quantize's last program reads them and sets them
    back to zero (current scaling's separate amax pass, before the cast, only raises the
    amax word), so a quantize needs no zeroing launch of its own (host time). Quantizes on
    one stream run one after another; a set per stream keeps quantizes that overlap on two
    streams apart, and a copy of the quantizer (``copy()``, deepcopy, pickling) starts
    without any.

    Under CUDA graph capture: fresh zeroed words, not kept, so the graph zeroes its own on
    each replay instead of holding a pointer to words an eager quantize also uses (or that
    a replaced quantizer frees). They are words all the same, so the capture launches the
    kernel variants the eager warm-up compiled (a kernel compiled and loaded for the first
    time inside a capture breaks it). None under tracing (torch.compile), where the ops
    allocate what they need.
    """
    if _tracing(()):
        return None
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(AMAX_WORDS, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    by_stream = quantizer.__dict__.get("_amax_words")
    if by_stream is None:
        by_stream = quantizer._amax_words = {}
    words = by_stream.get(key)
    if words is None:
        with torch.inference_mode(False):  # a later quantize outside inference mode writes it
            words = by_stream[key] = torch.zeros(AMAX_WORDS, dtype=torch.int32, device=device)
    return words


def quantize_delayed(quantizer, x2d: torch.Tensor, prologue=None) -> dict:
    """Float8Quantizer._quantize_2d through the kernels: records the amax into
    ``quantizer.amax`` in place and keeps a copy of the (NaN-poisoned) scale."""
    scale = quantizer.scale.detach().reshape(1).to(device=x2d.device, dtype=torch.float32)
    target = quantizer.amax
    direct = (target.device == x2d.device and target.dtype == torch.float32
              and target.is_contiguous())
    amax = target if direct else torch.empty(1, dtype=torch.float32, device=x2d.device)
    row, col, scale_out = fp8_delayed_quantize(
        x2d, scale, amax,
        quantizer.fp8_dtype == torch.float8_e5m2, quantizer.rowwise_usage,
        quantizer.columnwise_usage, *prologue_launch_args(prologue),
        kept_amax_words(quantizer, x2d.device))
    if not direct:
        target.copy_(amax.reshape(target.shape))
    return _kernel_fields(quantizer, row, col, scale_out)


# ---- delayed-scaling state update ---------------------------------------------------------
#: Longest amax history the one-launch update handles (the whole history sits in registers).
UPDATE_MAX_HISTORY = 4096


@kernel_op("lowprec::fp8_delayed_update", mutates_args=("history", "current", "scale"))
def fp8_delayed_update(history: torch.Tensor, current: torch.Tensor, scale: torch.Tensor,
                       fp8_max: torch.Tensor, inv_margin: float, most_recent: bool) -> None:
    """Roll ``history`` (H, N), push ``current``, recompute ``scale`` and zero ``current``,
    in one launch (see ``delayed_update_kernel``)."""
    from .triton_kernels import delayed_update_kernel
    h, n = history.shape
    bh, bn = _update_tile(h, n)
    with device_guard(history.device):
        launch(delayed_update_kernel, (triton_cdiv(n, bn),),
            history, current, scale, fp8_max, h, n, inv_margin, MOST_RECENT=most_recent,
            BH=bh, BN=bn, num_warps=4)


@fp8_delayed_update.register_fake
def _(history, current, scale, fp8_max, inv_margin, most_recent):
    return None


def _update_tile(h: int, n: int) -> tuple[int, int]:
    """(BH, BN) of an update launch: the whole history (H - 1 rows kept) in one tile, as
    many columns beside it as keep the tile within 8192 elements."""
    bh = 1
    while bh < max(h - 1, 1):
        bh *= 2
    bn = 1
    while bn < n and bn * bh < 8192:
        bn *= 2
    return bh, bn


def fp8_delayed_update_many(table: torch.Tensor, h: int, max_n: int, inv_margin: float,
                            most_recent: bool) -> None:
    """``fp8_delayed_update`` of many states in one launch (``delayed_update_many_kernel``):
    ``table`` is the int64 (S, 5) table of their tensors' addresses and column counts (see
    ``lowprec.state_batch``), all of histories with ``h`` rows. Eager only, not a custom op:
    a table of addresses means nothing to a tracer."""
    from .triton_kernels import delayed_update_many_kernel
    bh, bn = _update_tile(h, max_n)
    with device_guard(table.device):
        launch(delayed_update_many_kernel, (table.shape[0], triton_cdiv(max_n, bn)),
               table, h, inv_margin, MOST_RECENT=most_recent, BH=bh, BN=bn, num_warps=4)


def prologue_launch_args(prologue) -> tuple[int, list]:
    """(pro code, pro tensors) of a launcher call for an optional prologue."""
    return (prologue.code, prologue.kernel_tensors()) if prologue is not None else (0, [])
