"""Does cuBLASLt have faster FP8 GEMM algorithms than the one ``torch._scaled_mm`` takes?

torch asks cuBLASLt's heuristic for one algorithm. This asks for up to ``--algos`` for the
same problem (per-tensor, 1x128 x 128x128 and 1x128 x 1x128 block scaling, through ctypes
as ``lowprec.gemm.cublaslt`` does), times each with CUDA events against
``torch._scaled_mm`` on the same operands in the same run, and prints each algorithm's
time, its ratio to torch's, and its largest difference from torch's output (0 where the
same kernel ran).

    python tools/probe_lt_fp8.py [--shape 16384x4096x4096] [--algos 16]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from harness import time_fn  # noqa: E402

from lowprec.gemm import cublaslt as lt

# cublasLt.h values (checked against the header where one is installed, see _header_enums)
ENUMS = {"CUBLASLT_MATMUL_DESC_A_SCALE_POINTER": 17, "CUBLASLT_MATMUL_DESC_B_SCALE_POINTER": 18,
         "CUBLASLT_MATMUL_DESC_FAST_ACCUM": 25, "CUBLASLT_MATMUL_DESC_A_SCALE_MODE": 31,
         "CUBLASLT_MATMUL_DESC_B_SCALE_MODE": 32, "CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F": 0,
         "CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F": 4,
         "CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F": 5}
CUDA_R_8F_E4M3, CUDA_R_16BF = 28, 14


def _header_enums():
    import torch as _t
    roots = [os.path.dirname(os.path.dirname(_t.__file__))]
    for root in roots:
        for path in glob.glob(os.path.join(root, "nvidia", "**", "cublasLt.h"), recursive=True):
            text = open(path).read()
            found = {}
            for name in ENUMS:
                m = re.search(rf"\b{name}\s*=\s*(\d+)", text)
                if m:
                    found[name] = int(m.group(1))
            # enums without explicit values: count their position in the block
            for enum_name in ("cublasLtMatmulMatrixScale_t",):
                m = re.search(r"typedef enum\s*\{([^}]*)\}\s*" + enum_name, text)
                if m:
                    names = [re.sub(r"=.*", "", ln).strip().rstrip(",")
                             for ln in re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S).split("\n")]
                    names = [n for n in names if n.startswith("CUBLASLT")]
                    for i, n in enumerate(names):
                        if n in ENUMS:
                            found.setdefault(n, i)
            return path, found
    return None, {}


def run_lt(handle, lib, a, b, sa, sb, mode_a, mode_b, out, algo, ws, m, n, k):
    """out (m, n) = mat(a) (m, k) @ mat(b) (n, k)^T with cuBLAS A = b, B = a."""
    return lib.cublasLtMatmul(handle, algo["desc"], ctypes.byref(algo["alpha"]), b.data_ptr(),
                              algo["la"], a.data_ptr(), algo["lb"], ctypes.byref(algo["beta"]),
                              out.data_ptr(), algo["ld"], out.data_ptr(), algo["ld"],
                              ctypes.byref(algo["heur"].algo), ws.data_ptr(), ws.numel(),
                              torch.cuda.current_stream().cuda_stream)


def algos_for(lib, handle, m, n, k, sa, sb, mode_a, mode_b, count, ws_bytes):
    E = ENUMS
    desc = ctypes.c_void_p()
    lt._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), 68, 0), "desc")
    sd = lib.cublasLtMatmulDescSetAttribute
    lt._set(sd, desc, 3, 1, ctypes.c_int32)  # TRANSA = T
    lt._set(sd, desc, 4, 0, ctypes.c_int32)  # TRANSB = N
    lt._set(sd, desc, E["CUBLASLT_MATMUL_DESC_A_SCALE_POINTER"], sb.data_ptr(), ctypes.c_void_p)
    lt._set(sd, desc, E["CUBLASLT_MATMUL_DESC_B_SCALE_POINTER"], sa.data_ptr(), ctypes.c_void_p)
    if mode_b != E["CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F"]:
        lt._set(sd, desc, E["CUBLASLT_MATMUL_DESC_A_SCALE_MODE"], mode_b, ctypes.c_int32)
    if mode_a != E["CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F"]:
        lt._set(sd, desc, E["CUBLASLT_MATMUL_DESC_B_SCALE_MODE"], mode_a, ctypes.c_int32)
    lays = []
    for rows, cols, ld, t in ((k, n, k, CUDA_R_8F_E4M3), (k, m, k, CUDA_R_8F_E4M3),
                              (n, m, n, CUDA_R_16BF)):
        lay = ctypes.c_void_p()
        lt._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), t, rows, cols, ld), "layout")
        lays.append(lay)
    pref = ctypes.c_void_p()
    lt._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
    lt._set(lib.cublasLtMatmulPreferenceSetAttribute, pref, 1, ws_bytes, ctypes.c_uint64)
    heurs = (lt._Heuristic * count)()
    got = ctypes.c_int(0)
    st = lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, lays[0], lays[1], lays[2], lays[2],
                                            pref, count, heurs, ctypes.byref(got))
    if st != 0:
        print(f"    heuristic status {st}")
        return []
    out = []
    for i in range(got.value):
        if heurs[i].state == 0:
            out.append({"desc": desc, "la": lays[0], "lb": lays[1], "ld": lays[2],
                        "heur": heurs[i], "alpha": ctypes.c_float(1.0),
                        "beta": ctypes.c_float(0.0), "waves": heurs[i].waves_count,
                        "ws": heurs[i].workspace_size})
    return out


def probe(name, m, n, k, dim_a, dim_b, count, lib, handle, ws):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = (torch.randn(m, k, device="cuda", generator=gen) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda", generator=gen) * 8).to(torch.float8_e4m3fn)
    E = ENUMS

    def scales(rows, dim):
        if dim == 0:
            return torch.rand(1, device="cuda", generator=gen) + 0.5, \
                E["CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F"]
        if dim == 1:   # memory (K/128, rows), rows contiguous
            s = torch.exp2(torch.randint(-3, 4, (k // 128, rows), device="cuda", generator=gen)
                           .float())
            return s, E["CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F"]
        s = torch.exp2(torch.randint(-3, 4, (rows // 128, k // 128), device="cuda",
                                     generator=gen).float())
        return s, E["CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F"]

    sa, mode_a = scales(m, dim_a)
    sb, mode_b = scales(n, dim_b)
    ta = sa.t() if dim_a == 1 else sa if dim_a == 2 else sa
    tb = sb if dim_b == 1 else sb.t() if dim_b == 2 else sb
    ref = torch._scaled_mm(a, b.t(), scale_a=ta, scale_b=tb, out_dtype=torch.bfloat16)
    t_ref = time_fn(lambda: torch._scaled_mm(a, b.t(), scale_a=ta, scale_b=tb,
                                             out_dtype=torch.bfloat16), [()], warmup=5,
                    iters=30)
    print(f"{name} {m}x{n}x{k}: torch._scaled_mm {t_ref * 1e3:.1f} us "
          f"({2 * m * n * k / t_ref / 1e9:.0f} TFLOPS)")
    algos = algos_for(lib, handle, m, n, k, sa, sb, mode_a, mode_b, count, ws.numel())
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for i, al in enumerate(algos):
        st = run_lt(handle, lib, a, b, sa, sb, mode_a, mode_b, out, al, ws, m, n, k)
        if st != 0:
            print(f"  algo {i}: status {st}")
            continue
        torch.cuda.synchronize()
        diff = (out.float() - ref.float()).abs().max().item()
        rel = diff / ref.float().abs().max().item()
        t = time_fn(lambda: run_lt(handle, lib, a, b, sa, sb, mode_a, mode_b, out, al, ws,
                                   m, n, k), [()], warmup=5, iters=30)
        print(f"  algo {i:2d}: {t * 1e3:7.1f} us  x{t / t_ref:.3f} of torch  waves "
              f"{al['waves']:.2f} ws {al['ws'] >> 10} KiB  max diff {rel:.2e} of max")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096x4096")
    ap.add_argument("--algos", type=int, default=16)
    args = ap.parse_args()
    path, found = _header_enums()
    print(f"header {path}: {found}")
    for key, v in found.items():
        if ENUMS[key] != v:
            print(f"  {key}: header says {v}, table {ENUMS[key]}: using the header")
            ENUMS[key] = v
    lib = lt._lib()
    handle = lt._handle(torch.cuda.current_device())
    ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    M, K, N = (int(v) for v in args.shape.split("x"))
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, (m, n, k), da, db in (
            ("tensorwise fprop", (M, N, K), 0, 0),
            ("tensorwise wgrad", (N, K, M), 0, 0),
            ("block fprop 1x128 x 128x128", (M, N, K), 1, 2),
            ("block dgrad 1x128 x 128x128", (M, K, N), 1, 2),
            ("block wgrad 1x128 x 1x128", (N, K, M), 1, 1)):
        probe(name, m, n, k, da, db, args.algos, lib, handle, ws)


if __name__ == "__main__":
    main()
