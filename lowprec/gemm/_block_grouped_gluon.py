"""Gluon kernel of the grouped block-scaled FP8 GEMM on Hopper (launcher:
:mod:`lowprec.gemm.block_grouped`; the Triton kernel beside it,
:mod:`._block_grouped_kernels`, computes the same bits where this one does not apply).

The sum is the Triton kernel's: each 128-long chunk of the contraction is a tensor-core dot
started from zero (``warpgroup_mma(..., use_acc=False)``), multiplied by its rows' and
columns' decode scales and added to the fp32 accumulator.

Why a second kernel: in Triton's, the warps wait for each chunk's dot before its scaled
add, so the tensor cores idle during every add (470-650 TFLOP/s at the MoE layer's
shapes, about half of cuBLAS's per-expert block-scaled GEMM). Here the layout of the
work is explicit:

* 64 rows a warpgroup: with 4 warps a 64-row tile, small enough that three programs fit
  an SM and one's scaled adds run under another's dots; with 8 warps a 128-row tile,
  whose two warpgroups share each B tile (half the operand traffic a row);
* the operands arrive by TMA into a ring of ``STAGES`` shared-memory buffers, each with
  its own mbarrier; a buffer is refilled once the dot that read it has finished (with 8
  warps the compiler puts a CTA barrier before the refill, which keeps the two
  warpgroups in step);
* ``OVERLAP`` (8 warps only): chunk i's dot is issued before chunk i-1's scaled add, the
  chunks taking two register sets in turn. ptxas still serializes those dots (its C7514
  note), so what it gains comes from the order of the loads and adds. With one warpgroup
  this form gave outputs off cuBLAS's on an H100 (repeated runs of one config), and
  the launcher refuses it (``block_grouped.check_gluon_config``).

:func:`block_grouped_ws_kernel` is the warp-specialized form of the 128-row tile: a
producer warp issues the TMA loads and each consumer warpgroup releases a buffer through an
mbarrier of its own as soon as its dot has read it, so neither waits for the other's adds.
It runs where a config's ``OVERLAP`` is 2: the tuning table's for large experts' forward
and dgrad, where it was 1.03-1.16x the two-warpgroup ``OVERLAP`` config on an H100.

Group lookup and tile order are the Triton kernel's (``GROUP_K`` picks rows or contraction
groups; tiles in bands of ``GROUP_M`` row tiles). Rows and columns past the operands are
read as zeros by TMA and not written. Imported only when the launcher runs on a Hopper GPU
with Gluon.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _issue(a_desc, b_desc, a_smem, b_smem, bars, chunk, n_chunks, at, bt,
           STAGES: gl.constexpr):
    """Starts the TMA loads of ``chunk`` into its ring buffer (nothing past ``n_chunks``);
    ``at`` / ``bt``: (row, contraction) of the operands' chunk 0."""
    BK: gl.constexpr = a_desc.block_type.shape[1]
    s = chunk % STAGES
    live = chunk < n_chunks
    bar = bars.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=live)
    tma.async_copy_global_to_shared(a_desc, [at[0], at[1] + chunk * BK], bar, a_smem.index(s),
                                    pred=live)
    tma.async_copy_global_to_shared(b_desc, [bt[0], bt[1] + chunk * BK], bar, b_smem.index(s),
                                    pred=live)


@gluon.jit
def _scales(da_ptrs, db_ptrs, rmask, cmask, col_l: gl.constexpr, DB_ONE: gl.constexpr):
    """The chunk's row decode scales and its column ones (``DB_ONE``: one for the tile).
    Column scales are loaded one a thread and then spread to the accumulator's layout,
    where each thread holds a quarter of them: their pointers would take 64 registers."""
    da = gl.load(da_ptrs, mask=rmask, other=0.0)
    if DB_ONE:
        db = gl.load(db_ptrs)
    else:
        db = gl.convert_layout(gl.load(db_ptrs, mask=cmask, other=0.0), col_l)
    return da, db


