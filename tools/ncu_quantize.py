"""Quantize kernels under Nsight Compute: one launch of each variant inside a profiler range.

Run it under ncu with ``--profile-from-start off``; every variant is warmed up (compiled)
before the range opens, so only one launch per variant is profiled:

    ncu --profile-from-start off --clock-control none --set full -o rep \
        python3 tools/ncu_quantize.py [--only mxfp8_col,block1_col]

Variants: ``<format>_<usage>`` with format in fp8 (delayed scaling, one cast pass), block1,
block2, mxfp8, mx2, nvfp4, nvfp4sr (stochastic rounding), nvfp4rhtsr (RHT and stochastic
rounding) and usage in row, col, both; a format ending in ``x`` (``mxfp8x``, ``nvfp4rhtsrx``)
also writes the exact bf16 operands of the requested usages (``quantize_for_gemm``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lowprec import Float8BlockQuantizer, Float8Quantizer, MXFP8Quantizer, NVFP4Quantizer  # noqa: E402

E4M3 = torch.float8_e4m3fn


def _factory(fmt: str, device):
    if fmt == "fp8":
        return lambda: Float8Quantizer(torch.ones(1, device=device),
                                       torch.zeros(1, device=device), E4M3)
    if fmt in ("block1", "block2"):
        return lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=int(fmt[-1]))
    if fmt in ("mxfp8", "mx2"):
        return lambda: MXFP8Quantizer(E4M3, with_2d_quantization=fmt == "mx2")
    if fmt in ("nvfp4", "nvfp4sr", "nvfp4rhtsr"):
        return lambda: NVFP4Quantizer(with_rht=fmt == "nvfp4rhtsr",
                                      stochastic_rounding=fmt != "nvfp4")
    raise ValueError(f"unknown format {fmt!r}; expected fp8, block1, block2, mxfp8, mx2, "
                     "nvfp4, nvfp4sr or nvfp4rhtsr (mxfp8 and the nvfp4 ones with an x suffix "
                     "for the exact operands)")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096")
    ap.add_argument("--only", default="mxfp8_row,mxfp8_col,mxfp8_both,block1_row,block1_col,"
                                      "fp8_col")
    args = ap.parse_args(argv)
    m, k = (int(v) for v in args.shape.split("x"))
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    runs = []
    for name in args.only.split(","):
        fmt, usage = name.rsplit("_", 1)
        exact = fmt.endswith("x")
        q = _factory(fmt[:-1] if exact else fmt, "cuda")()
        rowwise, columnwise = usage in ("row", "both"), usage in ("col", "both")
        q.set_usage(rowwise=rowwise, columnwise=columnwise)
        if exact:
            usages = ("rowwise",) * rowwise + ("columnwise",) * columnwise
            run = (lambda q=q, u=usages: q.quantize_for_gemm(x, u))
        else:
            run = (lambda q=q: q.quantize(x))
        run()  # compile + warm-up outside the profiled range
        runs.append((name, run))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, run in runs:
        torch.cuda.nvtx.range_push(name)
        run()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(n for n, _ in runs))


if __name__ == "__main__":
    main()
