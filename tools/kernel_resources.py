"""Registers, spills, shared memory and SASS size of the quantize kernels, per config.

Compiles each kernel for sm90 ahead of time (no GPU needed: Triton's bundled ``ptxas``), so
tile configs and kernel structure can be compared before spending device time. Occupancy
is what a memory-bound kernel lives on: at 232+ registers per thread an SM holds two
4-warp programs, too few loads in flight to reach copy bandwidth.

    python3 tools/kernel_resources.py [--only mx1,block1] [--configs 32x128x4,...]
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FP8 = dict(FP8_MAX=448.0, MBITS=3, BIAS=7, MAX_BITS=0x43E00000, HW_CVT=True, COL_MODE=0)
REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024


def _compile(fn, sig: dict, const: dict, warps: int, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    # As the JIT specializes a launch on a contiguous 16384x4096 input: the inner stride is
    # the constant 1, pointers and the other integers are divisible by 16.
    if "stride_xk" in fn.arg_names:
        const = dict(const, stride_xk=1)
    # parameters with defaults left out (optional pointers, flags) take their defaults
    defaults = {a: p.default for a, p in inspect.signature(fn.fn).parameters.items()
                if a not in sig and p.default is not inspect.Parameter.empty}
    const = dict(defaults, **const)
    full = {a: ("constexpr" if a in const else sig[a]) for a in fn.arg_names}
    names = list(full)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
             if full[a].startswith("*") or full[a] == "i32"}
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=fn, signature=full,
                 constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, **options})


def _nvidia_bin(tool: str) -> str:
    import triton
    return os.path.join(triton.__path__[0], "backends", "nvidia", "bin", tool)


def sass_count(cubin: bytes) -> int:
    """Static SASS instructions of a kernel (NOPs excluded). For a kernel without loops this
    is what each warp executes; these kernels are bound by integer/logic issue (ncu: the ALU
    pipe at 72-79% on sm90), so fewer instructions per element is the lever."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([_nvidia_bin("cuobjdump"), "-sass", path], capture_output=True,
                              text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    ops = [op for op in ops if not op.startswith("NOP")]
    # fp64 arithmetic and conversions run at a fraction of the fp32 rate on sm90 (the
    # conversions 16 per SM per clock): counted apart
    f64 = sum(1 for op in ops if op.startswith(("DMUL", "DADD", "DFMA", "DSETP"))
              or (op.startswith("F2F") and "F64" in op))
    return len(ops), f64


