"""@triton.jit kernel of the grouped block-scaled FP8 GEMM (launcher:
:mod:`lowprec.gemm.block_grouped`).

``out = sum over contraction chunks c of (A[:, c] @ B[:, c].T) * da[:, c] * db[:, c]``: both
operands are fp8 and contiguous along the contraction, which runs in chunks of 128, one
decode scale per operand row (or per 128 rows) and chunk. Each chunk's product is a
tensor-core dot started from zero, then scaled and added to the fp32 accumulator: the
two-level accumulation of block-scaled FP8 GEMMs (cuBLAS's, DeepGEMM's), since the scales
change from chunk to chunk.

Two ways the groups split the problem (``GROUP_K``):

* rows (``GROUP_K=False``, forward and dgrad): group ``g`` owns rows ``[offs[g-1], offs[g])``
  of A and output; B is expert ``g``'s matrix. Groups start at multiples of the row tile, so
  a tile lies inside one group; rows past the last group are not written.
* contraction (``GROUP_K=True``, wgrad): ``out[g] = A[:, rows of g] @ B[:, rows of g].T``;
  groups start at multiples of 128 (whole column blocks). An empty group writes zeros.

Imported only when a launcher runs on CUDA with Triton available.
"""

import triton
import triton.language as tl


@triton.jit
def block_grouped_gemm_kernel(
        a_ptr, b_ptr, da_ptr, db_ptr, out_ptr, offs_ptr,
        M, N, K, G,
        s_am, s_ak, s_bg, s_bn, s_bk,
        s_dam, s_dak, s_dbg, s_dbn, s_dbk,
        s_og, s_om, s_on,
        GROUP_K: tl.constexpr, A_ROWS: tl.constexpr, B_ROWS: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GP: tl.constexpr,
        GROUP_M: tl.constexpr):
    """One (BM, BN) output tile (grid: tiles, then groups for ``GROUP_K``). ``A_ROWS`` /
    ``B_ROWS``: rows sharing one decode scale (1 for 1x128 blocks, 128 for 128x128).
    ``GP``: ``G`` rounded up to a power of two."""
    # tiles in bands of GROUP_M row tiles, so that a band's A rows stay in L2 while every
    # column tile reads them
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    band = GROUP_M * tiles_n
    first_m = (pid // band) * GROUP_M
    band_m = min(tl.cdiv(M, BM) - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % band_m
    pid_n = (pid % band) // band_m
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    if GROUP_K:
        g = tl.program_id(1)
        k_hi = tl.load(offs_ptr + g)
        # group starts are multiples of 128: told to the compiler, or the loads lose their
        # 16-byte vectors
        k_lo = tl.multiple_of(tl.load(offs_ptr + g - 1, mask=g > 0, other=0), 128)
        b_base = b_ptr
        db_base = db_ptr
        out_base = out_ptr + g.to(tl.int64) * s_og
    else:
        # the group whose rows hold this tile: the number of groups ending at or before it
        gidx = tl.arange(0, GP)
        ends = tl.load(offs_ptr + gidx, mask=gidx < G, other=2147483647)
        g = tl.sum((ends <= pid_m * BM).to(tl.int32))
        if g >= G:
            return  # rows past the last group
        k_lo = 0
        k_hi = K
        b_base = b_ptr + g.to(tl.int64) * s_bg
        db_base = db_ptr + g.to(tl.int64) * s_dbg
        out_base = out_ptr
    rmask = rows < M
    cmask = cols < N
    ks = tl.arange(0, BK)
    chunk0 = k_lo // BK
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * s_am + (k_lo + ks)[None, :] * s_ak
    b_ptrs = b_base + cols.to(tl.int64)[None, :] * s_bn + (k_lo + ks)[:, None] * s_bk
    da_ptrs = da_ptr + (rows // A_ROWS).to(tl.int64) * s_dam + chunk0 * s_dak
    db_ptrs = db_base + (cols // B_ROWS).to(tl.int64) * s_dbn + chunk0 * s_dbk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, tl.cdiv(k_hi - k_lo, BK)):
        a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=cmask[None, :], other=0.0)
        da = tl.load(da_ptrs, mask=rmask, other=0.0)
        db = tl.load(db_ptrs, mask=cmask, other=0.0)
        part = tl.dot(a, b)
        acc += part * (da[:, None] * db[None, :])
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
        da_ptrs += s_dak
        db_ptrs += s_dbk
    optr = out_base + rows.to(tl.int64)[:, None] * s_om + cols[None, :] * s_on
    tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
