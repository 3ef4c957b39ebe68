"""Quantize throughput of every format, against a device-to-device copy measured in the same run.

GB/s counts the fewest bytes a quantize must move: the high-precision input read
once plus every output buffer (data and scales of each direction) written once.
The copy moves the input once each way (read + write). ``ratio`` is quantize GB/s
over copy GB/s (1.0 = as fast as a copy per byte moved).

Each format is timed on its default path (Triton kernels where the format has them
and Triton is available) and, with ``--reference``, on the pure-torch reference too.

    python benchmarks/bench_quantize.py [--shape 16384x4096] [--dtype bf16] [--reference]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lowprec  # noqa: E402
from harness import append_rows, l2_rotation, print_table, time_fn  # noqa: E402
from lowprec import (Float8BlockQuantizer, Float8CurrentScalingQuantizer,  # noqa: E402
                     Float8Quantizer, MXFP8Quantizer, NVFP4Quantizer)

E4M3 = torch.float8_e4m3fn
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def quantizers(device):
    """(name, factory, rowwise, columnwise)."""
    return [
        ("fp8_delayed", lambda: Float8Quantizer(torch.ones(1, device=device),
                                                torch.zeros(1, device=device), E4M3), True, True),
        ("fp8_current", lambda: Float8CurrentScalingQuantizer(E4M3), True, True),
        ("fp8_current_row", lambda: Float8CurrentScalingQuantizer(E4M3), True, False),
        ("block_1x128", lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=1), True, True),
        ("block_128x128", lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=2), True, True),
        ("mxfp8", lambda: MXFP8Quantizer(E4M3), True, True),
        ("mxfp8_row", lambda: MXFP8Quantizer(E4M3), True, False),
        ("mxfp8_2d", lambda: MXFP8Quantizer(E4M3, with_2d_quantization=True), True, True),
        ("nvfp4", lambda: NVFP4Quantizer(), True, True),
        ("nvfp4_2d", lambda: NVFP4Quantizer(with_2d_quantization=True), True, True),
        ("nvfp4_rht_sr", lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True),
         True, True),
    ]


def out_bytes(qt) -> int:
    return sum(t.numel() * t.element_size() for t in qt.inner_tensors().values()
               if t is not None)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--reference", action="store_true", help="also time the torch reference")
    ap.add_argument("--only", default="", help="comma-separated format names")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    m, k = (int(v) for v in args.shape.lower().split("x"))
    dtype, dev = DTYPES[args.dtype], "cuda"
    nbytes = m * k * dtype.itemsize
    gen = torch.Generator(device=dev).manual_seed(0)
    inputs = l2_rotation(lambda: (torch.randn(m, k, device=dev, generator=gen).to(dtype),),
                         nbytes)
    dst = torch.empty(m, k, device=dev, dtype=dtype)
    copy_ms = time_fn(lambda x: dst.copy_(x), inputs, iters=args.iters)
    copy_gbs = 2 * nbytes / copy_ms / 1e6
    rows = [{"bench": "quantize", "shape": f"{m}x{k}", "recipe": "d2d_copy", "metric": "GB/s",
             "value": copy_gbs, "baseline": "", "baseline_value": "", "ratio": 1.0,
             "note": f"{copy_ms:.4f} ms"}]
    only = set(filter(None, args.only.split(",")))
    paths = [("default", None)] + ([("reference", lowprec.kernels.reference_only)]
                                   if args.reference else [])
    for name, make, row, col in quantizers(dev):
        if only and name not in only:
            continue
        q = make()
        q.set_usage(rowwise=row, columnwise=col)
        for path, ctx in paths:
            if ctx is not None:
                with ctx():
                    ms, ob = _time_one(q, inputs, args.iters)
            else:
                ms, ob = _time_one(q, inputs, args.iters)
            gbs = (nbytes + ob) / ms / 1e6
            rows.append({"bench": "quantize", "shape": f"{m}x{k}", "recipe": f"{name}/{path}",
                         "metric": "GB/s", "value": gbs, "baseline": "d2d_copy",
                         "baseline_value": copy_gbs, "ratio": gbs / copy_gbs,
                         "note": f"{ms:.4f} ms, {(nbytes + ob) / 1e6:.0f} MB, {args.dtype} in"})
    print_table(rows, ["recipe", "value", "ratio", "note"])
    if not args.no_csv:
        append_rows(rows)
    return rows


def _time_one(q, inputs, iters):
    qt = q.quantize(inputs[0][0])
    ob = out_bytes(qt)
    del qt
    return time_fn(lambda x: q.quantize(x), inputs, iters=iters), ob


if __name__ == "__main__":
    main()
