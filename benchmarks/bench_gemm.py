"""One fprop GEMM per backend (operands already quantized), against a bf16 GEMM.

Shows where the time of a quantized Linear goes: the GEMM backends alone, and
the pieces of the exact bf16 emulation (dequantize, bf16 GEMM with bf16 or fp32
output, fp32 epilogue).

    python benchmarks/bench_gemm.py [--shapes 16384x4096x4096,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import append_rows, l2_rotation, print_table, time_fn  # noqa: E402

import lowprec.gemm.dispatch as G  # noqa: E402
from lowprec import (  # noqa: E402
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from lowprec.gemm import exact_bf16, kernels  # noqa: E402

E4M3 = torch.float8_e4m3fn


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x4096x4096,16384x4096x14336,16384x14336x4096")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for s in args.shapes.split(","):
        m, k, n = (int(v) for v in s.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)

        def pair():
            return (torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16),
                    torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16))
        sets = l2_rotation(pair, 2 * (m * k + n * k), max_sets=3)
        bf16_ms = time_fn(lambda a, b: a @ b.t(), sets, iters=args.iters)
        flops = 2 * m * n * k
        cases = {}
        cases["bf16 mm out fp32"] = (lambda a, b: torch.mm(a, b.t(), out_dtype=torch.float32),
                                     sets)
        qsets = {}
        for name, qa, qb in (
                ("fp8 tensorwise", Float8CurrentScalingQuantizer(E4M3),
                 Float8CurrentScalingQuantizer(E4M3)),
                ("block 1x128x128x128", Float8BlockQuantizer(E4M3, block_scaling_dim=1),
                 Float8BlockQuantizer(E4M3, block_scaling_dim=2)),
                ("mxfp8 emulated", MXFP8Quantizer(E4M3), MXFP8Quantizer(E4M3)),
                ("nvfp4 emulated", NVFP4Quantizer(), NVFP4Quantizer(with_2d_quantization=True))):
            qa.set_usage(rowwise=True, columnwise=False)
            qb.set_usage(rowwise=True, columnwise=False)
            qsets[name] = [(qa.quantize(a), qb.quantize(b)) for a, b in sets]
            cases[name] = (lambda a, b: G.gemm(a, "rowwise", b, "rowwise",
                                               out_dtype=torch.bfloat16), qsets[name])
        cases["mxfp8 dequant x2"] = (
            lambda a, b: (exact_bf16.bf16_operand(a, "rowwise"),
                          exact_bf16.bf16_operand(b, "rowwise")), qsets["mxfp8 emulated"])
        cases["nvfp4 dequant x2"] = (
            lambda a, b: (exact_bf16.bf16_operand(a, "rowwise"),
                          exact_bf16.bf16_operand(b, "rowwise")), qsets["nvfp4 emulated"])
        acc = [(torch.randn(m, n, device="cuda", generator=gen), torch.rand(1, device="cuda"))
               for _ in range(2)]
        cases["fp32 epilogue"] = (lambda c, d: kernels.scale_bias_epilogue(
            c, d, d, None, torch.bfloat16), acc)
        for name, (fn, inp) in cases.items():
            try:
                ms = time_fn(fn, inp, iters=args.iters)
            except Exception as e:  # noqa: BLE001
                print(f"{s} {name}: FAILED {type(e).__name__}: {e}")
                continue
            rows.append({"bench": "gemm", "shape": s, "recipe": name, "metric": "ms",
                         "value": ms, "baseline": "bf16 mm", "baseline_value": bf16_ms,
                         "ratio": ms / bf16_ms,
                         "note": f"{flops / ms / 1e9:.0f} TFLOP/s-equiv"})
        rows.append({"bench": "gemm", "shape": s, "recipe": "bf16 mm", "metric": "ms",
                     "value": bf16_ms, "baseline": "bf16 mm", "baseline_value": bf16_ms,
                     "ratio": 1.0, "note": f"{flops / bf16_ms / 1e9:.0f} TFLOP/s"})
        del sets, qsets, acc
        torch.cuda.empty_cache()
    print_table(rows, ["shape", "recipe", "value", "ratio", "note"])
    if not args.no_csv:
        append_rows(rows)
    return rows


if __name__ == "__main__":
    main()