@gluon.jit
def _add(acc, part, da, db, DB_ONE: gl.constexpr):
    """``acc + part * (da * db)``, the Triton kernel's expression (the same fused rounding)."""
    if DB_ONE:
        return acc + part * (da[:, None] * db)
    else:
        return acc + part * (da[:, None] * db[None, :])


@gluon.jit
def _scale_ptrs(da_ptr, db_base, rows, cols, col0, chunk0, s_dam, s_dak, s_dbn, s_dbk,
                A_ROWS: gl.constexpr, B_ROWS: gl.constexpr, DB_ONE: gl.constexpr):
    """Pointers to chunk 0's row decode scales (``rows``) and column ones (``cols``, or
    the one of the tile starting at column ``col0`` with ``DB_ONE``)."""
    da_ptrs = da_ptr + (rows // A_ROWS).to(gl.int64) * s_dam + chunk0 * s_dak
    if DB_ONE:
        db_ptrs = db_base + (col0 // B_ROWS).to(gl.int64) * s_dbn + chunk0 * s_dbk
    else:
        db_ptrs = db_base + (cols // B_ROWS).to(gl.int64) * s_dbn + chunk0 * s_dbk
    return da_ptrs, db_ptrs


@gluon.jit
def _store(acc, out_base, row0, col0, M, N, s_om, s_on, ROWS: gl.constexpr,
           COLS: gl.constexpr, num_warps: gl.constexpr):
    """The (ROWS, COLS) tile at (``row0``, ``col0``) in the output's dtype, stored through a
    blocked layout whose threads write 8 neighbouring columns each (not straight from the
    wgmma layout); nothing past (M, N)."""
    out_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    res = gl.convert_layout(acc.to(out_base.dtype.element_ty), out_l)
    orows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_l))
    ocols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, out_l))
    optr = out_base + orows.to(gl.int64)[:, None] * s_om + ocols[None, :] * s_on
    gl.store(optr, res, mask=(orows < M)[:, None] & (ocols < N)[None, :])


@gluon.jit
def _dot(a_smem, b_smem, bars, chunk, into, STAGES: gl.constexpr):
    """Waits for ``chunk``'s operands and starts its dot from zero in ``into``'s registers."""
    s = chunk % STAGES
    mbarrier.wait(bars.index(s), (chunk // STAGES) & 1)
    return warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), into, use_acc=False,
                         is_async=True)