def resources(kernel) -> dict:
    """ptxas -v figures of a compiled kernel, its layout conversions and SASS size."""
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        err = subprocess.run([_nvidia_bin("ptxas"), "-arch=sm_90a", "-v", ptx, "-o",
                              os.path.join(d, "k.o")], capture_output=True, text=True).stderr
    regs = int(re.search(r"Used (\d+) registers", err).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", err).group(1))
    return {"regs": regs, "spill": spill, "smem": kernel.metadata.shared,
            "converts": kernel.asm["ttgir"].count("convert_layout"),
            **dict(zip(("sass", "f64"), sass_count(kernel.asm["cubin"])))}


def programs_per_sm(res: dict, warps: int) -> int:
    """Programs an SM holds at once, by registers and by shared memory."""
    return min(REGS_PER_SM // (max(res["regs"], 1) * 32 * warps),
               SMEM_PER_SM // max(res["smem"], 1))


def _quant_sig(extra_ptrs=()):
    sig = {"x_ptr": "*bf16"}
    for p in ("rq_ptr", "rs_ptr", "cq_ptr", "cs_ptr", "rd_ptr", "cd_ptr"):
        sig[p] = "*u8" if "q" in p else "*fp32"
    sig.update({"M": "i32", "K": "i32", "stride_xm": "i32", "stride_xk": "i32",
                "p0": "*bf16", "p1": "*bf16", "p2": "*bf16", "p3": "*bf16"})
    return sig


def cases(only):
    """(name, kernel fn, signature, constexprs, configs) per kernel family and usage."""
    from lowprec.formats.float8.triton_kernels import cast_kernel
    from lowprec.kernels.block_scaled import block_scaled_quant_kernel
    from lowprec.kernels.tuning import tuning
    out = []
    for usage, (r, c) in (("both", (True, True)), ("row", (True, False)), ("col", (False, True))):
        sig = {"x_ptr": "*bf16", "row_ptr": "*u8", "col_ptr": "*u8", "amax_ptr": "*i32",
               "scale_in_ptr": "*fp32", "scale_out_ptr": "*fp32", "amax_out_ptr": "*fp32",
               "M": "i32", "K": "i32",
               "stride_xm": "i32", "p0": "*bf16", "p1": "*bf16", "p2": "*bf16", "p3": "*bf16",
               "eps": "fp32"}
        for current in (True, False):
            const = dict(FP8, PRO=0, CURRENT=current, POW2=False, ROWWISE=r, COLWISE=c,
                         RECORD=not current, FINISH=not current, RESET=current)
            out.append(("current" if current else "delayed", usage, cast_kernel, sig, const,
                        tuning.fp8_configs[f"cast_{usage}"]))
    for usage, (r, c) in (("both", (True, True)), ("row", (True, False)), ("col", (False, True))):
        for dim in (1, 2):
            sig = dict(_quant_sig(), eps="fp32")
            const = dict(FP8, PRO=0, POW2=True, TWO_D=dim == 2, ROWWISE=r, COLWISE=c,
                         E8M0=False, BLK=128, DECODE=True)
            out.append((f"block{dim}", usage, block_scaled_quant_kernel, sig, const,
                        tuning.block_configs[(dim, usage)]))
        for two_d in (False, True):
            sig = dict(_quant_sig(), eps="fp32")
            sig["rs_ptr"] = sig["cs_ptr"] = "*u8"
            const = dict(FP8, PRO=0, POW2=False, TWO_D=two_d, ROWWISE=r, COLWISE=c, E8M0=True,
                         BLK=32, DECODE=False)
            out.append((f"mx{2 if two_d else 1}", usage, block_scaled_quant_kernel, sig, const,
                        tuning.mxfp8_configs[(two_d, usage)]))
            # with the exact bf16 values of each direction written too (quantize_for_gemm)
            sig_ex = dict(sig, re_ptr="*bf16", ce_ptr="*bf16")
            out.append((f"mx{2 if two_d else 1}+ex", usage, block_scaled_quant_kernel, sig_ex,
                        dict(const, EXACT_ROW=r, EXACT_COL=c),
                        tuning.mxfp8_configs[(two_d, usage)]))
    return [c for c in out if not only or c[0] in only]


def nvfp4_cases():
    """(name, kernel fn, signature, constexprs, warps, elements per program) of the NVFP4
    rowwise and columnwise kernels at the launch configs, 1D blocks."""
    from lowprec.formats.nvfp4 import triton_kernels as nk
    from lowprec.kernels.tuning import tuning
    sig = {"x_ptr": "*bf16", "M": "i32", "K": "i32", "SX": "i32", "data_ptr": "*u8",
           "scale_ptr": "*u8", "glob_ptr": "*fp32", "key_ptr": "*i64", "IDX0": "i32",
           "exact_ptr": "*bf16"}
    cfg = tuning.nvfp4_config
    kb, rb, kw = cfg["row"]["KB"], cfg["row"]["RB"], cfg["col"]["KW"]
    out = []
    for sr, ex in ((False, False), (True, False), (True, True)):
        tag = ("+sr" if sr else "") + ("+ex" if ex else "")
        out.append(("row" + tag, nk._nvfp4_row_kernel, sig,
                    dict(TWO_D=False, SR=sr, VEC=8, KB=kb, RB=rb, EVEN=True, IDX64=False,
                         EXACT=ex, CODES=True),
                    max(1, kb * rb // 32), kb * rb * 16))
        for rht in (False, True):
            out.append(("col" + ("+rht" if rht else "") + tag, nk._nvfp4_col_kernel, sig,
                        dict(RHT=rht, TWO_D=False, SR=sr, KW=kw, EVEN=True, IDX64=False,
                             EXACT=ex, CODES=True),
                        kw, 64 * 16 * kw))
    return out


def nvfp4_report():
    print(f"{'nvfp4 kernel':14} {'regs':>5} {'spill':>6} {'sass':>6} {'ins/el':>6} "
          f"{'f64/el':>6}")
    for name, fn, sig, const, warps, elements in nvfp4_cases():
        r = resources(_compile(fn, sig, const, warps, enable_fp_fusion=False))
        per = 32 * warps / elements
        print(f"{name:14} {r['regs']:5} {r['spill']:6} {r['sass']:6} {r['sass'] * per:6.1f} "
              f"{r['f64'] * per:6.2f}")


def gluon_report():
    """The Gluon kernels at their launch configs: block 1x128 (``formats/block/
    gluon_kernels.py``) and MXFP8 1x32 both usages (``formats/mxfp8/gluon_kernels.py``)."""
    from lowprec.formats.block import gluon_kernels as gk
    from lowprec.formats.block import launch as bl
    from lowprec.formats.mxfp8 import gluon_kernels as mk
    from lowprec.kernels.tuning import tuning
    e4m3 = dict(FP8_MAX=448.0, MBITS=3, BIAS=7, MAX_BITS=0x43E00000)
    fp8 = dict(e4m3, POW2=True)
    base = {"x_ptr": "*bf16", "cq_ptr": "*u8", "cs_ptr": "*fp32", "cd_ptr": "*fp32",
            "M": "i32", "K": "i32", "stride_xm": "i32", "eps": "fp32"}
    r, t, w, kf = bl.gluon_config("col")
    rb, rr, tb, wb, kfb, ev = bl.gluon_config("both")
    both = dict(base, rq_ptr="*u8", rs_ptr="*fp32", rd_ptr="*fp32")
    mrb, mw, mkf, mev = tuning.mxfp8_gluon_config
    mx = {"x_ptr": "*bf16", "rq_ptr": "*u8", "rs_ptr": "*u8", "cq_ptr": "*u8", "cs_ptr": "*u8",
          "re_ptr": "*bf16", "ce_ptr": "*bf16", "M": "i32", "K": "i32", "stride_xm": "i32"}
    mx_const = dict(e4m3, RB=mrb, WARPS=mw, K_FAST=bool(mkf), EVICT=bool(mev))
    print(f"{'gluon kernel':30} {'regs':>5} {'spill':>6} {'smem':>6} {'progs/SM':>8} "
          f"{'ins/el':>6}")
    for name, fn, sig, const, warps, elements in (
            (f"block1 col R{r} T{t} W{w}", gk.block1_col_kernel, base,
             dict(fp8, R=r, T=t, WARPS=w, K_FAST=bool(kf)), w, 128 * 8 * t),
            (f"block1 both RB{rb} R{rr} T{tb} W{wb}", gk.block1_both_kernel, both,
             dict(fp8, RB=rb, R=rr, T=tb, WARPS=wb, K_FAST=bool(kfb), EVICT=bool(ev)), wb,
             128 * 128),
            *((f"mxfp8 both RB{mrb} W{mw}{tag}", mk.mx1_both_kernel, mx,
               dict(mx_const, EXACT_ROW=er, EXACT_COL=ec, ROW_CODES=True, COL_CODES=True), mw,
               32 * mw * 128)
              for tag, er, ec in (("", False, False), (" +exact row", True, False),
                                  (" +exact both", True, True)))):
        res = resources(_compile(fn, sig, const, warps))
        progs = programs_per_sm(res, warps)
        print(f"{name:30} {res['regs']:5} {res['spill']:6} {res['smem']:6} {progs:8} "
              f"{res['sass'] * 32 * warps / elements:6.1f}")


def tile_config(cfg):
    from lowprec.kernels.grid import tile_config as tc
    return tc(cfg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="",
                    help="comma-separated families: current,delayed,block1,block2,mx1,mx2,"
                         "nvfp4,gluon")
    ap.add_argument("--usages", default="both,row,col")
    ap.add_argument("--configs", default="",
                    help="extra BMxBNxWARPS[xITERSxSTAGES] configs to try for every case, "
                         "e.g. 64x128x4,32x128x4x4x3")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    if not only or "nvfp4" in only:
        nvfp4_report()
    if not only or "gluon" in only:
        gluon_report()
    extra = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",") if c]
    usages = args.usages.split(",")
    print(f"{'kernel':8} {'usage':5} {'BMxBNxWxIxS':14} {'regs':>5} {'spill':>6} {'smem':>6} "
          f"{'cvt':>4} {'progs/SM':>8} {'sass':>6} {'ins/el':>6}")
    for fam, usage, fn, sig, const, default in cases(only):
        if usage not in usages:
            continue
        for cfg in [default] + extra:
            bm, bn, warps, iters, stages, _ = tile_config(cfg)
            name = "x".join(str(v) for v in (bm, bn, warps, iters, stages))
            try:
                k = _compile(fn, sig, dict(const, BM=bm, BN=bn, ITERS=iters, STAGES=stages),
                             warps)
                r = resources(k)
            except Exception as e:  # noqa: BLE001
                print(f"{fam:8} {usage:5} {name:14} failed: {type(e).__name__}")
                continue
            progs = programs_per_sm(r, warps)
            mark = " (default)" if cfg == default else ""
            # thread instructions per input element (a loop body counts once: ITERS=1 only)
            per_el = r["sass"] * 32 * warps / (bm * bn) if iters == 1 else float("nan")
            print(f"{fam:8} {usage:5} {name:14} {r['regs']:5} {r['spill']:6} "
                  f"{r['smem']:6} {r['converts']:4} {progs:8} {r['sass']:6} {per_el:6.1f}{mark}")


if __name__ == "__main__":
    main()
