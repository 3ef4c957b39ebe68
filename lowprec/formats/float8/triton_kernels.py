"""Triton kernels for per-tensor FP8 quantization (the jit helpers they share with the other
FP8 formats are in ``kernels/fp8_cast.py``).

Only ``launch.py`` modules import this file (lazily, from inside their custom ops), so
``import lowprec`` never needs Triton.

Numerics (bit for bit those of ``casting.py`` / ``float8/reference.py``):

* amaxes are reduced on the *bit patterns* of ``|x|`` as int32: for non-negative floats the
  integer order is the float order, every NaN sorts above Inf, so a NaN anywhere propagates
  exactly as ``torch.amax`` does, with no float NaN semantics involved;
* the current-scaling scale is ``fp8_max / max(amax, eps)`` with a correctly rounded
  (``div.rn``) fp32 division, amax 0 -> 1, Inf -> fp32 max, optional power-of-two floor,
  non-finite amax -> NaN;
* the fp8 cast saturates to +-max (NaN kept) and rounds to nearest even: on the GPU one
  hardware conversion does both (``cvt.rn.satfinite``, what Triton emits on sm89+; checked
  against the reference on all 2**32 fp32 bit patterns by
  ``tests/slow/test_fuzz_kernels_fp8.py``), elsewhere (``HW_CVT=False``, exact on any
  backend including the CPU interpreter) integer arithmetic on the bit pattern.

Compiler pitfall (Triton 3.6, sm90): when one tile of fp8 codes fed both the rowwise store
and, through a layout conversion, the transposed columnwise store, the columnwise bytes came
out wrong (fp32 inputs of the per-tensor kernel, fp32 and bf16 inputs of the 2-D block
kernels). Every kernel therefore computes the columnwise codes as a chain of ops of its own
(``fp8_codes(..., ALT=True)``, ``e8m0_scale(..., ALT=True)``) and builds each mask in the
orientation it is stored in, so no value is both stored and layout-converted.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...kernels.fp8_cast import abs_bits, current_scale, decode_scale, fp8_codes, store_t, tile_ids
from ...kernels.prologue import load_tile

#: Where a quantize writes the decode scale in its scale buffer: 16 bytes past the scale,
#: since cuBLAS refuses a scale pointer that is not 16-byte aligned.
DECODE_AT: tl.constexpr = tl.constexpr(4)


# ---- per-tensor kernels -------------------------------------------------------------------
@triton.jit
def amax_kernel(x_ptr, amax_ptr, M, K, stride_xm, stride_xk, p0, p1, p2, p3, n_tiles, iters,
                PRO: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Grid-stride over (BM, BN) tiles (``iters`` each); one relaxed int32 atomic max per
    program."""
    bits = _strided_tiles_amax(x_ptr, tl.program_id(0), tl.num_programs(0), iters, M, K,
                               stride_xm, stride_xk, p0, p1, p2, p3, PRO, BM, BN)
    tl.atomic_max(amax_ptr, bits, sem="relaxed")


