"""Tile ids of a 2-D Gluon quantize grid, shared by the Gluon kernels of the block FP8 and
MXFP8 formats. Only Gluon kernel modules import this file, and only when Gluon imports."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def tile_ids(K_FAST: gl.constexpr):
    """(pid_m, pid_k) of this program; ``K_FAST``: grid axis 0 runs along K, so programs
    launched together read neighbouring columns of the same rows."""
    if K_FAST:
        return gl.program_id(1), gl.program_id(0)
    else:
        return gl.program_id(0), gl.program_id(1)