@gluon.jit
def _locate(a_desc, offs_ptr, db_ptr, out_ptr, M, N, G, B_GROUP_ROWS, B_GROUP_COLS, s_dbg,
            s_og, BM: gl.constexpr, BN: gl.constexpr, GROUP_K: gl.constexpr,
            GP: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    """This program's tile and group: (pid_m, pid_n, g, k_lo, k_hi, (B's row, contraction)
    of chunk 0, the group's column scales, its output). Tiles run in bands of ``GROUP_M``
    row tiles, so that a band's A rows stay in L2 while every column tile reads them. For
    row groups, ``g == G`` marks a tile past the last group."""
    pid = gl.program_id(0)
    tiles_n = gl.cdiv(N, BN)
    band = GROUP_M * tiles_n
    first_m = (pid // band) * GROUP_M
    band_m = gl.minimum(gl.cdiv(M, BM) - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % band_m
    pid_n = (pid % band) // band_m
    if GROUP_K:
        g = gl.program_id(1)
        k_hi = gl.load(offs_ptr + g)
        k_lo = gl.load(offs_ptr + g - 1, mask=g > 0, other=0)
        bt = (pid_n * BN, k_lo)
        db_base = db_ptr
        out_base = out_ptr + g.to(gl.int64) * s_og
    else:
        # the group whose rows hold this tile: the number of groups ending at or before it
        gidx = gl.arange(0, GP, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        ends = gl.load(offs_ptr + gidx, mask=gidx < G, other=2147483647)
        g = gl.sum((ends <= pid_m * BM).to(gl.int32), axis=0)
        k_lo = gl.to_tensor(0)
        k_hi = gl.to_tensor(a_desc.shape[1])
        bt = (g * B_GROUP_ROWS + pid_n * BN, g * B_GROUP_COLS)
        db_base = db_ptr + g.to(gl.int64) * s_dbg
        out_base = out_ptr
    return pid_m, pid_n, g, k_lo, k_hi, bt, db_base, out_base


@gluon.jit
def block_grouped_gluon_kernel(
        a_desc, b_desc, da_ptr, db_ptr, out_ptr, offs_ptr,
        M, N, G, B_GROUP_ROWS, B_GROUP_COLS,
        s_dam, s_dak, s_dbg, s_dbn, s_dbk,
        s_og, s_om, s_on,
        GROUP_K: gl.constexpr, A_ROWS: gl.constexpr, B_ROWS: gl.constexpr,
        GP: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
        OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    """One (BM, BN) output tile; ``a_desc`` (rows, contraction) and ``b_desc`` (rows,
    contraction) are TMA descriptors of the fp8 codes, with (BM, 128) and (BN, 128) blocks.
    For row groups ``b_desc`` holds every expert's matrix, expert g's at row
    ``g * B_GROUP_ROWS`` and column ``g * B_GROUP_COLS``."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BN, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)

    pid_m, pid_n, g, k_lo, k_hi, bt, db_base, out_base = _locate(
        a_desc, offs_ptr, db_ptr, out_ptr, M, N, G, B_GROUP_ROWS, B_GROUP_COLS, s_dbg, s_og,
        BM, BN, GROUP_K, GP, GROUP_M, num_warps)
    if g >= G:
        return  # rows past the last group
    a_row = pid_m * BM
    at = (a_row, k_lo)
    n_chunks = gl.cdiv(k_hi - k_lo, BK)

    rows = a_row + gl.arange(0, BM, layout=row_l)
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    cols = pid_n * BN + gl.arange(0, BN, layout=one_l)
    rmask = rows < M
    cmask = cols < N
    DB_ONE: gl.constexpr = B_ROWS % BN == 0
    da_ptrs, db_ptrs = _scale_ptrs(da_ptr, db_base, rows, cols, pid_n * BN, k_lo // BK, s_dam,
                                   s_dak, s_dbn, s_dbk, A_ROWS, B_ROWS, DB_ONE)

    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(bars.index(b), count=1)
    fence_async_shared()  # the TMA engine (the async proxy) must see the barriers' init
    # the ring's first chunks (all of it under OVERLAP, which refills a buffer one chunk
    # later: after the dot that read it, not before the next dot)
    for c in gl.static_range(STAGES - 1):
        _issue(a_desc, b_desc, a_smem, b_smem, bars, c, n_chunks, at, bt, STAGES)
    if OVERLAP:
        _issue(a_desc, b_desc, a_smem, b_smem, bars, STAGES - 1, n_chunks, at, bt, STAGES)

    acc = gl.zeros((BM, BN), gl.float32, mma)
    if OVERLAP:
        # two register sets X and Y take the chunks in turn, each pair of chunks one pass,
        # so that neither is copied while its dot runs (a copy serializes the dots)
        if n_chunks > 0:
            px = _dot(a_smem, b_smem, bars, 0, gl.zeros((BM, BN), gl.float32, mma), STAGES)
            dax, dbx = _scales(da_ptrs, db_ptrs, rmask, cmask, col_l, DB_ONE)
            y = gl.zeros((BM, BN), gl.float32, mma)
            for i in range(1, n_chunks - 1, 2):
                py = _dot(a_smem, b_smem, bars, i, y, STAGES)
                x = warpgroup_mma_wait(1, deps=[px])
                acc = _add(acc, x, dax, dbx, DB_ONE)
                _issue(a_desc, b_desc, a_smem, b_smem, bars, i - 1 + STAGES, n_chunks, at, bt,
                       STAGES)
                day, dby = _scales(da_ptrs + i * s_dak, db_ptrs + i * s_dbk, rmask, cmask,
                                   col_l, DB_ONE)
                px = _dot(a_smem, b_smem, bars, i + 1, x, STAGES)
                y = warpgroup_mma_wait(1, deps=[py])
                acc = _add(acc, y, day, dby, DB_ONE)
                _issue(a_desc, b_desc, a_smem, b_smem, bars, i + STAGES, n_chunks, at, bt, STAGES)
                dax, dbx = _scales(da_ptrs + (i + 1) * s_dak, db_ptrs + (i + 1) * s_dbk,
                                   rmask, cmask, col_l, DB_ONE)
            if n_chunks % 2 == 0:  # the last chunk, in Y
                last = n_chunks - 1
                py = _dot(a_smem, b_smem, bars, last, y, STAGES)
                x = warpgroup_mma_wait(1, deps=[px])
                acc = _add(acc, x, dax, dbx, DB_ONE)
                day, dby = _scales(da_ptrs + last * s_dak, db_ptrs + last * s_dbk, rmask,
                                   cmask, col_l, DB_ONE)
                y = warpgroup_mma_wait(0, deps=[py])
                acc = _add(acc, y, day, dby, DB_ONE)
            else:
                x = warpgroup_mma_wait(0, deps=[px])
                acc = _add(acc, x, dax, dbx, DB_ONE)
    else:
        part = gl.zeros((BM, BN), gl.float32, mma)
        for i in range(n_chunks):
            # chunk i-1's dot finished last iteration: its buffer takes chunk i-1+STAGES
            _issue(a_desc, b_desc, a_smem, b_smem, bars, i - 1 + STAGES, n_chunks, at, bt,
                   STAGES)
            da, db = _scales(da_ptrs + i * s_dak, db_ptrs + i * s_dbk, rmask, cmask, col_l,
                             DB_ONE)
            part = _dot(a_smem, b_smem, bars, i, part, STAGES)
            part = warpgroup_mma_wait(0, deps=[part])
            acc = _add(acc, part, da, db, DB_ONE)
    for b in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(b))

    _store(acc, out_base, a_row, pid_n * BN, M, N, s_om, s_on, BM, BN, num_warps)


@gluon.jit
def _ws_loads(a_desc, b_desc, a_smem, b_smem, full, empty, n_chunks, a_row, a_k, b_row, b_k,
              STAGES: gl.constexpr):
    """The producer warp: each chunk's TMA loads once both consumers released its buffer."""
    BK: gl.constexpr = a_desc.block_type.shape[1]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    for i in range(n_chunks):
        s = i % STAGES
        # a buffer's first use waits on the phase before the barrier's first: no wait
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(full.index(s), nbytes)
        tma.async_copy_global_to_shared(a_desc, [a_row, a_k + i * BK], full.index(s),
                                        a_smem.index(s))
        tma.async_copy_global_to_shared(b_desc, [b_row, b_k + i * BK], full.index(s),
                                        b_smem.index(s))


@gluon.jit
def _ws_sums(a_smem, b_smem, full, empty, n_chunks, da_ptr, db_base, s_dam, s_dak, s_dbn,
             s_dbk, chunk0, row0, col0, M, N, out_base, s_om, s_on, HALF: gl.constexpr,
             A_ROWS: gl.constexpr, B_ROWS: gl.constexpr, BN: gl.constexpr,
             STAGES: gl.constexpr):
    """A consumer warpgroup: rows ``[64 HALF, 64 HALF + 64)`` of the tile, each chunk's dot
    from zero, the buffer released as soon as the dot is done, then the scaled add."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BN, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    DB_ONE: gl.constexpr = B_ROWS % BN == 0
    rows = row0 + 64 * HALF + gl.arange(0, 64, layout=row_l)
    cols = col0 + gl.arange(0, BN, layout=one_l)
    rmask = rows < M
    cmask = cols < N
    da_ptrs, db_ptrs = _scale_ptrs(da_ptr, db_base, rows, cols, col0, chunk0, s_dam, s_dak,
                                   s_dbn, s_dbk, A_ROWS, B_ROWS, DB_ONE)
    acc = gl.zeros((64, BN), gl.float32, mma)
    part = gl.zeros((64, BN), gl.float32, mma)
    for i in range(n_chunks):
        s = i % STAGES
        da, db = _scales(da_ptrs + i * s_dak, db_ptrs + i * s_dbk, rmask, cmask, col_l,
                         DB_ONE)
        mbarrier.wait(full.index(s), (i // STAGES) & 1)
        part = warpgroup_mma(a_smem.index(s).slice(64 * HALF, 64),
                             b_smem.index(s).permute((1, 0)), part, use_acc=False,
                             is_async=True)
        part = warpgroup_mma_wait(0, deps=[part])
        mbarrier.arrive(empty.index(s))
        acc = _add(acc, part, da, db, DB_ONE)
    _store(acc, out_base, row0 + 64 * HALF, col0, M, N, s_om, s_on, 64, BN, 4)


@gluon.jit
def block_grouped_ws_kernel(
        a_desc, b_desc, da_ptr, db_ptr, out_ptr, offs_ptr,
        M, N, G, B_GROUP_ROWS, B_GROUP_COLS,
        s_dam, s_dak, s_dbg, s_dbn, s_dbk,
        s_og, s_om, s_on,
        GROUP_K: gl.constexpr, A_ROWS: gl.constexpr, B_ROWS: gl.constexpr,
        GP: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
        num_warps: gl.constexpr):
    """:func:`block_grouped_gluon_kernel`'s tile of 128 rows, warp-specialized: a producer
    warp issues the TMA loads, and two consumer warpgroups (the default partition's four
    warps and four more), 64 rows each, run their dots and scaled adds each at its own
    pace, releasing a buffer through an mbarrier both arrive on; ``num_warps`` is 4."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    gl.static_assert(BM == 128, "two consumer warpgroups of 64 rows each")
    pid_m, pid_n, g, k_lo, k_hi, bt, db_base, out_base = _locate(
        a_desc, offs_ptr, db_ptr, out_ptr, M, N, G, B_GROUP_ROWS, B_GROUP_COLS, s_dbg, s_og,
        BM, BN, GROUP_K, GP, GROUP_M, num_warps)
    if g >= G:
        return  # rows past the last group
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(full.index(b), count=1)
        mbarrier.init(empty.index(b), count=2)  # one arrival a consumer warpgroup
    fence_async_shared()
    # partition arguments are scalars (integers equal to 1 arrive as constexprs: made
    # tensors here), shared memory and descriptors
    n_chunks = gl.to_tensor(gl.cdiv(k_hi - k_lo, BK))
    chunk0 = gl.to_tensor(k_lo // BK)
    row0 = gl.to_tensor(pid_m * BM)
    col0 = gl.to_tensor(pid_n * BN)
    mm, nn = gl.to_tensor(M), gl.to_tensor(N)
    sdam, sdak = gl.to_tensor(s_dam), gl.to_tensor(s_dak)
    sdbn, sdbk = gl.to_tensor(s_dbn), gl.to_tensor(s_dbk)
    som, son = gl.to_tensor(s_om), gl.to_tensor(s_on)
    gl.warp_specialize([
        (_ws_sums, (a_smem, b_smem, full, empty, n_chunks, da_ptr, db_base, sdam, sdak, sdbn,
                    sdbk, chunk0, row0, col0, mm, nn, out_base, som, son, 0, A_ROWS, B_ROWS,
                    BN, STAGES)),
        (_ws_sums, (a_smem, b_smem, full, empty, n_chunks, da_ptr, db_base, sdam, sdak, sdbn,
                    sdbk, chunk0, row0, col0, mm, nn, out_base, som, son, 1, A_ROWS, B_ROWS,
                    BN, STAGES)),
        (_ws_loads, (a_desc, b_desc, a_smem, b_smem, full, empty, n_chunks, row0,
                     gl.to_tensor(k_lo), gl.to_tensor(bt[0]), gl.to_tensor(bt[1]), STAGES)),
    ], [4, 1], [216, 24])
    for b in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(b))
        mbarrier.invalidate(empty.index(b))
