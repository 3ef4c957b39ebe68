"""Static cost of a *candidate* 1x128 columnwise quantize kernel written with Gluon's
explicit layouts (not used by lowprec; no GPU needed, compiles for sm90 ahead of time).

The Triton kernel (``formats/block/triton_kernels.py``) leaves layouts to the compiler,
which transposes the fp8 codes byte by byte through shared memory and computes each
column's scale in every thread that holds a piece of the column. This sketch loads the
(BM, BN) bf16 tile with each thread holding R consecutive rows of 8 consecutive columns,
reduces each column to its amax, converts the BN amaxes to a layout with one column per
thread for the scale math (``DIV1D``), broadcasts the scales back, and stores the codes
from a layout that differs from the load layout only in its register order, so no data
moves between threads: each thread writes R consecutive bytes of a (K, M) row. Aligned
shapes only (no masks) and 1x128 E4M3 with power-of-two scales: enough to count
instructions, not a kernel to ship. Prints the same columns as ``kernel_resources.py``.

    python3 benchmarks/sketch_gluon_col.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from kernel_resources import REGS_PER_SM, resources  # noqa: E402


@gluon.jit
def _col_sketch(x_ptr, cq_ptr, cs_ptr, cd_ptr, M, K, BM: gl.constexpr, BN: gl.constexpr,
                WARPS: gl.constexpr, DIV1D: gl.constexpr, R: gl.constexpr, T: gl.constexpr):
    load_l: gl.constexpr = gl.BlockedLayout([R, 8], [32 // T, T], [WARPS, 1], [1, 0])
    store_l: gl.constexpr = gl.BlockedLayout([R, 8], [32 // T, T], [WARPS, 1], [0, 1])
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    pid_m = gl.program_id(0)
    pid_k = gl.program_id(1)
    offs_m = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, load_l))
    offs_k = pid_k * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, load_l))
    x = gl.load(x_ptr + offs_m.to(gl.int64)[:, None] * K + offs_k[None, :]).to(gl.float32)
    amax = gl.max(x.to(gl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)
    if DIV1D:
        amax = gl.convert_layout(amax, one_l)
        offs_s = pid_k * BN + gl.arange(0, BN, layout=one_l)
    else:
        offs_s = offs_k
    af = amax.to(gl.float32, bitcast=True)
    s = gl.where(amax == 0, 1.0, gl.div_rn(gl.zeros_like(af) + 448.0, af))
    s = (s.to(gl.int32, bitcast=True) & -8388608).to(gl.float32, bitcast=True)  # pow2
    gl.store(cs_ptr + offs_s.to(gl.int64) * (M // 128) + pid_m, s)
    gl.store(cd_ptr + pid_m * K + offs_s, gl.div_rn(gl.zeros_like(s) + 1.0, s))
    if DIV1D:
        s = gl.convert_layout(s, gl.SliceLayout(0, load_l))
    q = (x * s[None, :]).to(gl.float8e4nv).to(gl.uint8, bitcast=True)
    q = gl.convert_layout(q, store_l)  # same threads, register order only
    offs_m2 = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, store_l))
    offs_k2 = pid_k * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, store_l))
    gl.store(cq_ptr + offs_k2.to(gl.int64)[None, :] * M + offs_m2[:, None], q)


def compile_sketch(bm, bn, warps, r, t, div1d=True):
    sig = {"x_ptr": "*bf16", "cq_ptr": "*u8", "cs_ptr": "*fp32", "cd_ptr": "*fp32",
           "M": "i32", "K": "i32"}
    const = {"BM": bm, "BN": bn, "WARPS": warps, "DIV1D": div1d, "R": r, "T": t}
    full = {**sig, **dict.fromkeys(const, "constexpr")}
    names = list(full)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
             if full[a].startswith("*") or full[a] == "i32"}
    src = GluonASTSource(fn=_col_sketch, signature=full, attrs=attrs,
                         constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


#: (BM, BN, warps, R rows per thread, T threads along K); each layout covers the tile
#: without replication.
CONFIGS = [(128, 64, 4, 4, 4), (128, 64, 4, 8, 8), (128, 128, 4, 8, 8), (128, 64, 2, 16, 8),
           (128, 128, 4, 16, 16)]


def main():
    print(f"{'BMxBNxW R T':16} {'scale math':10} {'regs':>5} {'spill':>6} {'smem':>6} "
          f"{'progs/SM':>8} {'ins/el':>6}")
    for bm, bn, warps, r, t in CONFIGS:
        for div1d in (False, True):
            res = resources(compile_sketch(bm, bn, warps, r, t, div1d))
            progs = REGS_PER_SM // (res["regs"] * 32 * warps)
            print(f"{bm}x{bn}x{warps} R{r} T{t:<3} {'1 per col' if div1d else 'replicated':10} "
                  f"{res['regs']:5} {res['spill']:6} {res['smem']:6} {progs:8} "
                  f"{res['sass'] * 32 * warps / (bm * bn):6.1f}")


if __name__ == "__main__":
    main()
