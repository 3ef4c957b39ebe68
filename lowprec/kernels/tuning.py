"""The kernel switches and tile configs of every format's launchers, in one object.

``tuning`` holds them; the launchers read it at launch time, so a change applies to the
next launch. ``override`` changes some of them for the duration of a ``with`` block (tests,
benchmark sweeps) and restores them after::

    from lowprec.kernels import tuning
    with tuning.override(block_gluon=False, split_both={**tuning.tuning.split_both,
                                                       "block1": False}):
        ...

The values are the ones the benchmarks verified bit-exact and picked by timing; every
choice here changes speed only, never a bit of a result.
"""

from __future__ import annotations

import contextlib
import copy


class Tuning:
    """Switches and tile configs of the quantize kernels (see the attributes' comments)."""

    def __init__(self):
        # ---- FP8 cast, all FP8 formats -------------------------------------------------
        #: Use the hardware fp32 -> fp8 conversion (cvt.rn.satfinite) after an explicit
        #: saturation; False computes the rounding with integer arithmetic (same bits, more
        #: instructions).
        self.hw_cvt = True
        #: How the kernels write a transposed (columnwise) tile (see ``fp8_cast.store_t``):
        #: 0 ``tl.trans`` of the fp8 codes, 3 transposed pointers (the compiler arranges the
        #: coalesced store). Both are verified bit-exact on sm90; 0 was as fast or faster.
        self.col_mode = 0
        #: Formats whose "both usages" quantization runs as two launches (rowwise-only, then
        #: columnwise-only) instead of one fused pass: keys "pertensor", "block1", "block2",
        #: "mx1", "mx2". The fused pass reads the input once; the split one twice, which can
        #: still be faster where the fused kernel's in-register transposition costs more
        #: than the second read.
        self.split_both = {"pertensor": False, "block1": True, "block2": False,
                           "mx1": False, "mx2": False}

        # ---- per-tensor FP8 (``formats/float8/launch.py``) -----------------------------
        #: Tile configs: name -> (BM, BN, num_warps[, ITERS, STAGES, K_FAST, BOTTOM_UP] of
        #: the casts: see ``grid.tile_config`` and ``grid.cast_bottom_up``), picked by
        #: timing 16384x4096 bf16 on an H200 (tools/sweep_fp8_quantize.py);
        #: tests/slow/test_fuzz_kernels_fp8.py checks them bit for bit. The casts take the
        #: rows the amax pass read last first, from L2 (``cast_kernel``).
        self.fp8_configs = {
            "amax": (32, 256, 8),
            "cast_row": (32, 512, 8, 4, 1, 1, 1),
            "cast_col": (64, 128, 8, 1, 1, 1, 1),
            "cast_both": (128, 128, 8, 1, 1, 1, 1),
            "finish": (4096, 0, 4),
            # current scaling in one cooperative launch: (BM, BN, warps, programs per SM at
            # most; how many fit is the driver's count for the compiled variant: 2 with 128
            # registers when M, K and the row stride are multiples of 16, 1 for a variant
            # near 255)
            "current_one": (128, 128, 8, 2),
        }
        #: Current scaling's amax pass and cast in one cooperative launch
        #: (``formats/float8/cooperative.py``) when no producer computed the amax, instead
        #: of two launches (``amax_kernel``, then ``cast_kernel``). Off by default: it saves
        #: one launch's host time per quantize, but a cooperative grid the size of the GPU
        #: cannot start until every SM has room for it, so it waits for kernels of other
        #: streams (communication overlapped with compute) to leave.
        self.one_launch_current = False

        # ---- block FP8 (``formats/block/launch.py``) -----------------------------------
        #: (BM, BN, num_warps[, tiles per program, pipeline stages[, grid axis 0 along K]])
        #: per (block_scaling_dim, usages), picked by timing on an H200
        #: (tools/sweep_fp8_quantize.py); the 1x128 rowwise launch and the Gluon
        #: columnwise one run K-fast (H100: 3% faster for both usages).
        self.block_configs = {
            (1, "row"): (32, 256, 4, 1, 1, 1),
            (1, "col"): (128, 64, 4),
            (1, "both"): (128, 128, 8),
            (2, "row"): (128, 128, 8),
            (2, "col"): (128, 128, 8),
            (2, "both"): (128, 128, 8),
        }
        #: Run the 1x128 columnwise usage through a Gluon kernel
        #: (``formats/block/gluon_kernels.py``) where one applies (Gluon imports, no
        #: prologue, a unit inner stride, a 16-bit or fp32 input): ``block1_both_kernel``
        #: for both usages when ``block_gluon_both`` (one launch, the input read from DRAM
        #: once, the columnwise pass re-reading each tile from L2), else the Triton rowwise
        #: launch and ``block1_col_kernel``. False: the Triton kernel only.
        self.block_gluon = True
        self.block_gluon_both = True
        #: Gluon launch configs: "col" (R rows per thread, T threads along K, warps[,
        #: K-fast]): a program covers 128 rows and 8 * T columns; "both" (RB rows per
        #: rowwise chunk, R, T, warps[, K-fast[, L2 eviction hints]]): a program covers
        #: 128 x 128, its columnwise pass in "col" pieces of R, T. K-fast: grid axis 0 runs
        #: along K.
        self.block_gluon_configs = {"col": (8, 8, 4, 1), "both": (32, 8, 8, 4, 1, 1)}
        #: The grouped block-scaled FP8 GEMM (``gemm/block_grouped.py``) in its Gluon
        #: kernel where it applies (Hopper, operands TMA can read), else the Triton one.
        #: Configs by (problem, experts averaging at least ``block_grouped_large_rows``
        #: rows): (BN, STAGES, OVERLAP, GROUP_M, warps) of
        #: ``gemm/_block_grouped_gluon.py`` (the row tile is 16 rows a warp), or None
        #: for the Triton kernel. Picked by ``tools/probe_block_grouped.py --gluon`` on an
        #: H100 at the MoE layer's shapes (every config 0 bits off the Triton kernel):
        #: small experts run one warpgroup a program, three programs an SM; large ones the
        #: warp-specialized kernel (OVERLAP 2: a loader warp and two consumer warpgroups over
        #: a 128-row tile, each releasing a stage as soon as its dot has read it), 1.03-1.16x
        #: the two-warpgroup OVERLAP 1 config at Mixtral's forward and dgrad. Large experts'
        #: wgrad stays on the Triton kernel (the Gluon configs probed ran 0.80-1.00x of it).
        self.block_grouped_gluon = True
        self.block_grouped_large_rows = 2048
        self.block_grouped_gluon_configs = {
            ("rows", False): (128, 2, False, 8, 4), ("rows", True): (128, 3, 2, 8, 4),
            ("wgrad", False): (128, 2, False, 8, 4), ("wgrad", True): None}

        # ---- MXFP8 (``formats/mxfp8/launch.py``) ---------------------------------------
        #: (BM, BN, num_warps[, tiles per program, pipeline stages[, grid axis 0 along K]])
        #: per (two_d, usages), picked by timing on an H200 (tools/sweep_fp8_quantize.py).
        #: With the columnwise usage the grid runs along K first, picked on an H100: programs
        #: in flight together then read whole rows and write neighbouring stretches of each
        #: columnwise row, 7-13% less GPU time.
        self.mxfp8_configs = {
            (False, "row"): (32, 128, 2),
            (False, "col"): (32, 128, 2, 1, 1, 1),
            (False, "both"): (32, 128, 2, 1, 1, 1),
            (True, "row"): (64, 128, 8),
            (True, "col"): (64, 128, 8),
            (True, "both"): (64, 128, 4),
        }
        #: Both usages of 1x32 blocks through the Gluon kernel
        #: (``formats/mxfp8/gluon_kernels.py``: the rowwise usage from DRAM, the columnwise
        #: one re-reading each tile from L2) where it applies (Gluon imports, no prologue, a
        #: unit inner stride, M and K multiples of 32, a 16-bit or fp32 input); False: the
        #: Triton kernel only.
        self.mxfp8_gluon = True
        #: The Gluon kernel's launch config: (RB rows per rowwise chunk, warps, grid axis 0
        #: along K, L2 eviction hints); a program covers 32 * warps rows and 128 columns.
        self.mxfp8_gluon_config = (32, 2, 1, 1)

        # ---- NVFP4 (``formats/nvfp4/launch.py``) ---------------------------------------
        #: Tile shapes (see the kernels' docs; warps follow from them), tuned on an H200
        #: with tools/sweep_nvfp4.py.
        self.nvfp4_config = {
            # grid-stride tiles: FLAT flat elements, or (RHT) 64 x 16 KW; PROGS_PER_SM
            # programs
            "amax": {"FLAT": 4096, "KW": 4, "PROGS_PER_SM": 8},
            "row": {"KB": 8, "RB": 16},            # 16 rows x 8 blocks of 16 columns
            "col": {"KW": 4},                      # 64 rows x 16 KW columns
            "dequant": {"KB": 32, "RB": 8},
        }


#: The one instance the launchers read.
tuning = Tuning()


@contextlib.contextmanager
def override(**values):
    """Set attributes of ``tuning`` (by name) inside the block, restore them after; a name
    ``Tuning`` does not have raises ``AttributeError`` before anything changes."""
    for name in values:
        if not hasattr(tuning, name):
            raise AttributeError(f"tuning has no setting {name!r}")
    saved = {name: copy.copy(getattr(tuning, name)) for name in values}
    try:
        for name, value in values.items():
            setattr(tuning, name, value)
        yield tuning
    finally:
        for name, value in saved.items():
            setattr(tuning, name, value)