@triton.jit
def _strided_tiles_amax(x_ptr, pid, nprog, iters, M, K, stride_xm, stride_xk, p0, p1, p2, p3,
                        PRO: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """int32 amax bits of the ``iters`` (BM, BN) tiles ``pid + i * nprog`` of x, the tiles
    numbered row-major."""
    tiles_k = tl.cdiv(K, BN)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for i in range(0, iters):
        t = pid + i * nprog
        offs_m = (t // tiles_k) * BM + tl.arange(0, BM)
        offs_k = (t % tiles_k) * BN + tl.arange(0, BN)
        # A tile past the last one starts at a row >= M, so load_tile masks all of it.
        x = load_tile(x_ptr, offs_m, offs_k, M, K, stride_xm, stride_xk, p0, p1, p2, p3, PRO)
        acc = tl.maximum(acc, abs_bits(x))
    return tl.max(tl.max(acc, 1), 0)


@triton.jit
def _cast_tile(pid_m, pid_k, scale, x_ptr, row_ptr, col_ptr, M, K, stride_xm,
               stride_xk, p0, p1, p2, p3, PRO: tl.constexpr, RECORD: tl.constexpr,
               MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr,
               HW_CVT: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, COL_MODE: tl.constexpr):
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BN + tl.arange(0, BN)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    offs_m64 = offs_m.to(tl.int64)
    x = load_tile(x_ptr, offs_m, offs_k, M, K, stride_xm, stride_xk, p0, p1, p2, p3, PRO)
    y = x * scale
    if ROWWISE:
        tl.store(row_ptr + offs_m64[:, None] * K + offs_k[None, :],
                 fp8_codes(y, MBITS, BIAS, MAX_BITS, HW_CVT), mask=mask)
    if COLWISE:
        # With both directions the columnwise codes are a chain of their own (ALT): see the
        # compiler pitfall in the module docstring.
        store_t(col_ptr, offs_m, offs_k, M, K, M,
                fp8_codes(y, MBITS, BIAS, MAX_BITS, HW_CVT, ROWWISE), COL_MODE)
    if RECORD:
        # masked elements load as 0, below any |x|
        tile_amax = tl.max(tl.max(abs_bits(x), 1), 0)
    else:
        tile_amax = 0
    return tile_amax


@triton.jit
def cast_kernel(x_ptr, row_ptr, col_ptr, amax_ptr, scale_in_ptr, scale_out_ptr, amax_out_ptr,
                M, K, stride_xm, stride_xk, p0, p1, p2, p3, eps,
                PRO: tl.constexpr, CURRENT: tl.constexpr, POW2: tl.constexpr, FP8_MAX: tl.constexpr,
                MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr,
                HW_CVT: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, COL_MODE: tl.constexpr,
                RECORD: tl.constexpr, FINISH: tl.constexpr, RESET: tl.constexpr,
                ITERS: tl.constexpr = 1,
                STAGES: tl.constexpr = 1, K_FAST: tl.constexpr = False,
                BOTTOM_UP: tl.constexpr = False):
    """One pass over x: cast ``x * scale`` and write rowwise (M, K) and/or columnwise (K, M).

    CURRENT: the scale comes from the amax pass (``amax_ptr``); program (0, 0) stores it and
    its correctly rounded reciprocal (the decode scale GEMMs take) at ``scale_out[DECODE_AT]``.
    Otherwise the scale is ``scale_in``. RECORD (delayed scaling): this pass also records the
    amax (atomic max into ``amax_ptr[0]``); then the scales are stored by
    ``delayed_finish_kernel`` or, with FINISH, by the last program to finish its tiles
    (a count in ``amax_ptr[1]``, zero at launch), which sets both words back to zero: one
    launch fewer. RESET (current scaling): the last program likewise sets the amax word and
    the count back to zero, so the next amax pass needs no zeroing launch.
    Each program converts ITERS tiles down a column of tiles; with STAGES > 1 the loads of
    the next tiles are issued (asynchronously) while one is converted.

    Tile order: K_FAST puts grid axis 0 along K, so the programs launched together read
    whole rows of tiles; BOTTOM_UP then takes the row tiles from the last one up. The amax
    pass (and a norm or activation producer) went through x top to bottom, so its last rows
    are the ones L2 still holds when this pass starts: read first, they come from L2.
    """
    pid_m, pid_k, groups_m = tile_ids(K_FAST)
    if BOTTOM_UP:
        pid_m = groups_m - 1 - pid_m
    if CURRENT:
        scale = current_scale(tl.load(amax_ptr), eps, FP8_MAX, POW2)
        if (pid_m == 0) & (pid_k == 0):
            tl.store(scale_out_ptr, scale)
            tl.store(scale_out_ptr + DECODE_AT, decode_scale(scale))
    else:
        scale = tl.load(scale_in_ptr)
    # One atomic per program, not per tile: same-address atomics serialize in L2, and one a
    # tile cost delayed scaling a third of its pass (16384 of them on 16384x4096).
    amax = tl.program_id(0) * 0
    for t in tl.range(0, ITERS, num_stages=STAGES):
        tile_amax = _cast_tile(pid_m * ITERS + t, pid_k, scale, x_ptr, row_ptr, col_ptr, M,
                               K, stride_xm, stride_xk, p0, p1, p2, p3, PRO, RECORD, MBITS,
                               BIAS, MAX_BITS, HW_CVT, ROWWISE, COLWISE, BM, BN, COL_MODE)
        amax = tl.maximum(amax, tile_amax)
    if RECORD:
        tl.atomic_max(amax_ptr, amax, sem="relaxed")
    if FINISH or RESET:
        # acq_rel: this program's stores, amax and read of the amax word are done before
        # its count, and the last program sees every other program's.
        nprog = tl.num_programs(0) * tl.num_programs(1)
        # One thread issues the count: the barrier orders every thread's stores before it
        # (Triton 3.6 emits one here anyway; this does not rely on that).
        tl.debug_barrier()
        if tl.atomic_add(amax_ptr + 1, 1, sem="acq_rel") == nprog - 1:
            if FINISH:
                bits = tl.atomic_max(amax_ptr, 0, sem="acquire")
            # Every other program is done with both words: leave them zero for the next
            # quantize that counts in them (``launch.kept_amax_words``), once every thread of
            # this one has the amax.
            tl.debug_barrier()
            tl.store(amax_ptr, 0)
            tl.store(amax_ptr + 1, 0)
            if FINISH:
                n = M * K
                _finish_delayed(bits, 0, 1, tl.cdiv(n, 1024), scale_in_ptr, scale_out_ptr,
                                amax_out_ptr, row_ptr, col_ptr, n, ROWWISE, COLWISE, 1024)


@triton.jit(do_not_specialize=["iters"])
def current_quantize_kernel(x_ptr, row_ptr, col_ptr, words_ptr, scale_out_ptr, M, K,
                            stride_xm, stride_xk, p0, p1, p2, p3, eps, iters,
                            PRO: tl.constexpr, POW2: tl.constexpr, FP8_MAX: tl.constexpr,
                            MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr,
                            HW_CVT: tl.constexpr, ROWWISE: tl.constexpr,
                            COLWISE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            COL_MODE: tl.constexpr):
    """Current scaling in one launch: the amax pass, a grid-wide barrier, the cast.

    Launched as a cooperative grid (every program resident at once, or the launch fails),
    so programs may wait for each other. Each program takes ``iters`` (BM, BN) tiles, the
    grid striding through x row-major, and reduces their amax; it raises ``words[0]``,
    counts itself in ``words[1]`` and waits until every program has. It then reads the
    amax, counts itself out in ``words[2]`` (the last one sets the three words back to zero,
    see ``launch.kept_amax_words``) and casts its tiles in reverse order: the tiles the grid
    read last, first, while L2 still holds them.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_k = tl.cdiv(K, BN)
    tl.atomic_max(words_ptr, _strided_tiles_amax(x_ptr, pid, nprog, iters, M, K, stride_xm,
                                                 stride_xk, p0, p1, p2, p3, PRO, BM, BN),
                  sem="relaxed")
    # acq_rel: the amax above is visible to whoever sees this count; a program that sees
    # every count sees every amax.
    tl.debug_barrier()
    arrived = tl.atomic_add(words_ptr + 1, 1, sem="acq_rel") + 1
    while arrived < nprog:
        arrived = tl.atomic_add(words_ptr + 1, 0, sem="acquire")
    bits = tl.atomic_max(words_ptr, 0, sem="acquire")
    tl.debug_barrier()
    if tl.atomic_add(words_ptr + 2, 1, sem="acq_rel") == nprog - 1:
        # every program has read the amax and stopped waiting
        tl.store(words_ptr, 0)
        tl.store(words_ptr + 1, 0)
        tl.store(words_ptr + 2, 0)
    scale = current_scale(bits, eps, FP8_MAX, POW2)
    if pid == 0:
        tl.store(scale_out_ptr, scale)
        tl.store(scale_out_ptr + DECODE_AT, decode_scale(scale))
    for i in range(0, iters):
        t = pid + (iters - 1 - i) * nprog
        _cast_tile(t // tiles_k, t % tiles_k, scale, x_ptr, row_ptr, col_ptr, M, K,
                   stride_xm, stride_xk, p0, p1, p2, p3, PRO, False, MBITS, BIAS, MAX_BITS,
                   HW_CVT, ROWWISE, COLWISE, BM, BN, COL_MODE)


@triton.jit
def _finish_delayed(bits, pid, nprog, iters, scale_in_ptr, scale_out_ptr, amax_out_ptr,
                    row_ptr, col_ptr, N, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Program ``pid`` of ``nprog`` finishing a delayed cast whose amax bits are ``bits``:
    program 0 records the amax (the max with what ``amax_out`` holds, NaN sticking, as the
    reference's ``torch.maximum``) and stores the (NaN-poisoned) scale and its reciprocal
    (``scale_out[0]``, ``scale_out[DECODE_AT]``); only when the amax is not finite, every
    program overwrites its share (``iters`` blocks) of the data with NaN codes (as the
    reference's ``x * NaN``)."""
    if pid == 0:
        new = bits.to(tl.float32, bitcast=True)
        old = tl.load(amax_out_ptr)
        acc = tl.where((old != old) | (new != new), float("nan"), tl.maximum(old, new))
        tl.store(amax_out_ptr, acc)
        s = tl.load(scale_in_ptr).to(tl.int32, bitcast=True)
        s = tl.where(bits < 0x7F800000, s, 0x7FC00000).to(tl.float32, bitcast=True)
        tl.store(scale_out_ptr, s)
        tl.store(scale_out_ptr + DECODE_AT, decode_scale(s))
    if bits >= 0x7F800000:
        nan = tl.full([BLOCK], 0x7F, dtype=tl.uint8)
        for i in range(0, iters):
            start = (pid + i * nprog).to(tl.int64) * BLOCK
            offs = start + tl.arange(0, BLOCK).to(tl.int64)
            if ROWWISE:
                tl.store(row_ptr + offs, nan, mask=offs < N)
            if COLWISE:
                tl.store(col_ptr + offs, nan, mask=offs < N)


@triton.jit
def delayed_finish_kernel(amax_bits_ptr, scale_in_ptr, scale_out_ptr, amax_out_ptr,
                          row_ptr, col_ptr, N, iters,
                          ROWWISE: tl.constexpr, COLWISE: tl.constexpr, BLOCK: tl.constexpr):
    """After a delayed cast pass that did not finish itself (``cast_kernel`` FINISH off):
    ``_finish_delayed`` over a grid. With a finite amax each program reads one word and
    exits."""
    _finish_delayed(tl.load(amax_bits_ptr), tl.program_id(0), tl.num_programs(0), iters,
                    scale_in_ptr, scale_out_ptr, amax_out_ptr, row_ptr, col_ptr, N, ROWWISE,
                    COLWISE, BLOCK)


@triton.jit
def _update_columns(hist_ptr, cur_ptr, scale_ptr, fmax_ptr, H, N, cols, inv_margin,
                    MOST_RECENT: tl.constexpr, BH: tl.constexpr):
    """DelayedScalingState.update of the columns ``cols`` of one state: its history (H, N)
    rolls down one row, row 0 becomes ``cur``, the new scale is ``fmax / amax * inv_margin``
    (at most the fp32 max) where amax is finite and > 0 (NaN anywhere in the history gives
    NaN, so the scale is kept), and ``cur`` is zeroed."""
    cmask = cols < N
    rows = tl.arange(0, BH)
    keep = (rows < H - 1)[:, None] & cmask[None, :]
    old = tl.load(hist_ptr + rows[:, None] * N + cols[None, :], mask=keep, other=float("-inf"))
    cur = tl.load(cur_ptr + cols, mask=cmask, other=0.0)
    # Every thread must have read its rows before any thread overwrites them.
    tl.debug_barrier()
    tl.store(hist_ptr + (rows[:, None] + 1) * N + cols[None, :], old, mask=keep)
    tl.store(hist_ptr + cols, cur, mask=cmask)
    tl.store(cur_ptr + cols, tl.zeros_like(cur), mask=cmask)
    if MOST_RECENT:
        amax = cur
    else:
        has_nan = (tl.sum((old != old).to(tl.int32), 0) > 0) | (cur != cur)
        amax = tl.maximum(tl.max(tl.where(old != old, float("-inf"), old), 0),
                          tl.where(cur != cur, float("-inf"), cur))
        amax = tl.where(has_nan, float("nan"), amax)
    fmax = tl.load(fmax_ptr + cols, mask=cmask, other=1.0)
    # clamped to the fp32 max: a tiny amax must not give an infinite scale
    new = tl.minimum(tl.math.div_rn(fmax, amax) * inv_margin, 3.4028234663852886e38)
    ok = (amax == amax) & (tl.abs(amax) != float("inf")) & (amax > 0)
    old_scale = tl.load(scale_ptr + cols, mask=cmask, other=1.0)
    tl.store(scale_ptr + cols, tl.where(ok, new, old_scale), mask=cmask)


@triton.jit
def delayed_update_kernel(hist_ptr, cur_ptr, scale_ptr, fmax_ptr, H, N, inv_margin,
                          MOST_RECENT: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr):
    """One state's update (``_update_columns``) in one launch, its columns split over the
    programs."""
    _update_columns(hist_ptr, cur_ptr, scale_ptr, fmax_ptr, H, N,
                    tl.program_id(0) * BN + tl.arange(0, BN), inv_margin, MOST_RECENT, BH)


@triton.jit
def delayed_update_many_kernel(table_ptr, H, inv_margin, MOST_RECENT: tl.constexpr,
                               BH: tl.constexpr, BN: tl.constexpr):
    """Many states' updates in one launch: program (s, j) updates columns [j*BN, (j+1)*BN)
    of state s. Row s of the int64 ``table`` (S, 5) holds that state's history, current
    amax, scale and fp8-max addresses and its column count N; all share H."""
    row = table_ptr + tl.program_id(0) * 5
    n = tl.load(row + 4).to(tl.int32)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    if tl.program_id(1) * BN < n:
        _update_columns(tl.load(row).to(tl.pointer_type(tl.float32)),
                        tl.load(row + 1).to(tl.pointer_type(tl.float32)),
                        tl.load(row + 2).to(tl.pointer_type(tl.float32)),
                        tl.load(row + 3).to(tl.pointer_type(tl.float32)),
                        H, n, cols, inv_margin, MOST_RECENT, BH)


# ---- row groups (the experts of a grouped GEMM) -------------------------------------------
@triton.jit
def row_scaled_cast_kernel(x_ptr, y_ptr, yt_ptr, scale_ptr, ids_ptr, M, K, stride_xm,
                           rows_per_group, MBITS: tl.constexpr, BIAS: tl.constexpr,
                           MAX_BITS: tl.constexpr, HW_CVT: tl.constexpr,
                           COL_MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           TRANS: tl.constexpr, BY_IDS: tl.constexpr):
    """Rowwise codes of ``x * scale[group]``: each row cast with its group's scale, the group
    ``ids[row]`` (``BY_IDS``) or ``row // rows_per_group``; with ``TRANS`` also their
    transpose (K, M) at ``yt_ptr``."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_k = tl.program_id(1) * BN + tl.arange(0, BN)
    rows_in = offs_m < M
    if BY_IDS:
        group = tl.load(ids_ptr + offs_m, mask=rows_in, other=0)
    else:
        group = tl.where(rows_in, offs_m // rows_per_group, 0)
    scale = tl.load(scale_ptr + group, mask=rows_in, other=1.0)
    x = load_tile(x_ptr, offs_m, offs_k, M, K, stride_xm, 1, 0, 0, 0, 0, 0)
    mask = rows_in[:, None] & (offs_k < K)[None, :]
    codes = fp8_codes(x * scale[:, None], MBITS, BIAS, MAX_BITS, HW_CVT)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :], codes, mask=mask)
    if TRANS:
        store_t(yt_ptr, offs_m, offs_k, M, K, M, codes, COL_MODE)


@triton.jit
def group_scales_kernel(amax_ptr, scale_ptr, decode_ptr, G, eps, FP8_MAX: tl.constexpr,
                        POW2: tl.constexpr, BG: tl.constexpr):
    """Each group's encode scale from its amax bits (``casting.scale_from_amax``) and the
    decode scale ``1 / scale`` (``torch.reciprocal``'s bits), ``BG`` groups a program."""
    g = tl.program_id(0) * BG + tl.arange(0, BG)
    live = g < G
    scale = current_scale(tl.load(amax_ptr + g, mask=live, other=0), eps, FP8_MAX, POW2)
    tl.store(scale_ptr + g, scale, mask=live)
    tl.store(decode_ptr + g, decode_scale(scale), mask=live)
